"""RMSNorm and fused add + RMSNorm: Triton kernel vs torch reference vs an fp64 oracle."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from execrt.kernels.norm import fused_add_rmsnorm, rmsnorm, rmsnorm_torch
from tests.kernels.helpers import (
    DEVICE,
    assert_within_ulps,
    max_rel,
    needs_cuda,
    replay_matches_eager,
)

EPS = 1e-6


def oracle(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Exact RMSNorm in fp64 (no intermediate rounding)."""
    xd = x.double()
    return xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def make_weight(hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # Spread around 1 with a few negative entries, as trained norm weights are.
    return (torch.randn(hidden, generator=gen) * 0.5 + 1.0).to(dtype).to(DEVICE)


def check(actual: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor) -> None:
    assert actual.dtype == reference.dtype and actual.shape == reference.shape
    if actual.dtype == torch.float32:
        assert max_rel(actual, reference) <= 1e-6
        assert max_rel(actual, exact) <= 1e-6
    else:
        # Same two roundings as the reference; only the fp32 sum order differs, so nearly every
        # element is bit-identical (skipping the first rounding leaves only ~75% identical).
        assert_within_ulps(actual, reference, 1.0, actual.dtype)
        assert (actual == reference).float().mean() >= 0.98
        assert_within_ulps(actual, exact, 1.5, actual.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [96, 200, 1000])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_rmsnorm_strided_rows(dtype: torch.dtype, hidden: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(hidden * 100 + tokens)
    wide = (torch.randn(tokens, hidden + 24, generator=gen) * 3).to(dtype).to(DEVICE)
    x = wide[:, 8 : 8 + hidden]  # [T, H], row stride H + 24
    weight = make_weight(hidden, dtype, gen)
    out = rmsnorm(x, weight, EPS, use_triton=True)
    check(out, rmsnorm_torch(x, weight, EPS), oracle(x, weight, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [200, 1000])
@pytest.mark.parametrize("tokens", [1, 33])
def test_fused_add_rmsnorm(dtype: torch.dtype, hidden: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    residual = (torch.randn(tokens, hidden, generator=gen) * 4).to(dtype).to(DEVICE)
    weight = make_weight(hidden, dtype, gen)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rmsnorm(x, residual, weight, EPS, use_triton=True)
    # The sum of two values of one dtype, rounded once: exactly what ``h + attn_out`` gives.
    expected_residual = (x.double() + residual.double()).to(dtype)
    assert torch.equal(new_residual, expected_residual)
    ref_normed, _ = fused_add_rmsnorm(x, residual, weight, EPS, use_triton=False)
    check(normed, ref_normed, oracle(expected_residual, weight, EPS))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rmsnorm_over_heads_of_a_3d_tensor() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, 64, generator=gen).to(DEVICE)  # [T, H, D]: per-head norm
    weight = make_weight(64, torch.float32, gen)
    out = rmsnorm(x, weight, EPS, use_triton=True)
    assert out.shape == (5, 4, 64)
    assert max_rel(out, oracle(x, weight, EPS)) <= 1e-6


def test_fp32_weight_promotes_the_result_like_the_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 96, generator=gen).half().to(DEVICE)
    weight = make_weight(96, torch.float32, gen)
    out = rmsnorm(x, weight, EPS, use_triton=True)
    ref = rmsnorm_torch(x, weight, EPS)
    assert out.dtype == ref.dtype == torch.float32
    # The normalised row is rounded to fp16 first in both; the fp32 product is then exact.
    assert max_rel(out, ref) <= 1e-3


def test_no_tokens() -> None:
    x = torch.empty(0, 96, device=DEVICE)
    assert rmsnorm(x, torch.ones(96, device=DEVICE), EPS, use_triton=True).shape == (0, 96)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((4, 96), (95,), (4, 96)), "weight"),
        (((4, 96), (96,), (3, 96)), "residual"),
    ],
)
def test_rejects_mismatched_shapes(shapes: tuple[tuple[int, ...], ...], match: str) -> None:
    x_shape, w_shape, r_shape = shapes
    x, w, r = (torch.ones(s, device=DEVICE) for s in (x_shape, w_shape, r_shape))
    with pytest.raises(ValueError, match=f"fused_add_rmsnorm: .*{match}"):
        fused_add_rmsnorm(x, r, w, EPS, use_triton=True)


def test_rejects_integer_input() -> None:
    x = torch.ones(2, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="rmsnorm: x dtype torch.int32 unsupported"):
        rmsnorm(x, torch.ones(8, device=DEVICE), EPS, use_triton=True)


# ----------------------------------------------------------------------------------------------
# GPU: bf16 at model sizes, CUDA-graph capture
# ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("hidden", [1024, 4096])
@pytest.mark.parametrize("tokens", [1, 7, 64, 256])
def test_bf16_model_sizes(hidden: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().cuda()
    residual = (torch.randn(tokens, hidden, generator=gen) * 8).bfloat16().cuda()
    weight = make_weight(hidden, torch.bfloat16, gen)
    out = rmsnorm(x, weight, EPS, use_triton=True)
    ref = rmsnorm_torch(x, weight, EPS)
    # tl.rsqrt and torch's rsqrt may differ in the last fp32 bit, which can flip one rounding.
    assert_within_ulps(out, ref, 2.0, torch.bfloat16)
    assert (out == ref).float().mean() >= 0.98
    normed, new_residual = fused_add_rmsnorm(x, residual, weight, EPS, use_triton=True)
    ref_normed, ref_residual = fused_add_rmsnorm(x, residual, weight, EPS)
    assert torch.equal(new_residual, ref_residual)
    assert_within_ulps(normed, ref_normed, 2.0, torch.bfloat16)
    assert (normed == ref_normed).float().mean() >= 0.98


@needs_cuda
def test_capturable_in_a_cuda_graph() -> None:
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5

    def step() -> list[torch.Tensor]:
        normed, new_residual = fused_add_rmsnorm(x, residual, weight, EPS, use_triton=True)
        return [rmsnorm(x, weight, EPS, use_triton=True), normed, new_residual]

    replay_matches_eager(step, [x, residual], [torch.randn_like(x), torch.randn_like(residual)])
