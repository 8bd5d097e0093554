"""data.format=text at scale: documents tokenized by all of a node's cores into a sharded cache.

The rows are cut group by group: documents [g*GROUP_DOCS, (g+1)*GROUP_DOCS) are tokenized, each
followed by the end-of-text token, laid end to end and cut into seq_len rows; the group's last
partial row is dropped. A group's rows depend on its own documents only, so processes that take
contiguous runs of groups and write one shard each produce, once their shards are read in order,
exactly the rows one process would (byte for byte, whatever num_proc is). These are the rows of
the earlier single-process packing (datasets' map, batches of 1000), so a recipe's data did not
change with this file; tests/launcher/test_text_cache.py checks both.

The cache is a folder of Arrow shards (`shard-00000.arrow`, ...: int32 token ids, half the disk of
int64) and `manifest.json`, written last. It is built in a temporary folder beside the final one
and renamed into place in one step: a folder under the final name is always complete, and an
interrupted build leaves only a `.tmp` folder, removed by the next build. Readers memory-map the
shards (nothing is copied into memory).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import time
import traceback
from pathlib import Path

GROUP_DOCS = 1000  # documents packed together (the earlier map's batch size: keeps the rows)
PROGRESS_EVERY_S = 10.0  # seconds between progress lines while a cache is built
MANIFEST = "manifest.json"


def node_cores() -> int:
    """The cores this process may run on (a job scheduler's cgroup/affinity, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pack_group(texts: list, tokenizer, seq_len: int):
    """(rows, tokens): the group's documents as an int32 array of shape (n, seq_len), and how many
    tokens they gave (end-of-text tokens included, the dropped tail too)."""
    import numpy as np
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    total = sum(len(x) for x in ids) + len(ids)
    flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(x, (eos,)) for x in ids),
                       dtype=np.int32, count=total)
    n = total // seq_len
    return flat[:n * seq_len].reshape(n, seq_len), total


def _rows_batch(rows):
    import numpy as np
    import pyarrow as pa
    n, seq_len = rows.shape
    offsets = pa.array(np.arange(0, (n + 1) * seq_len, seq_len, dtype=np.int32))
    return pa.record_batch([pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))],
                           names=["input_ids"])


def _schema():
    import pyarrow as pa
    return pa.schema([("input_ids", pa.list_(pa.int32()))])


def _check_texts(texts: list, first: int, text_field: str) -> None:
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(f"document {first + i}: data.text_field={text_field!r} holds "
                             f"{t!r:.80}, not a string; fix or drop that document (or point "
                             "data.text_field at the column holding the text)")


def _write_shard(index: int, raw, tokenizer, seq_len: int, groups: range, n_docs: int,
                 out: Path, counts, tick=None, text_field: str = "text") -> None:
    """Tokenize and pack `groups` into out/shard-{index}.arrow, adding the documents and tokens
    done to counts[2*index] and counts[2*index+1] after each group (read by the progress lines).
    In a child process an exception is written to out/error-{index}.txt for the parent to show."""
    import pyarrow as pa
    try:
        with pa.OSFile(str(out / f"shard-{index:05d}.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, _schema()) as writer:
            for g in groups:
                lo, hi = g * GROUP_DOCS, min((g + 1) * GROUP_DOCS, n_docs)
                texts = raw[lo:hi]
                _check_texts(texts, lo, text_field)
                rows, tokens = pack_group(texts, tokenizer, seq_len)
                if len(rows):
                    writer.write_batch(_rows_batch(rows))
                counts[2 * index] += hi - lo
                counts[2 * index + 1] += tokens
                if tick:
                    tick()
    except BaseException as exc:
        if tick:  # in-process: the caller sees the exception itself
            raise
        (out / f"error-{index}.json").write_text(json.dumps(
            {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}))
        raise


def _child(index, raw, tokenizer, seq_len, groups, n_docs, out, counts, text_field):
    # one process per core: the tokenizer's own thread pool would only oversubscribe them
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        _write_shard(index, raw, tokenizer, seq_len, groups, n_docs, out, counts,
                     text_field=text_field)
    except BaseException:
        os._exit(1)  # the error is in error-{index}.json; skip the interpreter's own report


class Progress:
    """Progress lines of a build: documents, tokens, rates and the time left, every
    PROGRESS_EVERY_S seconds and once at the end."""

    def __init__(self, what: str, n_docs: int, log=print):
        self.what, self.n_docs, self.log = what, n_docs, log
        self.t0 = self.last = time.time()

    def line(self, docs: int, tokens: int) -> str:
        dt = max(time.time() - self.t0, 1e-9)
        rate = docs / dt
        left = (self.n_docs - docs) / rate if rate > 0 else float("inf")
        return (f"[data] {self.what}: {docs:,}/{self.n_docs:,} documents "
                f"({100 * docs / max(self.n_docs, 1):.1f}%), {_big(tokens)} tokens, "
                f"{rate:,.0f} docs/s, {_big(tokens / dt)} tokens/s, "
                f"{_duration(dt)} so far" + ("" if docs >= self.n_docs else
                                            f", about {_duration(left)} left"))

    def maybe(self, docs: int, tokens: int, force: bool = False) -> None:
        if force or time.time() - self.last >= PROGRESS_EVERY_S:
            self.last = time.time()
            self.log(self.line(docs, tokens))


def _big(x: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.2f}{unit}"
    return f"{x:.0f}"


def _duration(s: float) -> str:
    if s == float("inf"):
        return "?"
    s = int(s)
    return f"{s // 3600} h {s % 3600 // 60:02d} min" if s >= 3600 else \
        f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


def build(raw, tokenizer, seq_len: int, text_field: str, path: Path, num_proc: int,
          what: str = "train", log=print) -> dict:
    """Write the cache of `raw`'s rows to `path` (see the module's docstring) with `num_proc`
    processes, printing progress; returns the manifest. `path` must not exist yet."""
    import multiprocessing as mp
    texts = raw.select_columns([text_field])[text_field]  # a lazy column: slices read on demand
    n_docs = len(raw)
    n_groups = -(-n_docs // GROUP_DOCS)
    procs = max(1, min(num_proc, n_groups))  # never an empty shard
    tmp = tmp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # contiguous, balanced runs of groups: shard i holds groups [i*n/p, (i+1)*n/p)
    runs = [range(i * n_groups // procs, (i + 1) * n_groups // procs) for i in range(procs)]
    progress = Progress(what, n_docs, log)
    _warn_if_short_of_disk(raw, text_field, path, what, log)
    log(f"[data] {what}: tokenizing {n_docs:,} documents into rows of {seq_len} tokens with "
        f"{procs} process{'es' if procs > 1 else ''} (data.num_proc) -> {path}")
    if procs == 1:
        counts = [0, 0]
        _write_shard(0, texts, tokenizer, seq_len, runs[0], n_docs, tmp, counts,
                     tick=lambda: progress.maybe(counts[0], counts[1]), text_field=text_field)
    else:
        ctx = mp.get_context("fork")  # children share the tokenizer and the memory-mapped data
        counts = ctx.Array("q", 2 * procs, lock=False)
        children = [ctx.Process(target=_child, daemon=True,
                                args=(i, texts, tokenizer, seq_len, runs[i], n_docs, tmp, counts,
                                      text_field))
                    for i in range(procs)]
        for c in children:
            c.start()
        try:
            _supervise(children, counts, progress, tmp)
        finally:
            for c in children:
                if c.is_alive():
                    c.kill()
                c.join()
    docs, tokens = sum(counts[0::2]), sum(counts[1::2])
    progress.maybe(docs, tokens, force=True)
    return _finish(tmp, path, procs, seq_len, docs, tokens)


def _warn_if_short_of_disk(raw, text_field: str, path: Path, what: str, log) -> None:
    """Say so up front when the cache will likely not fit, rather than fail an hour in. The
    estimate: about one byte of cache per byte of text (4 bytes a token, 4 to 5 characters a
    token for English text)."""
    try:
        table = raw.data  # the whole table, also under data.max_docs' selection: scaled below
        text_bytes = table.column(text_field).nbytes * len(raw) / max(table.num_rows, 1)
    except Exception:  # noqa: BLE001  an estimate only: a table that cannot say is not an error
        return
    free = shutil.disk_usage(path.parent).free
    if free < text_bytes:
        log(f"[data] {what}: WARNING the token cache will take about {text_bytes / 1e9:.1f} GB "
            f"(about a byte per byte of text) and {path.parent} has {free / 1e9:.1f} GB free: "
            "the preparation may run out of disk. Point data.cache_dir at a larger disk")


def _supervise(children, counts, progress: Progress, tmp: Path) -> None:
    """Wait for the children, printing progress; stop at the first that fails, with its error."""
    from multiprocessing.connection import wait
    pending = list(children)
    while pending:
        wait([c.sentinel for c in pending], timeout=max(0.05, min(1.0, PROGRESS_EVERY_S)))
        for c in [c for c in pending if c.exitcode is not None]:
            pending.remove(c)
            if c.exitcode != 0:
                i = children.index(c)
                err = tmp / f"error-{i}.json"
                if not err.exists():
                    raise RuntimeError(f"data preparation process {i} of {len(children)} exited "
                                       f"with code {c.exitcode} (killed? out of memory?); the "
                                       f"partial cache {tmp} is not used")
                e = json.loads(err.read_text())
                if e["type"] == "ValueError":  # bad data: its message says what and how to fix
                    raise ValueError(e["message"])
                raise RuntimeError(f"data preparation process {i} of {len(children)} failed; the "
                                   f"partial cache {tmp} is not used.\n{e['traceback']}")
        progress.maybe(sum(counts[0::2]), sum(counts[1::2]))


def _finish(tmp: Path, path: Path, procs: int, seq_len: int, docs: int, tokens: int) -> dict:
    import pyarrow as pa
    shards = []
    for i in range(procs):
        name = f"shard-{i:05d}.arrow"
        with pa.memory_map(str(tmp / name)) as f:
            rows = pa.ipc.open_stream(f).read_all().num_rows
        shards.append({"file": name, "rows": rows})
    manifest = {"rows": sum(s["rows"] for s in shards), "seq_len": seq_len, "documents": docs,
                "tokens": tokens, "tokens_in_rows": sum(s["rows"] for s in shards) * seq_len,
                "shards": shards, "dtype": "int32"}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last: the folder is whole
    publish(tmp, path)
    return manifest


def tmp_path(path: Path, kind: str = "tmp") -> Path:
    """Where this process builds `path`: named by host and process, since nodes that share the
    cache folder may run processes of the same number."""
    return Path(f"{path}.{kind}{socket.gethostname()}-{os.getpid()}")


def publish(tmp: Path, path: Path) -> None:
    """Give the whole folder `tmp` its final name in one step. Should another builder have got
    there first (only where the filesystem takes no locks), its folder holds the same rows: keep
    it and drop ours."""
    try:
        os.replace(tmp, path)
    except OSError:
        if not ((path / MANIFEST).exists() or (path / "dataset_info.json").exists()):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def load(path: Path):
    """The cached rows, memory-mapped from the shards the manifest names, in order."""
    import datasets
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    parts = [datasets.Dataset.from_file(str(Path(path) / s["file"])) for s in manifest["shards"]]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
