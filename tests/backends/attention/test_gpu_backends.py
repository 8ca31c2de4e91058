"""GPU: triton and flashinfer attention inside a Qwen3 model vs torch_native, and graph replay."""

from __future__ import annotations

import pytest
import torch

from execrt.core.context import RuntimeContext
from execrt.core.interfaces import AttentionStep
from execrt.plugins.host import PluginHost
from tests.drivers import Trace, make_worker, prefill_then_decode, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FAST_BACKENDS = ["triton", "flashinfer"]


@pytest.fixture(scope="module")
def qwen3_gpu_checkpoint(tmp_path_factory) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    path = str(tmp_path_factory.mktemp("qwen3-gpu"))
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _available(name: str) -> None:
    spec = PluginHost(autoload=False).registry.get("attention", name)
    missing = spec.unusable_here()
    if missing:
        pytest.skip("; ".join(missing))


def _decode_trace(
    path: str,
    backend: str,
    dtype: str,
    follow: list[list[int]] | None = None,
    steps: int = 6,
    **config: object,
) -> Trace:
    ctx = RuntimeContext()
    worker = make_worker(
        path,
        ctx,
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        max_running_requests=8,
        kv_cache_tokens=8192,
        **config,
    )
    variant = getattr(worker.model_runner.attn_backend, "prefill_variant", None)
    if "flashinfer_prefill_backend" in config:  # the variant asked for is the one built
        assert variant == config["flashinfer_prefill_backend"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (700, 33, 1, 1500)]
    trace = prefill_then_decode(worker, prompts, steps, follow=follow)
    worker.close()
    ctx.close()
    return trace


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_model_logits_match_torch_native(qwen3_gpu_checkpoint, backend, dtype) -> None:
    _available(backend)
    ref = _decode_trace(qwen3_gpu_checkpoint, "torch_native", dtype)
    got = _decode_trace(qwen3_gpu_checkpoint, backend, dtype, follow=ref.tokens)
    for step, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
        err = rel_err(a, b)
        assert err < 2e-2, f"{backend} {dtype} step {step}: relative error {err:.2e}"


@pytest.mark.parametrize("variant", ["fa2", "fa3"])
def test_flashinfer_prefill_variants_match_torch_native(qwen3_gpu_checkpoint, variant) -> None:
    _available("flashinfer")
    if variant == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer's FA3 prefill needs an sm90 GPU")
    ref = _decode_trace(qwen3_gpu_checkpoint, "torch_native", "bfloat16", steps=2)
    got = _decode_trace(
        qwen3_gpu_checkpoint, "flashinfer", "bfloat16", ref.tokens, 2,
        flashinfer_prefill_backend=variant,
    )  # fmt: skip
    for step, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
        err = rel_err(a, b)
        assert err < 2e-2, f"flashinfer {variant} step {step}: relative error {err:.2e}"


@pytest.mark.parametrize("graph", ["none", "full_cuda_graph"])
def test_triton_fused_merge_matches_the_separate_merge(qwen3_gpu_checkpoint, graph) -> None:
    # The merge inside the split launch, eager and replayed: contexts of 1 to 1500 tokens
    # (one split, and several), the same logits as the separate merge up to rounding.
    _available("triton")
    ref = _decode_trace(qwen3_gpu_checkpoint, "triton", "bfloat16", graph_backend=graph)
    got = _decode_trace(
        qwen3_gpu_checkpoint, "triton", "bfloat16", ref.tokens, graph_backend=graph,
        triton_decode_merge="fused",
    )  # fmt: skip
    for step, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
        err = rel_err(a, b)
        assert err < 5e-3, f"fused merge, {graph}, step {step}: relative error {err:.2e}"


def test_flashinfer_default_prefill_is_fa3_on_sm90() -> None:
    _available("flashinfer")
    from execrt.bench.attention import DecodeProblem, build_backend

    p = DecodeProblem(bs=1, ctx=64, hq=32, hkv=8, d=128, dtype=torch.bfloat16, seed=0)
    ctx = RuntimeContext()
    attn = build_backend(PluginHost(autoload=False), "flashinfer", p, ctx)
    expected = "fa3" if torch.cuda.get_device_capability()[0] == 9 else "fa2"
    assert getattr(attn, "prefill_variant", None) == expected
    assert getattr(attn, "warm_up_s", 0.0) > 0  # built (or loaded) its kernels while starting
    attn.close()
    ctx.close()


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_graph_replay_equals_eager(backend) -> None:
    from execrt.bench.attention import DecodeProblem, build_backend

    _available(backend)
    p = DecodeProblem(bs=8, ctx=1024, hq=32, hkv=8, d=128, dtype=torch.bfloat16, seed=3)
    ctx = RuntimeContext()
    attn = build_backend(PluginHost(autoload=False), backend, p, ctx)
    attn.init_graph_state(8, 8)
    fb = p.forward_batch()
    layer = p.layers[0]
    step = AttentionStep(attn, attn.plan_graph(fb), fb.out_cache_loc, fb.mode)
    attn.attend(p.q, layer, step)  # warm-up / JIT
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.attend(p.q, layer, step)
    for step in range(3):
        # New lengths and new queries, written into the same static tensors.
        lens = torch.randint(1, 1025, (8,), generator=torch.Generator().manual_seed(step)).tolist()
        fb.seq_lens.copy_(torch.tensor(lens))
        fb.seq_lens_cpu = lens
        p.q.normal_()
        attn.plan_graph(fb)
        graph.replay()
        eager_fb = p.forward_batch()
        eager_fb.seq_lens.copy_(torch.tensor(lens))
        eager_fb.seq_lens_cpu = lens
        eager_step = AttentionStep(attn, attn.plan(eager_fb), eager_fb.out_cache_loc, fb.mode)
        eager = attn.attend(p.q, layer, eager_step)
        torch.cuda.synchronize()
        err = rel_err(out.float(), eager.float())
        assert err < 1e-2, f"{backend} replay {step}: relative error vs eager {err:.2e}"
    attn.close()
    ctx.close()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_fp8_cache_model_logits_match_torch_native(
    qwen3_gpu_checkpoint, backend, kv_cache_dtype
) -> None:  # type: ignore[no-untyped-def]
    # Same fp8 cache semantics (the fused rotary kernel stores it for both), eager prefill and
    # graphed decode: the fast backends read it as torch_native's dequantizing reference does.
    _available(backend)
    path, kv = qwen3_gpu_checkpoint, kv_cache_dtype
    ref = _decode_trace(path, "torch_native", "bfloat16", kv_cache_dtype=kv)
    got = _decode_trace(path, backend, "bfloat16", follow=ref.tokens, kv_cache_dtype=kv)
    assert any(got.graphed), f"{backend}: no decode step replayed a graph"
    for step, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
        err = rel_err(a, b)
        assert err < 2e-2, f"{backend} {kv}: step {step}: relative error {err:.2e}"


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_fp8_cache_graph_replay_reads_the_scales(backend, kv_dtype) -> None:  # type: ignore[no-untyped-def]
    from execrt.bench.attention import DecodeProblem, build_backend
    from execrt.core.kv_quant import KVScales

    _available(backend)
    p = DecodeProblem(bs=8, ctx=1024, hq=32, hkv=8, d=128, dtype=torch.bfloat16, seed=4,
                      kv_dtype=kv_dtype)  # fmt: skip
    n = p.kv_cache.num_layers
    p.kv_cache.set_scales(KVScales((0.25,) * n, (4.0,) * n))  # before capture, as at load
    ctx = RuntimeContext()
    attn = build_backend(PluginHost(autoload=False), backend, p, ctx)
    attn.init_graph_state(8, 8)
    fb = p.forward_batch()
    step = AttentionStep(attn, attn.plan_graph(fb), fb.out_cache_loc, fb.mode)
    attn.attend(p.q, p.layers[0], step)  # warm-up / JIT
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.attend(p.q, p.layers[0], step)
    p.q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    err = rel_err(out.float(), p.reference())  # over the cache read times its scales
    assert err < 1e-2, f"{backend} {kv_dtype}: replay vs the dequantized reference {err:.2e}"
    attn.close()
    ctx.close()
