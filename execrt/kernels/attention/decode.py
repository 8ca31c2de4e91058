"""Split-KV flash-decoding over the page-size-1 cache: stage 1 per split, stage 2 merge."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from execrt.kernels._triton import check_index, fail, pdl_kwargs, pow2_at_least
from execrt.kernels.attention.common import COMPONENT, LOG2E, check_block, check_paged, check_qkvo
from execrt.kernels.triton_pdl import pdl_prologue

# ----------------------------------------------------------------------------------------------
# Decode: split-KV flash decoding
# ----------------------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    num_splits_ptr,
    part_o_ptr,
    part_lse_ptr,
    kv_scales_ptr,
    qk_scale,
    max_splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KV_SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if KV_SCALED:  # an fp8 cache holds K / k_scale: fold k_scale into the softmax scale
        qk_scale = qk_scale * tl.load(kv_scales_ptr)

    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int32)
    seq_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int32) - kv_start
    # Out-of-range counts are clamped (as in stage 2) so that the launched splits still cover
    # the whole context and a count of 0 cannot divide by zero.
    n_splits = tl.minimum(tl.maximum(tl.load(num_splits_ptr + b), 1), max_splits)
    # Splits are whole multiples of BLOCK_N so only the last block of the context is ragged.
    # split_len * n_splits >= seq_len, so splits at or past n_splits come out empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    heads = kv_head * GROUP + offs_h

    # All GROUP query heads of this kv head share one pass over K/V; rows past GROUP are zero
    # padding so that the tile is tall enough for tl.dot.
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    idx_base = kv_indices_ptr + kv_start
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        # int64: slot * row stride overflows int32 for caches past ~2M slots at 1k elements/row.
        slots = tl.load(idx_base + offs_n, mask=mask_n, other=0).to(tl.int64)  # [BLOCK_N]
        k = tl.load(
            k_base + slots[:, None] * stride_ks + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]; fp8 K converted up, exactly
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Every block holds at least one valid token, so m_new is finite for real rows.
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_H]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slots[:, None] * stride_vs + offs_dv[None, :],
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_DV]
        # p in the compute dtype: with fp8 V, rounding p to V's dtype would cost the most.
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    # Empty splits (no loop iteration) leave l_i == 0: they publish lse = -inf, which stage 2
    # reads as "skip", and do not write their partial row at all.
    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]  # [BLOCK_H, BLOCK_DV]
    if KV_SCALED:  # V / v_scale was stored; the merge is linear, so scale each split here
        out = out * tl.load(kv_scales_ptr + 1)

    tl.store(part_lse_ptr + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)
    po = part_o_ptr + b * stride_pob + split * stride_pos
    tl.store(
        po + heads[:, None] * stride_poh + offs_dv[None, :],
        out,
        mask=(mask_h & nonempty)[:, None] & mask_dv[None, :],
    )


@triton.jit
def _decode_merge_kernel(
    o_ptr,
    num_splits_ptr,
    part_o_ptr,
    part_lse_ptr,
    max_splits,
    stride_ob,
    stride_oh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    n_splits = tl.minimum(tl.maximum(tl.load(num_splits_ptr + b), 1), max_splits)

    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    lse_base = part_lse_ptr + b * stride_plb + head * stride_plh
    lse_all = tl.load(lse_base + offs_s, mask=offs_s < n_splits, other=float("-inf"))  # [BLOCK_S]
    lse_max = tl.max(lse_all, 0)
    # Every split empty (seq_len 0): use 0 as the reference so the exponentials stay 0, not NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    denom = tl.sum(tl.exp2(lse_all - lse_max), 0)

    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    po_base = part_o_ptr + b * stride_pob + head * stride_poh
    for split in range(0, n_splits):
        lse = tl.load(lse_base + split)
        # Empty splits never wrote their partial row; a zero-width load keeps stale memory
        # (possibly NaN) out of the sum, where a zero weight alone would not (0 * NaN).
        width = tl.where(lse > float("-inf"), HEAD_DIM_V, 0)
        part = tl.load(po_base + split * stride_pos + offs_dv, mask=offs_dv < width, other=0.0)
        acc += tl.exp2(lse - lse_max) * part

    out = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        o_ptr + b * stride_ob + head * stride_oh + offs_dv,
        out.to(o_ptr.dtype.element_ty),
        mask=mask_dv,
    )


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_splits: torch.Tensor,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
    sm_scale: float,
    max_splits: int,
    *,
    kv_scales: torch.Tensor | None = None,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Single-token decode attention over a page-size-1 KV cache (split-KV flash decoding).

    Request b attends, for every query head h, to the K/V rows at slots
    ``kv_indices[kv_indptr[b] : kv_indptr[b+1]]`` of kv head ``h // (Hq // Hkv)``, with softmax
    scale ``sm_scale``, and the result is written to ``o[b, h]``. The context is cut into
    ``num_splits[b]`` splits processed in parallel (stage 1, grid ``(B, Hkv, max_splits)``,
    each program covering all query heads of one kv head) and merged with their
    log-sum-exp weights (stage 2, grid ``(B, Hq)``). No host synchronisation and no
    allocation: the launch can be captured in a CUDA graph with fixed ``max_splits``.

    A request with an empty context (``kv_indptr[b+1] == kv_indptr[b]``) gets ``o[b] = 0``.

    Args:
        q: ``[B, Hq, D]`` fp16/bf16/fp32 queries, last dim contiguous.
        k_buffer: ``[S, Hkv, D]`` key cache on ``q``'s device, in ``q``'s dtype or fp8.
        v_buffer: ``[S, Hkv, Dv]`` value cache, in ``k_buffer``'s dtype.
        o: ``[B, Hq, Dv]`` output, same dtype as ``q``; written in place.
        kv_indptr: int32/int64 ``[>= B+1]`` prefix sum of context lengths.
        kv_indices: int32/int64 slot ids of all contexts, request after request.
        num_splits: int32 ``[>= B]``, ``1 <= num_splits[b] <= max_splits`` (see
            :func:`decode_num_splits`); values outside that range are clamped into it.
        partial_o: fp32 ``[>= B, Hq, >= max_splits, Dv]`` scratch, overwritten.
        partial_lse: fp32 ``[>= B, Hq, >= max_splits]`` scratch (log2 domain), overwritten.
        sm_scale: softmax scale, usually ``D ** -0.5``.
        max_splits: split grid dimension (``>= 1``), see :func:`choose_max_splits`.
        kv_scales: fp32 device tensor whose first two values are ``k_scale`` and ``v_scale``
            (the cache holds ``K / k_scale`` and ``V / v_scale``), read on the device so a
            graph replays whatever it holds; required for an fp8 cache. The scores use
            ``sm_scale * k_scale`` and the output is multiplied by ``v_scale``; K and V are
            converted to ``q``'s dtype and the probabilities stay in it.
        block_n: tokens per stage-1 loop step (power of two >= 16).
        num_warps: warps per stage-1 program.
        num_stages: software pipelining depth of the stage-1 loop.

    Raises:
        ValueError: on unsupported dtypes, shapes, head dims (> 256), head counts
            (``Hq % Hkv != 0``), devices, block sizes or ``max_splits < 1``.
    """
    batch, num_q_heads, num_kv_heads, head_dim, head_dim_v = check_qkvo(
        q, k_buffer, v_buffer, o, kv_scales
    )
    if max_splits < 1:
        fail(COMPONENT, f"max_splits {max_splits} unsupported (supported: >= 1)")
    check_block("block_n", block_n)
    check_paged(
        batch, kv_indptr, kv_indices, q, k_buffer=k_buffer, v_buffer=v_buffer, o=o,
        num_splits=num_splits, partial_o=partial_o, partial_lse=partial_lse,
        **({} if kv_scales is None else {"kv_scales": kv_scales}),
    )  # fmt: skip
    check_index(COMPONENT, "num_splits", num_splits, batch, (torch.int32,))
    if partial_o.dtype != torch.float32 or partial_lse.dtype != torch.float32:
        fail(
            COMPONENT,
            f"partial_o/partial_lse dtypes {partial_o.dtype}/{partial_lse.dtype} unsupported "
            "(supported: float32)",
        )
    if (
        partial_o.dim() != 4
        or partial_o.shape[0] < batch
        or partial_o.shape[1] != num_q_heads
        or partial_o.shape[2] < max_splits
        or partial_o.shape[3] != head_dim_v
    ):
        fail(
            COMPONENT,
            f"partial_o shape {tuple(partial_o.shape)} unsupported "
            f"(need [>= {batch}, {num_q_heads}, >= {max_splits}, {head_dim_v}])",
        )
    if (
        partial_lse.dim() != 3
        or partial_lse.shape[0] < batch
        or partial_lse.shape[1] != num_q_heads
        or partial_lse.shape[2] < max_splits
    ):
        fail(
            COMPONENT,
            f"partial_lse shape {tuple(partial_lse.shape)} unsupported "
            f"(need [>= {batch}, {num_q_heads}, >= {max_splits}])",
        )
    if batch == 0:
        return

    group = num_q_heads // num_kv_heads
    _decode_split_kernel[(batch, num_kv_heads, max_splits)](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        num_splits,
        partial_o,
        partial_lse,
        partial_lse if kv_scales is None else kv_scales,  # unread unless KV_SCALED
        sm_scale * LOG2E,
        max_splits,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_H=pow2_at_least(group),
        BLOCK_N=block_n,
        BLOCK_D=pow2_at_least(head_dim),
        BLOCK_DV=pow2_at_least(head_dim_v),
        KV_SCALED=kv_scales is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kwargs(q.device),
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        o,
        num_splits,
        partial_o,
        partial_lse,
        max_splits,
        o.stride(0),
        o.stride(1),
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        HEAD_DIM_V=head_dim_v,
        BLOCK_S=pow2_at_least(max_splits, 2),
        BLOCK_DV=pow2_at_least(head_dim_v),
        num_warps=4 if head_dim_v > 128 else 2,
        **pdl_kwargs(o.device),
    )
