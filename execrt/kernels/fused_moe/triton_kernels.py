"""Triton kernels of the fused MoE: expert alignment, grouped GEMM, top-k sum (imported lazily)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from execrt.kernels._triton import cdiv, next_power_of_2, pdl_kwargs, pow2_at_least
from execrt.kernels.fused_moe.config import GemmTile
from execrt.kernels.triton_dot import dot
from execrt.kernels.triton_pdl import pdl_prologue

# ----------------------------------------------------------------------------------------------
# Alignment: (token, slot) pairs grouped by expert, each segment padded to a multiple of BLOCK_M
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs", "sorted_len", "num_blocks"])
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntp_ptr,
    num_pairs,
    num_experts,
    sorted_len,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program holds every per-expert quantity in registers ([BLOCK_E] vectors), so the
    # whole alignment is a single launch with no scratch memory and no barriers. Its cost is
    # O(pairs x (experts + BLOCK_S)) lane operations: ~2% of the GEMMs' at any batch.
    pdl_prologue(PDL)
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK_S)
    expert_ok = experts < num_experts
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_S):
        ids = tl.load(ids_ptr + start + lanes, mask=start + lanes < num_pairs, other=-1)
        hit = (ids.to(tl.int32)[None, :] == experts[:, None]) & expert_ok[:, None]
        counts += tl.sum(hit.to(tl.int32), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(ntp_ptr, total)

    # Sentinels go only where no pair will land (segment tails, then past the last segment),
    # so no slot is written twice and no ordering between threads is needed.
    for j in range(0, BLOCK_M):
        pos = starts + counts + j
        tl.store(sorted_ptr + pos, tl.zeros_like(pos) + num_pairs, mask=expert_ok & (pos < ends))
    for start in range(total, sorted_len, BLOCK_S):
        pos = start + lanes
        tl.store(sorted_ptr + pos, tl.zeros_like(pos) + num_pairs, mask=pos < sorted_len)

    # Expert of every M-block: the segment holding its first row, -1 past the last segment.
    for start in range(0, num_blocks, BLOCK_S):
        block = start + lanes
        row = (block * BLOCK_M)[:, None]
        inside = (row >= starts[None, :]) & (row < ends[None, :])  # [BLOCK_S, BLOCK_E]
        owner = tl.sum(tl.where(inside, experts[None, :] + 1, 0), axis=1) - 1
        tl.store(expert_ids_ptr + block, owner, mask=block < num_blocks)

    # Scatter: a pair's slot is its expert's cursor plus the number of earlier pairs of this
    # block routed to the same expert; pairs keep their original order within a segment.
    cursor = starts
    earlier = lanes[None, :] < lanes[:, None]  # [BLOCK_S, BLOCK_S]: column before row
    for start in range(0, num_pairs, BLOCK_S):
        pair = start + lanes
        ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
        valid = (ids >= 0) & (ids < num_experts)
        hit = (ids[:, None] == experts[None, :]) & valid[:, None]  # [BLOCK_S, BLOCK_E]
        base = tl.sum(tl.where(hit, cursor[None, :], 0), axis=1)
        rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, pair, mask=valid)
        cursor += tl.sum(hit.to(tl.int32), axis=0)


def launch_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
) -> None:
    num_pairs = topk_ids.numel()
    block_e = pow2_at_least(num_experts)
    block_s = max(16, min(next_power_of_2(num_pairs), 8192 // block_e, 128))
    num_warps = 4 if num_pairs <= 256 else 8 if num_pairs <= 2048 else 16
    _align_kernel[(1,)](
        topk_ids,
        sorted_ids,
        expert_ids,
        num_tokens_post_padded,
        num_pairs,
        num_experts,
        sorted_ids.shape[0],
        expert_ids.shape[0],
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        BLOCK_S=block_s,
        num_warps=num_warps,
        **pdl_kwargs(topk_ids.device),
    )


# ----------------------------------------------------------------------------------------------
# Grouped GEMM: one M-block of one expert times an N-tile of that expert's weights
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks", "rows_per_expert"])
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntp_ptr,
    counts_ptr,
    N,
    K,
    num_pairs,
    num_m_blocks,
    rows_per_expert,
    up_offset,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWIGLU: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    EXPERT_MAJOR: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # GROUP_M consecutive M-blocks (same expert, mostly) sweep the N-tiles together, so an
    # expert's weight tile is read from HBM once and served to the others from L2.
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = tl.arange(0, BLOCK_M)
    if EXPERT_MAJOR:
        # Rows are the expert's own slots: block b of expert e covers rows b*BLOCK_M.. of it.
        blocks_per_expert = tl.cdiv(rows_per_expert, BLOCK_M)
        expert = pid_m // blocks_per_expert
        row0 = (pid_m % blocks_per_expert) * BLOCK_M
        count = tl.load(counts_ptr + expert)
        if row0 >= count:
            return
        row_ok = row0 + offs_m < count
        c_rows = expert.to(tl.int64) * rows_per_expert + row0 + offs_m
        a_rows = c_rows
    else:
        if pid_m * BLOCK_M >= tl.load(ntp_ptr):
            return
        expert = tl.load(expert_ids_ptr + pid_m)
        if expert < 0:
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m)
        row_ok = pair < num_pairs  # padding slots hold the sentinel num_pairs
        c_rows = pair.to(tl.int64)
        a_rows = c_rows // TOP_K

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrap instead of masking the weight loads; offsets inside one expert fit in int32, the
    # expert's base offset (E * N * K elements in all) may not.
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (
        b_ptr
        + expert.to(tl.int64) * stride_be
        + offs_bn[None, :] * stride_bn
        + offs_k[:, None] * stride_bk
    )  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = dot(a, b, acc)  # (IEEE fp32 for fp32 operands)
        if SWIGLU:
            if EVEN_K:
                b_up = tl.load(b_ptrs + up_offset * stride_bn)
            else:
                b_up = tl.load(b_ptrs + up_offset * stride_bn, mask=k_ok[:, None], other=0.0)
            acc_up = dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in fp32
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + c_rows, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@dataclass(frozen=True)
class GemmRows:
    """Which rows of ``a``/``c`` each M-block covers, and the expert it multiplies by.

    Standard: an alignment (``sorted_ids``, ``expert_ids``, ``num_tokens_post_padded``; ``a``
    row = pair // top_k, ``c`` row = pair). Expert-major: ``expert_counts`` and
    ``rows_per_expert`` (row r of expert e is ``e * rows_per_expert + r`` in both).
    """

    block_m: int
    num_m_blocks: int
    sorted_ids: torch.Tensor | None = None
    expert_ids: torch.Tensor | None = None
    num_tokens_post_padded: torch.Tensor | None = None
    expert_counts: torch.Tensor | None = None
    rows_per_expert: int = 0


def launch_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    rows: GemmRows,
    tile: GemmTile,
    *,
    n: int,
    top_k: int,
    swiglu: bool,
    weights: torch.Tensor | None = None,
) -> None:
    """``c[row] = act(a[row] @ b[expert].T)`` (times ``weights[row]`` when given) for the rows
    ``rows`` assigns to each expert.

    ``a [rows, K]``, ``b [E, N or 2N, K]``, ``c [rows, N]`` (2-D views, any strides). With
    ``swiglu``, ``b`` holds gate rows then up rows and ``c`` gets ``silu(gate) * up``.
    """
    k = a.shape[1]
    block_n = min(tile.block_n, pow2_at_least(n))
    block_k = min(tile.block_k, pow2_at_least(k))
    expert_major = rows.expert_counts is not None
    dummy = c  # never read: the flags that would read it are off
    grid = (rows.num_m_blocks * cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        weights if weights is not None else dummy,
        rows.sorted_ids if rows.sorted_ids is not None else dummy,
        rows.expert_ids if rows.expert_ids is not None else dummy,
        rows.num_tokens_post_padded if rows.num_tokens_post_padded is not None else dummy,
        rows.expert_counts if rows.expert_counts is not None else dummy,
        n,
        k,
        a.shape[0] * top_k,
        rows.num_m_blocks,
        rows.rows_per_expert,
        n if swiglu else 0,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        TOP_K=top_k,
        BLOCK_M=rows.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=tile.group_m,
        SWIGLU=swiglu,
        MUL_WEIGHT=weights is not None,
        EXPERT_MAJOR=expert_major,
        EVEN_K=k % block_k == 0,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl_kwargs(a.device),
    )


# ----------------------------------------------------------------------------------------------
# Top-k sum: out[t] = sum over the token's local slots, in slot order (deterministic)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _moe_sum_kernel(
    y_ptr,
    ids_ptr,
    out_ptr,
    H,
    num_experts,
    stride_y,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + t * TOP_K + k)
        # Slots of other ranks' experts were never written: read none of their row.
        limit = tl.where((expert >= 0) & (expert < num_experts), H, 0)
        y = tl.load(y_ptr + (t * TOP_K + k) * stride_y + offs, mask=offs < limit, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < H)


def launch_sum(
    y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out: torch.Tensor
) -> None:
    """``out [T, H] = sum_k y[t*K + k]`` over slots with a local expert; ``y [T*K, H]``."""
    t, top_k = topk_ids.shape
    h = out.shape[1]
    block_h = min(1024, pow2_at_least(h))
    _moe_sum_kernel[(t, cdiv(h, block_h))](
        y, topk_ids, out, h, num_experts, y.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, num_warps=4,
        **pdl_kwargs(y.device),
    )  # fmt: skip
