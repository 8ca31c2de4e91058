"""Linear layers at decode sizes: ``x @ W^T (+ b)``, optionally with SwiGLU fused into the load.

At a few tokens a projection is a weight stream: cuBLAS's M = 1 kernels read the 2-13 MB
matrices of a small model at 1.2-1.6 TB/s on an H200, and the SwiGLU between gate/up and down is
one more launch per layer. ``linear`` sends such calls to a Triton kernel that streams the
weight at close to copy bandwidth (``triton_linear.py``) and, with ``swiglu=True``, computes
``silu(gate) * up`` while it loads the activations; everything else goes to ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from execrt.kernels._triton import fail, import_triton
from execrt.kernels.activation import silu_and_mul, silu_and_mul_torch

#: Rows (tokens) up to which the Triton kernel may take a call; larger batches are GEMMs.
MAX_SKINNY_ROWS = 16


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
        import_triton()
        from execrt.kernels.triton_linear import skinny_linear

        out = skinny_linear(rows, weight, bias, swiglu=swiglu)  # [T, N]; None: cuBLAS is faster
        if out is not None:
            return out.view(*x.shape[:-1], weight.shape[0])
    if swiglu:
        x = silu_and_mul(x, use_triton=use_triton)
    return F.linear(x, weight, bias)
