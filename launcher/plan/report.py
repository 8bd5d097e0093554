"""The plan's data, per rank: its items (what is alive in which phase of a step), the totals
compared with the budget, and the table, report and verdict `python -m launcher plan` prints."""
from __future__ import annotations

from dataclasses import dataclass, field

from launcher.plan.model import ModelFacts

GB = 10 ** 9

PHASES = ("forward", "loss backward", "layer backward", "optimizer step", "end of run")
_SHORT = {"forward": "F", "loss backward": "L", "layer backward": "B", "optimizer step": "O",
          "end of run": "E"}


@dataclass
class Item:
    name: str
    device: dict  # phase -> bytes on the device
    host: int = 0  # bytes of host memory
    note: str = ""

    @property
    def device_max(self) -> int:
        return max(self.device.values(), default=0)


@dataclass
class Plan:
    recipe: str
    facts: ModelFacts
    overrides: list  # the command line's key=value, shown in the report
    device_type: str  # cuda or cpu
    budget: int  # bytes one rank may use (device memory, or host memory per process on cpu)
    budget_source: str
    items: list
    trainable: int
    phases: dict  # phase -> device bytes
    summary: str
    fix: list | None = None  # overrides that fit, when this plan does not
    host_budget: int | None = None  # one node's host memory (None: not known here)
    host_source: str = ""
    ranks_per_node: int = 1  # ranks whose host rows share that memory
    fix_tried: bool = False
    closest: tuple | None = None  # (overrides, Plan) needing the least, when none fits
    stages: list = field(default_factory=list)  # pipelined: each worker stage's need, in order
    heaviest: int = 0  # pipelined: the stage whose rows these are
    hosted_base: int = 0  # a shrunk process's need before its hosted ranks' (fsdp: gathered)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase]

    @property
    def host(self) -> int:
        return sum(i.host for i in self.items)

    @property
    def need(self) -> int:
        """Bytes compared with the budget: the device peak (plus the host rows on cpu)."""
        return self.peak + (self.host if self.device_type == "cpu" else 0)

    @property
    def fits(self) -> bool:
        return self.need <= self.budget

    @property
    def host_per_node(self) -> int:
        return self.host * self.ranks_per_node

    @property
    def host_fits(self) -> bool:
        """The host rows of a node's ranks (peer replicas, snapshots: held besides each process
        itself) within its host memory; true when that memory is not known, and on cpu, where
        the host rows are counted with the device's."""
        return (self.device_type == "cpu" or self.host_budget is None
                or self.host_per_node <= self.host_budget)

    @property
    def headroom(self) -> float:
        return (self.budget - self.need) / self.budget

    def over(self) -> list[str]:
        """Each phase over the budget, with its largest item."""
        extra = self.host if self.device_type == "cpu" else 0
        out = []
        for ph, total in self.phases.items():
            if total + extra > self.budget:
                big = max(self.items, key=lambda i: i.device.get(ph, 0))
                out.append(f"{ph} {fmt_gb(total + extra)} (largest: {big.name} "
                           f"{fmt_gb(big.device[ph])})")
        return out

    def verdict(self) -> str:
        where = "per device" if self.device_type == "cuda" else "per process (host memory)"
        if self.fits:
            return (f"fits: {fmt_gb(self.need)} of {fmt_gb(self.budget)} {where} at the peak "
                    f"({self.peak_phase}), {self.headroom:.0%} headroom")
        line = (f"does not fit: {fmt_gb(self.need)} needed at the peak ({self.peak_phase}), "
                f"{fmt_gb(self.budget)} {where}; over in " + ", ".join(self.over()))
        if self.fix:
            return line + "; fits with: " + " ".join(self.fix)
        if self.fix_tried:
            line += ("; no override tried fits (distributed.strategy=fsdp, "
                     "model.gradient_checkpointing=true, "
                     + ("distributed.pp_schedule=1f1b, " if self.stages else "")
                     + "a smaller trainer.micro_batch_size, trainer.grad_accum_steps=1)")
            if self.closest is not None:
                changes, best = self.closest
                line += (f"; the closest, {' '.join(changes) or 'the recipe as it is'}, needs "
                         f"{fmt_gb(best.need)}, over in " + ", ".join(best.over()))
        return line

    def table(self) -> str:
        rows = [("item", "device/rank", "bytes", "host/rank", "live in")]
        for it in self.items:
            if not it.device_max and not it.host:
                continue
            live = "".join(_SHORT[p] for p in PHASES if it.device.get(p))
            rows.append((it.name + (f" ({it.note})" if it.note else ""),
                         fmt_gb(it.device_max) if it.device_max else "-",
                         f"{it.device_max:,}" if it.device_max else "-",
                         fmt_gb(it.host) if it.host else "-", live or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) if i < 4 else v
                           for i, (v, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def report(self) -> str:
        f = self.facts
        phases = ", ".join(f"{_SHORT[p]} {p} {fmt_gb(b)}" for p, b in self.phases.items())
        if not self.host:
            host = "host per rank: nothing planned beyond the process (no peer replicas)"
        else:
            host = f"host per rank: {fmt_gb(self.host)} ({self.host:,} bytes)"
            if self.device_type == "cpu":
                host += " (on cpu: counted with the device rows)"
            elif self.host_budget is None:
                host += (" (not compared: no GPU here to say what a node holds; set "
                         "distributed.host_memory_gb)")
            else:
                host += (f"; {self.ranks_per_node} ranks per node: {fmt_gb(self.host_per_node)} "
                         f"of {fmt_gb(self.host_budget)} ({self.host_source})"
                         + ("" if self.host_fits else ": DOES NOT FIT"))
        return "\n".join([
            f"plan: {self.recipe}" + (f" with {' '.join(self.overrides)}" if self.overrides
                                      else ""),
            f"model: {f.name}, {f.n_params / 1e9:.3f}B parameters ({f.n_params:,}) in "
            f"{f.dtype_name}, {self.trainable:,} trained; config: {f.config_source}",
            self.summary,
            f"budget: {fmt_gb(self.budget)} per rank ({self.budget_source})",
            "",
            self.table(),
            "",
            f"peak per rank: {fmt_gb(self.peak)} ({self.peak:,} bytes) during {self.peak_phase}",
            f"by phase: {phases}",
            *(["by stage: " + ", ".join(f"{i} {fmt_gb(b)}" for i, b in enumerate(self.stages))
               + f" (the table is stage {self.heaviest}'s, the heaviest)"] if self.stages
              else []),
            host,
            self.verdict(),
        ])


def fmt_gb(n: int) -> str:
    return f"{n / GB:,.2f} GB"
