"""The timeline figure: steps completed over wall time per mode, failures marked."""
from __future__ import annotations

from pathlib import Path

COLORS = {"off": "#888888", "on": "#bbbbbb", "checkpointless": "#1f77b4", "restart": "#d62728"}


def plot_skipped() -> str | None:
    """The one line said when the timeline cannot be drawn (everything else is still written)."""
    from launcher.run.preflight import installed
    if installed("matplotlib"):
        return None
    return ("[bench] matplotlib is not installed: timeline.png will not be drawn (bench.json and "
            "the figures are written all the same). Fix: pip install matplotlib, or install the "
            "project with its bench extra: pip install -e '.[bench]'")


def plot(results: dict, path: Path) -> None:
    import matplotlib  # imported here: only the benchmark's final step needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for mode in ("off", "checkpointless", "restart"):
        r = results.get(mode)
        if not r or not r["records"]:
            continue
        t0 = r["summary"]["t0"]
        recs = sorted(r["records"], key=lambda x: x["t_end"])
        ax.plot([x["t_end"] - t0 for x in recs], [x["step"] + 1 for x in recs], ".",
                ms=2.5, color=COLORS[mode],
                label=f"{mode} (goodput {r['summary']['goodput']:.1%})")
        for i, k in enumerate(r["kills"]):
            ax.axvline(k["t"] - t0, color=COLORS[mode], ls="--", lw=0.8, alpha=0.7,
                       label=f"{mode}: failures" if i == 0 else None)
    ax.set_xlabel("wall time since the first step (s)")
    ax.set_ylabel("step completed")
    ax.set_title("Steps completed over time, same failure schedule")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
