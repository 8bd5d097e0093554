"""Training data: load text, tokenize, pack into fixed-length sequences, cache (served by step in
sampler.py).

data.format=text: documents + end-of-text laid end to end and cut into seq_len rows of
`input_ids` (every token in the loss). data.format=chat / instruction: examples tokenized with a
loss mask (`labels`, -100 outside the responses) and packed into rows with `position_ids`, or
padded one per row with `attention_mask` (launcher/data/sft.py). `prepare(cfg, tok, "eval")` is
the validation data, processed the same way.

The launcher builds the cache once per node before any worker starts (`prepare_node`), with
data.num_proc processes (launcher/data/text_cache.py), printing progress; workers and spares then only
memory-map it. A worker that finds no cache (a run started without the launcher) builds it itself,
under a lock, with one process.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
from pathlib import Path


DATA_FORMAT_VERSION = 2  # bump when tokenization, packing or the layout changes (2: int32 shards)
SFT_FORMAT_VERSION = 1  # bump when chat/instruction tokenization, masking or rows change
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the folder holding launcher/

_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
_THINGS = ["apples", "books", "coins", "stones", "shells", "cards"]
_PLACES = ["the garden", "the market", "the river", "the library", "the hill"]


def synthetic_docs(n: int, seed: int | str) -> list[str]:
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


def resolve_files(files, key: str = "data.files") -> list[str]:
    """Each path as given when it exists from the current directory, else (relative) from the
    project root, so a shipped recipe's `launcher/assets/...` works from any directory."""
    out = []
    for f in files:
        p = Path(f).expanduser()
        if p.exists():
            out.append(str(p))
        elif not p.is_absolute() and (PROJECT_ROOT / p).exists():
            out.append(str(PROJECT_ROOT / p))
        else:
            raise ValueError(f"{key}: {f!r} does not exist (looked in {Path.cwd()} and in the "
                             f"project root {PROJECT_ROOT})")
    return out


def _load_files(files: list[str], key: str, d, num_proc: int = 1):
    import datasets
    ext = Path(files[0]).suffix.lstrip(".")
    builder = {"jsonl": "json", "json": "json", "txt": "text", "parquet": "parquet"}.get(ext)
    if builder is None:
        raise ValueError(f"{key}: {files[0]!r} has an unsupported extension; use "
                         ".json, .jsonl, .txt or .parquet")
    if builder == "text" and d.format != "text":
        raise ValueError(f"{key}: {files[0]!r} is plain text; data.format={d.format} reads "
                         "examples from .json, .jsonl or .parquet files")
    # several processes read several files at once; the rows keep the files' order
    level = datasets.logging.get_verbosity()
    # its own "Failed to load JSON" line (an error record): one sentence is said below instead
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        ds = datasets.load_dataset(builder, data_files=list(files), split="train",
                                   num_proc=_procs_for(num_proc, len(files)))
    except Exception as exc:  # noqa: BLE001  datasets wraps the parser's error in its own
        from launcher.data.errors import unreadable
        raise ValueError(unreadable(files, key, builder, exc)) from None
    finally:
        datasets.logging.set_verbosity(level)
    if builder == "text" and d.text_field != "text":
        ds = ds.rename_column("text", d.text_field)
    return ds


def _eval_source(cfg) -> tuple[str, object]:
    """Where the validation data comes from: ("files", paths), ("hub", split) or
    ("synthetic", (docs, seed)); a ValueError when the recipe names none."""
    d, e = cfg.data, cfg.eval
    if e.files:
        return "files", resolve_files(e.files, "eval.files")
    if d.source == "hub":
        if not e.split:
            raise ValueError(f"validation data: set eval.split to a split of {d.id!r} other "
                             f"than data.split={d.split!r} (e.g. validation or test), or "
                             "eval.files")
        return "hub", e.split
    if d.source == "synthetic":
        # seeded apart from the training text: a string seed is a stream no int seed gives
        return "synthetic", (max(64, d.synthetic_docs // 10), f"eval:{e.seed}")
    raise ValueError("validation data: data.source=files has no held-out split; set eval.files "
                     "to the validation files (same format as data.files)")


def _procs_for(num_proc: int, n_files: int) -> int | None:
    """load_dataset's num_proc: None for one process, never more than the files it splits."""
    n = min(num_proc, n_files)
    return n if n > 1 else None


def _load_hub(d, split: str, num_proc: int):
    """The hub split, downloaded and converted to Arrow once (datasets' own cache) by up to
    `num_proc` processes, each taking whole files of the dataset (datasets lowers num_proc to the
    number of files itself)."""
    import datasets
    return datasets.load_dataset(d.id, d.subset, split=split, revision=d.revision,
                                 num_proc=num_proc if num_proc > 1 else None)


def _raw_dataset(cfg, part: str = "train", num_proc: int = 1):
    import datasets
    d = cfg.data
    if d.source == "synthetic" and d.format != "text":
        raise ValueError(f"data.source=synthetic generates raw text; data.format={d.format} needs "
                         "examples from data.source=files (e.g. launcher/assets/tiny_chat.jsonl) "
                         "or hub")
    if part == "eval":
        kind, where = _eval_source(cfg)
        if kind == "files":
            ds = _load_files(where, "eval.files", d, num_proc)
        elif kind == "hub":
            ds = _load_hub(d, where, num_proc)
        else:
            ds = datasets.Dataset.from_dict({d.text_field: synthetic_docs(*where)})
    elif d.source == "synthetic":
        ds = datasets.Dataset.from_dict({d.text_field: synthetic_docs(d.synthetic_docs,
                                                                      cfg.run.seed)})
    elif d.source == "hub":
        ds = _load_hub(d, d.split, num_proc)
    else:
        ds = _load_files(resolve_files(d.files), "data.files", d, num_proc)
    if part == "train" and d.max_docs:
        ds = ds.select(range(min(d.max_docs, len(ds))))
    if d.format == "text" and d.text_field not in ds.column_names:
        raise ValueError(f"data.text_field={d.text_field!r} is not a column of the dataset "
                         f"(columns: {ds.column_names})")
    return ds


def _stat(files: list[str], resolved: list[str]) -> list:
    return [(f, os.path.getsize(r), os.path.getmtime(r)) for f, r in zip(files, resolved)]


def tokenizer_fingerprint(tokenizer) -> str:
    """What decides the token ids of a text: the vocabulary, and for a fast tokenizer its whole
    pipeline (normalizer, pre-tokenizer, merges, added tokens), plus the end-of-text id appended
    to each document. Two tokenizers with one vocabulary and other merges differ here."""
    parts = {"vocab": sorted(tokenizer.get_vocab().items()), "eos": tokenizer.eos_token_id,
             "class": type(tokenizer).__name__}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # its JSON, keys sorted: the same pipeline gives the same text
        parts["pipeline"] = json.loads(backend.to_str())
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_key(cfg, tokenizer, part: str = "train") -> str:
    """Names the cached rows; it covers everything the rows depend on (data.num_proc is not one
    of them: any number of processes writes the same rows)."""
    d = cfg.data
    files = _stat(d.files, resolve_files(d.files)) if d.source == "files" else []
    vocab = tokenizer_fingerprint(tokenizer)
    ident = {"v": DATA_FORMAT_VERSION, "source": d.source, "id": d.id,
             "subset": d.subset, **({"revision": d.revision} if d.revision else {}), "split": d.split, "files": files,
             "field": d.text_field, "max_docs": d.max_docs, "seq_len": d.seq_len,
             "synthetic": [d.synthetic_docs, cfg.run.seed] if d.source == "synthetic"
             else None, "tokenizer": vocab}
    if part != "train":
        kind, where = _eval_source(cfg)
        ident.update(part=part, max_docs=None, files=[], synthetic=None, split=None,
                     eval=[kind, _stat(cfg.eval.files, where) if kind == "files" else where])
    if d.format != "text":
        ident.update(format=d.format, sft=SFT_FORMAT_VERSION, train_on_prompt=d.train_on_prompt,
                     packing=d.packing, pad=tokenizer.pad_token_id, eos=tokenizer.eos_token_id,
                     fields=[d.messages_field] if d.format == "chat"
                     else [d.prompt_field, d.response_field],
                     chat_template=getattr(tokenizer, "chat_template", None)
                     if d.format == "chat" else None)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def num_procs(cfg) -> int:
    """Processes that prepare the data: data.num_proc, or 0 for all of this node's cores."""
    from launcher.data.text_cache import node_cores
    return cfg.data.num_proc or node_cores()


def prepare_node(cfg, log=print) -> None:
    """Build the caches this run's workers read, once on this node and before any of them starts:
    the training rows, and the validation rows when eval.every > 0. Workers and spares then only
    memory-map them (no worker tokenizes, and 8 workers do not wait on one lock for an hour).
    A problem with the data is a RecipeError: one message, no traceback, no worker started."""
    import time

    import datasets

    from models import build_tokenizer

    from launcher.recipe.load import RecipeError
    datasets.disable_progress_bars()  # our own progress lines say it once, not a bar per map
    n = num_procs(cfg)
    tok = build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.id or cfg.model.id,
                          cfg.tokenizer.chat_template)
    for part in ("train", "eval") if cfg.eval.every > 0 else ("train",):
        t0 = time.time()
        try:
            ds = prepare(cfg, tok, part, num_proc=n, log=log)
            where = Path(cfg.data.cache_dir) / cache_key(cfg, tok, part)
        except (ValueError, FileNotFoundError) as exc:
            raise RecipeError(f"data ({part}): {exc}") from None
        log(f"[data] {part}: {len(ds):,} rows of {cfg.data.seq_len} tokens ready in {where} "
            f"({time.time() - t0:.1f} s)")
    if cfg.data.source == "hub" and not cfg.data.revision:
        log(f"[data] data.revision is not set: {cfg.data.id}'s rows are those of the first "
            "download into this cache, even if the dataset changes on the hub since. Pin "
            "data.revision=<commit> to train on a known version (a new revision, new rows)")


def _complete(path: Path) -> bool:
    # each layout's last file; the folder only gets its name once whole (an atomic rename)
    from launcher.data.text_cache import MANIFEST
    return (path / MANIFEST).exists() or (path / "dataset_info.json").exists()


def prepare(cfg, tokenizer, part: str = "train", num_proc: int = 1, log=print):
    """The rows of `part` (train, or eval: the validation data, see `_eval_source`), built once
    with `num_proc` processes and memory-mapped from the Arrow cache afterwards.

    Processes asking at once (the launchers of several nodes on one shared filesystem, or workers
    started without the launcher) take a file lock: the first builds, the others wait and map.
    """
    if part not in ("train", "eval"):
        raise ValueError(f"part={part!r}: use 'train' or 'eval'")
    root = Path(cfg.data.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / cache_key(cfg, tokenizer, part)
    if not _complete(path):
        with open(str(path) + ".lock", "w") as lock:
            locked = _lock(lock, path, part, log)
            if not _complete(path):
                if locked:  # without the lock, a leftover may be another node's build at work
                    _clear_leftovers(path, log)
                _build(cfg, tokenizer, part, path, num_proc, log)
    ds = _load(path)
    if len(ds) == 0:
        what = "the dataset" if part == "train" else "the validation data"
        raise ValueError(f"{what} yields no sequence of data.seq_len={cfg.data.seq_len} "
                         "tokens; lower seq_len or add data" if cfg.data.format == "text" else
                         f"{what} yields no example with a token in the loss")
    return ds.with_format("torch")


def _lock(lock, path: Path, part: str, log) -> bool:
    """Hold the cache's lock (waiting, and saying so, while another process builds it); False
    where the filesystem takes no locks (some NFS and Lustre mounts): then each builder builds
    and the first to finish names the cache (`text_cache.publish`)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log(f"[data] {part}: another process is preparing {path}; waiting for it")
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as exc:
        log(f"[data] {part}: {path.parent} takes no file locks ({exc.strerror}): building "
            "without one; run `python -m launcher prepare` on one node first to build it once")
        return False
    return True


def _clear_leftovers(path: Path, log) -> None:
    """Remove what an interrupted build of `path` left (we hold its lock: nobody else is at it)."""
    for p in sorted(path.parent.glob(path.name + ".tmp*")) + \
            sorted(path.parent.glob(path.name + ".scratch*")) + ([path] if path.exists() else []):
        log(f"[data] removing {p}: left by an interrupted preparation, never used")
        shutil.rmtree(p, ignore_errors=True)


def _load(path: Path):
    import datasets

    from launcher.data import text_cache
    if (path / text_cache.MANIFEST).exists():
        return text_cache.load(path)
    return datasets.load_from_disk(str(path))


def _build(cfg, tokenizer, part: str, path: Path, num_proc: int = 1, log=print) -> None:
    from launcher.data import text_cache
    raw = _raw_dataset(cfg, part, num_proc)
    if cfg.data.format == "text":
        text_cache.build(raw, tokenizer, cfg.data.seq_len, cfg.data.text_field, path, num_proc,
                         part, log)
        return
    from launcher.data.sft import build_rows, tokenize_examples
    tmp, scratch = text_cache.tmp_path(path), str(text_cache.tmp_path(path, "scratch"))
    try:
        rows, _ = build_rows(tokenize_examples(raw, tokenizer, cfg.data, num_proc), tokenizer,
                             cfg.data, scratch, part)
        rows.save_to_disk(str(tmp))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text_cache.publish(tmp, path)
