"""Linear layers at decode sizes: ``x @ W^T (+ b)``, optionally with SwiGLU fused into the load.

At a few tokens a projection is a weight stream: cuBLAS's M = 1 kernels read the 2-13 MB
matrices of a small model at 1.2-1.6 TB/s on an H200, and the SwiGLU between gate/up and down
and the RMSNorm before q/k/v and gate/up are one more launch each. ``linear`` sends such calls
to a Triton kernel that streams the weight at close to copy bandwidth (``triton_linear.py``)
and, with ``swiglu=True``, computes ``silu(gate) * up`` while it loads the activations;
``norm_linear`` does the same with a residual add + RMSNorm and, with ``swiglu_out=True``
for gate/up, may apply the SwiGLU to its output instead. Everything else goes to ``F.linear``
(after the separate norm / SwiGLU kernels). ``dense_layer_kernels`` lists what a decode layer
launches under a table's choices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from execrt.kernels._triton import fail, import_triton
from execrt.kernels.activation import silu_and_mul, silu_and_mul_torch
from execrt.kernels.norm import fused_add_rmsnorm, rmsnorm

#: Rows (tokens) up to which the Triton kernel may take a call (a decode batch); larger ones
#: (prefill) are cuBLAS GEMMs. Past ``CUDA_CORE_ROWS`` only the tuned table's tensor-core
#: tiles take a call: a GPU without a table entry at such M runs cuBLAS.
MAX_SKINNY_ROWS = 256


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
        # [T, N]; None where the table runs this call otherwise
        out = _triton_linear().skinny_linear(rows, weight, bias, swiglu=swiglu)
        if out is not None:
            return out.view(*x.shape[:-1], weight.shape[0])
    if swiglu:  # SwiGLU apart, then the plain product's own choice (tile or cuBLAS)
        return linear(silu_and_mul(x, use_triton=use_triton), weight, bias, use_triton=use_triton)
    return F.linear(x, weight, bias)


def norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    swiglu_out: bool = False,
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(rmsnorm(x + residual))`` and ``x + residual``: a norm in front of a projection.

    ``x [T, K]`` is the residual stream itself when ``residual`` is None (the first layer), else
    the delta added to ``residual`` first (in the dtype, as ``fused_add_rmsnorm``). Returns
    ``(out [T, N], new_residual [T, K])`` (``new_residual`` is ``x`` when nothing was added).
    With ``use_triton``, decode-size calls run one kernel that normalises the rows while it
    streams the weight (``skinny_eligible`` plus one dtype for the norm weight and a residual of
    x's layout) where the tuned table says so; others run ``fused_add_rmsnorm`` / ``rmsnorm``,
    then ``linear``.

    ``swiglu_out``: ``weight`` is a gate/up matrix ``[2I, K]`` (gate rows first). Where the
    tuned table fuses SwiGLU into this product's output, ``out`` is ``silu(gate) * up``
    ``[T, I]`` (rounded as ``silu_and_mul`` rounds ``linear``'s output); elsewhere it is the
    gate/up output ``[T, 2I]`` and the caller runs the SwiGLU (``linear(..., swiglu=True)``
    of the next projection). The caller tells the two apart by ``out``'s last dim.
    """
    rows = x.reshape(-1, x.shape[-1])  # [T, K]
    if use_triton and _norm_eligible(rows, weight, norm_weight, residual):
        tlin = _triton_linear()
        tile = None
        if swiglu_out and weight.shape[0] % 2 == 0:
            tile = tlin.tile_for(rows, weight, bias, tlin.SWIGLU_OUT)  # None: no epilogue
        epilogue = tile is not None
        out_shape = (*x.shape[:-1], weight.shape[0] // (2 if epilogue else 1))
        if tile is not None and not tile.fuse_norm:  # the norm kernel, then the epilogue
            normed, new_residual = _norm_apart(x, norm_weight, eps, residual, use_triton)
            out = tlin.launch(normed.reshape(rows.shape), weight, bias, tile, swiglu_out=True)
            return out.view(out_shape), new_residual
        if tile is None:
            tile = tlin.tile_for(rows, weight, bias, tlin.NORM)  # None: the norm apart
        if tile is not None:
            res_rows = None if residual is None else residual.reshape(rows.shape)
            new_res = None if res_rows is None else torch.empty_like(rows)
            norm = tlin.NormIn(norm_weight, eps, res_rows, new_res)
            out = tlin.launch(rows, weight, bias, tile, swiglu_out=epilogue, norm=norm)
            return out.view(out_shape), (x if new_res is None else new_res.view(x.shape))
    normed, new_residual = _norm_apart(x, norm_weight, eps, residual, use_triton)
    return linear(normed, weight, bias, use_triton=use_triton), new_residual


def _norm_apart(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual), x + residual)`` as a kernel of its own."""
    if residual is None:
        return rmsnorm(x, norm_weight, eps, use_triton=use_triton), x
    return fused_add_rmsnorm(x, residual, norm_weight, eps, use_triton=use_triton)


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


def dense_layer_kernels(
    pick: Callable[[int, int, int, str], Any],
    m: int,
    *,
    hidden: int,
    qkv_out: int,
    attn_out: int,
    intermediate: int,
) -> list[str]:
    """The norm / projection / activation kernels one dense decoder layer launches at ``m``
    rows with ``use_triton``, in order, as ``norm_linear``, ``linear`` and ``MLP.down`` decide
    them: ``pick(m, N, K, variant)`` is the tile choice (``triton_linear.choose`` over a
    table; None: that variant runs apart). Names: ``skinny[fused parts](proj)``,
    ``cublas(proj)``, ``norm``, ``silu_and_mul``. The layer adds q/k norm + RoPE (one kernel)
    and the attention backend's kernels (Triton decode: split and merge)."""
    skinny = 0 < m <= MAX_SKINNY_ROWS

    def product(name: str, n: int, k: int, variant: str = "") -> list[str]:
        tile = pick(m, n, k, variant) if skinny else None
        if variant and tile is None:  # the fused part apart, then the plain choice
            apart = "norm" if variant == "norm" else "silu_and_mul"
            return [apart, *product(name, n, k)]
        if tile is None:
            return [f"cublas({name})"]
        return [f"skinny[{variant}]({name})" if variant else f"skinny({name})"]

    def behind_norm(name: str, n: int, k: int) -> list[str]:
        tile = pick(m, n, k, "norm") if skinny else None
        if tile is not None and tile.fuse_norm:
            return [f"skinny[norm]({name})"]
        return ["norm", *product(name, n, k)]

    kernels = [*behind_norm("qkv", qkv_out, hidden), *product("o", hidden, attn_out)]
    epilogue = pick(m, 2 * intermediate, hidden, "swiglu_out") if skinny else None
    if epilogue is None:
        kernels += behind_norm("gate_up", 2 * intermediate, hidden)
        return kernels + product("down", hidden, intermediate, "swiglu_in")
    if epilogue.fuse_norm:
        kernels.append("skinny[norm+swiglu_out](gate_up)")
    else:
        kernels += ["norm", "skinny[swiglu_out](gate_up)"]
    return kernels + product("down", hidden, intermediate)
