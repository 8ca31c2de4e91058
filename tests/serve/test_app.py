"""The HTTP app in-process (ASGI) over a fake engine: routing, validation, error JSON, SSE
framing, stop strings, n, logprobs, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from execrt.engine.codec import TokenizerCodec
from execrt.engine.limits import kv_refusal
from execrt.models.builtin import build_tokenizer
from execrt.models.tokenizer import ChatTemplate
from execrt.serve.app import create_app
from execrt.serve.protocol import APIError, engine_error, parse
from tests.serve.fakes import FakeClient


def call(
    client: FakeClient,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    **app: Any,
):  # type: ignore[no-untyped-def]
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(client, **app))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            content = raw if raw is not None else (None if body is None else orjson.dumps(body))
            return await http.request(method, path, content=content)

    return asyncio.run(go())


def events(response: httpx.Response) -> list[Any]:
    """The SSE payloads; asserts the framing (``data: <payload>`` + blank line, nothing else)."""
    assert response.headers["content-type"].startswith("text/event-stream")
    text = response.text
    assert text.endswith("\n\n")
    out = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    assert out[-1] == "[DONE]" and out.count("[DONE]") == 1
    return out[:-1]


@pytest.fixture
def fake():  # type: ignore[no-untyped-def]
    client = FakeClient()
    yield client
    client.close()


def test_health_and_every_request_are_503_while_loading() -> None:
    loading = FakeClient(is_ready=False)
    for method, path, body in [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "a"}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
    ]:
        r = call(loading, method, path, body)
        assert r.status_code == 503, path
        assert r.json()["error"]["type"] == "service_unavailable"
        assert r.json()["error"]["message"] == "the model is loading"
    loading.is_ready = True
    assert call(loading, "GET", "/health").json() == {"status": "ok"}
    loading.close()


def test_models_names_the_model_and_its_context(fake) -> None:
    r = call(fake, "GET", "/v1/models")
    assert r.status_code == 200
    (model,) = r.json()["data"]
    assert (model["id"], model["object"], model["max_model_len"]) == ("fake", "model", 64)


def test_max_model_len_is_what_the_kv_cache_holds_where_that_is_less(fake, monkeypatch) -> None:
    # A client sizing requests by max_model_len must not be refused for lack of KV slots.
    info = fake.model_info()
    monkeypatch.setattr(fake, "model_info", lambda: dataclasses.replace(info, kv_slots_total=20))
    (model,) = call(fake, "GET", "/v1/models").json()["data"]
    assert model["max_model_len"] == 21  # 20 slots: the last token's K/V is never stored
    r = call(fake, "POST", "/tokenize", {"prompt": "abc"})
    assert r.json()["max_model_len"] == 21


def test_a_model_is_retrieved_by_its_id_and_another_is_404(fake) -> None:
    r = call(fake, "GET", "/v1/models/fake")
    listed = call(fake, "GET", "/v1/models").json()["data"][0]
    # Each call() builds its own app, whose start is the card's "created": a second may pass.
    assert r.status_code == 200 and r.json() | {"created": 0} == listed | {"created": 0}
    assert 0 <= listed["created"] - r.json()["created"] <= 60
    r = call(fake, "GET", "/v1/models/other/name")  # ids may hold slashes (org/model)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'other/name' does not exist (this server serves 'fake')" in r.json()["error"]["message"]
    loading = FakeClient(is_ready=False)
    assert call(loading, "GET", "/v1/models/fake").status_code == 503
    loading.close()


def test_unknown_route_and_wrong_method_answer_in_openai_error_shape(fake) -> None:
    r = call(fake, "POST", "/v1/embeddings", {"input": "a"})
    error = r.json()["error"]
    assert r.status_code == 404 and set(error) == {"message", "type", "param", "code"}
    assert (error["message"], error["type"]) == (
        "no route POST /v1/embeddings on this server",
        "not_found_error",
    )
    r = call(fake, "GET", "/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["message"] == "/v1/completions does not take GET"
    assert r.headers["allow"] == "POST"


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"foo": 1}, "foo", "field 'foo' is unsupported"),
        ({"best_of": 2}, "best_of", "field 'best_of' = 2 is unsupported"),
        ({"metadata": {"a": 1}}, "metadata", "metadata {'a': 1} must map strings to strings"),
        ({"tools": [{"type": "function"}]}, "tools", "field 'tools' is unsupported"),
        ({"logit_bias": {"x": 5}}, "logit_bias", "must map token ids (as strings) to biases"),
        ({"temperature": -1}, "temperature", "temperature -1 must be a finite number >= 0"),
        ({"n": 0}, "n", "n 0 must be an integer in 1..64"),
        ({"stop": list("abcdefghijklmnopq")}, "stop", "a list of up to 16"),
        ({"stop": [""]}, "stop", "non-empty string"),
        ({"logprobs": 6}, "logprobs", "logprobs 6 must be an integer in 0..5"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "needs stream: true"),
        (
            {"stream": True, "stream_options": {"include_usage": "y"}},
            "stream_options.include_usage",
            "stream_options.include_usage 'y' must be true or false",
        ),
        (
            {"max_tokens": 64},
            "max_tokens",
            "This model's maximum context length is 64 tokens. However, you requested 65 "
            "tokens (1 in the prompt, 64 in the completion): max_tokens 64 is too large, at "
            "most 63 can be generated",
        ),
        (
            {"prompt": ["a", "bcd"], "max_tokens": 62},
            "max_tokens",
            "(3 in the prompt, 62 in the completion): max_tokens 62 is too large, at most 61",
        ),
        ({"prompt": "a" * 70}, "prompt", "prompt of 70 tokens leaves no room in the context"),
        ({"prompt": []}, "prompt", "prompt must be a string"),
        ({"prompt": "A!"}, "prompt", "letters only"),
        ({"stream": "yes"}, "stream", "stream 'yes' must be true or false"),
    ],
)
def test_a_bad_completion_is_a_400_naming_the_field(fake, extra, param, needle) -> None:
    r = call(fake, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2} | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    overflow = "too large" in needle or "leaves no room" in needle
    assert error["code"] == ("context_length_exceeded" if overflow else None), error
    assert error["type"] == "invalid_request_error" and set(error) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert fake.submitted == []  # nothing reached the engine


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"messages": []}, "messages", "non-empty list"),
        (
            {"messages": [{"role": "tool", "content": "a"}]},
            "messages[0].tool_call_id",
            "has role 'tool' but no 'tool_call_id'",
        ),
        (
            {"messages": [{"role": "tool", "content": "a", "tool_call_id": "c1"}]},
            "messages[0].tool_call_id",
            "'c1' answers no earlier assistant tool call (made: none)",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "content": "4", "tool_call_id": "c2"},
                ]
            },
            "messages[2].tool_call_id",
            "'c2' answers no earlier assistant tool call (made: c1)",
        ),
        (
            {"messages": [{"role": "robot", "content": "a"}]},
            "messages[0].role",
            "'robot' is unsupported (supported: system, developer, user, assistant, tool)",
        ),
        ({"messages": [{"role": "User", "content": "a"}]}, "messages[0].role", "'User'"),
        (
            {"messages": [{"role": "function", "content": "a", "name": "f"}]},
            "messages[0].role",
            "send tool results with role 'tool'",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "string"),
        (
            {"messages": [{"role": "user", "content": "a", "audio": {}}]},
            "messages[0].audio",
            "field 'audio' is unsupported",
        ),
        (
            {"messages": [{"role": "assistant", "content": "a", "tool_calls": {}}]},
            "messages[0].tool_calls",
            "tool_calls must be a list",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs", ""),
        (
            {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10**9},
            "max_completion_tokens",
            "max_completion_tokens 1000000000 is too large",
        ),
        (
            {"messages": [{"role": "assistant", "content": "a", "annotations": [{"x": 1}]}]},
            "messages[0].annotations",
            "field 'annotations' is unsupported",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "temperature": -1}, "temperature", "-1"),
    ],
)
def test_a_bad_chat_request_is_a_400(fake, body, param, needle) -> None:
    r = call(fake, "POST", "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"]
    if param is not None:
        assert error["param"] == param


def test_developer_messages_are_system_messages_and_tool_answers_follow_their_call(fake) -> None:
    """The fake's template knows system, user and assistant only (any other role raises)."""
    body = {"messages": [{"role": "developer", "content": "be"}, {"role": "user", "content": "a"}]}
    r = call(fake, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    r = call(fake, "POST", "/v1/chat/completions", {"messages": history})
    assert r.status_code == 400 and "bad role" in r.json()["error"]["message"]  # the template's


@pytest.mark.parametrize(
    ("endpoint", "field"), [("completion", "max_tokens"), ("chat", "max_completion_tokens")]
)
def test_an_engine_refusal_names_the_request_field_not_the_engine_keyword(endpoint, field) -> None:
    error = engine_error("max_new_tokens 0 must be an integer >= 1; top_p 2 bad", endpoint)
    echo = " (0 with echo: true scores the prompt)" if endpoint == "completion" else ""
    assert (error.param, error.message) == (
        field,
        f"{field} 0 must be an integer >= 1{echo}; top_p 2 bad",
    )
    assert engine_error("top_p 0 must be in (0, 1]", endpoint).param == "top_p"
    assert engine_error("prompt_logprobs: the model (M) does not", endpoint).param == "echo"


def test_a_format_the_model_cannot_follow_is_a_400_naming_response_format() -> None:
    """It was found only once queued: HTTP 500 (the request aborted), not a refusal."""
    from execrt.core.sampling_params import SamplingParams
    from execrt.engine.limits import RequestLimits

    fmt = SamplingParams(response_format="json_object", reasoning="qwen3")
    no_think = RequestLimits(vocab_size=10, context_len=10, kv_slots_total=10, think_tokens=False)
    no_tokenizer = RequestLimits(10, 10, 10, no_response_format="needs the model's tokenizer")
    for limits in (no_think, no_tokenizer):
        (problem,) = limits.params_problems(fmt)
        assert engine_error(problem, "chat").param == "response_format"
    assert RequestLimits(10, 10, 10).params_problems(fmt) == []


def test_an_error_quoting_a_huge_value_stays_small(fake) -> None:
    # 100,000 stop strings were quoted whole: a 989 KB error body.
    stops = [f"s{i}" for i in range(100_000)]
    r = call(fake, "POST", "/v1/completions", {"prompt": "a", "stop": stops})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "stop"
    assert len(error["message"]) < 2100 and "characters cut" in error["message"]
    assert error["message"].startswith("stop ['s0', 's1'")  # the field still comes first


def test_a_large_body_is_parsed_off_the_event_loop(fake, monkeypatch) -> None:
    # An 8 MB prompt was tokenized on the event loop: every other stream and /health
    # stalled for seconds before its 400 came back.
    import threading

    from execrt.serve import app as app_module

    threads: list[bool] = []
    real = app_module.parse

    def parse(*args, **kwargs):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(app_module, "parse", parse)
    assert call(fake, "POST", "/v1/completions", {"prompt": "a"}).status_code == 200
    big = "a " * app_module.PARSE_OFF_LOOP_BYTES
    assert call(fake, "POST", "/v1/completions", {"prompt": big}).status_code == 400
    assert threads == [True, False]  # the small one on the loop (no thread hop), not the big


def test_bad_json_a_non_object_and_a_wrong_model(fake) -> None:
    r = call(fake, "POST", "/v1/completions", raw=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = call(fake, "POST", "/v1/completions", [1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = call(fake, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_neutral_values_of_unimplemented_fields_are_accepted(fake) -> None:
    body = {"prompt": "a", "max_tokens": 3, "model": "fake", "echo": False, "best_of": 1}
    body |= {"store": False, "service_tier": "auto", "modalities": ["text"]}
    body |= {"frequency_penalty": 0, "presence_penalty": 0.0, "user": "me", "suffix": None}
    body |= {"metadata": {"purpose": "test"}, "repetition_penalty": 1, "min_p": 0}
    r = call(fake, "POST", "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "bcd"


def test_completion_shape_and_usage(fake) -> None:
    r = call(fake, "POST", "/v1/completions", {"prompt": ["ab", [3, 4]], "max_tokens": 3})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake" and isinstance(body["created"], int)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "cde", "length"),
        (1, "fgh", "length"),
    ]
    assert body["choices"][0]["logprobs"] is None
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 6,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_shape_and_template_stop(fake) -> None:
    body = {"messages": [{"role": "user", "content": "w"}], "max_completion_tokens": 10}
    r = call(fake, "POST", "/v1/chat/completions", body)
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    # The template's end-of-turn token (25, "z") stops it; max_completion_tokens was 10.
    assert choice["message"] == {"role": "assistant", "content": "xyz"}
    assert choice["finish_reason"] == "stop"
    assert fake.submitted[0].sampling["max_new_tokens"] == 10
    assert fake.submitted[0].sampling["stop_token_ids"] == [25]


def test_an_answer_sent_back_as_history_keeps_its_null_output_fields(fake) -> None:
    # openai's ChatCompletionMessage.model_dump() has refusal, audio, function_call and
    # annotations (null or empty): the next turn sends them back, and vLLM takes them.
    answer = {
        "role": "assistant", "content": "xy", "refusal": None, "audio": None,
        "function_call": None, "annotations": [], "tool_calls": None,
    }  # fmt: skip
    plain = [{"role": "user", "content": "w"}, {"role": "assistant", "content": "xy"}]
    turn = {"role": "user", "content": "v"}
    got = call(fake, "POST", "/v1/chat/completions", {"messages": [plain[0], answer, turn]})
    want = call(fake, "POST", "/v1/chat/completions", {"messages": [*plain, turn]})
    assert got.status_code == want.status_code == 200, got.text
    assert fake.submitted[0].prompt_ids == fake.submitted[1].prompt_ids


def test_chat_ignoring_eos_runs_to_max_tokens_past_the_end_of_turn(fake) -> None:
    # Fixed-length benchmarks (vLLM's benchmark_serving, genai-perf) send ignore_eos: the
    # template's end of turn (an EOS) must not stop them, as it does not on completions.
    body = {"messages": [{"role": "user", "content": "w"}], "max_tokens": 6, "ignore_eos": True}
    out = call(fake, "POST", "/v1/chat/completions", body).json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 6
    assert fake.submitted[0].sampling["stop_token_ids"] == []
    body |= {"stop_token_ids": [24]}  # the caller's own stop ids still stop it
    out = call(fake, "POST", "/v1/chat/completions", body).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert fake.submitted[1].sampling["stop_token_ids"] == [24]


def test_health_answers_head_and_models_say_when_served(fake) -> None:
    import time

    assert call(fake, "HEAD", "/health").status_code == 200  # load balancers probe so
    (model,) = call(fake, "GET", "/v1/models").json()["data"]
    assert abs(model["created"] - time.time()) < 600


def test_version_names_the_running_build_even_while_loading() -> None:
    import execrt

    r = call(FakeClient(is_ready=False), "GET", "/version")
    assert r.status_code == 200 and r.json() == {"version": execrt.__version__}


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice 'auto' needs tools"),
        ({"tool_choice": "required", "tools": []}, "tool_choice", "needs tools"),
        ({"user": 5}, "user", "user 5 must be a string"),
        ({"logit_bias": {"\u0661\u0662": 1}}, "logit_bias", "must map token ids"),
    ],
)
def test_more_bad_chat_fields_are_400s_naming_them(fake, extra, param, needle) -> None:
    body = {"messages": [{"role": "user", "content": "w"}], "max_tokens": 2} | extra
    r = call(fake, "POST", "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and needle in r.json()["error"]["message"]
    ok = {"messages": [{"role": "user", "content": "w"}], "max_tokens": 2, "tool_choice": "none"}
    assert call(fake, "POST", "/v1/chat/completions", ok).status_code == 200


def test_chat_template_kwargs_reach_the_template_and_a_bad_value_is_a_400(fake) -> None:
    body = {"messages": [{"role": "user", "content": "w"}], "max_tokens": 1}
    variables = {"enable_thinking": True, "other": False}
    call(fake, "POST", "/v1/chat/completions", body | {"chat_template_kwargs": variables})
    call(fake, "POST", "/v1/chat/completions", body | {"chat_template_kwargs": None})
    # The fake's template prefixes the initial of each variable set true.
    assert [r.prompt_ids for r in fake.submitted] == [fake.text().encode(t) for t in ("ew", "w")]
    r = call(fake, "POST", "/v1/chat/completions", body | {"chat_template_kwargs": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = call(fake, "POST", "/v1/completions", {"prompt": "a", "chat_template_kwargs": {}})
    assert r.status_code == 400 and "'chat_template_kwargs' is unsupported" in r.text
    assert len(fake.submitted) == 2


def test_a_chat_answer_without_max_tokens_stays_within_a_kv_cache_smaller_than_the_context() -> (
    None
):
    # The OpenAI SDK sends no max_tokens: the default was the whole context left, which a
    # smaller cache refused as "needs up to 4095 KV slots" for every such request.
    text = TokenizerCodec(build_tokenizer(), ChatTemplate("{{ messages[0]['content'] }}"))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    ids = parse(body, "chat", text, 4096).prompts[0]
    assert parse(body, "chat", text, 4096).sampling["max_new_tokens"] == 4096 - len(ids)
    small = parse(body, "chat", text, 4096, max_len=257)  # a cache of 256 slots
    assert small.sampling["max_new_tokens"] == 257 - len(ids)  # needs exactly the 256 slots
    fits = parse(body | {"max_tokens": 257 - len(ids)}, "chat", text, 4096, max_len=257)
    assert fits.sampling["max_new_tokens"] == 257 - len(ids)
    # A client's max_tokens past the longest request served (max_model_len, not the context)
    # is refused at once in OpenAI's words and code: it read "at most 4094 can be generated"
    # from the context, then a max_tokens within that was refused by the engine with code null.
    with pytest.raises(APIError) as info:
        parse(body | {"max_tokens": 300}, "chat", text, 4096, max_len=257)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert f"maximum context length is 257 tokens. However, you requested {len(ids) + 300}" in (
        str(info.value)
    ) and f"at most {257 - len(ids)} can be generated" in str(info.value)
    for endpoint, field in (("chat", "max_completion_tokens"), ("completion", "max_tokens")):
        error = engine_error(kv_refusal(2, 300, 4096, 256), endpoint)
        assert error.param == field and error.code == "context_length_exceeded", endpoint
        assert (
            "maximum context length is 257 tokens. However, you requested 302 tokens (2 in "
            in (error.message)
            and f"{field} 300 is too large, at most 255 can be generated" in error.message
        )
        assert f"lower {field}, or raise kv_cache_tokens" in error.message  # the operator's hint
        whole = engine_error(kv_refusal(300, 1, 4096, 256), endpoint)
        assert whole.code == "context_length_exceeded", endpoint
        assert "maximum context length is 257 tokens. However, your " in whole.message
        assert "resulted in 300 tokens, which leaves no room" in whole.message


def test_a_reserved_template_variable_is_a_400_on_chat_template_kwargs() -> None:
    text = TokenizerCodec(build_tokenizer(), ChatTemplate("{{ messages[0]['content'] }}"))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse(body | {"chat_template_kwargs": {"x": 1}}, "chat", text, 64).prompts
    with pytest.raises(APIError) as info:
        parse(body | {"chat_template_kwargs": {"eos_token": "!"}}, "chat", text, 64)
    assert info.value.param == "chat_template_kwargs" and "'eos_token' is reserved" in str(
        info.value
    )


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_assistant_prefill_is_continued_with_continue_final_message() -> None:
    # vLLM's fields: the prompt ends right after the final assistant message's content (its
    # end of turn cut), or, with add_generation_prompt false, after the last turn.
    tokenizer = build_tokenizer()
    text = TokenizerCodec(tokenizer, ChatTemplate(CHATML))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]

    def prompt(**fields: Any) -> str:
        ids = parse({"messages": messages} | fields, "chat", text, 256).prompts[0]
        return tokenizer.decode(ids, skip_special_tokens=False)

    continued = prompt(continue_final_message=True, add_generation_prompt=False)
    assert continued.endswith("<|im_start|>assistant\nSure, ")
    assert prompt(continue_final_message=True) == continued  # the opening is then off by default
    assert prompt().endswith("Sure, <|im_end|>\n<|im_start|>assistant\n")
    assert prompt(add_generation_prompt=False).endswith("Sure, <|im_end|>\n")
    for fields, needle in [
        ({"continue_final_message": True, "add_generation_prompt": True}, "exclude each other"),
        ({"continue_final_message": "yes"}, "continue_final_message 'yes' must be true or false"),
    ]:
        with pytest.raises(APIError) as info:
            prompt(**fields)
        assert info.value.param == "continue_final_message" and needle in str(info.value)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(APIError, match="needs a final assistant message"):
        prompt(continue_final_message=True)


def _choice_of(fake, body):  # type: ignore[no-untyped-def]
    """The first choice's text and logprobs, non-streamed and streamed (must agree)."""
    (choice,) = call(fake, "POST", "/v1/completions", body).json()["choices"]
    chunks = events(call(fake, "POST", "/v1/completions", body | {"stream": True}))
    parts = [c["choices"][0] for c in chunks]
    assert "".join(p["text"] for p in parts) == choice["text"]
    assert parts[-1]["finish_reason"] == choice["finish_reason"]
    streamed = [p["logprobs"] for p in parts if p["logprobs"] is not None]
    if choice["logprobs"] is None:
        assert streamed == []
    else:
        joined = {
            k: None if streamed[0][k] is None else sum((lp[k] for lp in streamed), [])
            for k in choice["logprobs"]
        }
        assert joined == choice["logprobs"]
    return choice


def test_echo_puts_the_prompt_and_its_logprobs_first(fake) -> None:
    body = {"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 1}
    choice = _choice_of(fake, body)
    assert choice["text"] == "abcde" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c", "d", "e"],
        "token_logprobs": [None, -1.0, -1.0, -0.5, -0.5],  # the first token has none
        "top_logprobs": [None, {"b": -1.0}, {"c": -1.0}, {"d": -0.5}, {"e": -0.5}],
        "text_offset": [0, 1, 2, 3, 4],
    }
    assert all(r.prompt_logprobs == 1 for r in fake.submitted)
    # Without logprobs the text alone is echoed, and the prompt is not scored.
    choice = _choice_of(fake, {"prompt": [0, 1], "max_tokens": 1, "echo": True})
    assert (choice["text"], choice["logprobs"]) == ("abc", None)  # token ids, decoded
    assert fake.submitted[-1].prompt_logprobs is None


def test_echo_with_max_tokens_0_scores_the_prompt_alone(fake) -> None:
    body = {"prompt": ["ab", "xyz"], "max_tokens": 0, "echo": True, "logprobs": 0}
    r = call(fake, "POST", "/v1/completions", body).json()
    assert [c["text"] for c in r["choices"]] == ["ab", "xyz"]
    assert [c["finish_reason"] for c in r["choices"]] == ["length", "length"]
    assert r["choices"][1]["logprobs"] == {
        "tokens": ["x", "y", "z"],
        "token_logprobs": [None, -1.0, -1.0],
        "top_logprobs": [None, {"y": -1.0}, {"z": -1.0}],  # logprobs 0: the chosen token alone
        "text_offset": [0, 1, 2],
    }
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 5
    assert all(req.sampling["max_new_tokens"] == 1 for req in fake.submitted)
    assert _choice_of(fake, body | {"prompt": "ab"})["text"] == "ab"
    # max_tokens 0 without echo is the engine's refusal, as before
    plan = parse({"prompt": "ab", "max_tokens": 0}, "completion", fake.text(), 64)
    assert plan.sampling["max_new_tokens"] == 0 and not plan.prompt_only


def test_tokenize_and_detokenize_as_the_endpoints_encode(fake) -> None:
    r = call(fake, "POST", "/tokenize", {"prompt": "abc", "add_special_tokens": False})
    assert r.json() == {"count": 3, "max_model_len": 64, "tokens": [0, 1, 2]}
    chat = {"messages": [{"role": "user", "content": "w"}], "chat_template_kwargs": {"e": True}}
    assert call(fake, "POST", "/tokenize", chat).json()["tokens"] == fake.text().encode("ew")
    assert call(fake, "POST", "/detokenize", {"tokens": [7, 8]}).json() == {"prompt": "hi"}
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "A"}, "prompt"),  # the codec's refusal
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
        ("/detokenize", {"tokens": [1, 26]}, "tokens"),  # the fake's vocabulary is 26
        ("/detokenize", {"tokens": "ab"}, "tokens"),
    ]:
        r = call(fake, "POST", path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = call(fake, "POST", "/tokenize", {"prompt": "a", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = call(fake, "GET", "/tokenizer_info")  # the fake's codec has no tokenizer to describe
    assert r.status_code == 400 and "no tokenizer.json" in r.json()["error"]["message"]
    assert fake.submitted == []


def test_chat_stream_framing(fake) -> None:
    body = {
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = call(fake, "POST", "/v1/chat/completions", body)
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    chunks = events(r)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    for index in (0, 1):
        mine = [
            c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])
        assert "".join(m["delta"].get("content", "") for m in mine) == "bcd"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])  # include_usage: null until the end


def test_completion_stream_without_usage(fake) -> None:
    body = {"prompt": "a", "max_tokens": 4, "stream": True}
    chunks = events(call(fake, "POST", "/v1/completions", body))
    assert all("usage" not in c for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "bcde" and chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_text_and_aborts_the_request(fake, stream) -> None:
    body = {"prompt": "a", "max_tokens": 20, "stop": ["xx", "ef"], "stream": stream}
    r = call(fake, "POST", "/v1/completions", body)
    if stream:
        chunks = events(r)
        pieces = [c["choices"][0]["text"] for c in chunks]
        assert "".join(pieces) == "bcd" and not any("e" in p for p in pieces)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("bcd", "stop")
        assert r.json()["usage"]["completion_tokens"] == 5  # up to the token that matched
    assert fake.aborted == [(fake.submitted[0].request_id, "stop string matched")]


def test_a_held_back_prefix_is_released_when_no_stop_follows(fake) -> None:
    r = call(fake, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 6, "stop": "eg"})
    assert r.json()["choices"][0]["text"] == "bcdefg" and fake.aborted == []


def test_n_choices_get_seeds_derived_from_seed(fake) -> None:
    call(fake, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 1, "n": 3, "seed": 7})
    seeds = [r.sampling["seed"] for r in fake.submitted]
    assert seeds[0] == 7 and len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
    call(fake, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 1, "n": 2})
    assert [r.sampling["seed"] for r in fake.submitted[3:]] == [None, None]


def test_logprobs_in_both_shapes(fake) -> None:
    r = call(fake, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {
        "tokens": ["b", "c"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"b": -0.5}, {"c": -0.5}],
        "text_offset": [0, 1],
    }
    body = {
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 1,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = call(fake, "POST", "/v1/chat/completions", body)
    (entry,) = r.json()["choices"][0]["logprobs"]["content"]
    assert entry["token"] == "b" and entry["logprob"] == -0.5 and entry["bytes"] == [98]
    assert [t["token"] for t in entry["top_logprobs"]] == ["b", "a"]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_stop_with_the_text_a_stop_string_ends(fake, stream) -> None:
    """Generated b c d e f: the stop "de" ends the text after "bc", and the tokens it cut off
    (d and e, and whatever came after) have no log-probabilities; usage still counts them."""
    body = {"prompt": "a", "max_tokens": 6, "logprobs": 0, "stop": "de", "stream": stream}
    r = call(fake, "POST", "/v1/completions", body | {"stream_options": {"include_usage": True}}
             if stream else body)  # fmt: skip
    if stream:
        chunks = [c for c in events(r) if c != "[DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        listed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
        tokens = [t for lp in listed if lp for t in lp["tokens"]]
        offsets = [o for lp in listed if lp for o in lp["text_offset"]]
        usage = chunks[-1]["usage"]
    else:
        choice = r.json()["choices"][0]
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
        offsets, usage = choice["logprobs"]["text_offset"], r.json()["usage"]
    assert (text, tokens, offsets) == ("bc", ["b", "c"], [0, 1])
    assert usage["completion_tokens"] == 4  # b c d e were generated


def test_flush_cache_is_501_without_a_prefix_cache(fake) -> None:
    r = call(fake, "POST", "/flush_cache")
    assert r.status_code == 501 and "no prefix cache" in r.json()["error"]["message"]


def metric_values(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_metrics_parse_and_count_requests(fake) -> None:
    app = create_app(fake)

    async def go() -> tuple[str, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            before = (await http.get("/metrics")).text
            await http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "n": 2})
            return before, (await http.get("/metrics")).text

    before, after = asyncio.run(go())
    a, b = metric_values(before), metric_values(after)
    assert b["execrt:request_success_total{finished_reason=length}"] == 2
    assert b["execrt:prompt_tokens_total{}"] - a["execrt:prompt_tokens_total{}"] == 2
    assert b["execrt:generation_tokens_total{}"] == 6
    assert b["execrt:time_to_first_token_seconds_count{}"] == 2
    assert b["execrt:e2e_request_latency_seconds_count{}"] == 2
    assert b["execrt:inter_token_latency_seconds_count{}"] >= 2
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"execrt:{name}{{}}" in b
    for name in ("num_retractions_total", "prefix_cache_hits_total", "prefix_cache_queries_total"):
        assert b[f"execrt:{name}{{}}"] == 0
    assert b["execrt:engine_steps_total{kind=extend}"] == 2  # the fake: one per request
    assert b["execrt:engine_steps_total{kind=decode}"] >= 3  # 3 tokens each, together
    assert a["execrt:engine_steps_total{kind=extend}"] == 0


def test_an_engine_failure_is_a_500_or_an_error_event(fake) -> None:
    r = call(fake, "POST", "/v1/completions", {"prompt": "qa", "max_tokens": 5})
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "step failed: RuntimeError: boom",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    body = {"prompt": ["qa", "ab"], "max_tokens": 3, "stream": True}
    chunks = events(call(fake, "POST", "/v1/completions", body))
    errors = [c for c in chunks if "error" in c]
    assert [e["error"]["message"] for e in errors] == ["step failed: RuntimeError: boom"]
    ok = [c["choices"][0]["text"] for c in chunks if "choices" in c and c["choices"][0]["index"]]
    assert "".join(ok) == "cde"  # the other prompt's choice is served whole


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_the_model_s_sampling_defaults_fill_only_what_a_request_leaves_out(endpoint) -> None:
    """--generation-config auto (the default): generation_config.json's settings for the
    fields a request omits; a field the request sets keeps its value; none: OpenAI's."""
    client = FakeClient(sampling_defaults=(("temperature", 0.6), ("top_p", 0.95), ("top_k", 20)))
    try:
        prompt = (
            {"prompt": "ab"}
            if "chat" not in endpoint
            else {"messages": [{"role": "user", "content": "ab"}]}
        )
        body = prompt | {"max_tokens": 2, "top_p": 0.5}
        assert call(client, "POST", endpoint, body).status_code == 200
        assert call(client, "POST", endpoint, body, generation_config="none").status_code == 200
        auto, none = (r.sampling for r in client.submitted)
        assert (auto["temperature"], auto["top_p"], auto["top_k"]) == (0.6, 0.5, 20)
        assert "temperature" not in none and "top_k" not in none and none["top_p"] == 0.5
        with pytest.raises(ValueError, match="generation_config 'model' unsupported"):
            create_app(client, generation_config="model")
    finally:
        client.close()
