"""A drop-in for torch's DistributedDataParallel that survives a recovery with the same bits.

torch's wrapper cannot follow a recovery: its constructor broadcasts from rank 0 (a replacement
would wait in a collective the survivors never join), it keeps the process group it was built
with, and it re-buckets after the first iteration in the order gradients happened to arrive. This
one keeps what makes DDP fast, gradient all-reduce overlapped with the rest of backward, and drops
what breaks recovery:

  * buckets come from the model alone: parameters in reverse registration order (the last layers'
    gradients are ready first), cut at `bucket_cap_mb`, so every generation, every process and
    every run sums the same elements together, in the same order;
  * a bucket's all-reduce starts, asynchronously, as soon as all its gradients are accumulated,
    and buckets always start in index order, so every rank issues the same collectives;
  * sums are taken in the buckets' own buffers and become the parameters' `.grad` (views into the
    buffer: no copy back) only once every bucket's collective succeeded, so when a peer dies
    mid-backward each rank still holds its own gradients (see `Job.grads_kept`);
  * the collectives use the default process group of the moment, so it follows each new
    generation without being rebuilt.
"""
from __future__ import annotations

import contextlib
import queue
import threading

import torch
import torch.distributed as dist

from .failures import communicating
from .pace import waiting


class DistributedDataParallel(torch.nn.Module):
    """Owns the bucket layout of a model's gradients and their overlapped all-reduce."""

    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=True, process_group=None, bucket_cap_mb: float = 25.0,
                 find_unused_parameters=False, gradient_as_bucket_view=True, static_graph=False):
        super().__init__()
        if process_group is not None:
            raise ValueError("checkpointless.DistributedDataParallel: leave process_group unset; "
                             "the job's group changes with every generation and the wrapper "
                             "always uses the current one")
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        cap = max(1, int(bucket_cap_mb * 2 ** 20))
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in reversed(params):
            bytes_ = p.numel() * p.element_size()
            last = self.buckets[-1] if self.buckets else None
            if last is None or size + bytes_ > cap or p.dtype != last[0].dtype \
                    or p.device != last[0].device:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += bytes_
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._sync = True
        self.on_local_grads = None  # (grads, extra) -> None: told the local values before a sum
        self._extra: torch.Tensor | None = None
        self.extra_sum: torch.Tensor | None = None
        self._reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def reduce_with(self, extra: torch.Tensor | None) -> None:
        """Sum `extra` (e.g. the step's summed loss) over the ranks with the next reduction of
        the gradients; the result is `extra_sum`. Set it before the backward that reduces."""
        self._extra = extra

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (earlier micro-batches); the next backward outside
        reduces everything accumulated."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    # ---- one backward ----------------------------------------------------------------------
    def _reset(self) -> None:
        self._waiting = [len(b) for b in self.buckets]  # gradients not yet ready, per bucket
        self._flats: list[torch.Tensor] = []  # bucket buffers handed to the sender, in order
        self._queued = False

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._queued:  # the end of this backward finishes the reduction
            self._queued = True
            self._sender = _Sender()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        i = self._bucket_of[id(p)]
        self._waiting[i] -= 1
        while len(self._flats) < len(self.buckets) and self._waiting[len(self._flats)] == 0:
            self._launch(len(self._flats))

    def _launch(self, i: int) -> None:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.buckets[i]])
        self._flats.append(flat)
        self._sender.put(flat, f"all-reduce of gradient bucket {i}")

    def _finish(self) -> None:
        try:
            params = [p for b in self.buckets for p in b]
            extra = None if self._extra is None else self._extra.detach().clone().float()
            if self.on_local_grads is not None:
                self.on_local_grads([(p, p.grad) for p in params if p.grad is not None], extra)
            while len(self._flats) < len(self.buckets):  # unused parameters: zeros
                self._launch(len(self._flats))
            if extra is not None:  # last, so every rank issues the collectives in one order
                self._sender.put(extra, "all-reduce of the step's extra values")
            self._sender.finish()  # raises PeerLost if any collective failed
            self.extra_sum = extra
            world = dist.get_world_size()
            for bucket, flat in zip(self.buckets, self._flats):
                flat.div_(world)
                offset = 0
                for p in bucket:  # a new tensor: the local gradient object stays as it was
                    p.grad = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
        finally:
            self._extra = None
            self._reset()

    def reduce_now(self, extra: torch.Tensor | None = None) -> None:
        """Average the gradients the parameters hold now, in the same buckets and order as a
        backward would (a survivor redoing a step from the gradients it kept)."""
        self._reset()
        self._sender = _Sender()
        self._extra = extra
        self._finish()


class _Sender:
    """Runs one backward's all-reduces on a thread of its own, one at a time, in the order given.

    The thread overlaps communication with the rest of backward (a blocking collective releases
    the interpreter lock while it waits). One at a time matters: after a collective fails on a
    group whose peer died, another collective on that group can receive the stray bytes of the
    first and abort the whole process from inside gloo; so after a failure nothing more is sent.
    """

    def __init__(self):
        self._items: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                         name="checkpointless-ddp-sender")
        self._thread.start()

    def put(self, tensor: torch.Tensor, what: str) -> None:
        self._items.put((tensor, what))

    def finish(self) -> None:
        self._items.put(None)
        with waiting():  # the training thread waits for the peers' share of the sums
            self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            if self._error is not None:
                continue  # a collective failed: the group is broken, send nothing more
            tensor, what = item
            try:
                with communicating(what):
                    dist.all_reduce(tensor)
            except BaseException as exc:  # handed to the training thread in finish()
                self._error = exc
