"""How fast raw text is prepared (launcher/data/text_cache.py), offline, and what that makes for a split
of a given size.

    python -m launcher.bench.data_rate [--docs 20000] [--num-proc 1] [--tokens 10e9] [--earlier]

No hub tokenizer can be assumed here, so it trains a GPT-2-like byte-level BPE (50,257 tokens,
GPT-2's pre-tokenizer) on prose found on this machine (the .md/.rst/.txt files of the Python
installation and of this project), cuts documents of 1,500 to 7,500 characters from it, prepares
them as a recipe would, and prints the wall time, the CPU-seconds per million tokens (this process
and its children: independent of how busy the machine is, unlike the wall time) and the time the
tokens of a split would take on 16 and 64 cores at that rate. --earlier times the code this
replaced instead: datasets' map over the whole data in one process, then save_to_disk.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the rate of one core
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _prose(limit: int = 20_000_000) -> str:
    roots = [Path(sys.prefix), Path(__file__).resolve().parents[2]]
    parts, size = [], 0
    for root in roots:
        for f in sorted(root.rglob("*")):
            if f.suffix in (".md", ".rst", ".txt") and f.is_file() and ".cache" not in f.parts:
                t = f.read_bytes().decode("utf-8", "ignore").replace("\x00", "")
                parts.append(t)
                size += len(t)
                if size >= limit:
                    return "\n".join(parts)
    return "\n".join(parts)


def _tokenizer(text: str, where: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=50257, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text.splitlines(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(where)
    return str(where)


def _earlier(raw, tok, seq_len: int, where: Path):
    """(rows, tokens) the way data.py made them before text_cache.py (the same rows)."""
    import datasets
    datasets.disable_caching()  # a second run must not find the first one's map results
    eos = tok.eos_token_id

    def tokenize(batch):
        return {"ids": [x + [eos] for x in tok(batch["text"], add_special_tokens=False)
                        ["input_ids"]]}

    def group(batch):
        flat = [t for x in batch["ids"] for t in x]
        n = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i:i + seq_len] for i in range(0, n, seq_len)]}

    ids = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    rows = ids.map(group, batched=True, batch_size=1000, remove_columns=["ids"])
    rows.save_to_disk(str(where))
    return rows, ids


def _cpu() -> float:
    a, b = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--num-proc", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--tokens", type=float, default=10e9, help="tokens of the split to estimate "
                    "(FineWeb-Edu sample-10BT: about 10e9)")
    ap.add_argument("--earlier", action="store_true", help="time the single-process map this "
                    "replaced (same rows)")
    args = ap.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    from launcher.data import prepare as D
    from launcher.recipe.schema import Recipe
    from models import build_tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = _prose()
        tok_dir = _tokenizer(text, tmp / "bpe")
        rng = random.Random(0)
        starts = [rng.randrange(len(text) - 7500) for _ in range(args.docs)]
        docs = [text[a:a + rng.randint(1500, 7500)] for a in starts]
        pq.write_table(pa.table({"text": docs}), tmp / "docs.parquet")
        cfg = OmegaConf.merge(OmegaConf.structured(Recipe), {
            "data": {"source": "files", "files": [str(tmp / "docs.parquet")],
                     "seq_len": args.seq_len, "cache_dir": str(tmp / "cache")},
            "tokenizer": {"kind": "hub", "id": tok_dir}})
        tok = build_tokenizer("hub", tok_dir)
        c0, t0 = _cpu(), time.time()
        if args.earlier:
            ds, tokens = _earlier(D._raw_dataset(cfg), tok, args.seq_len, tmp / "earlier")
        else:
            ds = D.prepare(cfg, tok, num_proc=args.num_proc)
            tokens = json.loads((Path(cfg.data.cache_dir) / D.cache_key(cfg, tok) /
                                 "manifest.json").read_text())["tokens"]
        cpu, wall = _cpu() - c0, time.time() - t0
        if args.earlier:  # counted after the clock stopped: the earlier code never counted them
            tokens = sum(len(x) for x in tokens["ids"])
    per_m = cpu / (tokens / 1e6)
    out = {"docs": args.docs, "code": "earlier" if args.earlier else "text_cache",
           "num_proc": 1 if args.earlier else args.num_proc, "rows": len(ds), "tokens": tokens,
           "chars_per_token": round(sum(map(len, docs)) / tokens, 2), "wall_s": round(wall, 1),
           "cpu_s": round(cpu, 1), "cpu_s_per_million_tokens": round(per_m, 3),
           "load_average": [round(x, 1) for x in os.getloadavg()],
           "estimate_for_tokens": args.tokens,
           "estimate_core_hours": round(per_m * args.tokens / 1e6 / 3600, 2),
           "estimate_min_on_16_cores": round(per_m * args.tokens / 1e6 / 16 / 60, 1),
           "estimate_min_on_64_cores": round(per_m * args.tokens / 1e6 / 64 / 60, 1)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
