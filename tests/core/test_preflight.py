"""Settings checked before any weight loads: fused kernels and the memory the pools need."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from execrt.core import preflight
from execrt.core.config import RuntimeConfig
from execrt.core.errors import ConfigError
from tests.core import fakes

# 4 layers x 2 kv heads x (64 + 64) x 4 bytes = 4 KiB per token in fp32.
SPEC = dataclasses.replace(fakes.SPEC, num_layers=4, head_dim=64, max_position_embeddings=8192)
CPU = torch.device("cpu")
GIB = 1 << 30


def check(monkeypatch: pytest.MonkeyPatch, available: int | None, **config: object) -> None:
    monkeypatch.setattr(preflight, "available_memory", lambda device: available)
    preflight.check_before_load(RuntimeConfig(**config), SPEC, CPU, torch.float32, 8192)


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        (
            {"kv_cache_tokens": 99_999_999_999},
            "config: kv_cache_tokens=99999999999 needs 373.3 TiB for the KV cache (4.0 KiB per "
            "token), before the model's weights, but cpu has 16.0 GiB available; lower "
            "kv_cache_tokens (0 sizes the KV cache to fit)",
        ),
        (
            {"max_running_requests": 100_000_000},
            "config: max_running_requests=100000000 needs 3.0 TiB for the request-to-token "
            "table (100000001 rows x 8192 tokens, int32), before the model's weights, but cpu "
            "has 16.0 GiB available; lower max_running_requests (or context_len)",
        ),
        (
            {"max_prefill_tokens": 10_000_000_000, "max_running_requests": 32},
            "config: max_prefill_tokens=10000000000 needs 223.5 GiB for the step input buffers "
            "(10000000000 tokens x 3, int64), before the model's weights, but cpu has 16.0 GiB "
            "available; lower max_prefill_tokens (longer prompts are prefilled in chunks)",
        ),
    ],
)
def test_pools_larger_than_memory_name_key_bytes_and_memory(monkeypatch, setting, error) -> None:
    with pytest.raises(ConfigError) as info:
        check(monkeypatch, 16 * GIB, **setting)
    assert str(info.value) == error


def test_two_keys_that_overflow_together_are_both_named(monkeypatch) -> None:
    # 1 GiB of request table and 1 GiB of KV cache: each fits in 1.5 GiB, not both.
    rows = (1 * GIB) // (8192 * 4) - 1
    with pytest.raises(ConfigError) as info:
        check(monkeypatch, 3 * GIB // 2, max_running_requests=rows, kv_cache_tokens=GIB // 4096)
    message = str(info.value)  # the KV cache (slot 0 and the free list too) is the larger
    assert message.startswith("config: kv_cache_tokens=262144 needs 1.0 GiB for the KV cache")
    assert f" and max_running_requests={rows} needs 1.0 GiB for the request-to-token" in message
    assert message.endswith(
        "1.5 GiB available; lower kv_cache_tokens (0 sizes the KV cache to fit)"
    )


def test_what_fits_passes_and_an_unknown_amount_is_not_refused(monkeypatch) -> None:
    check(monkeypatch, 16 * GIB, kv_cache_tokens=100_000, max_running_requests=64)
    check(monkeypatch, 16 * GIB)  # the automatic KV cache is sized to fit later
    check(monkeypatch, None, kv_cache_tokens=99_999_999_999)  # the platform does not say


def test_available_memory_reads_the_machine() -> None:
    free = preflight.available_memory(CPU)
    assert free is None or free > 0


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        ({"kv_cache_tokens": 99_999_999_999}, "kv_cache_tokens=99999999999 needs "),
        ({"max_running_requests": 100_000_000}, "max_running_requests=100000000 needs "),
        ({"fused_kernels": "on"}, "kernels: mode 'on' on a CPU device needs the Triton interp"),
    ],
)
def test_the_engine_refuses_before_loading_any_weight(monkeypatch, setting, error) -> None:
    from execrt.engine import Engine
    from execrt.kernels import _triton as triton_switch
    from execrt.models import loader as loader_module

    def no_load(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(loader_module, "load_model", no_load)  # reads the weights
    monkeypatch.setattr(triton_switch, "interpreter_enabled", lambda: False)
    with pytest.raises(ConfigError, match=error):
        Engine("builtin", device="cpu", **setting)


def test_cpu_kv_budget_grows_to_fit_one_full_context_request_within_limits() -> None:
    floor, mib = 256 << 20, 1 << 20
    smollm2 = 30 * 3 * (64 + 64) * 4  # bytes per token in fp32: 8,192 tokens need 360 MiB
    assert preflight.cpu_kv_budget(floor, smollm2, 8192, 16 * GIB) == smollm2 * 8192
    assert preflight.cpu_kv_budget(floor, smollm2, 8192, None) == smollm2 * 8192
    assert preflight.cpu_kv_budget(floor, smollm2, 8192, GIB) == floor  # a quarter is too little
    assert preflight.cpu_kv_budget(floor, smollm2, 2048, 16 * GIB) == floor  # fits already
    huge = 4 * GIB // 8192  # 4 GiB for one request: past the ceiling, the floor stays
    assert preflight.cpu_kv_budget(floor, huge, 8192, 64 * GIB) == floor
    assert preflight.CPU_KV_CEILING_BYTES == 1024 * mib


@pytest.mark.parametrize(("available", "fits"), [(64 * GIB, True), (GIB, False)])
def test_the_automatic_cpu_cache_holds_one_full_context_request(
    monkeypatch, runtime_context, available, fits
) -> None:
    import dataclasses

    from execrt.core import assembly, model_runner
    from execrt.plugins.host import PluginHost
    from tests.core.fakes import SPEC, ToyLoader

    # 600 layers x 2 heads x (8 + 8) x 4 bytes = 75 KiB per token: 4,096 tokens are 300 MiB.
    spec = dataclasses.replace(SPEC, num_layers=600, max_position_embeddings=4096)
    monkeypatch.setattr(assembly, "available_memory", lambda device: available)
    cfg = RuntimeConfig(device="cpu", max_running_requests=1)
    registry = PluginHost(autoload=False).registry
    mr = model_runner.ModelRunner(ToyLoader(spec), cfg, runtime_context, registry)
    size = mr.token_to_kv_pool_allocator.size
    assert size == (4096 if fits else assembly.CPU_KV_BUDGET_BYTES // (600 * 2 * 16 * 4))
    mr.close()
