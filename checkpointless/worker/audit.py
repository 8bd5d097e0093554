"""Audits by replay: what a rank computes of an audited step, and how it is compared.

A chip that computes wrong without crashing (silent data corruption) puts a wrong gradient into
the reduction; every replica then receives the same wrong sum, so comparing replicas sees
nothing. Because a step here is bit-exact (the same state, batch and seeds give the same bits on
any healthy worker), one recomputation settles it: every `audit.every` steps one sampled rank
(ranks in turn) and its witness (the next rank) publish a digest of their local gradient
contribution, the one that enters the reduction, and of the parameters their forward used. The
witness ships those parameters to an idle spare (auditor.py), which replays both ranks' steps on
its own hardware and compares.

The digest is an integer sum of each gradient's bits (per dtype as integers): a flipped bit moves
it by a power of two, so it never goes unseen, and a sum is the same in any order, so a model
wrapped for fsdp or ddp and the spare's plain one agree whatever order their backward visits
the parameters. It costs one pass over the gradients, on the device, at audited steps only.

`GradTap` finds the gradients where every strategy has them whole: hooks on each leaf module's
own parameters, placed as its forward starts (under FSDP2 those are the unsharded parameters
then), fire as each contribution is computed, before it is accumulated and reduced. The same
hook flips the bit of an injected `sdc` fault, as a bad chip's output would be wrong.
"""
from __future__ import annotations

import random

import torch

from .tensors import local_tensor

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on t's device: the sum of t's elements read as integers of their width.
    One flipped bit changes it by +-2^k; it is independent of the order of a sum of such. A
    DTensor's local part is read (no collective)."""
    flat = local_tensor(t).detach().contiguous().reshape(-1)
    return flat.view(_AS_INT[flat.element_size()]).sum(dtype=torch.int64)


def flip_bit(t: torch.Tensor, bit: int | None = None) -> torch.Tensor:
    """A copy of `t` with one bit of its first element flipped: the top bit of the mantissa
    (a wrong value of the same sign and order of magnitude, as a bad multiplier would give)."""
    out = t.detach().clone()
    ints = out.reshape(-1).view(_AS_INT[out.element_size()])
    width = 8 * out.element_size()
    bit = {16: 6, 32: 22, 64: 51}.get(width, width - 2) if bit is None else bit
    ints[0] ^= 1 << bit
    return out


def audited(step: int, every: int, world: int) -> tuple[int, int] | None:
    """(audited rank, witness rank) of `step`, or None when no audit falls there. Every round
    of `world` audits covers every rank once, in an order drawn afresh for each round (seeded by
    the round: every process computes the same): a fault that strikes every k steps cannot hide
    from a fixed turn whose period shares a factor with k. A rank waits at most 2 * world - 1
    audits between two of its own."""
    if every <= 0 or step % every or world < 2:
        return None
    turn = step // every
    order = list(range(world))
    random.Random(f"audit-round:{turn // world}").shuffle(order)
    rank = order[turn % world]
    return rank, (rank + 1) % world


def rewind_bound(last_passed: int | None) -> int:
    """The newest step whose state is known clean of a worker found wrong: the state after
    the last step at which its audit passed (its chip computed right then; a fault that
    persists began after it), or the start when it never passed one."""
    return 0 if last_passed is None or last_passed < 0 else last_passed + 1


def judge(mine_audited: int, theirs_audited: int, mine_witness: int | None,
          theirs_witness: int | None) -> str:
    """What one audit found: "ok" (the audited rank's digest equals the replay's), "audited"
    (it differs, and the witness's equals the replay of the witness's own step: the spare
    computes right, the audited rank wrong), "auditor" (neither agrees: the replaying spare is
    the suspect, and nobody is accused), or "undecided" (it differs, and the witness's step was
    not replayed yet: it is replayed only then, `mine_witness` None before)."""
    if mine_audited == theirs_audited:
        return "ok"
    if mine_witness is None or theirs_witness is None:
        return "undecided"
    return "audited" if mine_witness == theirs_witness else "auditor"


class GradTap:
    """Hooks on a model's leaf modules. While armed for a step: the digest of every gradient
    contribution to a parameter, the digest of the parameters the forward used and (`capture`)
    a host copy of them by name; `flip` makes the first contribution of the step wrong by one
    bit. Disarmed, the hooks return at once."""

    def __init__(self, model: torch.nn.Module):
        self._names: dict[int, str] = {}
        self._module_hooks = []  # the forward pre-hooks, for remove()
        for name, module in model.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._names[id(module)] = name
                self._module_hooks.append(module.register_forward_pre_hook(self._before_forward))
        self.step: int | None = None
        self._handles: list = []
        self.flip = False
        self.flipped: str | None = None

    def arm(self, step: int, capture: bool = False, flip: bool = False) -> None:
        self.disarm()
        self.step, self.capture, self.flip, self.flipped = step, capture, flip, None
        self._grads = self._params = None  # int64 scalars on the device, once anything is seen
        self._seen: set[int] = set()
        self.params: dict[str, torch.Tensor] = {}

    def disarm(self) -> None:
        """Stop: the grad hooks placed for the step are removed (a leaf's hooks would stay)."""
        for h in self._handles:
            h.remove()
        self._handles, self.step = [], None

    def remove(self) -> None:
        """Take every hook off the model (a tap used once, such as the replay rehearsal's)."""
        self.disarm()
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []

    @property
    def armed(self) -> bool:
        return self.step is not None

    def digests(self) -> tuple[int, int] | None:
        """(gradient digest, parameter digest) of the armed step; None if nothing was computed."""
        if self._grads is None:
            return None
        return int(self._grads.item()), int(self._params.item())

    def _add(self, which: str, value: torch.Tensor) -> None:
        now = getattr(self, which)
        setattr(self, which, value.clone() if now is None else now + value.to(now.device))

    def _before_forward(self, module, args) -> None:
        if self.step is None or not torch.is_grad_enabled():
            return
        prefix = self._names.get(id(module), "")
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in self._seen:  # once per step: a leaf's hook fires in every backward
                continue
            self._seen.add(id(p))
            name = f"{prefix}.{pname}" if prefix else pname
            self._add("_params", checksum(p))
            if self.capture:
                self.params[name] = p.detach().to("cpu", copy=True)
            if p.requires_grad:
                self._handles.append(p.register_hook(self._on_grad(name)))

    def _on_grad(self, name: str):
        def hook(grad: torch.Tensor):
            if self.flip and self.flipped is None:
                grad, self.flipped = flip_bit(grad), name
            self._add("_grads", checksum(grad))
            return grad
        return hook
