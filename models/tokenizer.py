"""Tokenizers: the hub's, or a byte-level one built locally that needs no download.

The byte-level tokenizer maps each UTF-8 byte to one token (ids 0-255, in byte order) plus an
end-of-text token (256). It is a real `PreTrainedTokenizerFast`: saved beside the model, it
reloads with `AutoTokenizer.from_pretrained` and decodes any text exactly.

It carries a small chat template of its own, for chat fine-tuning without a hub tokenizer: each
message is `<|role|>\n{content}<|endoftext|>`, and the generation prompt is `<|assistant|>\n`. The
role markers are plain bytes; only `<|endoftext|>` is a token of its own (256).
"""
from __future__ import annotations

END_OF_TEXT = "<|endoftext|>"


def simple_chat_template(eos_token: str) -> str:
    """The project's role-tagged chat template (Jinja, as `apply_chat_template` renders it): each
    message `<|role|>\\n{content}` + eos, the generation prompt `<|assistant|>\\n`. Every message
    ends with eos, so the model learns to stop after an answer, and a prefix of a conversation
    renders as a prefix of its tokens."""
    eos = eos_token.replace("\\", "\\\\").replace("'", "\\'")
    return ("{%- for message in messages -%}"
            "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '" + eos + "' -}}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}")


CHAT_TEMPLATE = simple_chat_template(END_OF_TEXT)  # the byte tokenizer's


def _byte_to_char() -> dict[int, str]:
    """Printable stand-ins for the 256 bytes, as byte-level BPE tokenizers use them."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_to_char().items()}
    vocab[END_OF_TEXT] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TEXT,
                                   bos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                   unk_token=END_OF_TEXT, model_max_length=1 << 30)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tokenizer(kind: str, name_or_path: str | None = None, chat_template: str = "own"):
    """kind=byte or hub; chat_template=own keeps the tokenizer's template, simple replaces it with
    `simple_chat_template` on its eos token (for a tokenizer without one, e.g. a base model's)."""
    if kind == "byte":
        tok = byte_tokenizer()
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(name_or_path)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    if chat_template == "simple":
        if tok.eos_token is None:
            raise ValueError(f"tokenizer.chat_template=simple ends each message with the eos "
                             f"token, and {name_or_path or kind} has none")
        tok.chat_template = simple_chat_template(tok.eos_token)
    elif chat_template != "own":
        raise ValueError(f"tokenizer.chat_template={chat_template!r}: use own or simple")
    return tok
