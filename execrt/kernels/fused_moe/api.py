"""Fused-MoE entry points: ``moe_align`` and ``fused_experts`` (the Triton twin of run_experts)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from execrt.core.interfaces import (
    DispatchOutput,
    ExpertMajorDispatchOutput,
    StandardDispatchOutput,
)
from execrt.kernels._triton import check_device
from execrt.kernels.fused_moe.config import MoEConfig, get_config

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERTS = 1024


class MoEAlignment(NamedTuple):
    """(token, slot) pairs grouped by expert, as the grouped GEMM walks them.

    ``sorted_ids [max_padded]`` int32: flat pair indices ``t*K + k``, expert by expert in
    ascending id, each segment padded to a multiple of ``block_m`` with the sentinel ``T*K``
    (slots past ``num_tokens_post_padded`` hold it too). ``expert_ids [max_padded // block_m]``
    int32: expert of each M-block, -1 past the last segment. ``num_tokens_post_padded [1]``
    int32: slots in use. Pairs routed to -1 (or an id outside ``[0, E)``) appear nowhere.
    """

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Slots ``moe_align`` reserves: every hit expert wastes at most ``block_m - 1`` slots and
    at most ``min(E, T*K)`` experts are hit; rounded down to whole blocks (the padded total is
    a multiple of ``block_m`` that never exceeds the bound)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return bound // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Group ``topk_ids [T, K]`` (int32/int64 local ids, -1 = nowhere) by expert; see
    ``MoEAlignment``. One Triton launch, no host synchronisation, sizes from T, K, E only."""
    _check_ids(topk_ids)
    check_device("fused_moe", "topk_ids", topk_ids)
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(
            f"fused_moe: num_experts {num_experts} unsupported (supported: 1..{MAX_EXPERTS})"
        )
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"fused_moe: block_m {block_m} unsupported (power of two >= 16)")
    num_pairs = topk_ids.numel()
    size = max_padded_pairs(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    # The kernel writes the count; only an empty batch needs the memset (one launch less).
    ntp = (torch.empty if num_pairs else torch.zeros)(1, dtype=torch.int32, device=dev)
    if num_pairs:
        from execrt.kernels.fused_moe import triton_kernels

        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        triton_kernels.launch_align(ids, num_experts, block_m, sorted_ids, expert_ids, ntp)
    return MoEAlignment(sorted_ids, expert_ids, ntp)


def fused_experts(
    d: DispatchOutput,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """Triton expert compute with exactly the contract of ``execrt.core.experts.run_experts``.

    ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``, fp16/bf16/fp32 like the
    hidden states. STANDARD: ``[T, H]``, routing weights applied, summed over local slots.
    EXPERT_MAJOR: ``[E, P*C, H]`` unweighted; only the first ``expert_counts[e]`` rows of each
    expert are computed (the rest are left unwritten). Four launches (align, gate/up GEMM with
    SiLU*mul fused, down GEMM, top-k sum; two for expert-major), no host synchronisation,
    shapes from T, K, E, H, I only: capturable in a CUDA graph. ``config`` defaults to the
    shipped table for (E, I, device, dtype) at the nearest token count (see ``get_config``).
    """
    x = d.hidden_states
    num_experts, hidden, inter = _check_weights(x, w13, w2)
    from execrt.kernels.fused_moe import triton_kernels as tk

    if isinstance(d, StandardDispatchOutput):
        t, top_k = d.topk_ids.shape
        _check_ids(d.topk_ids)
        if x.dim() != 2 or x.shape[0] != t or d.topk_weights.shape != d.topk_ids.shape:
            raise ValueError(
                f"fused_moe: hidden {tuple(x.shape)}, topk_ids {tuple(d.topk_ids.shape)} and "
                f"topk_weights {tuple(d.topk_weights.shape)} disagree (need [T, H], [T, K], [T, K])"
            )
        if t == 0:
            return torch.zeros_like(x)
        cfg = config or get_config(num_experts, inter, t, top_k, x.dtype)
        align = moe_align(d.topk_ids, num_experts, cfg.block_m)
        rows = tk.GemmRows(cfg.block_m, align.expert_ids.shape[0], *align)
        act = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)  # [S, I] per pair
        tk.launch_gemm(x, w13, act, rows, cfg.up, n=inter, top_k=top_k, swiglu=True)
        weights = d.topk_weights.reshape(-1).float().contiguous()  # [S]
        y = torch.empty(t * top_k, hidden, dtype=x.dtype, device=x.device)  # [S, H] per pair
        tk.launch_gemm(act, w2, y, rows, cfg.down, n=hidden, top_k=1, swiglu=False, weights=weights)
        # Row-major whatever x's layout: the sum kernel writes each row with unit stride.
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, H]
        ids = d.topk_ids if d.topk_ids.is_contiguous() else d.topk_ids.contiguous()
        tk.launch_sum(y, ids, num_experts, out)
        return out

    if isinstance(d, ExpertMajorDispatchOutput):
        if x.dim() != 3 or x.shape[0] != num_experts or d.expert_counts.shape != (num_experts,):
            raise ValueError(
                f"fused_moe: expert-major hidden {tuple(x.shape)} / expert_counts "
                f"{tuple(d.expert_counts.shape)} do not match E={num_experts} "
                "(need [E, P*C, H] and [E])"
            )
        slots = x.shape[1]
        # Rows past each count stay unwritten, as the contract allows.
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [E, P*C, H]
        if slots == 0:
            return out
        # After an all-to-all each local expert gets ~T*K/E_local rows, as the standard format
        # with E_local experts and T tokens would: the same table entry fits. K is unknown
        # here, so an untuned shape gets the small-batch default (correct, maybe slow).
        cfg = config or get_config(num_experts, inter, max(d.num_tokens, 1), 1, x.dtype)
        blocks = num_experts * -(-slots // cfg.block_m)
        counts = d.expert_counts
        rows = tk.GemmRows(cfg.block_m, blocks, expert_counts=counts, rows_per_expert=slots)
        flat = x.reshape(num_experts * slots, hidden)  # [E*P*C, H]
        act = torch.empty(num_experts * slots, inter, dtype=x.dtype, device=x.device)
        tk.launch_gemm(flat, w13, act, rows, cfg.up, n=inter, top_k=1, swiglu=True)
        out_flat = out.view(num_experts * slots, hidden)
        tk.launch_gemm(act, w2, out_flat, rows, cfg.down, n=hidden, top_k=1, swiglu=False)
        return out
    raise TypeError(f"fused_moe: unknown dispatch output {type(d).__name__}")


def _check_ids(topk_ids: torch.Tensor) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"fused_moe: topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype} unsupported "
            "(supported: [T, K] int32/int64)"
        )
    if topk_ids.shape[1] < 1:
        raise ValueError(f"fused_moe: top_k {topk_ids.shape[1]} unsupported (supported: >= 1)")
    if topk_ids.numel() >= 2**31:
        raise ValueError(f"fused_moe: {topk_ids.numel()} (token, slot) pairs exceed int32")


def _check_weights(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    if x.dtype not in FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"fused_moe: dtypes hidden {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype} unsupported "
            "(supported: one of float16, bfloat16, float32 for all three)"
        )
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} must be 3-D")
    num_experts, two_i, hidden = w13.shape
    inter = w2.shape[2]
    if two_i != 2 * inter or w2.shape[:2] != (num_experts, hidden) or x.shape[-1] != hidden:
        raise ValueError(
            f"fused_moe: shapes hidden {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)} disagree (need [.., H], [E, 2I, H], [E, H, I])"
        )
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(
            f"fused_moe: num_experts {num_experts} unsupported (supported: 1..{MAX_EXPERTS})"
        )
    if w13.device != x.device or w2.device != x.device:
        raise ValueError(
            f"fused_moe: hidden on {x.device}, w13 on {w13.device}, w2 on {w2.device} "
            "(all on one device)"
        )
    check_device("fused_moe", "hidden", x)
    return num_experts, hidden, inter
