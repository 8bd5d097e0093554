"""What the benchmark prints and writes: the table of modes, the derived figures (overhead, the
recipe loop against plain torch, the copy the buckets save), the model's table, bench.json and the
timeline figure. The lines that read one mode against another are compared.py's."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from launcher.bench.compared import COMPARED
# the lines that read one mode against another, importable from here as before
from launcher.bench.compared import (audit_line, fsdp_exact_line, hsdp_exact_line,  # noqa: F401
                                     hsdp_line, pp_line, replication_line, tp_line)
from launcher.bench.config import MODES
from launcher.bench.model import model_rows
from launcher.bench.plot import plot, plot_skipped
from launcher.bench.shrink import MODES as SHRINK_MODES


def table(rows: list[list], header: list[str]) -> str:
    """Plain-text columns: the first left-aligned, the others right-aligned; None prints '-'."""
    cells = [header] + [["-" if v is None else str(v) for v in r] for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c[i].rjust(w[i]) if i else c[i].ljust(w[i]) for i in range(len(header)))
             for c in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def model_table(measured: dict, overhead, save_cost_s: float):
    """The goodput model's rows, and its text with every input named beside the table."""
    cl = measured.get("checkpointless", {})
    ov = overhead if overhead is not None else 0.0
    rows = model_rows(ov)
    lines = ["GOODPUT MODEL (not a measurement). Inputs: 16 B/param of state; 400 TFLOP/s per "
             "GPU; 1 GB/s checkpoint write per GPU; 50 GB/s peer link; restart recovery 10/15/30 "
             "min (HyperPod's '15-30 minutes or more');",
             f"regroup 1/2/5 s (assumed); measured here: steady overhead {ov:+.1%}"
             f"{' (below zero is noise: counted as 0)' if ov < 0 else ''}, local "
             f"checkpointless recovery median {cl.get('recovery_s_median')} s, local save "
             f"{save_cost_s * 1000:.0f} ms.",
             ""]
    hdr = ["scenario", "MTBF_h", "ckpt_s", "tau_min", "step_s", "R_restart", "R_cl_s",
           "goodput_restart", "goodput_checkpointless", "spare_share"]
    body = [[r["scenario"], r["mtbf_h"], r["checkpoint_s"], r["young_tau_min"], r["step_s"],
             f"{r['restart_recovery_min']} min", r["checkpointless_recovery_s"],
             f"{r['goodput_restart']:.2%}", f"{r['goodput_checkpointless']:.2%}",
             f"{r['spare_gpu_share']:.1%}"] for r in rows]
    lines.append(table(body, hdr))
    lines.append("MTBF sources: " + "; ".join(f"{r['scenario']}: {r['mtbf_source']}"
                                              for r in rows))
    return rows, "\n".join(lines)


def against_plain(summaries: dict, paired: Optional[dict]) -> Optional[dict]:
    """The recipe loop's median step time (off, on) over the plain torch loop's, from the paired
    run when plain took turns in it, else from the runs one after the other; None without plain."""
    paired = paired or {}
    if "step_s_median_plain" in paired:
        source, step = "paired", {m: paired.get(f"step_s_median_{m}") for m in ("off", "on")}
        plain = paired["step_s_median_plain"]
    elif (summaries.get("plain") or {}).get("step_s_median"):
        source, plain = "sequential", summaries["plain"]["step_s_median"]
        step = {m: summaries[m].get("step_s_median") for m in ("off", "on") if m in summaries}
    else:
        return None
    ratios = {f"{m}_over_plain": round(v / plain, 4) for m, v in step.items() if v}
    return {"source": source, "plain_step_s": plain,
            **{f"{m}_step_s": v for m, v in step.items() if v}, **ratios,
            "within_5pct": all(r <= 1.05 for r in ratios.values()) if ratios else None}


def plain_line(fig: dict) -> str:
    """One line: the plain loop's step time and the recipe loop's beside it, as ratios."""
    how = ("taking turns on the machine" if fig["source"] == "paired"
           else "runs one after the other")
    parts = [f"plain {fig['plain_step_s'] * 1000:.0f} ms"]
    for m in ("off", "on"):
        if f"{m}_over_plain" in fig:
            parts.append(f"{m} {fig[f'{m}_step_s'] * 1000:.0f} ms "
                         f"(x{fig[f'{m}_over_plain']:.3f})")
    verdict = "" if fig["within_5pct"] is None else \
        f"; within 5% of plain: {'yes' if fig['within_5pct'] else 'NO'}"
    return (f"median step beside plain torch (torch's DDP/FSDP2, same model, data and optimizer; "
            f"{how}): {', '.join(parts)}{verdict}")


def grad_copy_line(copy: dict, step_s: Optional[float]) -> str:
    """The copy-back the overlapped buckets no longer make, in bytes and time per worker-step."""
    share = f", {copy['copy_s_median'] / step_s:.2%} of off's step" if step_s else ""
    return (f"gradient copy-back saved by the buckets' views (the old flat all-reduce copied the "
            f"sum into every .grad): {copy['trainable_params']:,} trainable params x "
            f"{copy['bytes_per_step'] // max(1, copy['trainable_params'])} B = "
            f"{copy['bytes_per_step'] / 1e6:.1f} MB per worker per step, "
            f"{copy['copy_s_median'] * 1000:.2f} ms timed here{share}")


def overlap_line(paired: dict) -> str:
    """Overlapped buckets (off) against one flat all-reduce after backward (flat), from the
    paired run."""
    off, flat = paired["step_s_median_off"], paired["step_s_median_flat"]
    return (f"gradient all-reduce, median step (the recipe loop under torchrun, taking turns): "
            f"overlapped buckets {off * 1000:.0f} ms vs one flat all-reduce after backward "
            f"{flat * 1000:.0f} ms (buckets x{off / flat:.3f} of flat)")


def consistency_line(c: dict, step_s: Optional[float]) -> str:
    """The replica consistency check's cost, per check and spread over its interval."""
    if c["every_steps"] <= 0:
        return "replica consistency check: at the end of the run only (consistency_every=0)"
    share = f", {c['per_step_s'] / step_s:.3%} of off's step" if step_s else ""
    return (f"replica consistency check every {c['every_steps']} steps: "
            f"{c['check_s_median'] * 1000:.2f} ms per check (parameter checksum, timed here), "
            f"{c['per_step_s'] * 1000:.3f} ms per step{share}")


def report(cfg, results: dict, save_cost: float, out_root: Path,
           paired: Optional[dict] = None, grad_copy: Optional[dict] = None,
           consistency: Optional[dict] = None) -> int:
    """Print the results, write bench.json and timeline.png; exit code 1 if checkpointless
    ended with other bits than the failure-free run."""
    s = {m: r["summary"] for m, r in results.items()}
    sequential = None
    if "on" in s and "off" in s:
        sequential = round(s["on"]["step_s_median"] / s["off"]["step_s_median"] - 1, 4)
    overhead = sequential
    if paired and "step_s_median_on" in paired and "step_s_median_off" in paired:
        overhead = round(paired["step_s_median_on"] / paired["step_s_median_off"] - 1, 4)
    speedup = None
    if s.get("checkpointless", {}).get("recovery_s_median") and \
            s.get("restart", {}).get("recovery_s_median"):
        speedup = round(s["restart"]["recovery_s_median"] / s["checkpointless"]["recovery_s_median"], 1)
    rows = []
    for m in MODES:
        if m in s:
            x = s[m]
            rows.append([m, x["wall_s"], x["steps"],
                         None if x["goodput"] is None else f"{x['goodput']:.1%}",
                         x["recoveries"], x["recovery_s_median"], x["recovery_s_max"],
                         x["steps_redone"], f"{x['step_s_median'] * 1000:.0f}",
                         (x["params_sha256"] or "-")[:12]])
    print()
    print(table(rows, ["mode", "wall_s", "steps", "goodput", "failures", "recov_med_s",
                       "recov_max_s", "redone", "step_ms", "params_sha256"]))
    if paired and "step_s_median_on" in paired and "step_s_median_off" in paired:
        print(f"steady-state overhead of checkpointless (on vs off, median step time, the runs "
              f"taking turns on the machine, {paired['steps_counted_on']} and "
              f"{paired['steps_counted_off']} steps counted): {overhead:+.1%} "
              f"(runs one after the other: {sequential:+.1%})")
    elif overhead is not None:
        print(f"steady-state overhead of checkpointless (on vs off, median step time): "
              f"{overhead:+.1%}")
    plain_fig = against_plain(s, paired)
    if plain_fig:
        print(plain_line(plain_fig))
    if paired and "step_s_median_flat" in paired and "step_s_median_off" in paired:
        print(overlap_line(paired))
    if grad_copy:
        print(grad_copy_line(grad_copy, (s.get("off") or {}).get("step_s_median")))
    if consistency:
        print(consistency_line(consistency, (s.get("off") or {}).get("step_s_median")))
    if speedup is not None:
        print(f"median recovery: restart {s['restart']['recovery_s_median']:.2f} s vs "
              f"checkpointless {s['checkpointless']['recovery_s_median']:.2f} s "
              f"-> {speedup}x faster (every failure, s: checkpointless "
              f"{s['checkpointless']['recovery_s_all']}, restart {s['restart']['recovery_s_all']})")
    if "checkpointless" in s and "restart" in s and s["restart"]["goodput"]:
        print(f"goodput: checkpointless {s['checkpointless']['goodput']:.1%} vs restart "
              f"{s['restart']['goodput']:.1%}")
    if "on" in s and any(m.startswith("slow-") for m in s):
        print()
        print(straggler_table(s))
    same = None
    for mode, against, line in COMPARED:
        if mode in s and against in s:
            print(line(s, paired))
    if "checkpointless" in s and "off" in s:
        same = s["checkpointless"]["params_sha256"] == s["off"]["params_sha256"] is not None
        print(f"final bits: checkpointless {'EQUAL to' if same else 'DIFFER from'} the "
              f"failure-free run (params_sha256 {str(s['off']['params_sha256'])[:16]})")
    projected, model_text = model_table(s, overhead, save_cost)
    print()
    print(model_text)
    bench_json = _bench_json(cfg, results, s, save_cost, overhead, sequential, paired, speedup,
                             plain_fig, grad_copy, consistency, same, projected)
    (out_root / "bench.json").write_text(json.dumps(bench_json, indent=2) + "\n")
    if (note := plot_skipped()) is None:
        plot(results, out_root / "timeline.png")
        print(f"\n[bench] wrote {out_root / 'bench.json'} and {out_root / 'timeline.png'}")
    else:
        print(f"\n{note}\n[bench] wrote {out_root / 'bench.json'}")
    return 0 if same in (None, True) and all(bench_json["slow_same_bits_as_on"].values()) \
        and not _unmeasured(s) else 1


def _unmeasured(s: dict) -> list[str]:
    """The modes that were to meet failures and measured no recovery (said): no figure."""
    out = [m for m in ("checkpointless", "restart", "tp", "pp", *SHRINK_MODES)
           if m in s and s[m].get("recovery_s_median") is None]
    if out:
        print(f"[bench] ERROR: no recovery was measured in {', '.join(out)}: no failure "
              "landed inside its training (see the [bench] killed lines above)")
    return out


def _bench_json(cfg, results, s, save_cost, overhead, sequential, paired, speedup, plain_fig,
                grad_copy, consistency, same, projected) -> dict:
    """What bench.json holds: every mode's figures and every comparison printed."""
    return {
        "machine": f"{os.cpu_count()} CPU cores, {sys.platform}",
        "config": asdict(cfg),
        "modes": {m: {k: v for k, v in x.items() if k != "t0"} for m, x in s.items()},
        "overhead": overhead, "overhead_sequential": sequential, "overhead_paired": paired,
        "recovery_speedup": speedup,
        "against_plain": plain_fig, "grad_copy_saved": grad_copy,
        "consistency_check": consistency,
        "same_bits_as_off": same,
        "slow_same_bits_as_on": {m: s[m]["params_sha256"] == s["on"]["params_sha256"]
                                 for m in s if m.startswith("slow-") and "on" in s},
        "failures": {m: r["kills"] for m, r in results.items() if r["kills"]},
        "checkpoint_save_s": round(save_cost, 4),
        "model": projected,
    }


def straggler_table(s: dict) -> str:
    """A straggler evicted, only reported, and no straggler (on): goodput with its cost counted,
    step times, the bits."""
    rows = []
    for m in ("on", "slow-report", "slow-evict"):
        if m not in s:
            continue
        x = s[m]
        after = x.get("step_s_median_after")
        rows.append([m, None if x["goodput"] is None else f"{x['goodput']:.1%}",
                     x.get("slow_s"), x.get("straggler_action") or "-",
                     x.get("straggler_from_step"), x.get("straggler_until_step"),
                     f"{x['step_s_median'] * 1000:.0f}",
                     "-" if after is None else f"{after * 1000:.0f}",
                     "EQUAL" if x["params_sha256"] == s["on"]["params_sha256"] else "DIFFER"])
    return ("a straggler (slow-*: one rank slowed by the `slow` fault), evicted or only reported, "
            "beside the failure-free run (on):\n" +
            table(rows, ["mode", "goodput", "slow_s", "straggler", "from_step", "until_step",
                         "step_ms", "step_ms_after", "bits_vs_on"]))
