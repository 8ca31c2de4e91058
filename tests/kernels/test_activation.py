"""SwiGLU ``silu(gate) * up``: Triton kernel vs torch reference vs an fp64 oracle."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from execrt.kernels.activation import silu_and_mul, silu_and_mul_torch
from tests.kernels.helpers import (
    DEVICE,
    max_rel,
    needs_cuda,
    replay_matches_eager,
)


def oracle(x: torch.Tensor) -> torch.Tensor:
    """fp64 ``gate / (1 + exp(-gate)) * up`` with gate the first half of the last dim."""
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter].double(), x[..., inter:].double()
    return gate / (1.0 + torch.exp(-gate)) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [96, 200, 1000])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_matches_reference_and_oracle(dtype: torch.dtype, inter: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(inter * 100 + tokens)
    wide = (torch.randn(tokens, 2 * inter + 16, generator=gen) * 3).to(dtype).to(DEVICE)
    x = wide[:, : 2 * inter]  # [T, 2I] with a row stride of 2I + 16
    out = silu_and_mul(x, use_triton=True)
    assert out.shape == (tokens, inter) and out.dtype == dtype and out.is_contiguous()
    ref, exact = silu_and_mul_torch(x), oracle(x)
    if dtype == torch.float32:
        assert max_rel(out, ref) <= 1e-6
        assert max_rel(out, exact) <= 1e-6
    else:
        assert max_rel(out, ref) <= 1e-2
        # One rounding from fp32: within half an ulp of the result, plus fp32 error.
        bound = 2.0**-11 * exact.abs() + 1e-6 * exact.abs().max()
        assert ((out.double() - exact).abs() <= bound).all()
        assert max_rel(out, exact) <= max_rel(ref, exact)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(200)
def test_leading_dims_and_extreme_gates() -> None:
    x = torch.tensor([[-200.0, -20.0, 0.0, 30.0, 1.0, 2.0, 3.0, 4.0]], device=DEVICE)
    out = silu_and_mul(x.view(1, 1, 8), use_triton=True)
    assert out.shape == (1, 1, 4)
    # silu(-200) underflows to -0, silu(0) = 0, silu(30) = 30 to fp32 precision.
    expected = torch.tensor([[[0.0, -20.0 / (1 + 4.851651954097903e8) * 2, 0.0, 120.0]]])
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-30)


def test_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="silu_and_mul: x \\(2, 7\\) must be"):
        silu_and_mul(torch.ones(2, 7, device=DEVICE), use_triton=True)


def test_no_tokens() -> None:
    assert silu_and_mul(torch.ones(0, 8, device=DEVICE), use_triton=True).shape == (0, 4)


@needs_cuda
@pytest.mark.parametrize("inter", [3072, 12288])
@pytest.mark.parametrize("tokens", [1, 7, 64, 256])
def test_bf16_model_sizes(inter: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(inter + tokens)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 3).bfloat16().cuda()
    out = silu_and_mul(x, use_triton=True)
    assert max_rel(out, silu_and_mul_torch(x)) <= 1e-2
    assert max_rel(out, oracle(x)) <= max_rel(silu_and_mul_torch(x), oracle(x))


@needs_cuda
def test_capturable_in_a_cuda_graph() -> None:
    x = torch.randn(8, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    replay_matches_eager(lambda: [silu_and_mul(x, use_triton=True)], [x], [torch.randn_like(x)])
