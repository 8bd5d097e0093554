"""Writes the tiny chat and instruction data sets shipped beside this script.

    python launcher/assets/make_tiny_chat.py [OUT_DIR]     (default: this folder)

tiny_chat.jsonl       400 conversations ({"messages": [{"role", "content"}, ...]}), 1-3 turns each,
                      about a third with a system message, each at most 192 tokens with the
                      built-in byte tokenizer's chat template
tiny_chat_eval.jsonl  64 conversations of the same kinds, none of them in tiny_chat.jsonl, and no
                      computed question (arithmetic, counting, reversing) asked in both
tiny_instruct.jsonl   200 {"prompt", "response"} pairs of the same kinds

The questions are simple patterns a ~1M-parameter byte-level model picks up in a few hundred
steps: small sums, differences and products, counting, reversing a short word, the capital of a
made-up country (a fixed table, so it can only be memorised), and a follow-up that adds to the
previous answer. A system message "Answer in capital letters." makes every answer upper case.
Deterministic: plain Python, one seeded random.Random per file; rerunning rewrites the same bytes.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

COUNTRIES = [("Zorbia", "Quellin"), ("Marvania", "Tosk"), ("Elbonia", "Dravo"),
             ("Quistra", "Pellam"), ("Novaria", "Ostrin"), ("Tarkesh", "Vumi"),
             ("Brindle", "Cassel"), ("Oskaria", "Lunde"), ("Velmora", "Rhee"),
             ("Grunland", "Abbot"), ("Sylvane", "Mirrow"), ("Dunmark", "Ferro")]
WORDS = ["stone", "river", "apple", "cloud", "tiger", "lemon", "paper", "glass", "house",
         "plant", "robot", "ocean", "candle", "garden", "pencil", "window", "bridge", "forest",
         "silver", "rabbit", "dog", "cat", "sun", "moon", "star", "tree", "fish", "bird", "book",
         "lamp", "road", "ship", "drum", "coin", "kite", "rock", "milk", "frog", "wolf", "door"]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "Answer in capital letters."]
SHOUT = "Answer in capital letters."
MAX_TOKENS = 192  # longest conversation under the byte tokenizer's template: fits data.seq_len=256


def question(rng: random.Random) -> tuple[str, str, str, int | None]:
    """(kind, question, answer, number the answer ends on or None)."""
    kind = rng.choice(["add", "add", "sub", "mul", "count", "reverse", "capital", "capital"])
    if kind == "add":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return kind, f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", a + b
    if kind == "sub":
        a = rng.randint(0, 20)
        b = rng.randint(0, a)
        return kind, f"What is {a} - {b}?", f"{a} - {b} = {a - b}.", a - b
    if kind == "mul":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return kind, f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", a * b
    if kind == "count":
        a = rng.randint(1, 12)
        b = a + rng.randint(2, 5)
        return kind, f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + ".", b
    if kind == "reverse":
        w = rng.choice(WORDS)
        return kind, f"Reverse the word {w}.", w[::-1], None
    country, capital = rng.choice(COUNTRIES)
    q = rng.choice([f"What is the capital of {country}?", f"Name the capital of {country}."])
    return kind, q, f"The capital of {country} is {capital}.", None


def conversation(rng: random.Random) -> tuple[list[dict], list[str]]:
    """A conversation and its computed questions (worked out, not recalled from a table)."""
    messages, computed = [], []
    system = rng.choice(SYSTEMS) if rng.random() < 0.35 else None
    if system:
        messages.append({"role": "system", "content": system})
    last = None
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        if last is not None and rng.random() < 0.4:  # a follow-up on the previous answer
            c = rng.randint(1, 9)
            q, a, last = f"Add {c} to that.", f"{last} + {c} = {last + c}.", last + c
            kind = "follow"
        else:
            kind, q, a, last = question(rng)
        if kind not in ("capital", "follow"):
            computed.append(q)
        messages.append({"role": "user", "content": q})
        messages.append({"role": "assistant", "content": a.upper() if system == SHOUT else a})
    return messages, computed


def tokens(messages: list[dict]) -> int:
    """Length under the byte tokenizer's chat template: `<|role|>\\n{content}<|endoftext|>`."""
    return sum(len(m["role"]) + 6 + len(m["content"]) for m in messages)


def chat_sets(n_train: int = 400, n_eval: int = 64) -> tuple[list[dict], list[dict]]:
    rng = random.Random(20250101)
    evals, seen, held_out = [], set(), set()
    while len(evals) < n_eval:
        messages, computed = conversation(rng)
        key = json.dumps(messages)
        if key not in seen and tokens(messages) <= MAX_TOKENS:
            seen.add(key)
            held_out.update(computed)
            evals.append({"messages": messages})
    rng = random.Random(20250102)
    train = []
    while len(train) < n_train:
        messages, computed = conversation(rng)
        key = json.dumps(messages)
        if key not in seen and tokens(messages) <= MAX_TOKENS and \
                not held_out.intersection(computed):
            seen.add(key)
            train.append({"messages": messages})
    return train, evals


def instruct_set(n: int = 200) -> list[dict]:
    rng = random.Random(20250103)
    out, seen = [], set()
    while len(out) < n:
        _, q, a, _ = question(rng)
        if q not in seen:
            seen.add(q)
            out.append({"prompt": f"Question: {q}\nAnswer: ", "response": a})
    return out


def write(path: Path, rows: list[dict]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in rows)
    path.write_bytes(text.encode("ascii"))


def main(out_dir: str | Path | None = None) -> None:
    out = Path(out_dir) if out_dir else Path(__file__).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    train, evals = chat_sets()
    write(out / "tiny_chat.jsonl", train)
    write(out / "tiny_chat_eval.jsonl", evals)
    write(out / "tiny_instruct.jsonl", instruct_set())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
