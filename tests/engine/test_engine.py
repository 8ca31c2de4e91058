"""Engine: the public API on the built-in checkpoint, results and resource release."""

from __future__ import annotations

import pytest

from execrt import Engine, SamplingParams
from execrt.core.errors import ConfigError


@pytest.fixture(scope="module")
def engine():
    with Engine(device="cpu") as e:
        yield e


def test_builtin_model_generates_text(engine) -> None:
    result = engine.generate("Hello, execrt", SamplingParams(max_new_tokens=8, temperature=0))
    assert len(result.token_ids) == 8 and isinstance(result.text, str)
    assert result.prompt_token_ids == engine.tokenizer.encode("Hello, execrt").ids
    assert result.finish_reason == "length"
    assert engine.tokenizer.decode(result.token_ids, skip_special_tokens=True) == result.text


def test_lists_text_and_ids_and_per_request_params(engine) -> None:
    out = engine.generate(
        ["a", [10, 20, 30]],
        [SamplingParams(max_new_tokens=3, temperature=0), SamplingParams(max_new_tokens=5, seed=7)],
    )
    assert [len(r.token_ids) for r in out] == [3, 5]
    again = engine.generate([10, 20, 30], SamplingParams(max_new_tokens=5, seed=7))
    assert again.token_ids == out[1].token_ids  # seeded sampling is reproducible
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        engine.generate(["x"], [SamplingParams(), SamplingParams()])


def test_resolution_report_names_the_choices(engine) -> None:
    text = engine.resolution.describe()
    assert "attention: requested 'auto' -> torch_native" in text
    assert "moe_dispatch: requested 'auto' -> allreduce" in text


def test_close_releases_every_resource_and_blocks_reuse() -> None:
    e = Engine(device="cpu")
    assert e.context.open_resources()  # kv cache, backends, dispatcher
    assert e.close() == []
    assert e.context.open_resources() == []
    assert e.close() == []
    with pytest.raises(RuntimeError, match="after close"):
        e.generate("x")


def test_bad_model_path_and_bad_config_are_clear(tmp_path) -> None:
    with pytest.raises(ConfigError, match="is not a directory"):
        Engine(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="unknown key.*colour"):
        Engine(colour="blue")


def test_engine_config_precedence_env_then_kwargs(monkeypatch) -> None:
    from execrt.core.config import RuntimeConfig

    monkeypatch.setenv("EXECRT_MAX_RUNNING_REQUESTS", "3")
    monkeypatch.setenv("EXECRT_KV_CACHE_TOKENS", "64")
    with Engine(device="cpu") as e:  # environment < keyword arguments
        assert (e.config.max_running_requests, e.config.kv_cache_tokens) == (3, 64)
        assert e.worker.model_runner.req_to_token_pool.size == 3
    with Engine(device="cpu", max_running_requests=5) as e:
        assert (e.config.max_running_requests, e.config.kv_cache_tokens) == (5, 64)
    with Engine(config=RuntimeConfig(device="cpu")) as e:  # an explicit config is used as is
        assert e.config.max_running_requests == 32
    monkeypatch.setenv("EXECRT_MAX_RUNNING_REQUESTS", "many")
    with pytest.raises(ConfigError, match="max_running_requests='many' is not a valid int"):
        Engine(device="cpu")


@pytest.mark.parametrize(
    "kwargs", [{"max_running_requests": "abc"}, {"strict": "no"}, {"max_prefill_tokens": 1.5}]
)
def test_wrongly_typed_engine_kwargs_fail_before_any_model_loads(kwargs, monkeypatch) -> None:
    import execrt.engine.engine as engine_module

    def no_load(*args, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_module, "TpModelWorker", no_load)
    ((key, value),) = kwargs.items()
    with pytest.raises(ConfigError, match=f"config: {key}={value!r} has type"):
        Engine(device="cpu", **kwargs)
