"""Seeded initialization that gives the same model whatever the world size, sharded or not.

    with EmptyBuild() as built:              # parameters on the meta device, buffers real
        model = build_model(...)             # the model's own init runs, and is recorded
        model = apply_lora(model, ...)       # peft's adapter init is recorded too
    rules = built.rules(model)               # parameter name -> the init calls that made it
    ... fully_shard(model) ...               # (fsdp) or nothing (ddp)
    materialize(model, rules, seed, device)  # allocate local parts, replay the init per parameter

Why record and replay. A model's init rules are its own (transformers' `_init_weights`: normal
with `initializer_range` for Linear and Embedding, ones for norms, zeros for biases, GPT-2's
residual projections scaled by 1/sqrt(2 n_layer), the padding row of an embedding zeroed, peft's
adapters kaiming/zeros, ...). Rather than copy those rules here and drift from them, the model is
built with its parameters on the meta device while a torch-function mode watches every in-place
call that lands on a parameter (or on a view of one); the calls are no-ops on meta, but their
functions and arguments are kept. Materializing replays, for each parameter, the calls from its
last whole overwrite on, on a full-size tensor, with torch's RNG seeded from (run seed,
parameter name), then keeps the part this rank owns.

Why per parameter. One RNG stream over the whole model (what `torch.manual_seed` then
`from_config` does) cannot be cut: a rank would have to draw every value before its slice. A
stream per parameter makes the full value of each parameter a function of (seed, name) only, so
2, 4 or 8 ranks, ddp or fsdp, start from the same bits, and a process never holds more than one
full parameter beyond its own shard. DTensor's own random ops are not world-size invariant on CPU,
so they are not used.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from checkpointless.worker import is_dtensor, local_part

# calls that replace every value of the tensor they are given: earlier calls on it are moot
_INIT_FUNCTIONS = {"uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "trunc_normal_", "orthogonal_", "sparse_"}
_OVERWRITES = _INIT_FUNCTIONS | {"fill_", "zero_", "copy_", "random_", "bernoulli_",
                                 "exponential_", "geometric_", "log_normal_", "cauchy_"}
# calls whose result shares the parameter's memory: an init written through them lands on it
_VIEWS = {"__getitem__", "view", "view_as", "narrow", "select", "t", "transpose", "permute",
          "unsqueeze", "squeeze", "reshape", "flatten", "detach", "as_strided", "diagonal",
          "unflatten", "expand", "chunk", "split", "unbind", "tensor_split"}


class UnknownInit(RuntimeError):
    pass


@dataclass
class _Call:
    func: object
    args: tuple
    kwargs: dict
    geometry: tuple | None  # (size, stride, storage_offset) of the view written, None: whole

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", "")


@dataclass
class InitRules:
    """For each parameter name, the calls that give its value (from the last whole overwrite)."""
    calls: dict[str, list[_Call]] = field(default_factory=dict)

    def full_value(self, name: str, shape, dtype, device, seed: int) -> torch.Tensor:
        """The whole parameter `name` as the model's init makes it, from a stream of its own."""
        if name not in self.calls:
            raise UnknownInit(
                f"no initialization of parameter {name!r} was seen while the model was built "
                "(an init that writes through `.data` or outside torch functions cannot be "
                "replayed); use model.init=pretrained or give the module an init that calls "
                "torch.nn.init / tensor methods on the parameter")
        full = torch.empty(shape, dtype=dtype, device=device)
        devices = [device] if torch.device(device).type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(param_seed(seed, name))
            for call in self.calls[name]:
                target = full if call.geometry is None else full.as_strided(*call.geometry)
                args = tuple(target if a is _TARGET else _real(a, device, name)
                             for a in call.args)
                kwargs = {k: (target if v is _TARGET else _real(v, device, name))
                          for k, v in call.kwargs.items()}
                call.func(*args, **kwargs)
        return full


class _Target:
    """Stands for the parameter in a recorded call's arguments."""

    def __repr__(self):
        return "<param>"


_TARGET = _Target()


def _real(value, device, name):
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise UnknownInit(f"the init of {name!r} reads a tensor computed on the meta device, "
                              "which has no values to replay")
        return value.to(device)
    return value


def param_seed(seed: int, name: str) -> int:
    """A seed for one parameter's stream: a function of (run seed, name) only."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.roots: dict[int, torch.Tensor] = {}  # id -> parameter (kept alive: ids stay unique)
        self.aliases: dict[int, tuple] = {}  # id of a view -> (root id, geometry, the view)
        self.calls: dict[int, list[_Call]] = {}

    def _resolve(self, t):
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return None
        if id(t) in self.aliases:
            root, geom, _ = self.aliases[id(t)]
            return root, geom
        if isinstance(t, torch.nn.Parameter):
            self.roots.setdefault(id(t), t)
            return id(t), None
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        target = args[0] if args else kwargs.get("tensor")
        found = self._resolve(target)
        if found is None:
            return out
        root, geom = found
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.data.__get__ or name in _VIEWS:
            for view in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(view, torch.Tensor) and view is not target:
                    g = (tuple(view.shape), tuple(view.stride()), view.storage_offset())
                    whole = g == (tuple(self.roots[root].shape), tuple(self.roots[root].stride()),
                                  self.roots[root].storage_offset())
                    self.aliases[id(view)] = (root, None if whole else g, view)
        elif name.endswith("_") and not name.startswith(("__", "requires_grad")):
            if geom is None and name in _OVERWRITES:
                self.calls[root] = []  # what came before is overwritten
            rec_args = tuple(_TARGET if a is target else a for a in args)
            rec_kwargs = {k: (_TARGET if v is target else v) for k, v in kwargs.items()}
            self.calls.setdefault(root, []).append(_Call(func, rec_args, rec_kwargs, geom))
        return out


class EmptyBuild:
    """Build a model with its parameters on the meta device (no memory, no values) and its
    buffers real (rotary frequencies are computed, not initialized), recording the init calls."""

    def __enter__(self):
        # A parameter is moved to meta as it is registered; one already on meta (a tied weight
        # assigned to a second module) is registered as is, so it stays the same object.
        # (accelerate's init_empty_weights re-wraps it, which silently unties the embeddings.)
        self._register = register = torch.nn.Module.register_parameter

        def on_meta(module, name, param):
            if param is not None and not param.is_meta:
                param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            register(module, name, param)

        torch.nn.Module.register_parameter = on_meta
        self._rec = _Recorder()
        self._rec.__enter__()
        return self

    def __exit__(self, *exc):
        self._rec.__exit__(*exc)
        torch.nn.Module.register_parameter = self._register
        return False

    def rules(self, model: torch.nn.Module) -> InitRules:
        """The recorded calls by parameter name (tied parameters under their first name)."""
        rules = InitRules()
        for name, p in model.named_parameters():
            if id(p) in self._rec.calls and self._rec.calls[id(p)]:
                rules.calls[name] = list(self._rec.calls[id(p)])
        self._rec.aliases.clear()  # drop the meta views; the rules hold what they need
        return rules


def is_meta(model: torch.nn.Module) -> bool:
    return any(local_part(p).is_meta for p in model.parameters())


def materialize(model: torch.nn.Module, rules: InitRules, seed: int, device,
                fill=lambda name, p: True, weights=None, prefixes=()) -> int:
    """Allocate the model's parameters on `device` (under FSDP2 each rank's shard only) and give
    every parameter for which `fill(name, param)` holds the value the model's init gives it,
    drawn as a whole from its own stream and cut to this rank's part. Parameters not filled stay
    uninitialized: a replacement receives them from a peer. With `weights`
    (models.pretrained.SafetensorsFiles) a parameter the checkpoint holds is read from it, this
    rank's part only. Returns the bytes allocated."""
    buffers = {name: b for name, b in model.named_buffers()}  # real already: kept
    # swap in place: a tied parameter (lm_head = embed_tokens) stays one object; a plain
    # meta -> device conversion would give each module its own new parameter and untie them
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers and not buffers[name].is_meta:
                b.copy_(buffers[name])
        total = 0
        for name, p in model.named_parameters():
            local = local_part(p)
            total += local.numel() * local.element_size()
            if not fill(name, p):
                continue
            if weights is not None:
                key = weights.key_for(name, prefixes)
                if key is not None:
                    local.copy_(weights.read_part(key, p))
                    continue
                if not weights.may_lack(name):  # never a silent random init of a base weight
                    raise weights.missing(name)
            full = rules.full_value(name, p.shape, p.dtype, local.device, seed)
            local.copy_(_my_part(full, p))
            del full  # at most one full parameter at a time
    return total


def _my_part(full: torch.Tensor, p) -> torch.Tensor:
    """The slice of `full` that this rank holds of parameter `p` (all of it when not sharded)."""
    if not is_dtensor(p):
        return full
    from torch.distributed.tensor import distribute_tensor
    # src_data_rank=None: every rank cuts its part from its own copy, no communication
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
