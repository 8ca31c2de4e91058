"""RMSNorm and fused residual-add + RMSNorm: torch references and the switch to Triton."""

from __future__ import annotations

import torch

from execrt.kernels._triton import import_triton


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference ``x [..., H]`` -> ``[..., H]``: normalise in fp32, cast to ``x.dtype``, scale.

    The double rounding (normalised value rounded to the input dtype, then the product with the
    weight rounded again) is what Hugging Face does, and the Triton kernel reproduces it.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rmsnorm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``new_residual = x + residual`` in the input dtype, and its RMSNorm."""
    new_residual = x + residual  # [T, H]
    return rmsnorm_torch(new_residual, weight, eps), new_residual


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool = False
) -> torch.Tensor:
    """RMSNorm of each row of ``x [T, H]`` (any leading dims) with ``weight [H]``.

    ``use_triton`` (see ``execrt.kernels.use_triton``) picks the one-launch Triton kernel; the
    result's dtype is ``x.dtype`` promoted with ``weight.dtype``, as in the reference.
    """
    if not use_triton:
        return rmsnorm_torch(x, weight, eps)
    import_triton()
    from execrt.kernels.triton_norm import rmsnorm_triton

    return rmsnorm_triton(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` with ``new_residual = x + residual`` and its RMSNorm.

    ``x`` and ``residual`` are ``[T, H]`` of one dtype; both results are new tensors (the
    inputs are not modified), ``new_residual`` in the input dtype as ``h = h + attn_out`` is.
    """
    if not use_triton:
        return fused_add_rmsnorm_torch(x, residual, weight, eps)
    import_triton()
    from execrt.kernels.triton_norm import fused_add_rmsnorm_triton

    return fused_add_rmsnorm_triton(x, residual, weight, eps)
