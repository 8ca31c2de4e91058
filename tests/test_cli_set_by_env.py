"""Where a bad config value came from: a ConfigError found after the config loaded names its
RuntimeConfig keys (``keys``), and ``execrt generate`` / ``execrt serve`` add ``(the environment
sets EXECRT_X=value)`` for a key that a variable set and no flag overrode."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from execrt.cli import main
from execrt.core import preflight
from execrt.core.config import RuntimeConfig
from execrt.core.errors import ConfigError
from execrt.core.parallel import ParallelState
from execrt.engine import Engine
from tests.core import fakes

GENERATE = ["generate", "--model", "builtin", "--device", "cpu", "--max-new-tokens", "2", "hi"]
SERVE = ["serve", "--model", "builtin", "--device", "cpu", "--port", "0"]
TOO_LONG = "context_len 100000000 exceeds the model's max_position_embeddings 2048"


def test_a_plugins_config_error_needs_no_keys_and_keys_survive_a_pickle() -> None:
    plain = ConfigError("myattn: head_dim 80 unsupported (supported: 64, 128)")
    assert plain.keys == () and str(plain).startswith("myattn: head_dim 80")
    keyed = ConfigError("context_len 9 too long", keys=["context_len"])
    assert keyed.keys == ("context_len",) and str(keyed) == "context_len 9 too long"
    back = pickle.loads(pickle.dumps(keyed))  # as from the engine's process
    assert (type(back), back.keys, str(back)) == (ConfigError, ("context_len",), str(keyed))


def test_errors_found_after_the_config_loaded_name_their_keys(monkeypatch) -> None:
    with pytest.raises(ConfigError, match=TOO_LONG) as info:
        Engine(device="cpu", context_len=100_000_000)
    assert info.value.keys == ("context_len",)
    with pytest.raises(ConfigError, match="tp_size 2 needs 2 processes") as info:
        ParallelState().with_layout(2, 0, is_moe=False)
    assert info.value.keys == ("tp_size",)
    with pytest.raises(ConfigError, match="unsupported in a world of 2") as info:
        ParallelState(world_size=2, tp_size=2).with_layout(2, 3, is_moe=True)
    assert info.value.keys == ("tp_size", "ep_size")
    monkeypatch.setattr(preflight, "available_memory", lambda device: 1 << 30)
    spec = dataclasses.replace(fakes.SPEC, max_position_embeddings=8192)
    config = RuntimeConfig(kv_cache_tokens=10**11, max_running_requests=32)
    with pytest.raises(ConfigError, match="kv_cache_tokens=") as info:
        preflight.check_before_load(config, spec, torch.device("cpu"), torch.float32, 8192)
    assert info.value.keys == ("kv_cache_tokens",)


def test_an_error_of_loading_the_config_names_its_source_itself() -> None:
    with pytest.raises(ConfigError) as info:
        RuntimeConfig.load(environ={"EXECRT_MAX_RUNNING_REQUESTS": "-3"})
    assert str(info.value).startswith("config (environment EXECRT_MAX_RUNNING_REQUESTS): ")
    assert info.value.keys == ()  # nothing for a front end to add
    with pytest.raises(ConfigError) as info:
        RuntimeConfig(max_running_requests=-3)  # Engine(**kw), replace(): no source to say
    assert info.value.keys == ("max_running_requests",)


def test_generate_says_which_variable_set_a_value_the_model_refuses(monkeypatch, capsys) -> None:
    monkeypatch.setenv("EXECRT_CONTEXT_LEN", "100000000")
    assert main(GENERATE) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"execrt: error: {TOO_LONG}" in err, err
    assert err.rstrip().endswith("(the environment sets EXECRT_CONTEXT_LEN=100000000)"), err


def test_a_flag_over_the_variable_is_not_blamed_on_the_environment(monkeypatch, capsys) -> None:
    monkeypatch.setenv("EXECRT_TP_SIZE", "3")
    assert main([*GENERATE, "--tp", "2"]) == 2  # the flag's 2, not the variable's 3
    err = capsys.readouterr().err
    assert "tp_size 2 needs 2 processes" in err and "environment" not in err, err
    monkeypatch.setenv("EXECRT_TP_SIZE", "2")
    assert main(GENERATE) == 2
    assert capsys.readouterr().err.rstrip().endswith("(the environment sets EXECRT_TP_SIZE=2)")
    monkeypatch.delenv("EXECRT_TP_SIZE")
    monkeypatch.setenv("EXECRT_PREFIX_CACHE", "bogus")  # the same name by flag and variable
    assert main([*GENERATE, "--prefix-cache", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "prefix_cache backend 'bogus' unavailable" in err and "environment" not in err, err


def test_a_variable_refused_while_loading_the_config_is_said_once(monkeypatch, capsys) -> None:
    monkeypatch.setenv("EXECRT_MAX_RUNNING_REQUESTS", "-3")
    assert main(GENERATE) == 2
    err = capsys.readouterr().err
    assert err.count("EXECRT_MAX_RUNNING_REQUESTS") == 1 and "the environment sets" not in err


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_serve_says_it_too_when_the_model_fails_to_load(engine, monkeypatch, capsys) -> None:
    for package in ("fastapi", "uvicorn"):  # execrt[serve]; execrt serve refuses without them
        pytest.importorskip(package, reason=f"execrt serve needs {package}")
    monkeypatch.setenv("EXECRT_CONTEXT_LEN", "100000000")
    assert main([*SERVE, "--engine", engine]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"execrt: error: {TOO_LONG}" in err, err
    assert err.rstrip().endswith("(the environment sets EXECRT_CONTEXT_LEN=100000000)"), err
