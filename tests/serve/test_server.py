"""The real server: the openai client against uvicorn on 127.0.0.1 (port 0) over the built-in
model on CPU, with the engine on a thread of this process and in a process of its own. Random
weights, so every answer is compared with Engine.generate: on the serving engine itself (called
from this thread while the engine thread serves), or on an engine of the same checkpoint here
when the serving one runs in its own process."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import orjson
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from execrt import Engine, SamplingParams
from execrt.engine import json_grammar as J
from execrt.engine.client import EngineClient, EngineStats
from execrt.engine.process import ProcessEngineClient
from execrt.engine.threaded import ThreadedEngineClient
from execrt.models.builtin import builtin_model_path
from execrt.serve.protocol import Plan
from execrt.serve.server import UvicornServer, bind
from tests.serve.http import abandon_stream

OBJ = J.JSON_OBJECT  # JSON mode's grammar: any object

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Served:
    url: str
    engine: Engine  # the serving engine (thread), else one of the same checkpoint here
    client: EngineClient
    runner: str  # "thread" or "process"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def stats(self) -> EngineStats:
        """The serving engine's stats (through the client: the engine may be elsewhere)."""
        return self.client.stats()

    def same_process(self) -> None:
        """Skip a test that reaches into the serving engine (it runs elsewhere)."""
        if self.runner != "thread":
            pytest.skip("patches the serving engine, which runs in another process")


def _build(path: str, built: list[Engine] | None = None) -> Engine:
    # One torch thread: idle ones spin for their turn, and the engine's process shares the
    # cores with the server and the clients here.
    torch.set_num_threads(1)
    engine = Engine(path, device="cpu", max_running_requests=64)
    if built is not None:
        built.append(engine)
    return engine


@pytest.fixture(scope="module", params=["thread", "process"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    # The built-in checkpoint with a chat template, so that chat is served too.
    path = tmp_path_factory.mktemp("builtin-chat")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(os.path.join(builtin_model_path(), name), path / name)
    config = {"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    engines: list[Engine] = []
    client: EngineClient
    if request.param == "thread":
        client = ThreadedEngineClient(functools.partial(_build, str(path), engines), name="builtin")
    else:
        client = ProcessEngineClient(functools.partial(_build, str(path)), name="builtin")
    server = UvicornServer(client, bind("127.0.0.1", 0)).start()
    assert client.wait_ready(120), client.load_error()
    reference = engines[0] if engines else _build(str(path))
    yield Served(server.url, reference, client, request.param)
    server.stop()
    if request.param == "thread":
        assert reference._closed  # the app's shutdown closed the client and the engine
    else:
        reference.close()
        assert isinstance(client, ProcessEngineClient)  # the app's shutdown stopped the engine
        assert client.process.exitcode == 0 and client.summary is not None


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, **kw)  # type: ignore[arg-type]


def test_completions_streamed_and_not_match_the_engine(served) -> None:
    api = served.openai()
    prompts = ["Hello there", "ünïcode ✓ 日本"]
    expected = served.engine.generate(prompts, greedy(12))
    api.completions.create(model="builtin", prompt=prompts, max_tokens=1)  # caches the prompts
    got = api.completions.create(model="builtin", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == [r.text for r in expected]
    assert [c.finish_reason for c in got.choices] == [r.finish_reason for r in expected]
    tok = served.engine.tokenizer
    assert got.usage.prompt_tokens == sum(len(tok.encode(p).ids) for p in prompts)
    assert got.usage.completion_tokens == sum(len(r.token_ids) for r in expected)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    # The first call cached both prompts: all but each one's last token hit.
    cached = got.usage.prompt_tokens - len(prompts)
    assert got.usage.prompt_tokens_details.cached_tokens == cached
    stream = api.completions.create(
        model="builtin",
        prompt=prompts[1],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[1].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        expected[1].token_ids
    )
    assert chunks[-1].usage.prompt_tokens == len(tok.encode(prompts[1]).ids)


def test_chat_streamed_and_not_match_the_engine(served) -> None:
    api = served.openai()
    messages = [{"role": "user", "content": "Say something"}]
    ids, params = served.engine.chat_request(messages, greedy(10))
    expected = served.engine.generate(ids, params)
    got = api.chat.completions.create(
        model="builtin", messages=messages, max_completion_tokens=10, temperature=0
    )
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ids)
    chunks = list(
        api.chat.completions.create(
            model="builtin", messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].delta.content is None
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_n_choices_with_a_seed_are_the_engine_with_derived_seeds(served) -> None:
    api = served.openai()
    got = api.completions.create(
        model="builtin", prompt="seeded", max_tokens=8, temperature=1.0, n=3, seed=5
    )
    seeds = [Plan.choice_seed(_plan(5), i) for i in range(3)]
    expected = served.engine.generate(
        ["seeded"] * 3, [SamplingParams(max_new_tokens=8, seed=s) for s in seeds]
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [r.text for r in expected]
    assert len({c.text for c in got.choices}) > 1  # distinct seeds, distinct samples
    one = api.completions.create(model="builtin", prompt="seeded", max_tokens=8, seed=5)
    assert one.choices[0].text == got.choices[0].text  # choice 0 takes the seed itself


def _plan(seed: int) -> Plan:
    return Plan("completion", None, [], 1, False, False, (), {}, seed, None)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_never_appears_and_ends_the_request(served, stream) -> None:
    api = served.openai()
    full = served.engine.generate("Hello", greedy(24, ignore_eos=True)).text
    start = next(i for i in range(3, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    expected = full[: full.find(stop)]
    baseline = reclaimable(served.stats())
    kw = dict(model="builtin", prompt="Hello", max_tokens=24, temperature=0, stop=[stop])
    kw["extra_body"] = {"ignore_eos": True}
    if stream:
        chunks = list(api.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        choice = api.completions.create(**kw).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert (text, reason) == (expected, "stop") and stop not in text
    wait_until(lambda: reclaimable(served.stats()) == baseline)


def test_engine_validation_is_a_400_with_the_field(served) -> None:
    api = served.openai()
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model="builtin", messages=[{"role": "user", "content": "x"}], max_completion_tokens=0
        )
    error = info.value.body
    assert error["param"] == "max_completion_tokens"
    assert error["message"] == "max_completion_tokens 0 must be an integer >= 1"
    with pytest.raises(openai.BadRequestError) as info:  # chat's older name, named as sent
        api.chat.completions.create(
            model="builtin", messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
    assert info.value.body["param"] == "max_tokens"
    assert info.value.body["message"] == "max_tokens 0 must be an integer >= 1"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="builtin", prompt=[7] * 2048, max_tokens=1)
    assert "leaves no room in the context of 2048" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="builtin", prompt="x", presence_penalty=3.0)
    assert info.value.body["param"] == "presence_penalty"
    assert info.value.body["message"] == "presence_penalty 3.0 must be in [-2, 2]"
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model="builtin",
            messages=[{"role": "user", "content": "x"}],
            max_completion_tokens=2,
            extra_body={"min_tokens": 5},
        )
    error = info.value.body
    assert error["param"] == "min_tokens"
    assert error["message"] == "min_tokens 5 must be in 0..max_completion_tokens (2)"


def test_a_failed_step_is_a_500_and_the_server_goes_on(served, monkeypatch) -> None:
    served.same_process()
    worker = served.engine.worker
    real = worker.forward_batch_generation

    def fail(batch):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(worker, "forward_batch_generation", real)  # once
        raise RuntimeError("device lost")

    monkeypatch.setattr(worker, "forward_batch_generation", fail)
    with pytest.raises(openai.InternalServerError) as info:
        served.openai().completions.create(model="builtin", prompt="x", max_tokens=3)
    assert info.value.body["message"] == "step failed: RuntimeError: device lost"
    again = served.openai().completions.create(model="builtin", prompt="x", max_tokens=3)
    assert again.choices[0].finish_reason in ("length", "stop")
    assert served.client.ready() and not served.engine.has_work


def test_flush_cache_runs_between_steps_and_empties_the_prefix_cache(served, monkeypatch) -> None:
    served.same_process()
    served.engine.generate("fill the prefix cache", greedy(4))
    assert served.engine.stats().kv_slots_cached > 0
    calls: list[str] = []
    flush = served.engine.flush_cache

    def recorded() -> int:
        calls.append(threading.current_thread().name)
        return flush()

    monkeypatch.setattr(served.engine, "flush_cache", recorded)
    assert httpx.post(served.url + "/flush_cache").json() == {"flushed": True}
    assert calls == ["execrt-engine"]  # on the engine thread, between its steps
    assert served.engine.stats().kv_slots_cached == 0
    served.engine.generate("fill it again", greedy(4))
    monkeypatch.setattr(served.engine, "flush_cache", lambda: 0)  # as if requests read it all
    assert httpx.post(served.url + "/flush_cache").status_code == 409
    monkeypatch.setattr(served.engine.worker.memory, "prefix_cache", None)
    r = httpx.post(served.url + "/flush_cache")
    assert r.status_code == 501 and "no prefix cache" in r.json()["error"]["message"]


def test_flush_cache_empties_the_serving_engines_prefix_cache(served) -> None:
    served.openai().completions.create(model="builtin", prompt="cache me", max_tokens=2)
    wait_until(lambda: served.stats().kv_slots_cached > 0)
    assert httpx.post(served.url + "/flush_cache").json() == {"flushed": True}
    wait_until(lambda: served.stats().kv_slots_cached == 0)
    assert served.stats().kv_slots_free == served.stats().kv_slots_total


def reclaimable(s: EngineStats) -> int:
    """KV slots free or held by the prefix cache only (a request could take them)."""
    return s.kv_slots_free + s.kv_slots_cached


def wait_until(condition, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_disconnect_mid_stream_aborts_and_frees_the_slots(served) -> None:
    baseline = served.stats()
    body = {"prompt": "long", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    steps: list[int] = []
    if served.runner == "thread":
        real = served.engine.abort_requests

        def abort(rids, reason: str = "aborted") -> None:  # type: ignore[no-untyped-def]
            steps.append(served.engine.stats().steps)  # when the server gives up on it
            real(rids, reason)

        served.engine.abort_requests = abort  # type: ignore[method-assign]
    try:
        abandon_stream(served.url, body, chunks=3)
        # Closed after three chunks of 1000: the request is aborted, its slots come back
        # (its prompt's stay in the prefix cache, evictable).
        wait_until(lambda: reclaimable(served.stats()) == reclaimable(baseline))
    finally:
        served.engine.__dict__.pop("abort_requests", None)
    after = served.stats()
    assert after.requests_running == 0 and after.requests_waiting == 0
    assert after.steps < baseline.steps + 50  # aborted long before its 1000 tokens
    if served.runner == "thread":
        assert len(steps) == 1 and steps[0] < baseline.steps + 50
        assert not served.engine.has_work


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.type in ("counter", "histogram"):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return out


def test_metrics_counters_only_grow(served) -> None:
    before = counters(served.url)
    served.openai().completions.create(model="builtin", prompt="m", max_tokens=3)
    after = counters(served.url)
    assert set(before) <= set(after)
    assert all(after[k] >= v for k, v in before.items())
    total = "execrt:generation_tokens_total{}"
    assert after[total] >= before.get(total, 0) + 1


def test_256_concurrent_streams_all_match_the_engine(served) -> None:
    prompts = [f"request {i}" for i in range(256)]
    expected = served.engine.generate(prompts, greedy(4, ignore_eos=True))

    async def one(api: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await api.completions.create(
            model="builtin",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them() -> list[str | BaseException]:
        api = openai.AsyncOpenAI(
            base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )
        async with api:
            return await asyncio.gather(*(one(api, p) for p in prompts), return_exceptions=True)

    got = asyncio.run(all_of_them())
    errors = [g for g in got if isinstance(g, BaseException)]
    assert errors == []
    assert got == [r.text for r in expected]
    wait_until(lambda: served.stats().requests_running == 0)


def test_echo_scores_a_prompt_as_lm_eval_asks(served) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 0 (or 1,
    the last token then dropped). The prompt is a greedy continuation, so each scored token
    is the most likely one, with the log-probability its decode step gave it."""
    api = served.openai()
    prompt = served.engine.tokenizer.encode("Hello there").ids
    made = api.completions.create(
        model="builtin", prompt=prompt, max_tokens=4, temperature=0, logprobs=1
    ).choices[0]
    assert made.logprobs is not None
    ids = prompt + served.engine.generate(prompt, greedy(4)).token_ids[:3]  # made's tokens
    for max_tokens in (0, 1):
        choice = api.completions.create(
            model="builtin", prompt=ids, max_tokens=max_tokens, logprobs=1, echo=True
        ).choices[0]
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == len(ids) + max_tokens and lp.token_logprobs[0] is None
        scored = lp.token_logprobs[len(prompt) : len(ids)]
        assert scored == pytest.approx(made.logprobs.token_logprobs[:3], abs=1e-4)
        scored_tops = lp.top_logprobs[len(prompt) : len(ids)]
        for token, top in zip(lp.tokens[len(prompt) : len(ids)], scored_tops, strict=True):
            assert max(top, key=top.get) == token  # greedy: each token is the best
        # lm-eval's is_greedy test compares the floats exactly
        assert all(v == max(t.values()) for v, t in zip(scored, scored_tops, strict=True))
        assert choice.text.startswith(served.engine.tokenizer.decode(prompt))
    with pytest.raises(openai.BadRequestError) as info:  # 0 without echo: what is accepted
        api.completions.create(model="builtin", prompt=ids, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    assert (
        "0 must be an integer >= 1 (0 with echo: true scores the prompt)"
        in (info.value.body["message"])
    )
    assert served.stats().requests_running == 0


def test_tokenizer_endpoints_serve_lm_evals_remote_tokenizer(served) -> None:
    """What lm-evaluation-harness's RemoteTokenizer asks: /tokenizer_info with eos_token,
    /tokenize without special tokens, /detokenize; the ids are those completions use."""
    http = httpx.Client(base_url=served.url, timeout=30)
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == TEMPLATE
    assert info["model_max_length"] == served.engine.worker.limits.context_len
    tok = served.engine.tokenizer
    text = "Hello there, ünïcode ✓"
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert ids["tokens"] == tok.encode(text, add_special_tokens=False).ids
    assert ids["count"] == len(ids["tokens"])
    back = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert back == tok.decode(ids["tokens"], skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    used = served.openai().chat.completions.create(
        model="builtin", messages=messages, max_tokens=1
    )  # fmt: skip
    assert used.usage is not None and used.usage.prompt_tokens == len(chat_ids)
    assert chat_ids == served.engine.chat_request(messages)[0]
    http.close()


def test_logit_bias_reaches_the_sampler_and_bad_ones_are_400s(served) -> None:
    api = served.openai()
    tok = served.engine.tokenizer
    got = api.completions.create(
        model="builtin", prompt="Hello", max_tokens=3, temperature=0, logit_bias={"42": 100}
    )
    assert got.choices[0].text == tok.decode([42, 42, 42], skip_special_tokens=True)
    vocab = served.engine.model_config.vocab_size
    for bias, needle in [
        ({str(vocab): 1}, f"logit_bias token id {vocab} out of range"),
        ({"42": 500}, "biases in [-100, 100]"),
        ({"x": 1}, "must map token ids"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            api.completions.create(model="builtin", prompt="Hello", max_tokens=1, logit_bias=bias)
        body = info.value.body
        assert needle in body["message"] and body["param"] == "logit_bias", body
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(
            model="builtin", prompt="Hello", max_tokens=1, extra_body={"stop_token_ids": [-1]}
        )
    body = info.value.body
    assert "stop_token_ids token id -1 unsupported" in body["message"], body
    assert body["param"] == "stop_token_ids", body


def test_penalties_min_p_and_min_tokens_reach_the_engine(served) -> None:
    """vLLM's and SGLang's sampling fields (the OpenAI penalties at the top level, the others
    as the openai client's ``extra_body``) give what the engine gives for the same params."""
    api = served.openai()
    params = greedy(10, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, seed=4, min_p=0.2, min_tokens=10)
    expected = served.engine.generate(["Hello there", "Hello there"], [params, sampled])
    assert expected[0].token_ids != served.engine.generate("Hello there", greedy(10)).token_ids
    fields = [
        {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"temperature": 0.9, "seed": 4},
    ]
    extra = [{"repetition_penalty": 1.3}, {"min_p": 0.2, "min_tokens": 10}]
    for kw, more, want in zip(fields, extra, expected, strict=True):
        got = api.completions.create(
            model="builtin", prompt="Hello there", max_tokens=10, extra_body=more, **kw
        )
        assert got.choices[0].text == want.text
    assert got.usage is not None and got.usage.completion_tokens == 10  # min_tokens


def test_stop_strings_wait_for_min_tokens(served) -> None:
    """A stop string that ends in the text of the first ``min_tokens - 1`` tokens is not a
    stop; one that ends in the ``min_tokens``-th token's or later is, wherever it begins."""
    api = served.openai()
    free = served.engine.generate("Hello", greedy(8, ignore_eos=True))
    pieces = [served.engine.tokenizer.decode([t]) for t in free.token_ids]
    stop = pieces[0]
    assert stop, pieces
    plain = api.completions.create(
        model="builtin", prompt="Hello", max_tokens=8, temperature=0, stop=[stop]
    )
    assert plain.choices[0].text == "" and plain.choices[0].finish_reason == "stop"
    held = api.completions.create(
        model="builtin",
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        stop=[stop],
        extra_body={"min_tokens": 3, "ignore_eos": True},
    )
    text = held.choices[0].text
    # A stop counts where it ends after the first two tokens' text.
    full, free = "".join(pieces), len(pieces[0] + pieces[1])
    cut = full.find(stop, max(0, free - len(stop) + 1))
    assert cut != 0  # the stop that ends in the first token's text is not one
    assert text == (full if cut < 0 else full[:cut])


def test_tools_for_a_template_without_them_are_refused_and_none_is_fine(served) -> None:
    api = served.openai()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model="builtin", messages=messages, tools=tools, max_tokens=2)
    assert info.value.body["param"] == "tools"
    assert "chat template does not render tools" in info.value.body["message"]
    got = api.chat.completions.create(
        model="builtin", messages=messages, tools=tools, tool_choice="none", max_tokens=2
    )
    assert got.choices[0].message.tool_calls is None and got.choices[0].finish_reason == "length"


def test_json_mode_answers_are_json_objects_and_schemas_are_refused(served) -> None:
    """``response_format={"type": "json_object"}`` (chat and completions, whole and streamed):
    the engine's tokens for the same params, every answer a prefix of one JSON object and the
    ones that stopped a whole one; ``json_schema`` and odd values are 400s naming the field."""
    api = served.openai()
    tok = served.engine.tokenizer
    quote, close = (tok.encode(c, add_special_tokens=False).ids[0] for c in ('"', "}"))
    bias = {quote: 9.0, close: 7.0}  # random weights: close what is opened
    params = SamplingParams(
        max_new_tokens=40, temperature=1.0, seed=3, logit_bias=bias, response_format="json_object"
    )
    (want,) = served.engine.generate(["Hello there"], params)
    fmt = {"type": "json_object"}
    got = api.completions.create(
        model="builtin", prompt="Hello there", max_tokens=40, temperature=1.0, seed=3,
        logit_bias={str(k): v for k, v in bias.items()}, extra_body={"response_format": fmt},
    )  # fmt: skip
    assert got.choices[0].text == want.text
    messages = [{"role": "user", "content": "Give me JSON"}]
    texts = []
    for seed in range(4):
        kw = dict(
            model="builtin", messages=messages, max_completion_tokens=40, seed=seed,
            logit_bias={str(k): v for k, v in bias.items()}, response_format=fmt,
        )  # fmt: skip
        whole = api.chat.completions.create(**kw)  # type: ignore[call-overload]
        streamed = api.chat.completions.create(stream=True, **kw)  # type: ignore[call-overload]
        text = whole.choices[0].message.content or ""
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
        assert OBJ.walk(OBJ.start, text.encode()) is not None, text
        if whole.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            texts.append(text)
    assert texts, "at least one answer completed its object"
    for value, needle in [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}},
            "json_schema: the root must be an object",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "string", "format": "date"}}}}},
            "keyword 'format'",
        ),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name must be a non-empty"),
        ({"type": "yaml"}, "response_format {'type': 'yaml'} unsupported"),
        ("json", "unsupported"),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            api.chat.completions.create(
                model="builtin", messages=messages, max_completion_tokens=4, response_format=value
            )  # type: ignore[call-overload]
        assert needle in info.value.message and info.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(
            model="builtin", prompt="a", max_tokens=4,
            extra_body={"min_tokens": 2, "response_format": fmt},
        )  # fmt: skip
    assert "min_tokens 2 unsupported with response_format" in info.value.message


def test_structured_outputs_follow_the_schema(served) -> None:
    """``response_format`` ``json_schema`` through the openai client: the engine's tokens for
    the same params, and every answer that stopped an instance of the schema."""
    from tests.engine.test_json_mode import SCHEMA
    from tests.engine.test_json_schema import valid

    api = served.openai()
    tok = served.engine.tokenizer
    ids = {c: tok.encode(c, add_special_tokens=False).ids[0] for c in ('"', "}", ",", " ", "\n")}
    bias = {ids['"']: 6.0, ids["}"]: 6.0, ids[","]: 6.0, ids[" "]: -100.0, ids["\n"]: -100.0}
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    text = orjson.dumps(SCHEMA).decode()
    params = SamplingParams(
        max_new_tokens=48, temperature=1.0, seed=1, logit_bias=bias,
        response_format="json_schema", json_schema=text,
    )  # fmt: skip
    (want,) = served.engine.generate(["Hello there"], params)
    got = api.completions.create(
        model="builtin", prompt="Hello there", max_tokens=48, temperature=1.0, seed=1,
        logit_bias={str(k): v for k, v in bias.items()}, extra_body={"response_format": fmt},
    )  # fmt: skip
    assert got.choices[0].text == want.text
    stopped = 0
    for seed in range(4):
        answer = api.chat.completions.create(
            model="builtin", messages=[{"role": "user", "content": "Pick"}], seed=seed,
            max_completion_tokens=48, logit_bias={str(k): v for k, v in bias.items()},
            response_format=fmt,  # type: ignore[arg-type]
        ).choices[0]  # fmt: skip
        if answer.finish_reason == "stop":
            value = json.loads(answer.message.content or "")
            assert valid(value, SCHEMA, SCHEMA), value
            assert list(value) == [k for k in SCHEMA["properties"] if k in value]  # in order
            stopped += 1
    assert stopped
