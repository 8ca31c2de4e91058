"""Causal extend (prefill on top of a cached prefix) over the page-size-1 cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from execrt.backends.attention.triton_kernels.common import (
    INDEX_DTYPES,
    LOG2E,
    check_block,
    check_devices,
    check_index,
    check_last_dim_contiguous,
    check_qkvo,
    fail,
    pow2_at_least,
)

# ----------------------------------------------------------------------------------------------
# Extend (prefill of new tokens on top of a cached prefix), causal
# ----------------------------------------------------------------------------------------------


def _extend_blocks(row_bytes: int) -> tuple[int, int]:
    """Default (block_m, block_n) for extend given the bytes of one K/V row of one head."""
    # Shared memory holds the q tile plus double-buffered K and V tiles. 64x64 tiles of 256-byte
    # rows (bf16 D=128) take ~80 KB on sm90; wider rows halve block_n (then block_m) so every
    # dtype/head-dim combination stays near 100 KB, well inside the 227 KB per-block limit.
    if row_bytes <= 256:
        return 64, 64
    if row_bytes <= 512:
        return 64, 32
    return 32, 32


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    prefix_lens_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(qo_indptr_ptr + b).to(tl.int32)
    extend_len = tl.load(qo_indptr_ptr + b + 1).to(tl.int32) - q_start
    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int32) - kv_start
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the new tokens
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    rows = (q_start + offs_m).to(tl.int64)  # token rows of q / o; int64 for very long batches

    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    # The last query of this block sees positions < prefix + its index + 1; nothing past that
    # is loaded. Blocks wholly past the request's new tokens get an empty loop and store nothing.
    last_query = tl.minimum((m_block + 1) * BLOCK_M, extend_len)
    kv_hi = tl.minimum(prefix + last_query, kv_len)
    kv_hi = tl.where(m_block * BLOCK_M < extend_len, kv_hi, 0)
    q_pos = prefix + offs_m  # [BLOCK_M] absolute position of each query

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    idx_base = kv_indices_ptr + kv_start
    for start in range(0, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_hi
        slots = tl.load(idx_base + offs_n, mask=mask_n, other=0).to(tl.int64)  # [BLOCK_N]
        k = tl.load(
            k_base + slots[:, None] * stride_ks + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # Position 0 is visible to every query and lies in the first block, so m_new is finite
        # from the first iteration on and no row ever computes exp2(-inf - -inf).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slots[:, None] * stride_vs + offs_dv[None, :],
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_DV]
    tl.store(
        o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_dv[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Causal prefill attention for new tokens on top of an optional cached prefix.

    The new tokens' K/V must already be stored in the cache. Request b owns query rows
    ``qo_indptr[b] : qo_indptr[b+1]`` of ``q`` / ``o`` and the context slots
    ``kv_indices[kv_indptr[b] : kv_indptr[b+1]]`` (prefix followed by its new tokens, so the
    context length is ``prefix_lens[b] + extend_len[b]``). Its new token i sits at position
    ``prefix_lens[b] + i`` and attends to context positions ``j <= prefix_lens[b] + i``.
    Grid ``(B, Hq, cdiv(max_extend_len, block_m))``; KV blocks past the causal limit of a
    query block are skipped. No host synchronisation.

    Args:
        q: ``[T, Hq, D]`` fp16/bf16/fp32 new-token queries, last dim contiguous.
        k_buffer: ``[S, Hkv, D]`` key cache, same dtype and device as ``q``.
        v_buffer: ``[S, Hkv, Dv]`` value cache, same dtype and device as ``q``.
        o: ``[T, Hq, Dv]`` output, same dtype as ``q``; rows of the requests written in place.
        qo_indptr: int32/int64 ``[B+1]`` offsets of each request's rows in ``q``.
        kv_indptr: int32/int64 ``[>= B+1]`` offsets of each request's context in
            ``kv_indices``.
        kv_indices: int32/int64 slot ids of all contexts, request after request.
        prefix_lens: int32/int64 ``[>= B]`` cached prefix length of each request.
        max_extend_len: upper bound on any request's new-token count (sizes the grid).
        sm_scale: softmax scale, usually ``D ** -0.5``.
        block_m: query rows per program (power of two >= 16); ``None`` picks by tile size,
            see :func:`_extend_blocks`.
        block_n: context tokens per loop step (power of two >= 16); ``None`` likewise.
        num_warps: warps per program.
        num_stages: software pipelining depth of the loop.

    Raises:
        ValueError: on unsupported dtypes, shapes, head dims (> 256), head counts, devices,
            block sizes or a negative ``max_extend_len``.
    """
    num_tokens, num_q_heads, num_kv_heads, head_dim, head_dim_v = check_qkvo(
        q, k_buffer, v_buffer, o
    )
    if max_extend_len < 0:
        fail(f"max_extend_len {max_extend_len} unsupported (supported: >= 0)")
    auto_m, auto_n = _extend_blocks(q.element_size() * max(head_dim, head_dim_v))
    block_m = auto_m if block_m is None else block_m
    block_n = auto_n if block_n is None else block_n
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    if qo_indptr.dim() != 1 or qo_indptr.shape[0] < 1:
        fail(f"qo_indptr must be 1-D [B+1], got shape {tuple(qo_indptr.shape)}")
    batch = qo_indptr.shape[0] - 1
    check_index("qo_indptr", qo_indptr, batch + 1, INDEX_DTYPES)
    check_index("kv_indptr", kv_indptr, batch + 1, INDEX_DTYPES)
    check_index("kv_indices", kv_indices, 0, INDEX_DTYPES)
    check_index("prefix_lens", prefix_lens, batch, INDEX_DTYPES)
    check_devices(
        q,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        o=o,
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        prefix_lens=prefix_lens,
    )
    check_last_dim_contiguous(q=q, k_buffer=k_buffer, v_buffer=v_buffer, o=o)
    if batch == 0 or max_extend_len == 0 or num_tokens == 0:
        return

    group = num_q_heads // num_kv_heads
    grid = (batch, num_q_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        prefix_lens,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        o.stride(0),
        o.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=pow2_at_least(head_dim),
        BLOCK_DV=pow2_at_least(head_dim_v),
        num_warps=num_warps,
        num_stages=num_stages,
    )
