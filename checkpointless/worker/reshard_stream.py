"""The slices of a shrink or grow cut anew tensor by tensor, each member receiving only its rows.

reshard.py decides which member sends each old slice (its own state, a snapshot, or a peer's
copy of a lost rank's). Here, for every sharded tensor in turn (a parameter cut on dim 0, or an
optimizer moment), one all_to_all_single moves the rows: the sender of old slice s sends each
member the rows where s overlaps the new chunks that member wants (its own, and under peer
replication the chunks of the ranks it keeps copies of). A member then holds its old state and
its new chunks, never the whole model: the host memory of a reshard is bounded by a slice and
the largest tensor, where broadcasting every old slice to everyone held the whole model and
optimizer state in each member at once (8 processes of a node x 20 GB for a 1B model).

What is not cut (a model's plain buffers, 0-dim optimizer state such as AdamW's step, the other
protected objects) is the same in every slice: old slice 0's sender broadcasts it with the
structure. Every byte moved is checked: each pair of members compares a SHA-256 of what was sent
with what arrived, once at the end.
"""
from __future__ import annotations

import hashlib
import math
import pickle

import torch
import torch.distributed as dist

from . import transfer
from .failures import communicating
from .tensors import is_dtensor


def chunk_rows(rows: int, ways: int, index: int) -> tuple[int, int]:
    """[start, end) of torch.chunk's (FSDP2's) chunk `index` of `rows` rows cut `ways` ways:
    empty past the end."""
    per = -(-rows // ways) if rows else 0
    start = min(rows, index * per)
    return start, min(rows, start + per)


def _refs(skeleton) -> list:
    """The skeleton's tensor references with the object each belongs to and its key there, in
    index order: [(object name, key or None, ref)]."""
    out = []

    def walk(x, name, key):
        if isinstance(x, transfer._TensorRef):
            out.append((name, key, x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, name, k)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, name, key)

    for name, obj in skeleton.items():
        walk(obj, name, None)
    return sorted(out, key=lambda item: item[2].index)


def _cut_leaves(objects: dict, leaves: list) -> list[bool]:
    """Whether each leaf is cut on dim 0: a model entry that is a DTensor in the live model, an
    optimizer tensor with dimensions; anything else is the same in every slice."""
    live = {name: obj.state_dict() for name, obj in objects.items()
            if isinstance(obj, torch.nn.Module)}  # once per module, not once per leaf
    return [is_dtensor(live[name].get(key)) if name in live else
            isinstance(objects.get(name), torch.optim.Optimizer) and len(ref.shape) > 0
            for name, key, ref in leaves]


def stream(state, me, old_ways: int, src_of: list[int], payloads: dict, wants: list[list]):
    """Every member's wanted new chunks, from the old slices' senders.

    `src_of[s]`: the member sending old slice s; `payloads[s]`: that slice's state (DTensors
    replaced by their local parts) on its sender; `wants[m]`: the (ways, index) chunks member m
    wants, its own first. Returns ({(ways, index): that chunk's state, shaped as a slice's
    state_dicts}, bytes received)."""
    world, rank = me.world_size, me.rank
    # the structure alone (flatten_state would copy slice 0's every tensor into one buffer)
    skel0 = pickle.dumps(transfer.strip_tensors(payloads[0])[0]) if rank == src_of[0] else None
    own = {s: transfer.strip_tensors(p)[1] for s, p in payloads.items()}
    shapes = {s: [tuple(t.shape) for t in tensors] for s, tensors in own.items()}
    gathered = [None] * world
    with communicating("exchanging the old slices' shapes"):
        dist.all_gather_object(gathered, shapes)
    shapes = {s: v for g in gathered for s, v in g.items()}
    skeleton = pickle.loads(_broadcast_bytes(skel0, src_of[0], rank))
    leaves = _refs(skeleton)
    cut = _cut_leaves(state.objects, leaves)
    # what is not cut comes whole from slice 0's sender, with the structure
    kept, moved = _broadcast_uncut(own.get(0), leaves, cut, src_of[0], rank)
    sent = [hashlib.sha256() for _ in range(world)]
    got = [hashlib.sha256() for _ in range(world)]
    mine = {w: {} for w in map(tuple, wants[rank])}
    for i, (_, _, ref) in enumerate(leaves):
        if not cut[i]:
            continue
        rows = [shapes[s][i][0] for s in range(old_ways)]
        trail = math.prod(ref.shape[1:])
        pieces = _move(i, rows, trail, ref.dtype, src_of, own, wants, rank, world, sent, got)
        for w, parts in pieces.items():
            a, b = chunk_rows(sum(rows), *w)
            mine[w][ref.index] = torch.cat(parts).view(b - a, *ref.shape[1:]) if parts else \
                torch.empty(b - a, *ref.shape[1:], dtype=ref.dtype)
            moved += sum(p.numel() for p in parts) * ref.dtype.itemsize
    _check_digests(sent, got, rank, world)
    out = {}
    for w, tensors in mine.items():
        out[w] = transfer.fill_refs(skeleton, {**kept, **tensors})
    return out, moved


def _broadcast_bytes(data: bytes | None, src: int, rank: int) -> bytes:
    """`data` from member `src` to every member."""
    box = [data if rank == src else None]
    with communicating(f"broadcasting rank {src}'s slice structure"):
        dist.broadcast_object_list(box, src)
    return box[0]


def _broadcast_uncut(tensors, leaves, cut, src: int, rank: int) -> tuple[dict, int]:
    """{leaf index: tensor} of the leaves not cut, sent whole by `src` from slice 0's
    `tensors`; and the bytes received."""
    values = None
    if rank == src:
        values = {ref.index: tensors[ref.index] for (_, _, ref), c in zip(leaves, cut) if not c}
    got, n = transfer.broadcast_state(values, src, rank)
    return (values if rank == src else got), (0 if rank == src else n)


def _move(i: int, rows: list[int], trail: int, dtype, src_of, own, wants, rank, world, sent,
          got) -> dict:
    """Leaf `i`'s rows in one all_to_all_single: {wanted chunk: its pieces in row order}."""
    offsets = [sum(rows[:s]) for s in range(len(rows))]
    total = sum(rows)

    def overlaps(m: int, s: int):  # (chunk wanted by m, rows of old slice s inside it)
        for w in wants[m]:
            a, b = chunk_rows(total, w[0], w[1])
            lo, hi = max(a, offsets[s]), min(b, offsets[s] + rows[s])
            yield tuple(w), max(0, hi - lo), lo - offsets[s]

    send, send_sizes = [], []
    for m in range(world):
        n = 0
        for s in range(len(rows)):
            if src_of[s] != rank:
                continue
            flat = own[s][i].reshape(rows[s], trail)
            for _, count, start in overlaps(m, s):
                if count:
                    # on the host, as transfer.py moves state: a sender's live state (it
                    # completed the step agreed, with no snapshot of it) may be on a GPU
                    piece = flat[start:start + count].reshape(-1).cpu()
                    send.append(piece)
                    sent[m].update(piece.contiguous().view(torch.uint8).numpy().tobytes())
                    n += piece.numel()
        send_sizes.append(n)
    recv_sizes, layout = [0] * world, []
    for q in range(world):
        for s in range(len(rows)):
            if src_of[s] == q:
                for w, count, _ in overlaps(rank, s):
                    if count:
                        layout.append((q, s, w, count * trail))
                        recv_sizes[q] += count * trail
    buf = torch.cat(send) if send else torch.empty(0, dtype=dtype)
    out = torch.empty(sum(recv_sizes), dtype=dtype)
    with communicating("cutting the slices anew"):
        dist.all_to_all_single(out, buf.to(dtype), output_split_sizes=recv_sizes,
                               input_split_sizes=send_sizes)
    pieces, at = {tuple(w): [] for w in wants[rank]}, 0
    for q, s, w, n in layout:  # by sender, then old slice
        part = out[at:at + n]
        got[q].update(part.view(torch.uint8).numpy().tobytes())
        pieces[w].append((s, part))
        at += n
    # old slices hold consecutive rows: a chunk's pieces in slice order are its rows in order
    return {w: [part for _, part in sorted(parts, key=lambda x: x[0])]
            for w, parts in pieces.items()}


def _check_digests(sent, got, rank: int, world: int) -> None:
    """Each member's SHA-256 of what it sent every other matched against what arrived."""
    mine = torch.frombuffer(bytearray(b"".join(h.digest() for h in sent)), dtype=torch.uint8)
    theirs = torch.empty(world * 32, dtype=torch.uint8)
    with communicating("checking the cut slices' digests"):
        dist.all_to_all_single(theirs, mine)
    for q in range(world):
        if theirs[q * 32:(q + 1) * 32].numpy().tobytes() != got[q].digest():
            raise transfer.IntegrityError(f"rows cut anew from rank {q} failed their SHA-256 "
                                          "check")
