"""Raw-text data at scale (launcher/data/text_cache.py, launcher/data/prepare.py): any data.num_proc writes the
rows one process writes, which are the rows of the earlier single-process packing; the cache is
reused, rebuilt when what decides it changes, never used half-built; progress is printed; the
launcher builds it before workers start and workers only map it. Local files only."""
import json
import os
import random
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fcntl

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from launcher.data import prepare as D
from launcher.data import sampler as S
from launcher.data import text_cache as T
from launcher.recipe.load import RecipeError, load
from launcher.recipe.schema import Recipe
from models import byte_tokenizer

DOCS = 2500  # three groups of 1000 documents: two or three processes each take whole groups


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Three jsonl files of documents of very different lengths, and an extra column."""
    d = tmp_path_factory.mktemp("docs")
    rng = random.Random(4)
    docs = [" ".join(D.synthetic_docs(rng.randint(1, 4), rng.random())) for _ in range(DOCS)]
    paths = []
    for i, chunk in enumerate((docs[:1200], docs[1200:1900], docs[1900:])):
        p = d / f"part{i}.jsonl"
        p.write_text("".join(json.dumps({"text": t, "n": j}) + "\n" for j, t in enumerate(chunk)))
        paths.append(str(p))
    return paths


@pytest.fixture(autouse=True)
def own_datasets_cache(tmp_path, monkeypatch):
    # each build reads the files through its own datasets cache, so load_dataset(num_proc=2)
    # converts them itself instead of reusing what a one-process load converted
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


def _cfg(tmp_path, files, cache="cache", **data):
    cfg = OmegaConf.structured(Recipe)
    return OmegaConf.merge(cfg, {"run": {"seed": 7}, "data": {
        "source": "files", "files": files, "seq_len": 96, "cache_dir": str(tmp_path / cache),
        **data}})


def _earlier_rows(cfg, tok) -> np.ndarray:
    """The rows as the code before text_cache.py made them: datasets' map over the whole data in
    one process, documents + eos cut into seq_len rows per batch of 1000 documents."""
    import datasets
    raw = datasets.load_dataset("json", data_files=list(cfg.data.files), split="train")
    eos, n = tok.eos_token_id, cfg.data.seq_len

    def tokenize(batch):
        return {"ids": [x + [eos] for x in tok(batch["text"], add_special_tokens=False)
                        ["input_ids"]]}

    def group(batch):
        flat = [t for x in batch["ids"] for t in x]
        return {"input_ids": [flat[i:i + n] for i in range(0, len(flat) // n * n, n)]}

    ids = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    rows = ids.map(group, batched=True, batch_size=1000, remove_columns=["ids"])
    return np.array(rows["input_ids"], dtype=np.int64)


def _rows(ds) -> np.ndarray:
    return np.asarray(ds.with_format("numpy")[:]["input_ids"], dtype=np.int64)


def _manifest(cfg, tok):
    return json.loads((D.Path(cfg.data.cache_dir) / D.cache_key(cfg, tok) / T.MANIFEST)
                      .read_text())


def test_any_num_proc_writes_the_rows_and_batches_of_one_process(tmp_path, files, tok):
    one = _cfg(tmp_path, files, "one")
    ds1 = D.prepare(one, tok, num_proc=1)
    expected = _earlier_rows(one, tok)
    assert len(expected) > 100 and np.array_equal(_rows(ds1), expected)
    for procs in (2, 3):
        cfg = _cfg(tmp_path, files, f"p{procs}")
        ds = D.prepare(cfg, tok, num_proc=procs)
        assert len(_manifest(cfg, tok)["shards"]) == procs  # it did split the work
        assert _rows(ds).tobytes() == _rows(ds1).tobytes()
        a, b = S.StepSampler(ds1, 7, 3, 2), S.StepSampler(ds, 7, 3, 2)
        n = len(ds)
        for step, rank, world, micro in [(0, 0, 2, 0), (5, 1, 2, 1), (n // 4, 3, 4, 1),
                                         (n, 0, 1, 0), (3 * n + 1, 2, 3, 1)]:  # later epochs
            x, y = a.batch(step, rank, world, micro), b.batch(step, rank, world, micro)
            assert x["input_ids"].dtype == torch.int64  # stored as int32, served as int64
            assert torch.equal(x["input_ids"], y["input_ids"])
            assert torch.equal(x["labels"], y["labels"])
    m = _manifest(one, tok)
    assert m["rows"] == len(ds1) and m["tokens_in_rows"] == len(ds1) * 96
    assert m["documents"] == DOCS and m["tokens"] > m["tokens_in_rows"]


def test_the_cache_is_reused_and_rebuilt_when_what_decides_it_changes(tmp_path, files, tok):
    said = []
    cfg = _cfg(tmp_path, files)
    D.prepare(cfg, tok, num_proc=2, log=said.append)
    assert any("tokenizing 2,500 documents" in s for s in said)
    manifest = tmp_path / "cache" / D.cache_key(cfg, tok) / T.MANIFEST
    built = manifest.stat().st_mtime_ns
    said.clear()
    D.prepare(cfg, tok, num_proc=1, log=said.append)  # another num_proc: the same rows, reused
    assert said == [] and manifest.stat().st_mtime_ns == built
    keys = {D.cache_key(cfg, tok)}
    for change in [{"seq_len": 64}, {"max_docs": 100}, {"files": files[:2]},
                   {"text_field": "body"}]:
        keys.add(D.cache_key(OmegaConf.merge(cfg, {"data": change}), tok))
    other = byte_tokenizer()  # the same vocabulary, another pipeline: other ids for a text
    from tokenizers import normalizers
    other.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert other.get_vocab() == tok.get_vocab()
    keys.add(D.cache_key(cfg, other))
    assert len(keys) == 6
    # a data file rewritten: its size and time change, so does the key, and the rows are rebuilt
    moved = tmp_path / "moved.jsonl"
    moved.write_text(open(files[0]).read())
    mine = _cfg(tmp_path, [str(moved)])
    before = D.cache_key(mine, tok)
    moved.write_text(open(files[1]).read())
    os.utime(moved, (time.time() + 5, time.time() + 5))
    assert D.cache_key(mine, tok) != before
    said.clear()
    D.prepare(mine, tok, log=said.append)
    assert any("tokenizing 700 documents" in s for s in said)


def test_an_interrupted_preparation_is_never_used(tmp_path, files, tok, monkeypatch):
    cfg = _cfg(tmp_path, files)
    path = tmp_path / "cache" / D.cache_key(cfg, tok)
    real, calls = T.pack_group, []

    def dies_on_the_third_group(texts, tokenizer, seq_len):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("stopped mid-way")
        return real(texts, tokenizer, seq_len)

    monkeypatch.setattr(T, "pack_group", dies_on_the_third_group)
    with pytest.raises(KeyboardInterrupt):
        D.prepare(cfg, tok, num_proc=1)
    assert not path.exists() and list(tmp_path.glob("cache/*.tmp*"))  # only the partial folder
    # in a child process: the parent names the process and shows its error; nothing is kept

    def fails_in_a_child(texts, tokenizer, seq_len):
        if os.getpid() != parent:
            raise OSError("No space left on device")
        return real(texts, tokenizer, seq_len)

    parent = os.getpid()
    monkeypatch.setattr(T, "pack_group", fails_in_a_child)
    with pytest.raises(RuntimeError, match=r"(?s)data preparation process \d of 2 failed.*"
                                           r"is not used.*OSError: No space left on device"):
        D.prepare(cfg, tok, num_proc=2)
    assert not path.exists()
    monkeypatch.setattr(T, "pack_group", real)
    # a build killed on another node: whole-looking, but still under its temporary name
    other = tmp_path / "cache" / f"{path.name}.tmp999999"
    other.mkdir()
    (other / T.MANIFEST).write_text("{}")
    said = []
    ds = D.prepare(cfg, tok, num_proc=2, log=said.append)
    assert sum("left by an interrupted preparation, never used" in s for s in said) == 2
    assert not list(tmp_path.glob("cache/*.tmp*"))
    assert np.array_equal(_rows(ds), _earlier_rows(cfg, tok))


def test_progress_lines_are_printed_while_it_runs(tmp_path, files, tok, monkeypatch):
    monkeypatch.setattr(T, "PROGRESS_EVERY_S", 0.0)  # a line after every group
    for procs in (1, 2):
        said = []
        D.prepare(_cfg(tmp_path, files, f"c{procs}"), tok, num_proc=procs, log=said.append)
        lines = [s for s in said if "docs/s" in s]
        assert len(lines) >= 2, said
        assert all("tokens/s" in s and "documents" in s for s in lines)
        assert "2,500/2,500 documents (100.0%)" in lines[-1]
        if procs == 1:  # one line per group, as the documents come in
            assert [s.split(" documents")[0].split()[-1] for s in lines[:3]] == \
                ["1,000/2,500", "2,000/2,500", "2,500/2,500"]


def test_a_second_builder_waits_for_the_first(tmp_path, files, tok):
    cfg = _cfg(tmp_path, files)
    (tmp_path / "cache").mkdir()
    lock = open(tmp_path / "cache" / (D.cache_key(cfg, tok) + ".lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another node of a shared filesystem is building it
    said, done = [], []
    t = threading.Thread(target=lambda: done.append(D.prepare(cfg, tok, log=said.append)))
    t.start()
    time.sleep(1.0)
    assert not done and any("another process is preparing" in s for s in said)
    lock.close()
    t.join(60)
    assert len(done[0]) > 0


def test_the_launcher_prepares_and_workers_only_map(tmp_path, files, tok, capsys):
    cfg = _cfg(tmp_path, files, num_proc=2)
    D.prepare_node(cfg)
    out = capsys.readouterr().out
    assert "with 2 processes" in out and "[data] train:" in out and "rows of 96 tokens ready" in out
    said = []
    D.prepare(cfg, tok, log=said.append)  # what model_setup.build does in each worker
    assert said == []
    bad = OmegaConf.merge(cfg, {"data": {"text_field": "body", "cache_dir": str(tmp_path / "b")}})
    with pytest.raises(RecipeError, match="data.text_field='body' is not a column"):
        D.prepare_node(bad)
    # a document that is no text, in the second process's groups: one sentence, no traceback
    lines = open(files[0]).read().splitlines()  # 1,200 documents: groups 0 and 1
    lines[1100] = json.dumps({"text": None, "n": 1100})
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecipeError, match=r"data \(train\): document 1100: data.text_field='text' "
                                          r"holds None, not a string; fix or drop"):
        D.prepare_node(_cfg(tmp_path, [str(broken)], "broken", num_proc=2))
    with pytest.raises(RecipeError, match=r"data.num_proc.*-1.*0: all of this node's cores"):
        load("tiny-llama", ["data.num_proc=-1"])
    assert load("llama3-8b", []).data.num_proc == 0


def test_a_data_file_that_cannot_be_parsed_is_named_with_its_line(tmp_path, files, capsys):
    """A malformed line, in the second of two files read by two processes: one sentence with the
    file, the line and what is wrong, instead of datasets' DatasetGenerationError."""
    lines = open(files[1]).read().splitlines()
    lines[599] = lines[599][:-1]  # the closing brace lost
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecipeError) as got:
        D.prepare_node(_cfg(tmp_path, [files[0], str(broken)], "broken", num_proc=2))
    msg = str(got.value)
    assert msg.startswith(f"data (train): data.files: {broken} line 600 is not valid JSON (")
    assert "Fix or remove that line" in msg and "DatasetGenerationError" not in msg
    assert "Failed to load JSON" not in capsys.readouterr().err  # datasets' own line, not said
    listed = tmp_path / "listed.jsonl"
    listed.write_text('{"text": "a"}\n["b"]\n')
    with pytest.raises(RecipeError, match=r"listed.jsonl line 2 is a JSON list, not an object"):
        D.prepare_node(_cfg(tmp_path, [str(listed)], "listed"))


def test_instruction_examples_tokenized_by_two_processes_give_the_same_rows(tmp_path, tok,
                                                                          monkeypatch):
    from launcher.data import sft as sft_data
    monkeypatch.setattr(sft_data, "MIN_EXAMPLES_PER_PROC", 100)  # two processes for 300 examples
    pairs = [{"prompt": f"q: {i} plus {i % 7}\na: ", "response": str(i + i % 7)}
             for i in range(300)]
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = _cfg(tmp_path, [str(f)], "one", format="instruction", seq_len=64)
    rows = {n: D.prepare(OmegaConf.merge(cfg, {"data": {"cache_dir": str(tmp_path / f"c{n}")}}),
                         tok, num_proc=n) for n in (1, 2)}
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(rows[1][:][key], rows[2][:][key])
    pairs[250]["response"] = None  # a bad example, found in the second process: the same message
    f.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    with pytest.raises(ValueError, match="example 250: data.response_field=.response. holds None"):
        D.prepare(OmegaConf.merge(cfg, {"data": {"cache_dir": str(tmp_path / "bad")}}), tok,
                  num_proc=2)


def test_a_filesystem_without_locks_still_gets_one_whole_cache(tmp_path, files, tok, monkeypatch):
    import errno

    real = fcntl.flock

    def no_locks(f, how):  # on the cache's lock only (datasets takes file locks of its own)
        if str(getattr(f, "name", "")).startswith(str(tmp_path / "cache")):
            raise OSError(errno.ENOLCK, "No locks available")
        return real(f, how)

    cfg = _cfg(tmp_path, files[2:])
    path = tmp_path / "cache" / D.cache_key(cfg, tok)
    at_work = tmp_path / "cache" / f"{path.name}.tmpnode7-123"  # another node's build, unlocked
    at_work.mkdir(parents=True)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    said = []
    ds = D.prepare(cfg, tok, log=said.append)
    assert any("takes no file locks (No locks available)" in s for s in said)
    assert at_work.exists()  # not ours to remove: without the lock it may be at work
    # that node finishing second: its folder is dropped, the first whole cache stays
    (at_work / T.MANIFEST).write_text("{}")
    T.publish(at_work, path)
    assert not at_work.exists() and len(D.prepare(cfg, tok)) == len(ds)


def test_a_cache_that_will_not_fit_is_announced(tmp_path, files, tok, monkeypatch):
    import collections
    import shutil
    usage, real = collections.namedtuple("usage", "total used free"), shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000)
                        if str(p).startswith(str(tmp_path / "cache")) else real(p))
    said = []
    D.prepare(_cfg(tmp_path, files[2:]), tok, log=said.append)  # ~100 kB of text, 1 kB free
    assert any("WARNING the token cache will take about 0.0 GB" in s and
               "Point data.cache_dir at a larger disk" in s for s in said), said
    said.clear()
    D.prepare(_cfg(tmp_path, files[2:], "roomy"), tok, log=said.append)
    assert not any("WARNING" in s for s in said)
