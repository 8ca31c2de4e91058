"""``kv_cache_rotation``: q and k rotated by one Hadamard matrix after RoPE change no attention
score, so the model's logits and tokens are those of the unrotated run (the cache holds
rotated keys, read back by prefill and decode alike); ``auto`` rotates for fp8 caches only."""

from __future__ import annotations

import pytest
import torch

from execrt.core.assembly import resolve_kv_rotation
from execrt.core.context import RuntimeContext
from execrt.core.errors import ConfigError
from execrt.models.layers import Attention
from tests.drivers import make_worker, prefill_then_decode, rel_err

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77], [9] * 13 + [100, 101]]


def _run(path: str, plugin_host, **config):  # type: ignore[no-untyped-def]
    ctx = RuntimeContext()
    worker = make_worker(path, ctx, plugin_host, **config)
    try:
        model = worker.model_runner.model
        rotated = [m.hadamard for m in model.modules() if isinstance(m, Attention)]
        resolutions = worker.model_runner.resolution.resolutions
        note = next(r.note for r in resolutions if r.kind == "attention")
        return prefill_then_decode(worker, PROMPTS, steps=6, full_logits=True), rotated, note
    finally:
        worker.close()
        ctx.close()


@pytest.mark.parametrize("fused", ["off", "on"], ids=["torch", "triton"])
def test_a_rotated_run_gives_the_logits_and_tokens_of_an_unrotated_one(
    checkpoint, plugin_host, fused: str
) -> None:
    if fused == "on":
        pytest.importorskip("triton")
        from execrt.kernels._triton import interpreter_enabled

        if not interpreter_enabled():
            pytest.skip("the fused kernels run on CPU under the Triton interpreter only")
    path = checkpoint("dense-tied-hd64")
    plain, rotated_flags, _ = _run(path, plugin_host, fused_kernels=fused)
    rotated, flags, note = _run(
        path, plugin_host, fused_kernels=fused, kv_cache_rotation="hadamard"
    )
    assert not any(rotated_flags) and flags and all(flags)
    assert "Hadamard-rotated" in note
    assert rotated.tokens == plain.tokens
    assert plain.prefill_full_logits is not None and rotated.prefill_full_logits is not None
    assert rel_err(rotated.prefill_full_logits, plain.prefill_full_logits) <= 1e-5
    for a, b in zip(rotated.logits, plain.logits, strict=True):  # decode reads rotated keys
        assert rel_err(a, b) <= 1e-5


def test_auto_rotates_fp8_caches_whose_head_dim_allows_it() -> None:
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert resolve_kv_rotation("auto", e4m3, 128) and resolve_kv_rotation("auto", e5m2, 64)
    assert not resolve_kv_rotation("auto", torch.bfloat16, 128)
    assert not resolve_kv_rotation("auto", e4m3, 96)  # not a power of two: left unrotated
    assert not resolve_kv_rotation("none", e4m3, 128)
    assert resolve_kv_rotation("hadamard", torch.float32, 64)
    with pytest.raises(ConfigError, match="power-of-two head_dim, the model's is 96"):
        resolve_kv_rotation("hadamard", torch.bfloat16, 96)


def test_an_fp8_cache_rotates_by_default_and_none_turns_it_off(checkpoint, plugin_host) -> None:
    path = checkpoint("dense-tied-hd64")
    _, flags, note = _run(path, plugin_host, kv_cache_dtype="fp8_e4m3")
    assert all(flags) and "float8_e4m3fn, q and k Hadamard-rotated" in note
    _, flags, note = _run(path, plugin_host, kv_cache_dtype="fp8_e4m3", kv_cache_rotation="none")
    assert not any(flags) and "rotated" not in note


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_on_the_gpu_the_rotated_fused_path_keeps_the_logits(checkpoint, plugin_host, kv) -> None:
    """The rotary kernel's Hadamard butterflies compiled for the GPU (fused kernels, graphs):
    fp32 logits of the rotated run match the unrotated one's; with an fp8 cache, the rotated
    run errs no more than the unrotated one."""
    path = checkpoint("dense-untied-hd128-sharded")
    base = dict(device="cuda", dtype="float32", fused_kernels="on")
    ref, _, _ = _run(path, plugin_host, **base)
    runs = {
        r: _run(path, plugin_host, **base, kv_cache_dtype=kv, kv_cache_rotation=r)[0]
        for r in ("none", "hadamard")
    }
    assert runs["hadamard"].prefill_full_logits is not None
    errors = {
        r: max(rel_err(a, b) for a, b in zip(t.logits, ref.logits, strict=True))
        for r, t in runs.items()
    }
    if kv == "auto":
        assert errors["hadamard"] <= 1e-4 and runs["hadamard"].tokens == ref.tokens
    else:  # random weights have no outlier channels to spread: no worse, and not broken
        assert errors["hadamard"] <= max(1.5 * errors["none"], 1e-3) and errors["none"] < 0.1
