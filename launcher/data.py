"""Training data: load text, tokenize, pack into fixed-length sequences, cache, serve by step.

The position is a pure function: the rows a rank trains on at global step S follow from
(seed, S, rank, world size, micro-batch) alone, so a run resumed or recovered at any step sees
exactly the batches of an uninterrupted run, none lost, none repeated.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
from pathlib import Path

import torch

DATA_FORMAT_VERSION = 1  # bump when tokenization or packing changes, to invalidate caches

_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
_THINGS = ["apples", "books", "coins", "stones", "shells", "cards"]
_PLACES = ["the garden", "the market", "the river", "the library", "the hill"]


def synthetic_docs(n: int, seed: int) -> list[str]:
    """Short stories with arithmetic that a small model can learn in a few hundred steps."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        a, b = rng.sample(_NAMES, 2)
        thing, place = rng.choice(_THINGS), rng.choice(_PLACES)
        x, y = rng.randint(1, 9), rng.randint(1, 9)
        docs.append(
            f"{a} went to {place} with {x} {thing}. {b} gave {a} {y} more {thing}. "
            f"now {a} has {x + y} {thing}. {a} counts: {' '.join(str(i) for i in range(1, x + y + 1))}."
        )
    return docs


def _raw_dataset(cfg):
    import datasets
    d = cfg.data
    if d.source == "synthetic":
        ds = datasets.Dataset.from_dict({d.text_field: synthetic_docs(d.synthetic_docs,
                                                                      cfg.run.seed)})
    elif d.source == "hub":
        ds = datasets.load_dataset(d.id, d.subset, split=d.split)
    else:
        ext = Path(d.files[0]).suffix.lstrip(".")
        builder = {"jsonl": "json", "json": "json", "txt": "text", "parquet": "parquet"}.get(ext)
        if builder is None:
            raise ValueError(f"data.files: {d.files[0]!r} has an unsupported extension; use "
                             ".json, .jsonl, .txt or .parquet")
        ds = datasets.load_dataset(builder, data_files=list(d.files), split="train")
        if builder == "text" and d.text_field != "text":
            ds = ds.rename_column("text", d.text_field)
    if d.max_docs:
        ds = ds.select(range(min(d.max_docs, len(ds))))
    if d.text_field not in ds.column_names:
        raise ValueError(f"data.text_field={d.text_field!r} is not a column of the dataset "
                         f"(columns: {ds.column_names})")
    return ds


def cache_key(cfg, tokenizer) -> str:
    d = cfg.data
    files = [(f, os.path.getsize(f), os.path.getmtime(f)) for f in d.files] \
        if d.source == "files" else []
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    ident = json.dumps({"v": DATA_FORMAT_VERSION, "source": d.source, "id": d.id,
                        "subset": d.subset, "split": d.split, "files": files,
                        "field": d.text_field, "max_docs": d.max_docs, "seq_len": d.seq_len,
                        "synthetic": [d.synthetic_docs, cfg.run.seed] if d.source == "synthetic"
                        else None, "tokenizer": vocab}, sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _pack(ds, tokenizer, seq_len: int, text_field: str):
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids]}

    def group(batch):
        flat = [t for x in batch["ids"] for t in x]
        n = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i:i + seq_len] for i in range(0, n, seq_len)]}

    ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names)
    return ds.map(group, batched=True, batch_size=1000, remove_columns=["ids"])


def prepare(cfg, tokenizer):
    """The packed dataset, built once and memory-mapped from the Arrow cache afterwards.

    Workers start together; a file lock lets the first build the cache while the others wait.
    """
    import datasets
    root = Path(cfg.data.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / cache_key(cfg, tokenizer)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "dataset_info.json").exists():
            packed = _pack(_raw_dataset(cfg), tokenizer, cfg.data.seq_len, cfg.data.text_field)
            tmp = Path(str(path) + f".tmp{os.getpid()}")
            packed.save_to_disk(str(tmp))
            os.replace(tmp, path)
    ds = datasets.load_from_disk(str(path))
    if len(ds) == 0:
        raise ValueError(f"the dataset yields no sequence of data.seq_len={cfg.data.seq_len} "
                         "tokens; lower seq_len or add data")
    return ds.with_format("torch")


class StepSampler:
    """Maps (step, rank, world, micro) to rows of the packed dataset, epoch after epoch.

    Global step S consumes positions [S*G, (S+1)*G) of an endless stream, G being the global batch
    in sequences; position p is row perm_e[p mod n] of epoch e = p // n, perm_e a permutation
    seeded by (seed, e).
    """

    def __init__(self, dataset, seed: int, micro_batch_size: int, grad_accum_steps: int):
        self.ds = dataset
        self.n = len(dataset)
        self.seed = seed
        self.mbs = micro_batch_size
        self.accum = grad_accum_steps
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g)}
        return self._perms[epoch]

    def positions(self, step: int, rank: int, world: int, micro: int) -> list[int]:
        global_batch = world * self.accum * self.mbs
        start = step * global_batch + (micro * world + rank) * self.mbs
        return list(range(start, start + self.mbs))

    def batch(self, step: int, rank: int, world: int, micro: int = 0) -> dict:
        """The model inputs of (step, rank, micro): see `batch_of`."""
        rows = [int(self._perm(p // self.n)[p % self.n]) for p in
                self.positions(step, rank, world, micro)]
        return batch_of(self.ds, rows)


def batch_of(ds, rows: list[int]) -> dict:
    """Keyword arguments of the model's forward for these rows: input_ids and labels (-100
    where a token carries no loss; the input ids themselves for raw text), plus position_ids
    (packed examples: positions restart at each one, which also keeps attention inside it) or
    attention_mask (padded examples) when the rows have them. The cache is off: training."""
    got = ds[rows]
    out = {"input_ids": got["input_ids"], "use_cache": False}
    out["labels"] = got["labels"] if "labels" in got else got["input_ids"]
    for key in ("position_ids", "attention_mask"):
        if key in got:
            out[key] = got[key]
    return out


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
