"""Engine state after an exception inside a step, and badly typed sampling parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from execrt.core.batch import ForwardBatch
from execrt.core.errors import RequestError
from execrt.core.schedule import Req, SamplingParams
from execrt.engine import Engine

PARAMS = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2, 40], [7, 7, 1], [100, 3, 8, 21, 64, 9, 30], [11, 12]]
# 4 requests needing 5..11 KV slots each (prompt + 6 - 1), 24 slots in all: retractions and
# chunked prefills happen, so failures hit waiting, running and mid-prefill requests.
CONFIG = dict(device="cpu", kv_cache_tokens=24, max_running_requests=3, max_prefill_tokens=6)


@pytest.fixture(scope="module")
def dense(checkpoint):
    return checkpoint("dense-tied-hd64")


@pytest.fixture(scope="module")
def fresh_tokens(dense):
    with Engine(dense, **CONFIG) as engine:
        return [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]


def _free(engine: Engine) -> tuple[int, int]:
    return engine.worker.memory.available_slots, engine.worker.memory.available_rows


def _fail_on_call(n: int, original: Callable[..., Any], exc: BaseException) -> Callable[..., Any]:
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise exc
        return original(*args, **kwargs)

    return wrapper


STAGES = {
    # KV reservation, after its slots and rows were allocated.
    "schedule": lambda e, wrap, mp: mp.setattr(
        e.worker.memory.req_to_token_pool,
        "write_tokens",
        wrap(e.worker.memory.req_to_token_pool.write_tokens),
    ),
    "forward_batch": lambda e, wrap, mp: mp.setattr(
        ForwardBatch, "init_new", wrap(ForwardBatch.init_new)
    ),
    "forward": lambda e, wrap, mp: mp.setattr(
        e.worker.model_runner, "forward", wrap(e.worker.model_runner.forward)
    ),
    "sample": lambda e, wrap, mp: mp.setattr(
        e.worker.model_runner, "sample", wrap(e.worker.model_runner.sample)
    ),
    # Result processing, part-way through a batch (some requests already updated).
    "process": lambda e, wrap, mp: mp.setattr(
        e.scheduler, "_check_finished", wrap(e.scheduler._check_finished)
    ),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("call", [1, 6])
def test_an_exception_in_any_stage_leaves_the_engine_clean(
    dense, fresh_tokens, stage: str, call: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    exc: BaseException = KeyboardInterrupt() if stage == "forward" else RuntimeError("boom")
    with Engine(dense, **CONFIG) as engine:
        start = _free(engine)
        submitted: list[Req] = []
        add = engine.scheduler.add
        monkeypatch.setattr(engine.scheduler, "add", lambda r: (submitted.append(r), add(r)))
        with monkeypatch.context() as mp:
            STAGES[stage](engine, lambda f: _fail_on_call(call, f, exc), mp)
            with pytest.raises(type(exc)):
                engine.generate(PROMPTS, PARAMS)
        assert len(submitted) == len(PROMPTS) and all(r.finished for r in submitted)
        unfinished = [r for r in submitted if r.finish_reason.value == "abort"]
        assert unfinished, "the failure came before any request could finish"
        assert all(type(exc).__name__ in r.error for r in unfinished)
        assert not any(engine.worker.memory.holds(r) for r in submitted)
        assert _free(engine) == start
        sched = engine.scheduler
        assert not sched.has_work and sched.finished == []
        again = engine.generate(PROMPTS, PARAMS)
        assert [r.token_ids for r in again] == fresh_tokens
        assert _free(engine) == start


def test_badly_typed_sampling_params_are_errors_and_the_rest_is_served(dense) -> None:
    good = SamplingParams(max_new_tokens=3, temperature=0)
    bad = [
        (SamplingParams(temperature="hot"), "temperature 'hot' has type str (accepted: float"),
        (SamplingParams(top_p=None), "top_p None has type NoneType (accepted: float or int)"),
        (SamplingParams(seed="1"), "seed '1' has type str (accepted: int or None)"),
        (SamplingParams(max_new_tokens=2.0), "max_new_tokens 2.0 has type float (accepted: int)"),
        (SamplingParams(max_new_tokens=True), "max_new_tokens True has type bool"),
        (SamplingParams(ignore_eos="no"), "ignore_eos 'no' has type str (accepted: bool)"),
        (SamplingParams(stop_token_ids=5), "stop_token_ids 5 has type int (accepted: a tuple"),
        (SamplingParams(top_k=1.5), "top_k 1.5 has type float (accepted: int)"),
    ]
    with Engine(dense, device="cpu") as engine:
        start = _free(engine)
        params = (
            [good] + [p for p, _ in bad] + [SamplingParams(max_new_tokens=2, stop_token_ids=[1])]
        )
        out = engine.generate([[1, 2, 3]] * len(params), params)
        assert out[0].error is None and len(out[0].token_ids) == 3
        for result, (_, message) in zip(out[1:-1], bad, strict=True):
            assert result.finish_reason == "error" and result.token_ids == []
            assert message in result.error
        assert out[-1].error is None  # a list of stop ids is accepted
        assert not engine.scheduler.has_work and _free(engine) == start


@pytest.fixture(scope="module")
def builtin():  # type: ignore[no-untyped-def]
    """The built-in model: it has a tokenizer, so prompts may be text."""
    with Engine("builtin", device="cpu") as engine:
        yield engine


def test_text_that_is_not_unicode_is_an_error_result_naming_the_character(builtin) -> None:
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    alone = builtin.generate("Hello", params)
    ok, bad, undecoded = builtin.generate(["Hello", "abc\ud800", "\udcffx"], params)
    assert ok.error is None and ok.token_ids == alone.token_ids  # served as if alone
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error == "text is not valid Unicode: character 3 is the lone surrogate '\\ud800'"
    # An undecodable byte of a command-line argument arrives as a surrogate escape.
    assert (
        undecoded.error == "text is not valid Unicode: character 0 is byte 0xff, which is not UTF-8"
    )
    with pytest.raises(RequestError, match="character 3 is the lone surrogate"):
        builtin.stream("abc\ud800", params)
    assert not builtin.scheduler.has_work


def test_a_failed_engine_releases_its_kv_cache_before_any_garbage_collection(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A corrupt tokenizer.json fails Engine() after the model and KV cache exist: they must
    be gone when the exception arrives (it was +256 MiB per attempt until a GC pass)."""
    import gc
    import shutil
    import weakref

    from execrt.core.errors import ModelLoadError
    from execrt.core.memory import KVCache
    from execrt.models.builtin import default_model

    model = tmp_path / "model"
    shutil.copytree(default_model(explicit_builtin=True).path, model)
    (model / "tokenizer.json").write_text("{not json")
    caches: list[weakref.ref[KVCache]] = []
    real_init = KVCache.__init__

    def recording_init(self: KVCache, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        caches.append(weakref.ref(self))

    monkeypatch.setattr(KVCache, "__init__", recording_init)
    gc.collect()
    gc.disable()
    try:
        # The exception (and its traceback, with the half-built engine's frame) is still
        # held here, as an interactive session holds the last one.
        with pytest.raises(ModelLoadError, match="not a valid tokenizer.json") as info:
            Engine(str(model), device="cpu")
        assert caches, "the failure came before the KV cache was built"
        assert all(ref() is None for ref in caches), "the KV cache outlived the failed Engine()"
        assert info.value is not None
    finally:
        gc.enable()


def test_a_request_larger_than_the_cache_is_told_which_setting_to_raise(dense) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with Engine(dense, device="cpu", kv_cache_tokens=16) as engine:
        result = engine.generate([1, 2, 3, 4, 5, 6, 7, 8], params)
    assert result.finish_reason == "abort"
    assert result.error.endswith(
        "but the whole cache holds 16; lower max_new_tokens, or raise kv_cache_tokens "
        "(EXECRT_KV_CACHE_TOKENS) to at least 19"
    ), result.error


def test_a_context_len_beyond_the_models_is_a_config_error_naming_both(dense) -> None:
    # vLLM and SGLang refuse it at start-up; taking the model's maximum instead would serve
    # less than asked for without a word.
    from execrt.core.errors import ConfigError

    with pytest.raises(ConfigError, match="context_len 257 exceeds the model's max_position_"):
        Engine(dense, device="cpu", context_len=257)
    with Engine(dense, device="cpu", context_len=256) as engine:
        assert engine.worker.limits.context_len == 256


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_path": 123}, "engine: model_path 123 has type int (accepted: a checkpoint"),
        ({"config": {"seed": 1}}, "engine: config has type dict (accepted: a RuntimeConfig"),
        ({"loader": "x"}, "engine: loader has type str (accepted: a ModelLoader"),
        (
            {"attention": "triton"},
            "config (Engine keyword arguments): unknown key(s) attention (accepted: ",
        ),
    ],
)
def test_arguments_of_the_wrong_kind_are_config_errors_naming_them(kwargs, message) -> None:  # type: ignore[no-untyped-def]
    """They failed deep inside, with a TypeError or an AttributeError about a str or a dict,
    or named a ``replace`` the caller never called."""
    from execrt.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        Engine(**kwargs)
    assert str(info.value).startswith(message), str(info.value)
