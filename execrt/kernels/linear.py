"""Linear layers at decode sizes: ``x @ W^T (+ b)``, optionally with SwiGLU fused into the load.

At a few tokens a projection is a weight stream: cuBLAS's M = 1 kernels read the 2-13 MB
matrices of a small model at 1.2-1.6 TB/s on an H200, and the SwiGLU between gate/up and down
and the RMSNorm before q/k/v and gate/up are one more launch each. ``linear`` sends such calls
to a Triton kernel that streams the weight at close to copy bandwidth (``triton_linear.py``)
and, with ``swiglu=True``, computes ``silu(gate) * up`` while it loads the activations;
``norm_linear`` does the same with a residual add + RMSNorm. Everything else goes to
``F.linear`` (after the separate norm / SwiGLU kernels).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from execrt.kernels._triton import fail, import_triton
from execrt.kernels.activation import silu_and_mul, silu_and_mul_torch
from execrt.kernels.norm import fused_add_rmsnorm, rmsnorm

#: Rows (tokens) up to which the Triton kernel may take a call; larger batches are GEMMs.
MAX_SKINNY_ROWS = 16


@functools.cache
def _triton_linear() -> ModuleType:
    """``triton_linear``, imported on first use (eager decoding calls this per projection)."""
    import_triton()
    from execrt.kernels import triton_linear

    return triton_linear


def linear_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, swiglu: bool = False
) -> torch.Tensor:
    """Reference: ``F.linear(silu_and_mul(x) if swiglu else x, weight, bias)``."""
    return F.linear(silu_and_mul_torch(x) if swiglu else x, weight, bias)


def skinny_eligible(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """Whether the Triton kernel serves ``x [M, K]`` (``[M, 2K]`` with ``swiglu``) times
    ``weight [N, K]``: at most ``MAX_SKINNY_ROWS`` rows, one floating dtype, the weight
    contiguous (it is streamed row by row) and both on one device."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_SKINNY_ROWS
        and weight.dim() == 2
        and x.shape[1] == weight.shape[1] * (2 if swiglu else 1)
        and x.dtype == weight.dtype
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and weight.is_contiguous()
        and x.stride(1) == 1
        and x.device == weight.device
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    swiglu: bool = False,
    use_triton: bool = False,
) -> torch.Tensor:
    """``x [T, K] @ weight[N, K]^T + bias [N]`` -> ``[T, N]`` in ``x.dtype``.

    ``swiglu``: ``x`` is a fused gate/up output ``[T, 2K]`` (gate first) and the product uses
    ``silu(gate) * up``, rounded to the dtype as ``silu_and_mul`` rounds it. ``use_triton`` (see
    ``execrt.kernels.use_triton``) lets calls of at most ``MAX_SKINNY_ROWS`` rows run the Triton
    kernel (fp32 accumulation, bias added in fp32, one rounding); others, and any call the
    kernel does not take (``skinny_eligible``, or a shape where the tuned table found cuBLAS
    faster), run ``F.linear`` (after the Triton ``silu_and_mul`` with ``swiglu``). Leading
    dims of ``x`` are kept.
    """
    if swiglu and x.shape[-1] != 2 * weight.shape[-1]:
        fail(
            "linear",
            f"swiglu input {tuple(x.shape)} must be [..., 2K] for weight {tuple(weight.shape)}",
        )
    rows = x.reshape(-1, x.shape[-1])  # [T, K]
    if use_triton and skinny_eligible(rows, weight, swiglu):
        # [T, N]; None where cuBLAS is faster
        out = _triton_linear().skinny_linear(rows, weight, bias, swiglu=swiglu)
        if out is not None:
            return out.view(*x.shape[:-1], weight.shape[0])
    if swiglu:
        x = silu_and_mul(x, use_triton=use_triton)
    return F.linear(x, weight, bias)


def norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(rmsnorm(x + residual))`` and ``x + residual``: a norm in front of a projection.

    ``x [T, K]`` is the residual stream itself when ``residual`` is None (the first layer), else
    the delta added to ``residual`` first (in the dtype, as ``fused_add_rmsnorm``). Returns
    ``(out [T, N], new_residual [T, K])`` (``new_residual`` is ``x`` when nothing was added).
    With ``use_triton``, decode-size calls run one kernel that normalises the rows while it
    streams the weight (``skinny_eligible`` plus one dtype for the norm weight and a residual of
    x's layout); others run ``fused_add_rmsnorm`` / ``rmsnorm``, then ``linear``.
    """
    rows = x.reshape(-1, x.shape[-1])  # [T, K]
    if use_triton and _norm_eligible(rows, weight, norm_weight, residual):
        tlin = _triton_linear()
        tile = tlin.tile_for(rows, weight, bias, norm=True)  # None: cuBLAS or the norm apart
        if tile is not None:
            res_rows = None if residual is None else residual.reshape(rows.shape)
            new_res = None if res_rows is None else torch.empty_like(rows)
            norm = tlin.NormIn(norm_weight, eps, res_rows, new_res)
            out = tlin.launch(rows, weight, bias, tile, norm=norm)
            out_shape = (*x.shape[:-1], weight.shape[0])
            return out.view(out_shape), (x if new_res is None else new_res.view(x.shape))
    if residual is None:
        normed, new_residual = rmsnorm(x, norm_weight, eps, use_triton=use_triton), x
    else:
        normed, new_residual = fused_add_rmsnorm(
            x, residual, norm_weight, eps, use_triton=use_triton
        )
    return linear(normed, weight, bias, use_triton=use_triton), new_residual


def _norm_eligible(
    rows: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    residual: torch.Tensor | None,
) -> bool:
    return (
        skinny_eligible(rows, weight)
        and rows.is_contiguous()
        and norm_weight.dtype == rows.dtype
        and norm_weight.shape == (rows.shape[1],)
        and norm_weight.is_contiguous()
        and norm_weight.device == rows.device
        and (
            residual is None
            or (
                residual.numel() == rows.numel()
                and residual.shape[-1] == rows.shape[1]
                and residual.dtype == rows.dtype
                and residual.is_contiguous()
                and residual.device == rows.device
            )
        )
    )
