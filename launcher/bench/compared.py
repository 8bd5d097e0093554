"""The benchmark's comparisons of one mode against another (launcher/bench/report.py prints them):
each a line with the two median steps, how they were measured (the runs taking turns on the
machine, else one after the other), and what the mode costs or holds; the ratio is kept in the
mode's figures for bench.json."""
from __future__ import annotations

from launcher.bench.shrink import shrink_line


def _against_replicated(s: dict, paired: dict, mode: str) -> tuple[float, float, str]:
    """(`mode`'s median step, fsdp-replicated's, how they were measured): from the runs taking
    turns when they ran, else one after the other; the ratio is kept in `mode`'s figures."""
    a, b = (paired or {}).get(f"step_s_median_{mode}"), \
        (paired or {}).get("step_s_median_fsdp-replicated")
    how = "the runs taking turns on the machine" if a and b else "runs one after the other"
    a, b = (a, b) if a and b else (s[mode]["step_s_median"], s["fsdp-replicated"]["step_s_median"])
    s[mode]["step_vs_fsdp_replicated"] = round(a / b - 1, 4)
    return a, b, how


def tp_line(s: dict, paired: dict) -> str:
    """fsdp x tp 2 against fsdp-replicated (the same 4 workers): the failure-free step time, and
    the tp mode's recoveries."""
    t = s["tp"]
    a, b, how = _against_replicated(s, paired, "tp")
    rec = t.get("recovery_s_all") or []
    return (f"tp (fsdp 2 shards x tp 2) median step {a * 1000:.1f} ms vs fsdp-replicated "
            f"{b * 1000:.1f} ms ({a / b - 1:+.1%}, {how}); recoveries of tp from the kill: "
            f"{rec or 'none (no failure fell inside its run)'} s, goodput "
            f"{'-' if t.get('goodput') is None else format(t['goodput'], '.1%')}")


def fsdp_exact_line(s: dict, paired: dict) -> str:
    """fsdp under shrink=exact against fsdp-replicated (the same recipe and copies): what the
    logical-order reduce-scatter costs a failure-free step, and its goodput."""
    a, b, how = _against_replicated(s, paired, "fsdp-exact")
    g = s["fsdp-exact"].get("goodput")
    return (f"fsdp-exact (reduce-scatter in logical order) median step {a * 1000:.1f} ms vs "
            f"fsdp-replicated {b * 1000:.1f} ms ({a / b - 1:+.1%}, {how}); goodput "
            f"{'-' if g is None else format(g, '.1%')}")


def hsdp_exact_line(s: dict, paired: dict) -> str:
    """hsdp under shrink=exact against hsdp under off (the same recipe): what summing each chunk
    over the world in logical order and handing it to its twins costs a failure-free step."""
    a, b = (paired or {}).get("step_s_median_hsdp-exact"), (paired or {}).get("step_s_median_hsdp")
    how = "the runs taking turns on the machine" if a and b else "runs one after the other"
    a, b = (a, b) if a and b else (s["hsdp-exact"]["step_s_median"], s["hsdp"]["step_s_median"])
    s["hsdp-exact"]["step_vs_hsdp"] = round(a / b - 1, 4)
    return (f"hsdp-exact (reduce-scatter over the world in logical order) median step "
            f"{a * 1000:.1f} ms vs hsdp {b * 1000:.1f} ms ({a / b - 1:+.1%}, {how})")


def hsdp_line(s: dict, paired: dict) -> str:
    """hsdp (two replica groups, no peer copies) against fsdp with peer replication: step time
    and host memory held."""
    h, rep = s["hsdp"], s["fsdp-replicated"]
    a, b, how = _against_replicated(s, paired, "hsdp")
    return (f"hsdp (2 replica groups, no peer copies) median step {a * 1000:.1f} ms vs "
            f"fsdp-replicated {b * 1000:.1f} ms ({a / b - 1:+.1%}, {how}); host memory per "
            f"worker for redundancy: hsdp {(h.get('replica_host_bytes') or 0) / 1e6:.1f} MB "
            f"(own snapshots only), fsdp-replicated "
            f"{(rep.get('replica_host_bytes') or 0) / 1e6:.1f} MB")


def replication_line(s: dict, paired: dict) -> str:
    """fsdp peer replication's per-step cost, beside the host memory its copies take; from the
    runs taking turns when they ran (the sequential ratio is shown too), else sequential."""
    rep, base = s["fsdp-replicated"], s["fsdp"]
    seq = round(rep["step_s_median"] / base["step_s_median"] - 1, 4)
    rep["replication_overhead_sequential"] = seq
    mem = f"replica host memory per worker: {(rep.get('replica_host_bytes') or 0) / 1e6:.1f} MB"
    crit = rep.get("replica_critical_ms")
    if crit:  # timed inside the run: what the step waits for, free of the machine's drift
        mem += (f"; on the training thread per exchange: snapshot copy {crit['snapshot']:.2f} ms"
                f" + waiting for the previous exchange {crit['wait']:.2f} ms (slowest rank), "
                f"{(crit['snapshot'] + crit['wait']) / 1000 / base['step_s_median']:.1%} "
                f"of fsdp's step")
    a, b = (paired or {}).get("step_s_median_fsdp-replicated"), \
        (paired or {}).get("step_s_median_fsdp")
    if a and b:
        over = rep["replication_overhead"] = round(a / b - 1, 4)
        return (f"fsdp peer replication (factor and interval from the recipe) per-step overhead: "
                f"{over:+.1%} (median step, the runs taking turns on the machine, "
                f"{paired['steps_counted_fsdp-replicated']} and {paired['steps_counted_fsdp']} "
                f"steps counted; runs one after the other: {seq:+.1%}); {mem}")
    rep["replication_overhead"] = seq
    return (f"fsdp peer replication (factor and interval from the recipe) per-step overhead: "
            f"{seq:+.1%} (runs one after the other); {mem}")


def audit_line(s: dict, paired: dict | None) -> str:
    """Audits every step against none (the same job, a spare, durable checkpoints): the
    failure-free step time, side by side when the paired run had enough steps."""
    p = paired or {}
    a, b = p.get("step_s_median_audit"), p.get("step_s_median_audit-off")
    how, bits = "side by side, taking turns", [p.get("params_sha256_audit"),
                                               p.get("params_sha256_audit-off")]
    if not (a and b):
        a, b = s["audit"]["step_s_median"], s["audit-off"]["step_s_median"]
        how, bits = "one after the other", [s[m]["params_sha256"] for m in ("audit", "audit-off")]
    same = bits[0] == bits[1] is not None
    return (f"audits every step: median step {a * 1000:.1f} ms vs none {b * 1000:.1f} ms "
            f"({a / b - 1:+.1%}, {how}); final bits {'EQUAL' if same else 'DIFFER'}")


def pp_line(s: dict, paired: dict | None) -> str:
    """2 pipeline stages x 2 replicas against ddp on the same workers (the same rows a step):
    the failure-free step time, and the pp mode's recoveries and goodput."""
    p = paired or {}
    a, b = p.get("step_s_median_pp"), p.get("step_s_median_ddp")
    how = "side by side, taking turns" if a and b else "one after the other"
    if not (a and b) and "on" in s:
        a, b = s["pp"]["step_s_median"], s["on"]["step_s_median"]
    rec, good = s["pp"].get("recovery_s_all") or [], s["pp"].get("goodput")
    tail = (f"recoveries of pp from the kills: {rec or 'none (no failure fell inside its run)'}"
            f" s, goodput {'-' if good is None else format(good, '.1%')}")
    if not (a and b):
        return f"pp (2 stages x 2 replicas, 1f1b): no ddp step time beside it; {tail}"
    s["pp"]["step_vs_ddp"] = round(a / b - 1, 4)
    return (f"pp (2 stages x 2 replicas, 1f1b) median step {a * 1000:.1f} ms vs ddp {b * 1000:.1f}"
            f" ms ({a / b - 1:+.1%}, {how}); {tail}")


# (mode, the mode it is read against, the line that compares them)
COMPARED = (("fsdp", "fsdp-replicated", replication_line), ("hsdp", "fsdp-replicated", hsdp_line),
            ("tp", "fsdp-replicated", tp_line), ("audit", "audit-off", audit_line),
            ("pp", "pp", pp_line), ("shrink-exact", "shrink-exact", shrink_line),
            ("fsdp-exact", "fsdp-replicated", fsdp_exact_line),
            ("hsdp-exact", "hsdp", hsdp_exact_line))
