"""Prompt log-probabilities (``Engine.submit(prompt_logprobs=k)``): each prompt token's
log-probability given the tokens before it, against transformers on the same checkpoint
(fp32), whatever the chunking of the prefill, the prefix cache's content or the batch's other
requests; and nothing left watched afterwards."""

from __future__ import annotations

import math

import pytest
import torch

from execrt import Engine, SamplingParams
from execrt.core.errors import RequestError
from execrt.engine.client import RequestOutput, TokenLogprobs
from tests.checkpoints import build_hf_model

pytest.importorskip("transformers")

NAME = "dense-tied-hd64"
ONE = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 90, 44, 12, 7, 7, 7, 81], [250, 3, 77], [9] * 13 + [100, 101]]


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    return build_hf_model(NAME)


@pytest.fixture
def engine(checkpoint, plugin_host):  # type: ignore[no-untyped-def]
    with Engine(checkpoint(NAME), device="cpu", plugin_host=plugin_host) as e:
        yield e


def reference(hf, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' log-probabilities of the prompt's rows ``[n - 1, V]`` (row i scores
    token i + 1)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1)


def run(engine: Engine, prompts, top: int | None = 3, **kw):  # type: ignore[no-untyped-def]
    """Submit ``prompts`` together (``top`` None: without prompt log-probabilities), step
    until done; each request's outputs."""
    outputs: dict[int, list[RequestOutput]] = {}
    for i, prompt in enumerate(prompts):
        outputs[i] = []
        engine.submit(prompt, ONE, on_output=outputs[i].append, prompt_logprobs=top, **kw)
    while engine.step():
        pass
    return [outputs[i] for i in range(len(prompts))]


def prompt_logprobs(outputs: list[RequestOutput]) -> list[TokenLogprobs]:
    (first, *rest) = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert rest == [] and outputs[0].prompt_logprobs is first  # once, with the first output
    return first


def assert_matches(hf, prompt: list[int], got: list[TokenLogprobs], top: int) -> None:  # type: ignore[no-untyped-def]
    ref = reference(hf, prompt)
    assert [lp.token_id for lp in got] == prompt[1:]
    for i, lp in enumerate(got):
        assert lp.logprob == pytest.approx(float(ref[i, prompt[i + 1]]), abs=1e-4)
        assert len(lp.top) == top
        best = ref[i].topk(top)
        for (token, value), want, want_id in zip(lp.top, best.values, best.indices, strict=True):
            assert value == pytest.approx(float(want), abs=1e-4)
            # a near-tie may order two ids either way; the value at our id must agree
            assert token == int(want_id) or float(ref[i, token]) == pytest.approx(value, abs=1e-4)


def test_prompt_logprobs_match_transformers_in_one_batch(engine, hf) -> None:
    outs = run(engine, PROMPTS)
    for prompt, outputs in zip(PROMPTS, outs, strict=True):
        got = prompt_logprobs(outputs)
        assert_matches(hf, prompt, got, 3)
        assert sum(math.exp(v) for _, v in got[0].top) <= 1.0 + 1e-6
        assert outputs[-1].finish_reason == "length"
    assert engine.worker._prompts == {}


def test_chunked_prefill_and_a_warm_prefix_cache_give_the_same_values(engine, hf) -> None:
    prompt = PROMPTS[0] + PROMPTS[2]  # 26 tokens
    run(engine, [prompt], top=None)  # the prompt's K/V now in the prefix cache
    engine.scheduler.prompt_logit_tokens = 7  # 4 extends of at most 7 tokens
    (outputs,) = run(engine, [prompt], top=2)
    assert outputs[0].cached_tokens == 0  # the cache was bypassed: every row computed
    assert_matches(hf, prompt, prompt_logprobs(outputs), 2)
    # Asked for nothing, the same prompt reads the cache as before.
    (again,) = run(engine, [prompt], top=None)
    assert again[0].cached_tokens > 0 and again[0].prompt_logprobs is None


def test_mixed_requests_each_get_what_they_asked_for(engine, hf) -> None:
    outputs: list[list[RequestOutput]] = [[], [], []]
    engine.submit(PROMPTS[0], ONE, on_output=outputs[0].append, prompt_logprobs=0)
    engine.submit(PROMPTS[1], ONE, on_output=outputs[1].append)
    engine.submit(PROMPTS[2], ONE, on_output=outputs[2].append, prompt_logprobs=5)
    while engine.step():
        pass
    zero = prompt_logprobs(outputs[0])
    assert all(lp.top == () for lp in zero)
    ref = reference(hf, PROMPTS[0])
    assert [lp.logprob for lp in zero] == pytest.approx(
        [float(ref[i, t]) for i, t in enumerate(PROMPTS[0][1:])], abs=1e-4
    )
    assert all(o.prompt_logprobs is None for o in outputs[1])
    assert_matches(hf, PROMPTS[2], prompt_logprobs(outputs[2]), 5)


def test_a_one_token_prompt_has_none_and_bad_values_are_refused(engine) -> None:
    (outputs,) = run(engine, [[42]])
    assert prompt_logprobs(outputs) == []
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(RequestError, match="prompt_logprobs .* must be an integer in 0..20"):
            engine.submit([1, 2], ONE, prompt_logprobs=bad)  # type: ignore[arg-type]
    assert engine.validate([1, 2], ONE, prompt_logprobs=20) is None
    # A model that does not say it computes prompt rows' logits is refused up front, not in
    # a step that would fail every request beside it.
    model = type(engine.worker.model_runner.model)
    model.computes_logit_rows = False
    engine.__dict__.pop("limits", None)  # read once (a cached property): read it again
    try:
        with pytest.raises(RequestError, match="does not compute the logits of prompt rows"):
            engine.submit([1, 2], ONE, prompt_logprobs=0)
        problem = engine.limits.check([1, 2], {"max_new_tokens": 1}, None, 0)  # the server's
        assert problem is not None and "does not compute the logits" in problem
        assert engine.validate([1, 2], ONE) is None
    finally:
        model.computes_logit_rows = True
        engine.__dict__.pop("limits", None)


def test_an_aborted_request_leaves_nothing_watched(engine) -> None:
    engine.scheduler.prompt_logit_tokens = 4
    outputs: list[RequestOutput] = []
    rid = engine.submit(PROMPTS[2], ONE, on_output=outputs.append, prompt_logprobs=1)
    engine.step()  # the first chunk
    assert engine.worker._prompts
    engine.abort_request(rid)
    while engine.step():
        pass
    assert outputs[-1].finish_reason == "abort" and engine.worker._prompts == {}
    stats = engine.stats()
    assert (stats.requests_running, stats.requests_waiting, stats.kv_usage) == (0, 0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_gpu_prompt_logprobs_match_transformers(checkpoint, plugin_host, hf, dtype) -> None:
    """The same path on CUDA (fused kernels, the LM head's skinny kernel for the rows, a
    pinned copy of their own): fp32 to the CPU reference's 1e-3, bf16 to its rounding."""
    tol = 1e-3 if dtype == "float32" else 0.15
    with Engine(checkpoint(NAME), device="cuda", dtype=dtype, plugin_host=plugin_host) as e:
        e.scheduler.prompt_logit_tokens = 5  # chunks, and rows of two requests in one step
        outs = run(e, PROMPTS)
    for prompt, outputs in zip(PROMPTS, outs, strict=True):
        got = prompt_logprobs(outputs)
        ref = reference(hf, prompt)
        assert [lp.token_id for lp in got] == prompt[1:]
        want = [float(ref[i, t]) for i, t in enumerate(prompt[1:])]
        assert [lp.logprob for lp in got] == pytest.approx(want, abs=tol)
        assert all(len(lp.top) == 3 for lp in got)


def test_a_model_that_ignores_logit_rows_fails_the_request_with_the_reason(
    engine, monkeypatch
) -> None:
    model = engine.worker.model_runner.model
    real = model.forward

    def without_rows(fb, attn):  # type: ignore[no-untyped-def]
        out = real(fb, attn)
        out.row_logits = None
        return out

    monkeypatch.setattr(model, "forward", without_rows)
    outputs: list[RequestOutput] = []
    engine.submit(PROMPTS[0], ONE, on_output=outputs.append, prompt_logprobs=1)
    with pytest.raises(RuntimeError, match="need a model that computes them"):
        while engine.step():  # the failed step raises to its driver, its requests aborted
            pass
    assert outputs[-1].finish_reason in ("error", "abort")
    assert "need a model that computes them" in (outputs[-1].error or "")
    monkeypatch.setattr(model, "forward", real)
    (again,) = run(engine, [PROMPTS[1]])  # the engine goes on serving
    assert len(prompt_logprobs(again)) == len(PROMPTS[1]) - 1
