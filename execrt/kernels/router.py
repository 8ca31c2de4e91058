"""Softmax top-k MoE routing (Qwen3-MoE / Mixtral style): reference and switch.

``logits [T, E]`` -> ``topk_ids [T, K]`` int64 and ``topk_weights [T, K]`` fp32: the K most
probable experts under ``softmax(logits)`` in fp32, most probable first, their probabilities
optionally renormalised to sum to 1, then rounded to the logits' dtype (as Hugging Face applies
them). Rows at or past ``num_token_non_padded`` (CUDA-graph padding) route nowhere: id -1.
"""

from __future__ import annotations

import torch

from execrt.kernels._triton import fail, import_triton


def topk_softmax_torch(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_token_non_padded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: softmax, torch.topk, renormalise, round, mask (one torch op each)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(logits.dtype).float()
    if num_token_non_padded is not None:  # a device-side mask: capture-safe
        padded = torch.arange(logits.shape[0], device=logits.device)[:, None] >= (
            num_token_non_padded
        )
        ids = ids.masked_fill(padded, -1)
    return ids, weights


def topk_softmax(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_token_non_padded: torch.Tensor | None = None,
    *,
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route every row of ``logits [T, E]`` to its ``top_k`` experts (see the module doc).

    The Triton kernel does it all in one launch, one program per token, instead of the
    reference's ~10 launches. It picks ties by the lowest expert id (torch.topk's order among
    exactly equal probabilities is unspecified on CUDA) and its fp32 arithmetic may differ from
    the reference's in the last bit before the final rounding.
    """
    if logits.dim() != 2:
        fail("topk_softmax", f"logits {tuple(logits.shape)} must be [T, E]")
    if not 1 <= top_k <= logits.shape[1]:
        fail("topk_softmax", f"top_k {top_k} unsupported (supported: 1..{logits.shape[1]})")
    if num_token_non_padded is not None and num_token_non_padded.numel() != 1:
        fail("topk_softmax", "num_token_non_padded must hold one count")
    if not use_triton:
        return topk_softmax_torch(logits, top_k, renormalize, num_token_non_padded)
    import_triton()
    from execrt.kernels.triton_router import topk_softmax_triton

    return topk_softmax_triton(logits, top_k, renormalize, num_token_non_padded)
