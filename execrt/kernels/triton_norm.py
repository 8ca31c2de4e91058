"""Triton RMSNorm and fused residual-add + RMSNorm: one program per row, fp32 accumulation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from execrt.kernels._triton import (
    check_device,
    check_float,
    check_last_dim_contiguous,
    check_same_device,
    fail,
    next_power_of_2,
    num_warps_for,
    pdl_kwargs,
)
from execrt.kernels.triton_pdl import pdl_prologue

# A row lives in registers as one block (no loop over H), which keeps a single pass over x;
# 32k fp32 values over 16 warps is 64 per thread. Real models stop at 16k (Llama 405B).
MAX_HIDDEN = 32768


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    hidden,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Rounded to the input dtype before the norm reads it, as ``h = h + attn_out`` is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / hidden
    # Round the normalised row to the input dtype first, then scale: Hugging Face's two roundings.
    y = (xf * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = y.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    check_float(name, "x", x)
    check_float(name, "weight", weight)
    check_device(name, "x", x)
    check_same_device(name, x, weight=weight)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        fail(name, f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [..., H] and [H]")
    if x.shape[-1] > MAX_HIDDEN:
        fail(name, f"hidden size {x.shape[-1]} unsupported (supported: <= {MAX_HIDDEN})")
    check_last_dim_contiguous(name, weight=weight)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[T, H]`` with unit last stride (a view when the layout allows)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor,
    res: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
    eps: float,
) -> None:
    t, h = x.shape
    if t == 0:
        return
    block = next_power_of_2(h)
    _rmsnorm_kernel[(t,)](
        x,
        res if res is not None else x,
        weight,
        out,
        res_out if res_out is not None else out,
        x.stride(0),
        res.stride(0) if res is not None else 0,
        out.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        h,
        eps,
        ADD_RESIDUAL=res is not None,
        BLOCK=block,
        num_warps=num_warps_for(block),
        **pdl_kwargs(x.device),
    )


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One launch, one program per row of ``x [..., H]``; see ``norm.rmsnorm``."""
    _check(x, weight, "rmsnorm")
    rows = _rows(x)  # [T, H]
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(rows, None, weight, out, None, eps)
    return out.view(x.shape)


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch for ``x + residual`` and its RMSNorm; see ``norm.fused_add_rmsnorm``."""
    name = "fused_add_rmsnorm"
    _check(x, weight, name)
    check_same_device(name, x, residual=residual)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        fail(
            name,
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}",
        )
    rows, res_rows = _rows(x), _rows(residual)  # [T, H]
    normed = torch.empty(
        rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
    )
    new_residual = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch(rows, res_rows, weight, normed, new_residual, eps)
    return normed.view(x.shape), new_residual.view(x.shape)
