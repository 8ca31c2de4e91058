"""GGUF vocabularies as llama.cpp reads them, beyond test_gguf's: control tokens spelled outside
the byte alphabet (DeepSeek's ``<｜User｜>``) and Llama 3's ``tokenizer.ggml.pre`` defaults."""

from __future__ import annotations

from typing import Any

import pytest

from execrt.models.tokenizer import tokenizer_from_gguf
from tests.models.gguf_files import byte_level_vocab

pytest.importorskip("tokenizers")


def _meta(pre: str, extra: list[tuple[str, int]], **keys: Any) -> dict[str, Any]:
    """A byte-level vocabulary of 384 tokens plus ``extra`` (token, llama.cpp type)."""
    tokens, merges, types = byte_level_vocab(384)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens + [t for t, _ in extra],
        "tokenizer.ggml.token_type": types + [k for _, k in extra],
        "tokenizer.ggml.merges": merges,
        **{f"tokenizer.ggml.{k}": v for k, v in keys.items()},
    }


def test_control_tokens_outside_the_byte_alphabet_match_whole() -> None:
    """DeepSeek-R1-Distill-Qwen's control tokens are stored as their text, with full-width
    bars; they used to be re-spelled as bytes, so its chat prompt's ``<｜User｜>`` became ten
    byte tokens and the eos token had no id by its name."""
    extra = [("<｜begin▁of▁sentence｜>", 3), ("<｜end▁of▁sentence｜>", 3), ("<｜User｜>", 3),
             ("<｜Assistant｜>", 3), ("<think>", 4), ("  ", 4)]  # fmt: skip
    meta = _meta("deepseek-r1-qwen", extra, bos_token_id=384, add_bos_token=True)
    tok = tokenizer_from_gguf(meta, "ds.gguf")
    assert tok.get_vocab_size() == 390  # no token added beyond the file's
    assert [tok.token_to_id(t) for t, _ in extra] == list(range(384, 390))
    text = "<｜User｜>the<think>hat  <｜Assistant｜>"
    ids = tok.encode(text).ids
    assert ids[:2] == [384, 386] and ids[-1] == 387 and 388 in ids and 389 in ids
    assert tok.decode(ids, skip_special_tokens=False) == "<｜begin▁of▁sentence｜>" + text
    assert tok.decode(ids) == "the<think>hat  "  # control tokens are special, user ones text


def test_llama3_vocabularies_ignore_merges_and_add_bos_unless_told() -> None:
    """llama.cpp's Llama 3 pre-tokenizers take a word that is one token whole (the HF
    tokenizer's ``ignore_merges``) and add bos when the file does not say; Qwen2's do not."""
    extra = [("Ġthe", 1), ("<|begin_of_text|>", 3)]  # "Ġthe": no merge reaches it
    for pre, add_bos, first in (("llama-bpe", None, [385, 384]), ("llama-bpe", False, [384])):
        keys = {"bos_token_id": 385} | ({} if add_bos is None else {"add_bos_token": add_bos})
        tok = tokenizer_from_gguf(_meta(pre, extra, **keys), "l3.gguf")
        assert tok.encode(" the hat").ids[: len(first)] == first, (pre, add_bos)
    tok = tokenizer_from_gguf(_meta("qwen2", extra, bos_token_id=385), "q.gguf")
    ids = tok.encode(" the hat").ids
    assert 384 not in ids and 385 not in ids and tok.decode(ids) == " the hat"
