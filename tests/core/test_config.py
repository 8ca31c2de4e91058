"""RuntimeConfig: validation and precedence file < env < CLI."""

from __future__ import annotations

import pytest

from execrt.core.config import RuntimeConfig
from execrt.core.errors import ConfigError


def test_precedence_file_then_env_then_cli(tmp_path) -> None:
    file = tmp_path / "execrt.toml"
    file.write_text(
        'attention_backend = "triton"\nmax_running_requests = 4\nstrict = false\n'
        'moe_dispatcher = "allreduce"\n'
    )
    env = {"EXECRT_ATTENTION_BACKEND": "flashinfer", "EXECRT_STRICT": "true", "HOME": "/x"}
    cfg = RuntimeConfig.load(
        file=file,
        environ=env,
        cli={"attention_backend": "torch_native", "max_running_requests": None},
    )
    assert cfg.attention_backend == "torch_native"  # CLI beats env and file
    assert cfg.strict is True  # env beats file
    assert cfg.max_running_requests == 4  # file, since CLI gave None
    assert cfg.moe_dispatcher == "allreduce"  # file only
    assert cfg.graph_backend == "auto"  # default


def test_prefix_cache_defaults_to_radix_and_its_switches_come_from_every_source(tmp_path) -> None:
    default = RuntimeConfig.load(environ={})
    assert (default.prefix_cache, default.prefix_cache_force_miss) == ("radix", False)
    env = {"EXECRT_PREFIX_CACHE": "none", "EXECRT_PREFIX_CACHE_FORCE_MISS": "1"}
    from_env = RuntimeConfig.load(environ=env)
    assert (from_env.prefix_cache, from_env.prefix_cache_force_miss) == ("none", True)
    file = tmp_path / "c.toml"
    file.write_text('prefix_cache = "my_lfu"\nprefix_cache_force_miss = true\n')
    cfg = RuntimeConfig.load(file=file, environ={}, cli={"prefix_cache": "radix"})
    assert (cfg.prefix_cache, cfg.prefix_cache_force_miss) == ("radix", True)
    with pytest.raises(ConfigError, match="prefix_cache must be a backend name, .auto. or .none."):
        RuntimeConfig(prefix_cache=" ")
    with pytest.raises(ConfigError, match="prefix_cache_force_miss=1 has type int"):
        RuntimeConfig(prefix_cache_force_miss=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="PREFIX_CACHE_FORCE_MISS|not a valid bool"):
        RuntimeConfig.load(environ={"EXECRT_PREFIX_CACHE_FORCE_MISS": "maybe"})


def test_kv_cache_dtype_comes_from_every_source(tmp_path) -> None:
    assert RuntimeConfig.load(environ={}).kv_cache_dtype == "auto"
    env = {"EXECRT_KV_CACHE_DTYPE": "fp8_e5m2"}
    assert RuntimeConfig.load(environ=env).kv_cache_dtype == "fp8_e5m2"
    file = tmp_path / "c.toml"
    file.write_text('kv_cache_dtype = "fp8_e5m2"\n')
    cfg = RuntimeConfig.load(file=file, environ={}, cli={"kv_cache_dtype": "fp8_e4m3"})
    assert cfg.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(
        ConfigError,
        match=r"\(environment EXECRT_KV_CACHE_DTYPE\): kv_cache_dtype 'fp8' unsupported",
    ):
        RuntimeConfig.load(environ={"EXECRT_KV_CACHE_DTYPE": "fp8"})


def test_toml_execrt_table_is_accepted(tmp_path) -> None:
    file = tmp_path / "c.toml"
    file.write_text('[execrt]\ndevice = "cpu"\n')
    assert RuntimeConfig.load(file=file, environ={}).device == "cpu"


def test_a_toml_file_with_a_utf8_byte_order_mark_reads_like_one_without(tmp_path) -> None:
    file = tmp_path / "windows.toml"
    file.write_bytes(b"\xef\xbb\xbf" + b'device = "cpu"\nmax_running_requests = 3\n')
    cfg = RuntimeConfig.load(file=file, environ={})
    assert (cfg.device, cfg.max_running_requests) == ("cpu", 3)
    middle = tmp_path / "middle.toml"  # only a leading mark is an encoding signature
    middle.write_bytes(b'device = "cpu"\n\xef\xbb\xbf')
    with pytest.raises(ConfigError, match="middle.toml' is not valid TOML"):
        RuntimeConfig.load(file=middle, environ={})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float64"}, "dtype 'float64' unsupported"),
        ({"device": "tpu"}, "device 'tpu' unsupported"),
        ({"max_running_requests": -1}, r"max_running_requests must be >= 0 \(0 = auto\)"),
        ({"max_prefill_tokens": -4}, r"max_prefill_tokens must be >= 0 \(0 = auto\), got -4$"),
        ({"tp_size": 0}, "tp_size must be >= 1, got 0"),
        ({"flashinfer_prefill_backend": "fa4"}, r"'fa4' unsupported \(supported: auto, fa2, fa3\)"),
        ({"attention_backend": ""}, "attention_backend must be a backend name"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction must be in"),
        (
            {"kv_cache_dtype": "bfloat16"},
            r"kv_cache_dtype 'bfloat16' unsupported \(supported: auto, fp8_e4m3, fp8_e5m2\)",
        ),
        ({"seed": -1}, r"seed must be >= 0, got -1$"),
        ({"kv_cache_tokens": -1}, r"kv_cache_tokens must be >= 0 \(0 = auto\), got -1$"),
        (  # it started, then refused every request
            {"context_len": 1},
            r"context_len 1 leaves no room .* \(accepted: 0 = the model's, or at least 2\)$",
        ),
    ],
)
def test_invalid_values_name_key_and_value(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        RuntimeConfig(**kwargs)


def test_unknown_keys_and_unparsable_env_are_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown key.*attention_backnd.*accepted:"):
        RuntimeConfig.load(cli={"attention_backnd": "x"}, environ={})
    with pytest.raises(ConfigError, match="unknown key.*bogus"):
        RuntimeConfig.load(environ={"EXECRT_BOGUS": "1"})
    named = r"environment EXECRT_MAX_RUNNING_REQUESTS\): max_running_requests='many' is not a"
    with pytest.raises(ConfigError, match=named):
        RuntimeConfig.load(environ={"EXECRT_MAX_RUNNING_REQUESTS": "many"})
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = not toml =")
    with pytest.raises(ConfigError, match="not valid TOML"):
        RuntimeConfig.load(file=bad, environ={})
    with pytest.raises(ConfigError, match="not found"):
        RuntimeConfig.load(file=tmp_path / "missing.toml", environ={})
    # Bytes that are not UTF-8, and a path that is not a file, are one-line errors too.
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="binary.toml' is not valid TOML"):
        RuntimeConfig.load(file=binary, environ={})
    with pytest.raises(ConfigError, match="cannot be read: Is a directory"):
        RuntimeConfig.load(file=tmp_path, environ={})


def test_plugin_env_vars_are_not_config_keys() -> None:
    env = {"EXECRT_PLUGINS": "a,b", "EXECRT_DISABLE_PLUGIN_AUTOLOAD": "1", "EXECRT_CACHE_DIR": "/t"}
    assert RuntimeConfig.load(environ=env) == RuntimeConfig()


def test_config_is_frozen() -> None:
    cfg = RuntimeConfig()
    with pytest.raises(AttributeError):
        cfg.strict = True  # type: ignore[misc]
    assert cfg.replace(strict=True).strict is True


@pytest.mark.parametrize(
    "key, value, accepted",
    [
        ("max_running_requests", "abc", "int"),
        ("max_running_requests", 2.5, "int"),
        ("max_running_requests", True, "int"),
        ("max_prefill_tokens", 1.5, "int"),
        ("strict", "no", "bool"),
        ("strict", 1, "bool"),
        ("kv_cache_memory_fraction", "0.5", "float or int"),
        ("kv_cache_memory_fraction", False, "float or int"),
        ("attention_backend", 3, "str"),
        ("model", 7, "str, a path or None"),
    ],
)
def test_wrong_types_from_every_source_are_config_errors(tmp_path, key, value, accepted) -> None:
    message = f"config: {key}={value!r} has type {type(value).__name__} (accepted: {accepted})"
    with pytest.raises(ConfigError) as direct:
        RuntimeConfig(**{key: value})
    with pytest.raises(ConfigError) as replaced:
        RuntimeConfig().replace(**{key: value})
    assert str(direct.value) == str(replaced.value) == message
    toml = {str: f'"{value}"', bool: str(value).lower()}.get(type(value), str(value))
    file = tmp_path / "c.toml"
    file.write_text(f"{key} = {toml}\n")
    with pytest.raises(ConfigError) as loaded:
        RuntimeConfig.load(file=file, environ={})
    assert str(loaded.value) == message.replace("config:", f"config (file {file}):")


def test_bad_values_from_a_file_or_the_environment_name_their_source(tmp_path) -> None:
    file = tmp_path / "execrt.toml"
    file.write_text("max_running_requests = -2\n")
    with pytest.raises(ConfigError) as info:
        RuntimeConfig.load(file=file, environ={})
    assert str(info.value) == (
        f"config (file {file}): max_running_requests must be >= 0 (0 = auto), got -2"
    )
    with pytest.raises(
        ConfigError, match=r"^config \(environment EXECRT_DEVICE\): device 'tpu' unsupported"
    ):
        RuntimeConfig.load(environ={"EXECRT_DEVICE": "tpu"})


def test_numbers_paths_and_none_of_the_right_kind_are_accepted(tmp_path) -> None:
    cfg = RuntimeConfig(model=tmp_path, kv_cache_memory_fraction=0.25)
    assert cfg.model == str(tmp_path) and isinstance(cfg.model, str)
    file = tmp_path / "c.toml"
    file.write_text("kv_cache_memory_fraction = 1\n")  # an int where a float goes
    with pytest.raises(ConfigError, match=r"must be in \[0, 0.95\] \(0 = auto\), got 1.0"):
        RuntimeConfig.load(file=file, environ={})
    assert RuntimeConfig(context_len=0).replace(model=None).model is None


def test_a_backend_gets_only_its_own_keys_from_any_source(tmp_path) -> None:
    env = {"EXECRT_FLASHINFER_PREFILL_BACKEND": "fa2"}
    cfg = RuntimeConfig.load(environ=env)
    assert cfg.backend_options("flashinfer") == {"prefill_backend": "fa2"}
    assert RuntimeConfig().backend_options("flashinfer") == {"prefill_backend": "auto"}
    assert cfg.backend_options("triton") == {
        "decode_merge": "auto",
        "decode_split_target": 0,
        "decode_min_split": 0,
        "decode_order": "longest",
        "decode_prologue": "off",
        "decode_programs": "request",
        "extend_kernel": "auto",
        "decode_fp8_kernel": "auto",
        "decode_wave": "auto",
    }
    assert cfg.backend_options("torch_native") == {}
    file = tmp_path / "c.toml"
    file.write_text('flashinfer_prefill_backend = "fa3"\n')
    assert RuntimeConfig.load(file=file, environ=env).flashinfer_prefill_backend == "fa2"
    assert RuntimeConfig.load(file=file, environ={}).flashinfer_prefill_backend == "fa3"


def test_sizes_default_to_auto() -> None:
    cfg = RuntimeConfig()
    sizes = (cfg.max_running_requests, cfg.max_prefill_tokens, cfg.kv_cache_tokens)
    assert sizes == (0, 0, 0) and cfg.kv_cache_memory_fraction == 0.0


def test_triton_decode_merge_is_checked_and_reaches_only_the_triton_backend() -> None:
    config = RuntimeConfig.load(environ={"EXECRT_TRITON_DECODE_MERGE": "fused"})
    assert config.backend_options("triton") == {
        "decode_merge": "fused",
        "decode_split_target": 0,
        "decode_min_split": 0,
        "decode_order": "longest",
        "decode_prologue": "off",
        "decode_programs": "request",
        "extend_kernel": "auto",
        "decode_fp8_kernel": "auto",
        "decode_wave": "auto",
    }
    assert "decode_merge" not in config.backend_options("flashinfer")
    auto = RuntimeConfig.load(environ={"EXECRT_TRITON_DECODE_MERGE": "auto"})
    assert auto.backend_options("triton")["decode_merge"] == "auto"
    with pytest.raises(
        ConfigError,
        match=r"triton_decode_merge 'last' unsupported \(supported: separate, fused, auto\)",
    ):
        RuntimeConfig(triton_decode_merge="last")


@pytest.mark.parametrize(
    ("option", "value", "default", "bad", "accepted"),
    [
        ("decode_order", "request", "longest", "shortest", "longest, request"),
        ("decode_programs", "sm", "request", "wave", "request, sm"),
    ],
)
def test_a_triton_decode_choice_is_checked_and_reaches_only_the_triton_backend(
    option: str, value: str, default: str, bad: str, accepted: str
) -> None:
    key = f"triton_{option}"
    config = RuntimeConfig.load(environ={f"EXECRT_{key.upper()}": value})
    assert config.backend_options("triton")[option] == value
    assert option not in config.backend_options("flashinfer")
    assert RuntimeConfig().backend_options("triton")[option] == default
    with pytest.raises(ConfigError, match=rf"{key} '{bad}' unsupported \(supported: {accepted}\)"):
        RuntimeConfig(**{key: bad})


def test_triton_decode_split_target_is_an_int_that_reaches_only_the_triton_backend() -> None:
    config = RuntimeConfig.load(environ={"EXECRT_TRITON_DECODE_SPLIT_TARGET": "512"})
    assert config.backend_options("triton")["decode_split_target"] == 512
    assert "decode_split_target" not in config.backend_options("flashinfer")
    with pytest.raises(ConfigError, match=r"triton_decode_split_target must be >= 0.*got -1"):
        RuntimeConfig(triton_decode_split_target=-1)
