"""Causal extend (prefill on top of a cached prefix) over the page-size-1 cache."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from execrt.kernels._triton import check_index, fail, pow2_at_least
from execrt.kernels.attention.common import COMPONENT, LOG2E, check_block, check_paged, check_qkvo

# ----------------------------------------------------------------------------------------------
# Tile choices
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtendTiles:
    """Launch shape of the extend kernel: rows of a query tile, KV tokens per loop step, warps
    and software-pipelining depth. ``benchmarks/tune_triton_extend.py`` sweeps these."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Keyed by (bytes per element, padded head dim). The compiled tiles follow fast Hopper
# flash-attention kernels: 128-row query tiles over two warpgroups (8 warps), 64-token K/V
# blocks, 3 stages (K/V gathered two blocks ahead into 3 shared-memory buffers). At bf16
# D=128 that is 128 KB of shared memory and ~200 registers per thread (no spills), from an
# AOT compile for sm90; D=256 halves block_n (160 KB). fp32 runs in TF32 and is not a fast
# path: small tiles keep it far from the shared-memory limit. The 16-bit rows for D 64, 128
# and 256 are the best of benchmarks/tune_triton_extend.py's sweep on an H200 (bf16 and fp16
# measured; at D=256 the 128-row tile is 2.3x the 64-row one); see docs/kernels.md.
_GPU_TILES: dict[tuple[int, int], ExtendTiles] = {
    (2, 16): ExtendTiles(128, 64, 8, 3),
    (2, 32): ExtendTiles(128, 64, 8, 3),
    (2, 64): ExtendTiles(128, 64, 8, 3),
    (2, 128): ExtendTiles(128, 64, 8, 3),
    (2, 256): ExtendTiles(128, 32, 8, 3),
    (4, 16): ExtendTiles(64, 32, 4, 2),
    (4, 32): ExtendTiles(64, 32, 4, 2),
    (4, 64): ExtendTiles(64, 32, 4, 2),
    (4, 128): ExtendTiles(32, 32, 4, 2),
    (4, 256): ExtendTiles(32, 16, 4, 2),
}

# Under the CPU interpreter every tl op is a NumPy call per program: mid-sized tiles keep the
# program count (and so the run time) low while still crossing tile boundaries in small tests.
_CPU_TILES = ExtendTiles(32, 32, 4, 1)

# Share of the L2 cache the query tiles running together may fill with their K/V before the
# schedule moves on to the next group of (request, head) pairs; see _pairs_per_chunk.
L2_SHARE = 0.5
_DEFAULT_L2_BYTES = 50 << 20


def default_extend_tiles(dtype: torch.dtype, head_dim: int, device: torch.device) -> ExtendTiles:
    """The tile table entry for this dtype and (padded) head dim, or the interpreter's tiles."""
    if device.type != "cuda":
        return _CPU_TILES
    key = (4 if dtype == torch.float32 else 2, pow2_at_least(head_dim))
    return _GPU_TILES[key]


def shared_memory_estimate(tiles: ExtendTiles, elem_bytes: int, block_d: int, block_dv: int) -> int:
    """Bytes of shared memory a launch needs: the q tile plus num_stages K and V buffers.

    Matches what Triton allocated for sm90 to within a few percent (it adds small scratch).
    """
    q_tile = tiles.block_m * block_d
    kv_tiles = tiles.num_stages * tiles.block_n * (block_d + block_dv)
    return (q_tile + kv_tiles) * elem_bytes


@functools.lru_cache(maxsize=8)
def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_L2_BYTES
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", _DEFAULT_L2_BYTES))


def _pairs_per_chunk(num_pairs: int, max_kv_len: int, row_bytes: int, l2_bytes: int) -> int:
    """(request, head block) pairs whose query tiles are interleaved longest first.

    The query tiles of one pair all read that pair's K/V; they should run close together so
    later ones find it in L2. Across pairs, long tiles should start first so that the grid
    ends on short ones. Pairs are therefore scheduled in chunks whose K/V fits in a share of
    L2, and inside a chunk the tiles run longest first.
    """
    pair_bytes = max(1, max_kv_len * row_bytes)
    return max(1, min(num_pairs, int(l2_bytes * L2_SHARE) // pair_bytes))


def _default_heads_per_tile(group: int, block_m: int) -> int:
    """Pack the whole GQA group into a tile when it fits, else its largest divisor that does."""
    return max(h for h in range(1, min(group, block_m) + 1) if group % h == 0)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(base, slots, stride, offs, DIM: tl.constexpr, BLOCK: tl.constexpr, mask_n):
    """Gather rows ``base[slots[i] * stride + offs]``; ``mask_n`` None means every row is valid.

    Masks are built only where needed (a padded head dim, a ragged block), so the unmasked
    blocks issue plain vector loads. One return: older Triton rejects returns in branches.
    """
    ptrs = base + slots[:, None] * stride + offs[None, :]
    if mask_n is None:
        if DIM == BLOCK:
            rows = tl.load(ptrs)
        else:
            rows = tl.load(ptrs, mask=(offs < DIM)[None, :], other=0.0)
    else:
        if DIM == BLOCK:
            rows = tl.load(ptrs, mask=mask_n[:, None], other=0.0)
        else:
            rows = tl.load(ptrs, mask=mask_n[:, None] & (offs < DIM)[None, :], other=0.0)
    return rows


# Runtime sizes vary from step to step: keep them out of Triton's divisibility
# specialisation so that a new batch shape never costs a recompile.
@triton.jit(do_not_specialize=["num_m_tiles", "num_head_blocks", "num_pairs", "pairs_per_chunk"])
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    prefix_lens_ptr,
    kv_scales_ptr,
    qk_scale,
    num_m_tiles,
    num_head_blocks,
    num_pairs,
    pairs_per_chunk,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    # A tile is TOKENS consecutive new tokens x HEADS query heads of one kv head: row r holds
    # token r // HEADS and head r % HEADS, so each K/V tile gathered serves every packed head.
    TOKENS: tl.constexpr = BLOCK_M // HEADS

    # Schedule (1-D grid): chunks of pairs_per_chunk (request, head block) pairs; inside a
    # chunk the highest query tiles (the longest causal rows) are dispatched first.
    pid = tl.program_id(0)
    chunk_programs = pairs_per_chunk * num_m_tiles
    chunk = pid // chunk_programs
    local = pid - chunk * chunk_programs
    first_pair = chunk * pairs_per_chunk
    width = tl.minimum(pairs_per_chunk, num_pairs - first_pair)
    m_tile = num_m_tiles - 1 - local // width
    pair = first_pair + local % width
    b = pair // num_head_blocks
    head0 = (pair - b * num_head_blocks) * HEADS  # first query head of the tile
    kv_head = head0 // GROUP

    q_start = tl.load(qo_indptr_ptr + b).to(tl.int32)
    extend_len = tl.load(qo_indptr_ptr + b + 1).to(tl.int32) - q_start
    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int32) - kv_start
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)

    tok0 = m_tile * TOKENS
    offs_r = tl.arange(0, BLOCK_M)
    tok = tok0 + offs_r // HEADS  # [BLOCK_M] new-token index of each row
    heads = head0 + offs_r % HEADS  # [BLOCK_M]
    # Rows past TOKENS * HEADS exist only when HEADS does not divide BLOCK_M.
    row_ok = (offs_r < TOKENS * HEADS) & (tok < extend_len)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = (q_start + tok).to(tl.int64)  # int64: token row * row stride passes 2**31 early

    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q_pos = prefix + tok  # [BLOCK_M] absolute position; the row sees context j <= q_pos
    if KV_SCALED:  # an fp8 cache holds K / k_scale: fold k_scale into the softmax scale
        qk_scale = qk_scale * tl.load(kv_scales_ptr)

    # Context [0, full_hi) is visible to every row (whole blocks, no mask math);
    # [full_hi, kv_hi) holds the diagonal, masked per row. A tile past the request's new
    # tokens gets two empty loops and stores nothing.
    tile_ok = tok0 < extend_len
    last_tok = tl.minimum(tok0 + TOKENS, extend_len) - 1
    kv_hi = tl.where(tile_ok, tl.minimum(prefix + last_tok + 1, kv_len), 0)
    full_hi = tl.where(tile_ok, tl.minimum(prefix + tok0 + 1, kv_hi) // BLOCK_N * BLOCK_N, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    idx_base = kv_indices_ptr + kv_start

    # The slot ids of block i + 1 are loaded during block i and carried over, so the K/V
    # gathers never depend on a load of their own iteration: the pipeliner treats them as
    # direct loads and issues them num_stages - 1 blocks ahead. The first diagonal block's
    # ids are loaded up front, so the switch between the loops waits for one load, not two.
    offs_b = tl.arange(0, BLOCK_N)
    ids = tl.load(idx_base + offs_b, mask=offs_b < full_hi, other=0)
    ids_diag = tl.load(idx_base + full_hi + offs_b, mask=full_hi + offs_b < kv_hi, other=0)

    # The first block processed (full or diagonal) starts at position 0, which every row
    # sees, so m_i is finite from then on and no row computes exp2(-inf - -inf).
    for start in range(0, full_hi, BLOCK_N):
        offs_next = start + BLOCK_N + offs_b
        ids_next = tl.load(idx_base + offs_next, mask=offs_next < full_hi, other=0)
        slots = ids.to(tl.int64)  # [BLOCK_N]; int64 offsets below
        k = _load_rows(k_base, slots, stride_ks, offs_d, HEAD_DIM, BLOCK_D, None).to(q.dtype)
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 domain (qk_scale > 0)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_base, slots, stride_vs, offs_dv, HEAD_DIM_V, BLOCK_DV, None).to(q.dtype)
        # p in the compute dtype: with fp8 V, rounding p to V's dtype would cost the most.
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None])  # [BLOCK_M, BLOCK_DV]
        m_i = m_new
        ids = ids_next

    for start in range(full_hi, kv_hi, BLOCK_N):
        offs_n = start + offs_b
        in_kv = offs_n < kv_hi
        ids_next = tl.load(idx_base + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < kv_hi, other=0)
        slots = ids_diag.to(tl.int64)
        # Columns past kv_hi load zeros, not slot 0's row: p = 0 times NaN would still be NaN.
        k = _load_rows(k_base, slots, stride_ks, offs_d, HEAD_DIM, BLOCK_D, in_kv).to(q.dtype)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_base, slots, stride_vs, offs_dv, HEAD_DIM_V, BLOCK_DV, in_kv).to(q.dtype)
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None])
        m_i = m_new
        ids_diag = ids_next

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_DV]
    if KV_SCALED:  # V / v_scale was stored
        out = out * tl.load(kv_scales_ptr + 1)
    tl.store(
        o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :],
    )


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


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
    kv_scales: torch.Tensor | None = None,
    max_kv_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads_per_tile: int | None = None,
    pairs_per_chunk: int | None = None,
) -> None:
    """Causal prefill attention for new tokens on top of an optional cached prefix.

    The new tokens' K/V must already be stored in the cache. Request b owns query rows
    ``qo_indptr[b] : qo_indptr[b+1]`` of ``q`` / ``o`` and the context slots
    ``kv_indices[kv_indptr[b] : kv_indptr[b+1]]`` (prefix followed by its new tokens, so the
    context length is ``prefix_lens[b] + extend_len[b]``). Its new token i sits at position
    ``prefix_lens[b] + i`` and attends to context positions ``j <= prefix_lens[b] + i``.

    One program handles ``block_m // heads_per_tile`` new tokens of one request times
    ``heads_per_tile`` query heads sharing one kv head, so each gathered K/V tile feeds all of
    them. Context blocks every row sees run without masks; only the diagonal blocks are
    masked. The 1-D grid covers (request, head block, query tile), longest tiles first inside
    chunks of pairs sized to L2. No host synchronisation and no allocation.

    Args:
        q: ``[T, Hq, D]`` fp16/bf16/fp32 new-token queries, last dim contiguous.
        k_buffer: ``[S, Hkv, D]`` key cache on ``q``'s device, in ``q``'s dtype or fp8.
        v_buffer: ``[S, Hkv, Dv]`` value cache, in ``k_buffer``'s dtype.
        o: ``[T, Hq, Dv]`` output, same dtype as ``q``; rows of the requests written in place.
        qo_indptr: int32/int64 ``[B+1]`` offsets of each request's rows in ``q``.
        kv_indptr: int32/int64 ``[>= B+1]`` offsets of each request's context in
            ``kv_indices``.
        kv_indices: int32/int64 slot ids of all contexts, request after request.
        prefix_lens: int32/int64 ``[>= B]`` cached prefix length of each request.
        max_extend_len: upper bound on any request's new-token count (sizes the grid).
        sm_scale: softmax scale, usually ``D ** -0.5``.
        kv_scales: fp32 device tensor whose first two values are ``k_scale`` and ``v_scale``
            (the cache holds ``K / k_scale`` and ``V / v_scale``); required for an fp8 cache.
            As in :func:`decode_attention`: ``sm_scale * k_scale``, output times ``v_scale``,
            K/V converted to ``q``'s dtype, probabilities kept in it.
        max_kv_len: host upper bound on any context length, used only to size the schedule's
            chunks (``None``: ``max_extend_len``).
        block_m: rows per query tile (power of two >= 16); ``None``: :func:`default_extend_tiles`.
        block_n: context tokens per loop step (power of two >= 16); ``None`` likewise.
        num_warps: warps per program; ``None`` likewise.
        num_stages: software pipelining depth of the loops; ``None`` likewise.
        heads_per_tile: query heads packed into a tile, a divisor of ``Hq // Hkv`` that is
            ``<= block_m``; ``None``: the largest such divisor.
        pairs_per_chunk: (request, head block) pairs per schedule chunk (>= 1); ``None``:
            as many as have their K/V fit in half the L2 cache.

    Raises:
        ValueError: on unsupported dtypes, shapes, head dims (> 256), head counts, devices,
            block sizes, head packing, chunk sizes or a negative ``max_extend_len``.
    """
    num_tokens, num_q_heads, num_kv_heads, head_dim, head_dim_v = check_qkvo(
        q, k_buffer, v_buffer, o, kv_scales
    )
    if max_extend_len < 0:
        fail(COMPONENT, f"max_extend_len {max_extend_len} unsupported (supported: >= 0)")
    tiles = default_extend_tiles(q.dtype, max(head_dim, head_dim_v), q.device)
    block_m = tiles.block_m if block_m is None else block_m
    block_n = tiles.block_n if block_n is None else block_n
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    group = num_q_heads // num_kv_heads
    heads = _default_heads_per_tile(group, block_m) if heads_per_tile is None else heads_per_tile
    if heads < 1 or group % heads or heads > block_m:
        fail(
            COMPONENT,
            f"heads_per_tile {heads} unsupported (supported: a divisor of the group size "
            f"{group} that is <= block_m {block_m})",
        )
    if pairs_per_chunk is not None and pairs_per_chunk < 1:
        fail(COMPONENT, f"pairs_per_chunk {pairs_per_chunk} unsupported (supported: >= 1)")
    if qo_indptr.dim() != 1 or qo_indptr.shape[0] < 1:
        fail(COMPONENT, f"qo_indptr must be 1-D [B+1], got shape {tuple(qo_indptr.shape)}")
    batch = qo_indptr.shape[0] - 1
    check_index(COMPONENT, "qo_indptr", qo_indptr, batch + 1)
    check_index(COMPONENT, "prefix_lens", prefix_lens, batch)
    check_paged(
        batch, kv_indptr, kv_indices, q, k_buffer=k_buffer, v_buffer=v_buffer, o=o,
        qo_indptr=qo_indptr, prefix_lens=prefix_lens,
        **({} if kv_scales is None else {"kv_scales": kv_scales}),
    )  # fmt: skip
    if batch == 0 or max_extend_len == 0 or num_tokens == 0:
        return

    num_m_tiles = triton.cdiv(max_extend_len, block_m // heads)
    num_head_blocks = num_q_heads // heads
    num_pairs = batch * num_head_blocks
    if pairs_per_chunk is None:
        row_bytes = (head_dim + head_dim_v) * k_buffer.element_size()
        kv_bound = max_extend_len if max_kv_len is None else max(max_kv_len, max_extend_len)
        pairs_per_chunk = _pairs_per_chunk(num_pairs, kv_bound, row_bytes, _l2_bytes(q.device))
    pairs_per_chunk = min(pairs_per_chunk, num_pairs)
    _extend_kernel[(num_pairs * num_m_tiles,)](
        q,
        k_buffer,
        v_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        prefix_lens,
        prefix_lens if kv_scales is None else kv_scales,  # unread unless KV_SCALED
        sm_scale * LOG2E,
        num_m_tiles,
        num_head_blocks,
        num_pairs,
        pairs_per_chunk,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        o.stride(0),
        o.stride(1),
        GROUP=group,
        HEADS=heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=pow2_at_least(head_dim),
        BLOCK_DV=pow2_at_least(head_dim_v),
        KV_SCALED=kv_scales is not None,
        num_warps=tiles.num_warps if num_warps is None else num_warps,
        num_stages=tiles.num_stages if num_stages is None else num_stages,
    )
