"""ModelRunner with a toy loader: dtype and device resolution, KV sizing, backends, close."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from execrt.core import assembly
from execrt.core.assembly import CPU_KV_BUDGET_BYTES, resolve_device, resolve_dtype
from execrt.core.batch import ForwardBatch
from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.errors import BackendUnavailableError, ConfigError, ResourceError
from execrt.core.interfaces import AttentionCapabilities
from execrt.core.kv_memory import KVMemory
from execrt.core.memory import KVCache
from execrt.core.model_runner import ModelRunner
from execrt.core.plugins import hookimpl
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.core.staging import HostToDevice
from execrt.plugins.host import PluginHost
from tests.core.fakes import SPEC, ToyLoader

CPU = torch.device("cpu")


def runner(context: RuntimeContext, loader: ToyLoader | None = None, **config) -> ModelRunner:  # type: ignore[no-untyped-def]
    cfg = RuntimeConfig(**({"device": "cpu"} | config))
    return ModelRunner(loader or ToyLoader(), cfg, context, PluginHost(autoload=False).registry)


def test_resolve_dtype_follows_the_checkpoint_on_cuda_and_fp32_on_cpu() -> None:
    assert resolve_dtype("auto", torch.bfloat16, CPU) == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.bfloat16, CPU) == torch.float16


def test_resolve_device() -> None:
    assert resolve_device("cpu") == CPU
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="'cuda:1' requested but no CUDA device"):
            resolve_device("cuda:1")


def test_runner_builds_pools_backends_and_loads_through_the_loader(runtime_context) -> None:  # type: ignore[no-untyped-def]
    loader = ToyLoader()
    mr = runner(runtime_context, loader, max_running_requests=3, kv_cache_tokens=40)
    (request,) = loader.requests
    assert request.device == CPU and request.dtype == torch.float32 and request.dispatcher is None
    assert request.max_positions == SPEC.max_position_embeddings == mr.context_len
    assert mr.req_to_token_pool.req_to_token.shape == (4, 64)
    assert mr.token_to_kv_pool_allocator.size == 40
    assert mr.kv_cache.k_buffers[0].shape == (41, SPEC.num_kv_heads, SPEC.head_dim)
    assert type(mr.attn_backend).__name__ == "TorchNativeAttnBackend"
    kinds = {r.kind: r for r in mr.resolution.resolutions}
    assert (
        kinds["attention"].chosen == "torch_native" and kinds["moe_dispatch"].note == "dense model"
    )
    assert runtime_context.get("kv_cache") is mr.kv_cache
    mr.close()
    mr.close()  # idempotent
    assert not runtime_context.has("kv_cache") and not runtime_context.has("attn_backend")


def test_context_len_is_the_models_or_less(runtime_context) -> None:  # type: ignore[no-untyped-def]
    assert runner(runtime_context, context_len=16).context_len == 16
    other = RuntimeContext()
    assert runner(other, context_len=0).context_len == SPEC.max_position_embeddings
    other.close()
    other = RuntimeContext()
    longest = SPEC.max_position_embeddings
    with pytest.raises(ConfigError, match=f"context_len 10000 exceeds .* at most {longest}"):
        runner(other, context_len=10_000)  # more than the model's: refused, not cut
    other.close()


def test_auto_kv_tokens_is_every_request_at_full_context_within_the_budget(runtime_context) -> None:  # type: ignore[no-untyped-def]
    mr = runner(runtime_context, max_running_requests=2)
    assert mr.token_to_kv_pool_allocator.size == 2 * SPEC.max_position_embeddings
    per_token = KVCache.bytes_per_token_for(
        SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, torch.float32
    )
    big = dataclasses.replace(SPEC, num_layers=4096, max_position_embeddings=4096)
    other = RuntimeContext()
    capped = runner(other, ToyLoader(big), max_running_requests=4)
    big_per_token = KVCache.bytes_per_token_for(
        4096, SPEC.num_kv_heads, SPEC.head_dim, torch.float32
    )
    assert capped.token_to_kv_pool_allocator.size == CPU_KV_BUDGET_BYTES // big_per_token
    assert per_token < big_per_token
    other.close()


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({}, "this one is on cpu (set kv_cache_tokens to size it)"),
        ({"kv_cache_tokens": 64}, "kv_cache_tokens is 64"),
    ],
)
def test_a_memory_fraction_that_sizes_nothing_is_warned_about(config, why, caplog) -> None:  # type: ignore[no-untyped-def]
    """It sizes an automatic KV cache on CUDA only; elsewhere it did nothing, silently."""
    with RuntimeContext() as ctx, caplog.at_level("WARNING", logger="execrt.core.assembly"):
        mr = runner(ctx, kv_cache_memory_fraction=0.5, max_running_requests=2, **config)
        mr.close()
    warned = [
        r.getMessage() for r in caplog.records if "kv_cache_memory_fraction" in r.getMessage()
    ]
    assert warned == [
        f"kv_cache_memory_fraction 0.5 ignored: it sizes an automatic KV cache on CUDA, and {why}"
    ]


def test_forward_runs_extend_and_decode_through_the_eager_runner(runtime_context) -> None:  # type: ignore[no-untyped-def]
    mr = runner(runtime_context)
    reqs = [
        Req(0, [1, 2, 3], SamplingParams(temperature=0)),
        Req(1, [4], SamplingParams(temperature=0)),
    ]
    memory = KVMemory(mr.req_to_token_pool, mr.token_to_kv_pool_allocator, HostToDevice(CPU))
    inputs = memory.reserve_extend(reqs, [3, 1])
    assert inputs is not None
    sb = ScheduleBatch.of(reqs, inputs, memory.stager)
    fb = ForwardBatch.init_new(sb)
    out = mr.forward(fb)
    assert out.logits_output.next_token_logits.shape == (2, SPEC.vocab_size)
    assert not out.can_run_graph
    tokens = mr.sample(out.logits_output, fb)
    assert tokens.tolist() == out.logits_output.next_token_logits.argmax(-1).tolist()
    # the inputs went through the static buffers, not the schedule batch's tensors
    assert mr.input_buffers.static.input_ids[:4].tolist() == [1, 2, 3, 4]


def test_a_runner_that_fails_to_build_leaves_nothing_registered(runtime_context) -> None:  # type: ignore[no-untyped-def]
    # The attention backend is built after the KV cache was registered: that goes again, so
    # the same context serves the next runner.
    with pytest.raises(BackendUnavailableError, match="flashinfer"):
        runner(runtime_context, attention_backend="flashinfer")
    assert runtime_context.open_resources() == []
    mr = runner(runtime_context)
    assert runtime_context.get("kv_cache") is mr.kv_cache


def test_a_second_runner_on_one_context_fails_without_closing_the_first(runtime_context) -> None:  # type: ignore[no-untyped-def]
    first = runner(runtime_context)
    held = runtime_context.open_resources()
    with pytest.raises(ResourceError, match="'kv_cache' already registered"):
        runner(runtime_context)
    assert runtime_context.open_resources() == held
    assert runtime_context.get("kv_cache") is first.kv_cache
    first.close()
    assert runtime_context.open_resources() == []


def test_a_dense_model_ignores_the_dispatcher_but_not_an_unknown_name(runtime_context) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BackendUnavailableError, match=r"'alreduce' unavailable: not registered"):
        runner(runtime_context, moe_dispatcher="alreduce")
    mr = runner(runtime_context, moe_dispatcher="allreduce")
    assert mr.moe_dispatcher is None and not runtime_context.has("moe_dispatcher")


# -- automatic sizes -------------------------------------------------------------------------------
CUDA = torch.device("cuda")  # resolve_sizes and the memory arithmetic never touch the device
GB = 10**9


def test_cpu_defaults_stay_small(runtime_context) -> None:  # type: ignore[no-untyped-def]
    mr = runner(runtime_context)
    assert (mr.max_running_requests, mr.config.max_prefill_tokens) == (32, 4096)
    assert mr.req_to_token_pool.req_to_token.shape[0] == 33
    assert not mr.resolved.running_fits_kv


def test_cuda_sizes_come_from_graphs_and_kv_unless_set() -> None:
    def sizes(spec=SPEC, **config) -> tuple[int, int]:  # type: ignore[no-untyped-def]
        cfg = assembly.resolve_sizes(RuntimeConfig(**config), spec, CUDA, 40960)
        return cfg.max_running_requests, cfg.max_prefill_tokens

    assert sizes() == (assembly.MAX_GRAPH_BS, 16384)
    assert sizes(cuda_graph_max_bs=64) == (64, 16384)  # the largest graph bucket
    assert sizes(kv_cache_tokens=20_000) == (19, 16384)  # 20,000 slots // 1024 per request
    assert sizes(kv_cache_tokens=100) == (1, 16384)
    assert sizes(max_running_requests=7, max_prefill_tokens=99) == (7, 99)  # set: kept
    moe = dataclasses.replace(SPEC, num_experts=8, top_k=2)
    assert sizes(moe) == (assembly.MAX_GRAPH_BS, 4096)
    on_cpu = assembly.resolve_sizes(RuntimeConfig(), SPEC, CPU, 40960)
    assert (on_cpu.max_running_requests, on_cpu.max_prefill_tokens) == (32, 4096)


def test_kv_budget_keeps_a_headroom_or_takes_the_fraction_asked() -> None:
    # Auto: all free memory after the weights but 10% of the GPU (at least 1 GiB).
    assert assembly.kv_budget_bytes(100 * GB, 140 * GB, 0.0) == 86 * GB
    assert assembly.kv_budget_bytes(6 * GB, 8 * GB, 0.0) == 6 * GB - (1 << 30)
    assert assembly.kv_budget_bytes(GB // 2, 8 * GB, 0.0) == 0
    assert assembly.kv_budget_bytes(100 * GB, 140 * GB, 0.5) == 50 * GB  # set: kept


def test_cuda_pool_from_probed_memory_then_running_requests_fit_it(
    runtime_context, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    mr = runner(runtime_context)
    per_token = KVCache.bytes_per_token_for(
        SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, torch.float32
    )
    ceiling = assembly.MAX_GRAPH_BS
    cfg = mr.resolved.config.replace(max_running_requests=ceiling)
    on_gpu = dataclasses.replace(mr.resolved, device=CUDA, config=cfg, running_fits_kv=True)
    probed: list[torch.device] = []

    def memory(device: torch.device) -> tuple[int, int]:
        probed.append(device)
        return 10 * GB + 100 * per_token, 100 * GB  # 10 GB is the headroom

    monkeypatch.setattr(assembly, "gpu_memory", memory)
    assert assembly.kv_cache_tokens(on_gpu) == 100 and probed == [CUDA]
    fitted = assembly.fit_running_requests(on_gpu, 100)
    assert fitted.config.max_running_requests == 1  # 100 slots hold one 64-token request
    assert not fitted.running_fits_kv
    assert assembly.fit_running_requests(fitted, 10**6) is fitted  # fitted once
    roomy = assembly.fit_running_requests(on_gpu, 10**6)
    assert roomy.config.max_running_requests == ceiling  # 15,625 requests: the ceiling
    set_by_user = dataclasses.replace(on_gpu, running_fits_kv=False)
    assert assembly.fit_running_requests(set_by_user, 100) is set_by_user
    # Memory held elsewhere leaves less than one request at full context (64 tokens): refused
    # with the numbers and the ways out, not built as a pool that aborts every long prompt.
    monkeypatch.setattr(assembly, "gpu_memory", lambda d: (10 * GB + 63 * per_token, 100 * GB))
    with pytest.raises(ConfigError, match=r"63 tokens at \d+ bytes each, fewer than one request "
                       r"at context_len 64.*set kv_cache_tokens"):  # fmt: skip
        assembly.kv_cache_tokens(on_gpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_counts_the_allocators_unused_cache_as_free() -> None:
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    before, total = assembly.gpu_memory(device)
    block = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    held, _ = assembly.gpu_memory(device)
    del block  # back to torch's cache, still taken for the driver
    after, _ = assembly.gpu_memory(device)
    assert held <= before - (1 << 30) + (64 << 20)
    assert abs(after - before) < (64 << 20) and total >= before


# -- an fp8 KV cache -------------------------------------------------------------------------------
E4M3 = torch.float8_e4m3fn


def test_an_fp8_cache_holds_exactly_twice_the_automatic_slots_of_a_bf16_one(
    runtime_context,
) -> None:  # type: ignore[no-untyped-def]
    # A fixed CPU budget (one full-context request fits in it, so it is not raised), and more
    # requests than either cache holds: the count is budget / bytes per token of the storage.
    big = dataclasses.replace(SPEC, num_layers=4096, max_position_embeddings=512)
    common = {"dtype": "bfloat16", "max_running_requests": 64}
    bf16 = runner(runtime_context, ToyLoader(big), **common)
    other = RuntimeContext()
    fp8 = runner(other, ToyLoader(big), kv_cache_dtype="fp8_e4m3", **common)
    assert bf16.kv_cache.dtype == torch.bfloat16 and fp8.kv_cache.dtype == E4M3
    slots = bf16.token_to_kv_pool_allocator.size
    assert slots == CPU_KV_BUDGET_BYTES // bf16.kv_cache.bytes_per_token() < 64 * 512
    assert fp8.token_to_kv_pool_allocator.size == 2 * slots
    other.close()


def test_the_kv_dtype_is_resolved_once_and_named_in_the_report(runtime_context, caplog) -> None:  # type: ignore[no-untyped-def]
    with caplog.at_level("WARNING", logger="execrt.core.model_runner"):
        mr = runner(runtime_context, kv_cache_dtype="fp8_e5m2", kv_cache_tokens=40)
    assert mr.resolved.kv_dtype == torch.float8_e5m2 and mr.resolved.dtype == torch.float32
    assert mr.resolved.attention_requirements().kv_dtype == torch.float8_e5m2
    assert mr.kv_cache.dtype == torch.float8_e5m2 and mr.attn_backend.dtype == torch.float32
    (attention,) = [r for r in mr.resolution.resolutions if r.kind == "attention"]
    assert "KV cache fp8_e5m2: float8_e5m2" in attention.describe()
    # The toy checkpoint has no scales: one warning, naming the dtype and the clipping.
    warned = [r.getMessage() for r in caplog.records if "k_scale" in r.getMessage()]
    assert len(warned) == 1 and "float8_e5m2" in warned[0] and "57344" in warned[0]
    assert mr.kv_cache.layer_scales[0].tolist() == [1.0, 1.0, 1.0, 1.0]
    reqs = [Req(0, [1, 2, 3], SamplingParams(temperature=0))]
    memory = KVMemory(mr.req_to_token_pool, mr.token_to_kv_pool_allocator, HostToDevice(CPU))
    inputs = memory.reserve_extend(reqs, [3])
    assert inputs is not None
    out = mr.forward(ForwardBatch.init_new(ScheduleBatch.of(reqs, inputs, memory.stager)))
    assert torch.isfinite(out.logits_output.next_token_logits).all()
    written = mr.kv_cache.k_buffers[1][inputs.out_cache_loc].float()
    assert written.abs().sum() > 0


def test_the_checkpoint_scales_reach_the_cache_without_a_warning(runtime_context, caplog) -> None:  # type: ignore[no-untyped-def]
    from execrt.core.kv_quant import KVScales
    from tests.core.fakes import ToyModel

    scales = KVScales((0.5, 2.0), (0.25, 4.0))

    class Scaled(ToyModel):
        def kv_scales(self) -> KVScales:  # type: ignore[override]
            return scales

    class ScaledLoader(ToyLoader):
        def load(self, request):  # type: ignore[no-untyped-def]
            return Scaled(self.spec, request)

    with caplog.at_level("WARNING", logger="execrt.core.model_runner"):
        mr = runner(runtime_context, ScaledLoader(), kv_cache_dtype="fp8_e4m3", kv_cache_tokens=8)
    assert not caplog.records
    assert mr.kv_cache.scales == scales
    assert mr.kv_cache.layer_scales[1].tolist() == [2.0, 4.0, 0.5, 0.25]


class _Bf16OnlyPlugin:
    """torch_native's code, registered ahead of it for auto, declaring no fp8 cache dtype."""

    @hookimpl
    def execrt_register_backends(self, registry):  # type: ignore[no-untyped-def]
        from execrt.core.interfaces import AttentionCapabilities

        factory = "execrt.backends.attention.torch_native:TorchNativeAttnBackend"
        registry.register("attention", "bf16_only", factory, AttentionCapabilities(), priority=90)


def test_a_backend_that_does_not_list_the_cache_dtype_is_refused_by_name(runtime_context) -> None:  # type: ignore[no-untyped-def]
    host = PluginHost(autoload=False)
    assert host.add_plugin(_Bf16OnlyPlugin(), "bf16-only")
    cfg = RuntimeConfig(device="cpu", kv_cache_dtype="fp8_e4m3", kv_cache_tokens=8)
    refusal = "KV cache dtype float8_e4m3fn unsupported (supported: bfloat16, float16, float32)"
    with pytest.raises(BackendUnavailableError, match=re.escape(refusal)):
        ModelRunner(
            ToyLoader(), cfg.replace(attention_backend="bf16_only"), runtime_context, host.registry
        )
    with pytest.raises(BackendUnavailableError, match="strict: preferred bf16_only unusable"):
        ModelRunner(ToyLoader(), cfg.replace(strict=True), runtime_context, host.registry)
    mr = ModelRunner(ToyLoader(), cfg, runtime_context, host.registry)  # auto falls through
    (attention,) = [r for r in mr.resolution.resolutions if r.kind == "attention"]
    assert attention.chosen == "torch_native"
    assert dict(attention.rejected)["bf16_only"] == (refusal,)
    mr.close()
    bf16 = ModelRunner(
        ToyLoader(), cfg.replace(kv_cache_dtype="auto"), runtime_context, host.registry
    )
    assert bf16.attn_backend.capabilities.kv_dtypes == AttentionCapabilities().kv_dtypes
