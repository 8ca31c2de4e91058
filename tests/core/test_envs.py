"""Environment variables: flags, the plugin allow-list, the cache dir, config overrides."""

from __future__ import annotations

import os

import pytest

from execrt.core import envs
from execrt.core.errors import ConfigError


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", " on ", "on\n"])
def test_truthy_flag_values(value: str) -> None:
    assert envs.flag("X", {"X": value})


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", "OFF", " No "])
def test_falsy_flag_values(value: str) -> None:
    assert not envs.flag("X", {"X": value})


@pytest.mark.parametrize("value", ["2", "enabled", "y", "maybe"])
def test_other_flag_values_are_refused_naming_them(value: str) -> None:
    # A typo must not silently mean false (EXECRT_DISABLE_PDL=maybe ran with PDL).
    with pytest.raises(ConfigError, match=f"X='{value}' unsupported; accepted: 1, true"):
        envs.flag("X", {"X": value})


def test_an_unset_flag_is_false_and_os_environ_is_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not envs.flag("X", {})
    monkeypatch.setenv("EXECRT_TEST_FLAG", "yes")
    assert envs.flag("EXECRT_TEST_FLAG")
    monkeypatch.delenv("EXECRT_TEST_FLAG")
    assert not envs.flag("EXECRT_TEST_FLAG")


def test_plugin_allow_list_unset_means_every_plugin() -> None:
    assert envs.plugin_allow_list({}) is None


@pytest.mark.parametrize("value", ["", " ", ",", " , ,"])
def test_an_empty_plugin_allow_list_loads_none(value: str) -> None:
    assert envs.plugin_allow_list({"EXECRT_PLUGINS": value}) == frozenset()


def test_plugin_allow_list_names_are_stripped() -> None:
    allow = envs.plugin_allow_list({"EXECRT_PLUGINS": " alpha , beta-2,,gamma.x ,alpha"})
    assert allow == frozenset({"alpha", "beta-2", "gamma.x"})


def test_cache_dir_from_the_variable_or_under_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    assert envs.cache_dir({"EXECRT_CACHE_DIR": "/data/cache"}) == "/data/cache"
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = os.path.join(str(tmp_path), ".cache", "execrt")
    assert envs.cache_dir({}) == expected
    assert envs.cache_dir({"EXECRT_CACHE_DIR": ""}) == expected  # empty counts as unset


def test_default_model_is_lower_cased_and_auto_when_unset() -> None:
    assert envs.default_model({}) == "auto"
    assert envs.default_model({"EXECRT_DEFAULT_MODEL": ""}) == "auto"
    assert envs.default_model({"EXECRT_DEFAULT_MODEL": " BuiltIn "}) == "builtin"


@pytest.mark.parametrize("value", ["bulitin", "smollm2", "1"])
def test_an_unknown_default_model_is_an_error_not_auto(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        envs.default_model({"EXECRT_DEFAULT_MODEL": value})
    assert f"EXECRT_DEFAULT_MODEL={value!r} unsupported (supported: auto, builtin)" in str(
        info.value
    )


def test_config_overrides_take_prefixed_fields_only() -> None:
    environ = {
        "EXECRT_ATTENTION_BACKEND": "triton",
        "EXECRT_MAX_BATCH_SIZE": "16",
        "EXECRT_MODEL_PATH": "/Models/Qwen3",  # values keep their case
        "EXECRT_STRICT": "",  # empty: not given (it was a ConfigError, "'' is not a bool")
        "EXECRT_SEED": "",
        "EXECRT_DEVICE": " ",  # blank too (it was "device '' unsupported")
        # Named variables that are not config fields:
        "EXECRT_PLUGINS": "a",
        "EXECRT_DISABLE_PLUGIN_AUTOLOAD": "1",
        "EXECRT_CACHE_DIR": "/tmp/x",
        "EXECRT_DEFAULT_MODEL": "builtin",
        # Not the prefix (it is case-sensitive) or not at the start:
        "execrt_dtype": "float16",
        "MY_EXECRT_DTYPE": "float16",
        "PATH": "/bin",
    }
    assert envs.config_overrides(environ) == {
        "attention_backend": "triton",
        "max_batch_size": "16",
        "model_path": "/Models/Qwen3",
    }


def test_non_config_names_every_special_variable() -> None:
    assert envs.NON_CONFIG == {
        "EXECRT_PLUGINS",
        "EXECRT_DISABLE_PLUGIN_AUTOLOAD",
        "EXECRT_CACHE_DIR",
        "EXECRT_DEFAULT_MODEL",
        "EXECRT_DISABLE_PDL",
        "EXECRT_PDL_PREFETCH",
        "EXECRT_PDL_PREFETCH_ROWS",
        "EXECRT_PDL_PRELOAD",
        "EXECRT_FP8_WORDS_OPAQUE",
        "EXECRT_FP8_DECODE_KERNEL",
        "EXECRT_DECODE_MERGE_CHUNK",
        "EXECRT_DEBUG_KV_OWNERSHIP",
    }
    assert all(name.startswith(envs.CONFIG_PREFIX) for name in envs.NON_CONFIG)


def test_config_overrides_read_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXECRT_GRAPH_BACKEND", "none")
    overrides = envs.config_overrides()
    assert overrides["graph_backend"] == "none"
    assert "cache_dir" not in overrides  # conftest sets EXECRT_CACHE_DIR for every test
