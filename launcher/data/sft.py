"""Chat and instruction examples for supervised fine-tuning: tokens, loss mask, fixed-length rows.

An example becomes `ids` and `labels`: labels equal ids on the tokens that count in the loss (the
assistant's messages, or the response and its end-of-text) and are -100 elsewhere. The first
token of every example is -100 too: nothing in the example precedes it, so no token predicts it
(in a packed row the only thing before it is another example).

Rows hold exactly data.seq_len tokens:
- packing=true: examples laid end to end in order, a new row when the next one does not fit in
  the rest of the current row (the rest is padding); `position_ids` restart at 0 at each
  example, and the padding is a run of its own from 0. transformers turns restarting positions
  into a block-diagonal causal mask when attention_mask is None and the cache is off (what
  `batch_of` passes), so attention stays inside each example.
- packing=false: one example per row, right-padded, with `attention_mask` (1 on real tokens).
Padding is tokenizer.pad_token_id with label -100. An example longer than seq_len is cut to its
first seq_len tokens; one left with no token in the loss is dropped (a row of nothing but -100
would make the mean loss 0/0).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

IGNORE = -100
MIN_EXAMPLES_PER_PROC = 1000  # fewer per process spend more on starting processes than they save
ROLES = ("system", "user", "assistant")


def tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or \
        f"the built-in {type(tokenizer).__name__} (tokenizer.kind=byte)"


# --- chat -------------------------------------------------------------------------------------

def check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"data.format=chat renders conversations with the tokenizer's chat template, and "
            f"{tokenizer_name(tokenizer)} has none; set tokenizer.chat_template=simple (the "
            "project's role-tagged template), use the tokenizer of an instruct/chat model "
            "(tokenizer.id=...), or data.format=instruction")


def check_messages(messages, index: int, field: str) -> list[dict]:
    """The example's messages as plain {role, content, ...} dicts, or a ValueError saying what is
    wrong with example `index` and how to fix it. Keys that are None are dropped: a column of
    messages read from json/parquet has every key any message has, None where one lacks it."""
    where = f"example {index} (data.messages_field={field!r})"
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where} holds {messages!r:.80}, not a non-empty list of "
                         "{role, content} messages; fix the data or point data.messages_field at "
                         "the column that holds the conversation")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: message {j} is {m!r:.80}, not a {{role, content}} dict")
        m = {k: v for k, v in m.items() if v is not None}
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"{where}: message {j} has no {key!r} (keys: {sorted(m)}); every "
                                 "message needs a role (system, user or assistant) and a content")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {j} has the unknown role {m['role']!r}; the roles "
                             f"are {', '.join(ROLES)} (rename it in the data)")
        if not isinstance(m["content"], str):
            raise ValueError(f"{where}: message {j} has a content of type "
                             f"{type(m['content']).__name__}; it must be a string")
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where} has no assistant message, so nothing in it can be trained on; "
                         "drop such examples from the data (or check data.messages_field)")
    return out


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """The token ids of the chat template's rendering (the template writes any special tokens it
    wants, such as a begin-of-text; the tokenizer adds none)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assistant_spans(tokenizer, messages: list[dict], full: list[int],
                    index: int = 0) -> list[tuple[int, int]]:
    """[start, end) of each assistant message's tokens in `full` (the whole conversation's ids),
    found generically from renderings of its prefixes: start is the length of the messages
    before it with the generation prompt, end the length of the messages up to it included."""
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = render_ids(tokenizer, messages[:k], add_generation_prompt=True)
            upto = render_ids(tokenizer, messages[:k + 1])
        except Exception as e:  # a template that refuses a partial conversation
            raise ValueError(f"the chat template of {tokenizer_name(tokenizer)} cannot render the "
                             f"first {k} messages of example {index} ({type(e).__name__}: {e}); "
                             "the loss mask is found by rendering each conversation's prefixes, "
                             "so this template cannot be used with data.train_on_prompt=false"
                             ) from e
        if full[:len(before)] != before or full[:len(upto)] != upto or len(before) > len(upto):
            raise ValueError(
                f"the chat template of {tokenizer_name(tokenizer)} is not prefix-stable: in "
                f"example {index} the rendering of the first {k} messages (with the generation "
                f"prompt) or of the first {k + 1} is not a prefix of the whole conversation's "
                "rendering (templates that rewrite earlier turns, e.g. drop past reasoning, do "
                "this), so the assistant tokens cannot be located; use another tokenizer/template "
                "or data.train_on_prompt=true")
        spans.append((len(before), len(upto)))
    return spans


def chat_example(tokenizer, messages: list[dict], train_on_prompt: bool,
                 index: int = 0) -> tuple[list[int], list[int]]:
    ids = render_ids(tokenizer, messages)
    if train_on_prompt:
        labels = list(ids)
    else:
        labels = [IGNORE] * len(ids)
        for start, end in assistant_spans(tokenizer, messages, ids, index):
            labels[start:end] = ids[start:end]
    if labels:
        labels[0] = IGNORE
    return ids, labels


# --- instruction ------------------------------------------------------------------------------

def instruction_example(tokenizer, prompt: str, response: str,
                        train_on_prompt: bool) -> tuple[list[int], list[int]]:
    """tokens(prompt) + tokens(response) + [eos], the loss on the response and the eos."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = p + r
    labels = list(ids) if train_on_prompt else [IGNORE] * len(p) + r
    if labels:
        labels[0] = IGNORE
    return ids, labels


# --- the whole data set -----------------------------------------------------------------------

def _require_columns(ds, d) -> None:
    cols = ds.column_names
    need = [("data.messages_field", d.messages_field)] if d.format == "chat" else \
        [("data.prompt_field", d.prompt_field), ("data.response_field", d.response_field)]
    missing = [f"{key}={name!r}" for key, name in need if name not in cols]
    if missing:
        hint = ""
        if d.format == "chat" and d.prompt_field in cols and d.response_field in cols:
            hint = "; the data has prompt/response columns: data.format=instruction reads those"
        elif d.format == "instruction" and d.messages_field in cols:
            hint = "; the data has a messages column: data.format=chat reads that"
        raise ValueError(f"data.format={d.format}: {' and '.join(missing)} "
                         f"{'is not a column' if len(missing) == 1 else 'are not columns'} of "
                         "the dataset "
                         f"(columns found: {cols}); set the field names to the columns holding "
                         f"the {'conversation' if d.format == 'chat' else 'prompt and response'}"
                         f"{hint}")


def tokenize_examples(ds, tokenizer, d, num_proc: int = 1):
    """A dataset of `ids` and `labels` (one example each, not yet cut or padded), tokenized by up
    to `num_proc` processes, each a contiguous run of at least MIN_EXAMPLES_PER_PROC examples.
    datasets keeps the examples' order, so the rows packed from them do not depend on num_proc."""
    _require_columns(ds, d)
    if d.format == "chat":
        check_chat_template(tokenizer)

        def one(ex, i):
            messages = check_messages(ex[d.messages_field], i, d.messages_field)
            ids, labels = chat_example(tokenizer, messages, d.train_on_prompt, i)
            return {"ids": ids, "labels": labels}
    else:
        def one(ex, i):
            p, r = ex[d.prompt_field], ex[d.response_field]
            for key, name, v in (("data.prompt_field", d.prompt_field, p),
                                 ("data.response_field", d.response_field, r)):
                if not isinstance(v, str):
                    raise ValueError(f"example {i}: {key}={name!r} holds {v!r:.80}, not a string; "
                                     "fix or drop the example")
            ids, labels = instruction_example(tokenizer, p, r, d.train_on_prompt)
            return {"ids": ids, "labels": labels}

    procs = min(num_proc, len(ds) // MIN_EXAMPLES_PER_PROC)
    return ds.map(one, with_indices=True, remove_columns=ds.column_names,
                  num_proc=procs if procs > 1 else None)


def _rows(examples: Iterable[tuple[list[int], list[int]]], seq_len: int, pad_id: int,
          packing: bool, stats: dict) -> Iterator[dict]:
    row_ids, row_labels, row_pos = [], [], []

    def close():
        pad = seq_len - len(row_ids)
        return {"input_ids": row_ids + [pad_id] * pad, "labels": row_labels + [IGNORE] * pad,
                "position_ids": row_pos + list(range(pad))}

    for ids, labels in examples:
        stats["examples"] += 1
        if len(ids) > seq_len:
            ids, labels = ids[:seq_len], labels[:seq_len]
            stats["truncated"] += 1
        if all(x == IGNORE for x in labels):
            stats["dropped"] += 1
            continue
        if not packing:
            pad = seq_len - len(ids)
            yield {"input_ids": ids + [pad_id] * pad, "labels": labels + [IGNORE] * pad,
                   "attention_mask": [1] * len(ids) + [0] * pad}
            continue
        if len(row_ids) + len(ids) > seq_len:
            yield close()
            row_ids, row_labels, row_pos = [], [], []
        row_ids += ids
        row_labels += labels
        row_pos += range(len(ids))
    if row_ids:
        yield close()


def _generate(tokenized, seq_len: int, pad_id: int, packing: bool, stats: dict):
    pairs = (pair for batch in tokenized.iter(batch_size=1000)
             for pair in zip(batch["ids"], batch["labels"]))
    yield from _rows(pairs, seq_len, pad_id, packing, stats)


def build_rows(tokenized, tokenizer, d, scratch: str, what: str = "train"):
    """The rows of the `ids`/`labels` examples (see the module's docstring), written through an
    Arrow file under `scratch` as they are made, so a large dataset is never all in memory."""
    import datasets
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    ints = getattr(datasets, "List", datasets.Sequence)(datasets.Value("int64"))  # List: >= 4
    third = "position_ids" if d.packing else "attention_mask"
    features = datasets.Features({"input_ids": ints, "labels": ints, third: ints})
    stats = {"examples": 0, "truncated": 0, "dropped": 0}
    rows = datasets.Dataset.from_generator(
        _generate, features=features, cache_dir=scratch,
        gen_kwargs={"tokenized": tokenized, "seq_len": d.seq_len, "pad_id": pad_id,
                    "packing": d.packing, "stats": stats})
    if stats["truncated"] or stats["dropped"]:
        print(f"data ({what}): {stats['truncated']} of {stats['examples']} examples were longer "
              f"than data.seq_len={d.seq_len} tokens and were truncated; {stats['dropped']} were "
              "dropped, having no token in the loss (after truncation)", flush=True)
    return rows, stats
