"""Chat and instruction data (launcher/data/prepare.py, launcher/data/sft.py): the byte tokenizer's chat
template, loss masks on the responses only, packed rows whose attention stays inside each
example, padded rows, validation data, clear errors; and the raw-text rows left bit for bit as
they were."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from omegaconf import OmegaConf

from launcher.data import prepare as D
from launcher.data import sampler as S
from launcher.recipe.schema import Recipe
from launcher.data.sft import IGNORE, check_messages
from models import byte_tokenizer

from tests.conftest import ROOT  # noqa: E402
EOT = "<|endoftext|>"

# assistant text in capitals, everything else in lower case: a labelled token is easy to place
CONVS = [
    [{"role": "system", "content": "you are terse."}, {"role": "user", "content": "hi there"},
     {"role": "assistant", "content": "HELLO"}],
    [{"role": "user", "content": "two plus two?"}, {"role": "assistant", "content": "FOUR"},
     {"role": "user", "content": "and three plus three?"}, {"role": "assistant", "content": "SIX"}],
    [{"role": "user", "content": "a color"}, {"role": "assistant", "content": "BLUE"}],
    [{"role": "system", "content": "be kind."}, {"role": "user", "content": "name a fruit"},
     {"role": "assistant", "content": "PEAR"}, {"role": "user", "content": "another"},
     {"role": "assistant", "content": "PLUM"}],
    [{"role": "user", "content": "yes or no"}, {"role": "assistant", "content": "NO"}],
]
PAIRS = [{"prompt": "q: seven minus two\na: ", "response": "FIVE"},
         {"prompt": "q: opposite of up\na: ", "response": "DOWN"},
         {"prompt": "q: say ok\na: ", "response": "OK"}]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(tmp_path, data=None, eval=None, seed=0):
    cfg = OmegaConf.structured(Recipe)
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.run.seed = seed
    return OmegaConf.merge(cfg, {"data": data or {}, "eval": eval or {}})


def _chat_cfg(tmp_path, convs=CONVS, **data):
    f = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in convs])
    return _cfg(tmp_path, {"source": "files", "files": [f], "format": "chat", "seq_len": 128,
                           **data})


def _rendered(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _segments(row):
    """(ids, labels) of each run of a packed row, split where position_ids restart at 0."""
    pos = row["position_ids"].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    return [(row["input_ids"][a:b].tolist(), row["labels"][a:b].tolist())
            for a, b in zip(starts, starts[1:])]


def _examples_of(ds, tok):
    """The example runs of every packed row, in order, padding runs left out."""
    out = []
    for i in range(len(ds)):
        for ids, labels in _segments(ds[i]):
            if all(t == tok.pad_token_id for t in ids) and all(x == IGNORE for x in labels):
                continue
            out.append((ids, labels))
    return out


def _labelled_spans(ids, labels):
    spans, cur = [], []
    for t, x in zip(ids, labels):
        if x != IGNORE:
            assert x == t
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


# --- the byte tokenizer's template --------------------------------------------------------------

def test_byte_tokenizer_chat_template_renders_round_trips_and_eos_is_one_token(tok, tmp_path):
    m = CONVS[0]
    assert tok.apply_chat_template(m, tokenize=False) == \
        f"<|system|>\nyou are terse.{EOT}<|user|>\nhi there{EOT}<|assistant|>\nHELLO{EOT}"
    assert tok.apply_chat_template(m[:2], tokenize=False, add_generation_prompt=True) == \
        f"<|system|>\nyou are terse.{EOT}<|user|>\nhi there{EOT}<|assistant|>\n"
    assert tok(EOT, add_special_tokens=False)["input_ids"] == [256] == [tok.eos_token_id]
    assert tok("a" + EOT, add_special_tokens=False)["input_ids"] == [97, 256]
    tok.save_pretrained(tmp_path / "tok")
    from transformers import AutoTokenizer
    back = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert back.chat_template == tok.chat_template
    for conv in CONVS:
        assert back.apply_chat_template(conv, tokenize=False) == \
            tok.apply_chat_template(conv, tokenize=False)
    assert back(EOT, add_special_tokens=False)["input_ids"] == [256]
    assert (back.eos_token_id, back.pad_token_id) == (256, 256)


def test_the_simple_template_replaces_a_tokenizers_own(tmp_path):
    from models import build_tokenizer
    plain = byte_tokenizer()
    plain.chat_template = None  # like a base model's tokenizer, saved without a template
    plain.save_pretrained(tmp_path / "base")
    assert build_tokenizer("hub", str(tmp_path / "base")).chat_template is None
    simple = build_tokenizer("hub", str(tmp_path / "base"), chat_template="simple")
    assert simple.apply_chat_template(CONVS[2], tokenize=False) == \
        f"<|user|>\na color{EOT}<|assistant|>\nBLUE{EOT}"
    assert build_tokenizer("byte", chat_template="simple").chat_template == \
        byte_tokenizer().chat_template
    with pytest.raises(ValueError, match="own or simple"):
        build_tokenizer("byte", chat_template="fancy")


# --- loss masks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("packing", [True, False])
def test_chat_labels_lie_only_on_assistant_messages(tok, tmp_path, packing):
    ds = D.prepare(_chat_cfg(tmp_path, packing=packing), tok)
    spans = []
    for i in range(len(ds)):
        row = ds[i]
        spans += _labelled_spans(row["input_ids"].tolist(), row["labels"].tolist())
        text = tok.decode([t for t, x in zip(row["input_ids"], row["labels"]) if x == IGNORE])
        assert not any(c.isupper() for c in text.replace("<|endoftext|>", ""))  # none answered
    want = [m["content"] + EOT for conv in CONVS for m in conv if m["role"] == "assistant"]
    assert [tok.decode(s) for s in spans] == want


@pytest.mark.parametrize("packing", [True, False])
def test_train_on_prompt_labels_every_real_token(tok, tmp_path, packing):
    ds = D.prepare(_chat_cfg(tmp_path, packing=packing, train_on_prompt=True), tok)
    if packing:
        examples = _examples_of(ds, tok)
    else:
        examples = [(r["input_ids"][r["attention_mask"] == 1].tolist(),
                     r["labels"][r["attention_mask"] == 1].tolist()) for r in ds]
        for r in ds:
            assert (r["labels"][r["attention_mask"] == 0] == IGNORE).all()
    assert [ids for ids, _ in examples] == [_rendered(tok, c) for c in CONVS]
    for ids, labels in examples:
        # the first token of an example has nothing before it in the example: no target
        assert labels[0] == IGNORE and labels[1:] == ids[1:]


def test_instruction_labels_only_the_response_and_eos(tok, tmp_path):
    f = _jsonl(tmp_path / "inst.jsonl", PAIRS)
    for on_prompt in (False, True):
        cfg = _cfg(tmp_path, {"source": "files", "files": [f], "format": "instruction",
                              "seq_len": 64, "train_on_prompt": on_prompt})
        examples = _examples_of(D.prepare(cfg, tok), tok)
        assert len(examples) == len(PAIRS)
        for (ids, labels), p in zip(examples, PAIRS):
            n = len(p["prompt"].encode())
            assert tok.decode(ids) == p["prompt"] + p["response"] + EOT
            assert ids[-1] == tok.eos_token_id
            if on_prompt:
                assert labels[0] == IGNORE and labels[1:] == ids[1:]
            else:
                assert labels[:n] == [IGNORE] * n and labels[n:] == ids[n:]
                assert tok.decode(labels[n:]) == p["response"] + EOT


# --- rows -------------------------------------------------------------------------------------

def test_packed_rows_are_full_greedy_and_positions_restart(tok, tmp_path):
    seq_len = 130
    ds = D.prepare(_chat_cfg(tmp_path, seq_len=seq_len), tok)
    assert set(ds.column_names) == {"input_ids", "labels", "position_ids"}
    lengths = [len(_rendered(tok, c)) for c in CONVS]
    assert all(n <= seq_len for n in lengths)
    assert [ids for ids, _ in _examples_of(ds, tok)] == [_rendered(tok, c) for c in CONVS]
    k = 0
    for i in range(len(ds)):
        row = ds[i]
        assert all(len(row[c]) == seq_len for c in ds.column_names)
        used = 0
        for ids, labels in _segments(row):
            assert row["position_ids"].tolist()[used:used + len(ids)] == list(range(len(ids)))
            used += len(ids)
            if ids[0] != tok.pad_token_id:
                k += 1
            else:  # padding: a run of its own at the row's end, out of the loss
                assert used == seq_len and all(x == IGNORE for x in labels)
                # greedy: the next example did not fit in the rest of this row
                assert k == len(CONVS) or len(ids) < lengths[k]
    assert k == len(CONVS) and len(ds) < len(CONVS)  # some rows hold several examples


def test_an_example_longer_than_seq_len_is_truncated_and_counted(tok, tmp_path, capsys):
    long = [{"role": "user", "content": "tell me a long story"},
            {"role": "assistant", "content": "ONCE UPON A TIME " * 10}]
    cfg = _chat_cfg(tmp_path, convs=[CONVS[2], CONVS[4], long], seq_len=64)
    ds = D.prepare(cfg, tok)
    assert "1 of 3 examples were longer than data.seq_len=64" in capsys.readouterr().out
    examples = _examples_of(ds, tok)
    assert examples[2][0] == _rendered(tok, long)[:64]
    D.prepare(cfg, tok)  # from the cache: said once, when the rows were built
    assert "truncated" not in capsys.readouterr().out


def test_padded_rows_have_attention_mask_and_no_loss_on_padding(tok, tmp_path):
    ds = D.prepare(_chat_cfg(tmp_path, packing=False, seq_len=100), tok)
    assert set(ds.column_names) == {"input_ids", "labels", "attention_mask"}
    assert len(ds) == len(CONVS)
    for row, conv in zip(ds, CONVS):
        ids = _rendered(tok, conv)
        n = len(ids)
        assert row["attention_mask"].tolist() == [1] * n + [0] * (100 - n)
        assert row["input_ids"].tolist() == ids + [tok.pad_token_id] * (100 - n)
        assert (row["labels"][n:] == IGNORE).all()
    batch = S.batch_of(ds, [0, 1])
    assert set(batch) == {"input_ids", "labels", "attention_mask", "use_cache"}
    assert batch["use_cache"] is False and batch["attention_mask"].shape == (2, 100)


def _tiny(kind):
    import transformers
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       vocab_size=257)
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=257,
                                  bos_token_id=256, eos_token_id=256)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_packed_attention_stays_inside_each_example(tok, tmp_path, kind):
    ds = D.prepare(_chat_cfg(tmp_path, convs=[CONVS[2], CONVS[4]], seq_len=80), tok)
    assert len(ds) == 1
    batch = S.batch_of(ds, [0])
    (a, _), (b, _), *pad = _segments(ds[0])
    assert pad  # the row ends in padding, a run of positions of its own
    model = _tiny(kind)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        alone_a = model(input_ids=torch.tensor([a]), use_cache=False).logits[0]
        alone_b = model(input_ids=torch.tensor([b]), use_cache=False).logits[0]
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
    torch.testing.assert_close(packed[:len(a)], alone_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[len(a):len(a) + len(b)], alone_b, atol=1e-5, rtol=0)
    # without position_ids the second example attends to the first: the check can fail
    assert (leaky[len(a):len(a) + len(b)] - alone_b).abs().max() > 1e-3


def test_the_batch_of_a_step_is_a_pure_function_of_the_seed(tok, tmp_path):
    ds = D.prepare(_chat_cfg(tmp_path, seq_len=100), tok)
    one, two = S.StepSampler(ds, 5, 2, 2), S.StepSampler(ds, 5, 2, 2)
    for step, rank, micro in [(0, 0, 0), (3, 1, 1), (7, 0, 1), (3, 1, 1)]:
        x, y = one.batch(step, rank, 2, micro), two.batch(step, rank, 2, micro)
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
    other = S.StepSampler(ds, 6, 2, 2)
    assert any(not torch.equal(one.batch(s, 0, 2)["input_ids"], other.batch(s, 0, 2)["input_ids"])
               for s in range(4))


# --- text rows as before ------------------------------------------------------------------------

def test_text_rows_are_unchanged_and_their_cache_key_is_stable(tok, tmp_path):
    # the rows: measured with the code of git HEAD 49d2f15, before chat/instruction data existed.
    # The key changed on purpose with the sharded int32 cache (DATA_FORMAT_VERSION 2, the whole
    # tokenizer pipeline in it); pinned so that a key computed differently in another process
    # (the launcher builds, the workers look it up) is caught
    cfg = _cfg(tmp_path, {"seq_len": 64, "synthetic_docs": 200}, seed=3)
    assert D.cache_key(cfg, tok) == "affb1b83495aeecd"
    ds = D.prepare(cfg, tok)
    assert ds.column_names == ["input_ids"] and len(ds) == 405
    h = hashlib.sha256()
    for r in ds["input_ids"]:
        h.update(r.numpy().astype("int64").tobytes())
    assert h.hexdigest() == "826f62aae1ca1151ab68d329e5a29e81c604e3619b50e7e6a61d106b24705e03"
    batch = S.batch_of(ds, [0, 1])
    assert set(batch) == {"input_ids", "labels", "use_cache"}
    assert torch.equal(batch["labels"], batch["input_ids"])


def test_the_cache_key_follows_what_changes_the_rows(tok, tmp_path):
    base = _chat_cfg(tmp_path)
    keys = {D.cache_key(base, tok)}
    for change in [{"train_on_prompt": True}, {"packing": False}, {"messages_field": "conv"},
                   {"format": "instruction"}, {"seq_len": 64}, {"revision": "c0ffee1"}]:
        keys.add(D.cache_key(OmegaConf.merge(base, {"data": change}), tok))
    other = byte_tokenizer()
    other.chat_template = other.chat_template.replace("|>", "|]")
    keys.add(D.cache_key(base, other))
    f = _jsonl(tmp_path / "val.jsonl", [{"messages": CONVS[0]}])
    keys.add(D.cache_key(OmegaConf.merge(base, {"eval": {"files": [f]}}), tok, "eval"))
    assert len(keys) == 9


# --- validation data ------------------------------------------------------------------------

def test_synthetic_eval_data_is_its_own_and_deterministic(tok, tmp_path):
    cfg = _cfg(tmp_path, {"seq_len": 64, "synthetic_docs": 300}, {"seed": 0}, seed=0)
    train, ev = D.prepare(cfg, tok), D.prepare(cfg, tok, part="eval")
    again = D.prepare(OmegaConf.merge(cfg, {"data": {"cache_dir": str(tmp_path / "c2")}}), tok,
                      part="eval")
    rows = lambda ds: [tuple(r.tolist()) for r in ds["input_ids"]]  # noqa: E731
    assert rows(ev) == rows(again)
    assert not set(rows(ev)) & set(rows(train))  # eval.seed == run.seed, still other text
    other = D.prepare(OmegaConf.merge(cfg, {"eval": {"seed": 2}}), tok, part="eval")
    assert rows(other) != rows(ev)


def test_eval_files_are_processed_like_the_training_data(tok, tmp_path):
    f = _jsonl(tmp_path / "val.jsonl", [{"messages": CONVS[3]}, {"messages": CONVS[1]}])
    cfg = OmegaConf.merge(_chat_cfg(tmp_path, seq_len=100), {"eval": {"files": [f]}})
    ev = D.prepare(cfg, tok, part="eval")
    assert set(ev.column_names) == {"input_ids", "labels", "position_ids"}
    assert [ids for ids, _ in _examples_of(ev, tok)] == \
        [_rendered(tok, CONVS[3]), _rendered(tok, CONVS[1])]


def test_eval_rows_are_a_fixed_set_whatever_the_world_size(tok, tmp_path):
    ds = D.prepare(_cfg(tmp_path, {"seq_len": 64, "synthetic_docs": 100}), tok, part="eval")
    rows = S.eval_rows(ds, max_batches=3, micro_batch_size=4)
    assert rows == list(range(12))
    for world in (1, 2, 3, 5):  # ranks split the one set; none is lost or counted twice
        assert sorted(r for k in range(world) for r in rows[k::world]) == rows
    assert S.eval_rows(ds, 10_000, 8) == list(range(len(ds)))


def test_eval_data_the_recipe_does_not_name_is_refused(tok, tmp_path):
    with pytest.raises(ValueError, match="set eval.files"):
        D.prepare(_chat_cfg(tmp_path), tok, part="eval")
    hub = _cfg(tmp_path, {"source": "hub", "id": "someone/data"})
    with pytest.raises(ValueError, match="eval.split"):
        D.prepare(hub, tok, part="eval")
    with pytest.raises(ValueError, match="part="):
        D.prepare(_chat_cfg(tmp_path), tok, part="test")


# --- files and errors -----------------------------------------------------------------------

def test_relative_files_resolve_against_the_project_root(tok, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, {"source": "files", "format": "chat", "seq_len": 256,
                          "files": ["launcher/assets/tiny_chat.jsonl"]},
               {"files": ["launcher/assets/tiny_chat_eval.jsonl"]})
    assert D.resolve_files(cfg.data.files) == [str(ROOT / "launcher/assets/tiny_chat.jsonl")]
    train, ev = D.prepare(cfg, tok), D.prepare(cfg, tok, part="eval")
    assert len(train) > 100 and len(ev) > 10
    with pytest.raises(ValueError, match="does not exist"):
        D.resolve_files(["launcher/assets/nope.jsonl"])


@pytest.mark.parametrize("bad, says", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}],
     r"example 1 \(data.messages_field='messages'\): message 1 has no 'content'"),
    ([{"content": "hi"}, {"role": "assistant", "content": "YO"}], r"message 0 has no 'role'"),
    ([{"role": "tool", "content": "hi"}, {"role": "assistant", "content": "YO"}],
     r"unknown role 'tool'"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
     r"example 1 .* has no assistant message"),
])
def test_bad_conversations_are_refused_clearly(tok, tmp_path, bad, says):
    with pytest.raises(ValueError, match=says):
        D.prepare(_chat_cfg(tmp_path, convs=[CONVS[0], bad]), tok)


def test_messages_that_are_not_a_list_are_refused():
    for bad in (None, [], "hello"):
        with pytest.raises(ValueError, match="example 7 .*not a non-empty list"):
            check_messages(bad, 7, "messages")


def test_missing_columns_are_refused_with_the_columns_found(tok, tmp_path):
    f = _jsonl(tmp_path / "conv.jsonl", [{"conversation": CONVS[0]}])
    cfg = _cfg(tmp_path, {"source": "files", "files": [f], "format": "chat"})
    with pytest.raises(ValueError, match=r"data.messages_field='messages' is not a column.*"
                                         r"\['conversation'\]"):
        D.prepare(cfg, tok)
    f = _jsonl(tmp_path / "qa.jsonl", [{"question": "a", "answer": "B"}])
    cfg = _cfg(tmp_path, {"source": "files", "files": [f], "format": "instruction"})
    with pytest.raises(ValueError, match=r"data.prompt_field='prompt' and "
                                         r"data.response_field='response' are not columns.*"
                                         r"columns found: \['question', 'answer'\]"):
        D.prepare(cfg, tok)


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path):
    odd = byte_tokenizer()  # the generation prompt differs from an assistant message's header
    odd.chat_template = odd.chat_template.replace("{{- '<|assistant|>\\n' -}}", "{{- 'BOT: ' -}}")
    with pytest.raises(ValueError, match="not prefix-stable"):
        D.prepare(_chat_cfg(tmp_path), odd)
    D.prepare(_chat_cfg(tmp_path, train_on_prompt=True), odd)  # no spans needed: accepted
    none = byte_tokenizer()
    none.chat_template = None
    with pytest.raises(ValueError, match="has none"):
        D.prepare(_chat_cfg(tmp_path), none)


def test_synthetic_source_with_a_chat_format_is_refused(tok, tmp_path):
    with pytest.raises(ValueError, match="source=synthetic generates raw text"):
        D.prepare(_cfg(tmp_path, {"format": "chat"}), tok)


# --- the shipped data ---------------------------------------------------------------------------

def test_the_shipped_data_is_what_the_generator_writes(tmp_path):
    assets = ROOT / "launcher" / "assets"
    subprocess.run([sys.executable, str(assets / "make_tiny_chat.py"), str(tmp_path)], check=True)
    names = ["tiny_chat.jsonl", "tiny_chat_eval.jsonl", "tiny_instruct.jsonl"]
    for name, n in zip(names, [400, 64, 200]):
        raw = (assets / name).read_bytes()
        assert raw == (tmp_path / name).read_bytes(), f"{name}: rerun make_tiny_chat.py"
        assert len(raw) < 200_000 and raw.isascii() and raw.count(b"\n") == n
    train = set((assets / names[0]).read_text().splitlines())
    ev = set((assets / names[1]).read_text().splitlines())
    assert len(train) == 400 and len(ev) == 64 and not train & ev
    for line in list(train) + list(ev):
        check_messages(json.loads(line)["messages"], 0, "messages")
