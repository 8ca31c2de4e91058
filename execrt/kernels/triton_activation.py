"""Triton SwiGLU: ``silu(gate) * up`` in fp32 with one rounding, tiled over tokens and columns."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from execrt.kernels._triton import (
    cdiv,
    check_device,
    check_float,
    check_last_dim_contiguous,
    next_power_of_2,
    num_warps_for,
    pdl_kwargs,
    sm_count,
)
from execrt.kernels.triton_pdl import pdl_prologue

MIN_BLOCK = 256  # 32 lanes x one 16-byte vector of 16-bit values
MAX_BLOCK = 2048


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    src = x_ptr + row * stride_x + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def block_for(tokens: int, inter: int, sms: int) -> int:
    """Columns per program: wide tiles, narrowed until the grid gives each SM two programs."""
    block = max(MIN_BLOCK, min(MAX_BLOCK, next_power_of_2(inter)))
    while block > MIN_BLOCK and tokens * cdiv(inter, block) < 2 * sms:
        block //= 2
    return block


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """One launch over ``x [..., 2I]``; see ``activation.silu_and_mul``."""
    check_float("silu_and_mul", "x", x)
    check_device("silu_and_mul", "x", x)
    check_last_dim_contiguous("silu_and_mul", x=x)
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])  # [T, 2I]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    t = rows.shape[0]
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t == 0 or inter == 0:
        return out.view(*x.shape[:-1], inter)
    block = block_for(t, inter, sm_count(x.device))
    grid = (t, cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        rows,
        out,
        rows.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        num_warps=num_warps_for(block),
        **pdl_kwargs(rows.device),
    )
    return out.view(*x.shape[:-1], inter)
