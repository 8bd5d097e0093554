"""Tokenizers: the hub's, or a byte-level one built locally that needs no download.

The byte-level tokenizer maps each UTF-8 byte to one token (ids 0-255, in byte order) plus an
end-of-text token (256). It is a real `PreTrainedTokenizerFast`: saved beside the model, it
reloads with `AutoTokenizer.from_pretrained` and decodes any text exactly.
"""
from __future__ import annotations

END_OF_TEXT = "<|endoftext|>"


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
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TEXT,
                                   bos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                   unk_token=END_OF_TEXT, model_max_length=1 << 30)


def build_tokenizer(kind: str, name_or_path: str | None = None):
    if kind == "byte":
        return byte_tokenizer()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(name_or_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
