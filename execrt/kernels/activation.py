"""SwiGLU activation ``silu(gate) * up`` over a fused gate/up projection: reference and switch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from execrt.kernels._triton import fail, import_triton


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """Reference ``x [..., 2I]`` -> ``[..., I]`` as ``MLP`` computes it (each op in x.dtype)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, *, use_triton: bool = False) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x [T, 2I]``: gate first, then up.

    The Triton kernel computes in fp32 and rounds once (the reference rounds silu's result to
    the dtype before multiplying): equal within 1e-6 relative in fp32, about one ulp in
    fp16/bf16. The result is a new contiguous tensor.
    """
    if x.dim() < 1 or x.shape[-1] % 2:
        fail("silu_and_mul", f"x {tuple(x.shape)} must be [..., 2I] (an even last dim)")
    if not use_triton:
        return silu_and_mul_torch(x)
    import_triton()
    from execrt.kernels.triton_activation import silu_and_mul_triton

    return silu_and_mul_triton(x)
