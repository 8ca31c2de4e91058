"""Triton softmax top-k routing: one program per token, the expert row in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from execrt.kernels._triton import check_device, check_float, next_power_of_2, pdl_kwargs
from execrt.kernels.triton_pdl import pdl_prologue


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    real_ptr,
    stride_l,
    num_experts,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_REAL: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < num_experts, other=-float("inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))  # columns past E: exp(-inf) = 0
    probs = e / tl.sum(e, axis=0)
    ks = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        pick = tl.argmax(probs, axis=0, tie_break_left=True)  # the lowest id among equals
        ids = tl.where(ks == k, pick.to(tl.int64), ids)
        weights = tl.where(ks == k, best, weights)
        probs = tl.where(cols == pick, -1.0, probs)  # below every probability, even 0
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    # Round to the logits' dtype, as the model applies the weights in it.
    weights = weights.to(logits_ptr.dtype.element_ty).to(tl.float32)
    if HAS_REAL:
        ids = tl.where(row >= tl.load(real_ptr), -1, ids)
    out = row * TOP_K + ks
    tl.store(ids_ptr + out, ids, mask=ks < TOP_K)
    tl.store(weights_ptr + out, weights, mask=ks < TOP_K)


def topk_softmax_triton(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_token_non_padded: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch over ``logits [T, E]``; see ``router.topk_softmax``."""
    check_float("topk_softmax", "logits", logits)
    check_device("topk_softmax", "logits", logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, weights
    real = num_token_non_padded
    block_e = max(16, next_power_of_2(e))
    _topk_softmax_kernel[(t,)](
        logits,
        ids,
        weights,
        ids if real is None else real,  # never read without HAS_REAL
        logits.stride(0),
        e,
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        HAS_REAL=real is not None,
        BLOCK_E=block_e,
        BLOCK_K=max(2, next_power_of_2(top_k)),
        num_warps=1 if block_e <= 256 else 4,
        **pdl_kwargs(logits.device),
    )
    return ids, weights
