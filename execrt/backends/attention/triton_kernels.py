"""Triton kernels for paged (page size 1) decode and extend attention over a slot KV cache."""

from __future__ import annotations

from typing import NoReturn

import torch
import triton
import triton.language as tl

# Largest head dim the kernels accept. Bigger dims would need tiles that overflow registers and
# shared memory at the block sizes used here.
MAX_HEAD_DIM = 256

# Stage 1 of decode processes one (request, kv head, split) per program. A program must be
# worth its fixed cost (loading q, writing a partial row per head, one more merge step in stage
# 2), so a split should not be shorter than this many tokens.
DEFAULT_MIN_SPLIT_LEN = 256

# Upper bound on the split grid dimension: the partial buffers grow linearly with it and stage 2
# merges splits sequentially, so past this point more splits cost more than they return.
DEFAULT_MAX_SPLITS_CAP = 64

# How many stage-1 programs per SM the split policy aims for. Several programs fit on one SM at
# once (the tiles need well under a quarter of the shared memory), so one "wave" of `num_sms`
# programs leaves most of the machine idle; four gives enough resident work to keep HBM busy and
# keeps the tail of the last wave short. A starting point, to be tuned on the GPU.
_TARGET_PROGRAMS_PER_SM = 4

_LOG2E = 1.4426950408889634

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(message: str) -> NoReturn:
    raise ValueError(f"triton attention: {message}")


def _check_index(name: str, t: torch.Tensor, min_len: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dim() != 1:
        _fail(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(f"{name} dtype {t.dtype} unsupported (supported: {', '.join(map(str, dtypes))})")
    if t.shape[0] < min_len:
        _fail(f"{name} has {t.shape[0]} entries, need at least {min_len}")
    if t.shape[0] > 0 and t.stride(0) != 1:
        _fail(f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_devices(ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != ref.device:
            _fail(f"{name} is on {t.device} but q is on {ref.device} (all inputs on one device)")


def _check_head_dim(name: str, dim: int) -> None:
    if not 1 <= dim <= MAX_HEAD_DIM:
        _fail(f"{name} {dim} unsupported (supported: 1..{MAX_HEAD_DIM})")


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    # The kernels vectorise along the head dim, so only the last stride has to be 1; the others
    # are passed to the kernels and may be anything (e.g. slices of a larger static buffer).
    for name, t in tensors.items():
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            _fail(f"{name} must be contiguous in its last dim, got strides {tuple(t.stride())}")


def _check_block(name: str, value: int, minimum: int = 16) -> None:
    if value < minimum or value & (value - 1):
        _fail(f"{name} {value} unsupported (supported: a power of two >= {minimum})")


def _check_qkvo(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """Validate q/k/v/o ranks, dtypes and shapes; return (rows, Hq, Hkv, D, Dv)."""
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o)):
        if t.dim() != 3:
            _fail(f"{name} must be 3-D, got shape {tuple(t.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        _fail(f"q dtype {q.dtype} unsupported (supported: float16, bfloat16, float32)")
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o)):
        if t.dtype != q.dtype:
            _fail(f"{name} dtype {t.dtype} differs from q dtype {q.dtype} (must match)")
    rows, num_q_heads, head_dim = q.shape
    num_slots, num_kv_heads, k_dim = k_buffer.shape
    head_dim_v = v_buffer.shape[2]
    if k_dim != head_dim:
        _fail(f"k_buffer head dim {k_dim} differs from q head dim {head_dim}")
    if tuple(v_buffer.shape[:2]) != (num_slots, num_kv_heads):
        _fail(
            f"v_buffer shape {tuple(v_buffer.shape)} does not match "
            f"k_buffer shape {tuple(k_buffer.shape)} in its first two dims"
        )
    if tuple(o.shape) != (rows, num_q_heads, head_dim_v):
        _fail(f"o shape {tuple(o.shape)} unsupported (expected {(rows, num_q_heads, head_dim_v)})")
    _check_head_dim("head_dim", head_dim)
    _check_head_dim("head_dim_v", head_dim_v)
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        _fail(
            f"{num_q_heads} query heads unsupported with {num_kv_heads} kv heads "
            "(supported: Hq a multiple of Hkv)"
        )
    return rows, num_q_heads, num_kv_heads, head_dim, head_dim_v


def _pow2_at_least(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------------------------
# KV index construction
# ----------------------------------------------------------------------------------------------


@triton.jit
def _build_kv_indices_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    stride_req_row,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    # int64 row offset: R * max_ctx can exceed 2**31 for large pools.
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    out_start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    src = req_to_token_ptr + row * stride_req_row
    dst = kv_indices_ptr + out_start
    for start in range(0, seq_len, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < seq_len
        slots = tl.load(src + offs, mask=mask)
        tl.store(dst + offs, slots.to(kv_indices_ptr.dtype.element_ty), mask=mask)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """Gather each request's context slot ids into the flat ``kv_indices`` buffer.

    For every request b, copies ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` into
    ``kv_indices[kv_indptr[b] : kv_indptr[b] + seq_lens[b]]``. One Triton program per request;
    no host synchronisation and no allocation, so the call can be captured in a CUDA graph.
    Entries of ``kv_indices`` past ``kv_indptr[B]`` are left untouched.

    Args:
        req_to_token: int32 ``[R, max_ctx]`` slot table, last dim contiguous.
        req_pool_indices: int32/int64 ``[B]`` row of ``req_to_token`` for each request.
        seq_lens: int32/int64 ``[B]`` context length of each request (``<= max_ctx``).
        kv_indptr: int32/int64 ``[>= B+1]`` prefix sum of ``seq_lens``, filled by the caller.
        kv_indices: int32/int64 ``[>= sum(seq_lens)]`` output (written in place).

    All tensors live on one device. ``B == 0`` is a no-op.

    Raises:
        ValueError: on wrong ranks, dtypes, lengths or devices.
    """
    if req_to_token.dim() != 2:
        _fail(f"req_to_token must be 2-D [R, max_ctx], got shape {tuple(req_to_token.shape)}")
    if req_to_token.dtype not in _INDEX_DTYPES:
        _fail(f"req_to_token dtype {req_to_token.dtype} unsupported (supported: int32, int64)")
    batch = req_pool_indices.shape[0] if req_pool_indices.dim() == 1 else -1
    _check_index("req_pool_indices", req_pool_indices, 0, _INDEX_DTYPES)
    _check_index("seq_lens", seq_lens, batch, _INDEX_DTYPES)
    if seq_lens.shape[0] != batch:
        _fail(f"seq_lens has {seq_lens.shape[0]} entries but req_pool_indices has {batch}")
    _check_index("kv_indptr", kv_indptr, batch + 1, _INDEX_DTYPES)
    _check_index("kv_indices", kv_indices, 0, _INDEX_DTYPES)
    _check_devices(
        req_to_token,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
    )
    if req_to_token.shape[1] > 1 and req_to_token.stride(1) != 1:
        _fail(
            f"req_to_token must be contiguous in its last dim, got {tuple(req_to_token.stride())}"
        )
    if batch == 0:
        return
    _build_kv_indices_kernel[(batch,)](
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_indptr,
        kv_indices,
        req_to_token.stride(0),
        BLOCK=512,
    )


# ----------------------------------------------------------------------------------------------
# Split policy
# ----------------------------------------------------------------------------------------------


def decode_num_splits(
    seq_lens: torch.Tensor,
    num_splits_out: torch.Tensor,
    max_splits: int,
    min_split_len: int,
) -> None:
    """Write the per-request KV split count used by :func:`decode_attention`.

    ``num_splits_out[b] = clamp(cdiv(seq_lens[b], min_split_len), 1, max_splits)`` for
    ``b < B``; entries past ``B`` are untouched. Runs on the device with no host
    synchronisation, so it may be captured in a CUDA graph together with the decode launch.

    Args:
        seq_lens: int32/int64 ``[B]`` context lengths.
        num_splits_out: int32 ``[>= B]`` output, same device as ``seq_lens``.
        max_splits: grid split dimension that the decode launch will use (``>= 1``).
        min_split_len: shortest split worth a program, in tokens (``>= 1``).

    Raises:
        ValueError: on bad dtypes, lengths, devices or non-positive ``max_splits`` /
            ``min_split_len``.
    """
    _check_index("seq_lens", seq_lens, 0, _INDEX_DTYPES)
    batch = seq_lens.shape[0]
    _check_index("num_splits_out", num_splits_out, batch, (torch.int32,))
    if num_splits_out.device != seq_lens.device:
        _fail(f"num_splits_out is on {num_splits_out.device}, seq_lens on {seq_lens.device}")
    if max_splits < 1:
        _fail(f"max_splits {max_splits} unsupported (supported: >= 1)")
    if min_split_len < 1:
        _fail(f"min_split_len {min_split_len} unsupported (supported: >= 1)")
    if batch == 0:
        return
    splits = torch.div(seq_lens + (min_split_len - 1), min_split_len, rounding_mode="floor")
    num_splits_out[:batch].copy_(splits.clamp_(1, max_splits))


def choose_max_splits(
    batch_size: int,
    max_seq_len: int,
    num_kv_heads: int,
    num_sms: int,
    *,
    min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
    cap: int = DEFAULT_MAX_SPLITS_CAP,
) -> int:
    """Pick the split grid dimension for a decode launch (host-side policy, no device work).

    Stage 1 runs ``batch_size * num_kv_heads * max_splits`` programs. Decode is bandwidth bound,
    so the goal is enough programs to keep every SM streaming K/V: about
    ``_TARGET_PROGRAMS_PER_SM * num_sms`` of them. Small batches with long contexts get many
    splits (one 32k request can then fill the GPU); large batches already have enough programs
    and get few or one, which keeps the stage-2 merge and the partial buffers small. A split
    shorter than ``min_split_len`` is never useful, so the result is also bounded by
    ``cdiv(max_seq_len, min_split_len)``, by ``cap``, and is at least 1.

    Pass the same ``min_split_len`` to :func:`decode_num_splits`.

    Args:
        batch_size: number of decode requests (``>= 0``; 0 returns 1).
        max_seq_len: longest context the launch may see, in tokens (``>= 0``).
        num_kv_heads: KV heads per layer on this device (``>= 1``).
        num_sms: streaming multiprocessors on the device (``>= 1``).
        min_split_len: shortest split worth a program, in tokens (``>= 1``).
        cap: upper bound on the result (``>= 1``).

    Returns:
        The ``max_splits`` grid dimension, ``1 <= max_splits <= cap``.

    Raises:
        ValueError: on out-of-range arguments.
    """
    if batch_size < 0 or max_seq_len < 0:
        _fail(f"batch_size {batch_size} / max_seq_len {max_seq_len} unsupported (need >= 0)")
    if num_kv_heads < 1 or num_sms < 1:
        _fail(f"num_kv_heads {num_kv_heads} / num_sms {num_sms} unsupported (need >= 1)")
    if min_split_len < 1 or cap < 1:
        _fail(f"min_split_len {min_split_len} / cap {cap} unsupported (need >= 1)")
    work_items = max(1, batch_size * num_kv_heads)
    wanted = -(-_TARGET_PROGRAMS_PER_SM * num_sms // work_items)
    useful = -(-max_seq_len // min_split_len)
    return max(1, min(wanted, useful, cap))


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
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

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
        )  # [BLOCK_N, BLOCK_D]
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
        )  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Empty splits (no loop iteration) leave l_i == 0: they publish lse = -inf, which stage 2
    # reads as "skip", and do not write their partial row at all.
    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]  # [BLOCK_H, BLOCK_DV]

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
):
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
    block_n: int = 64,
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
        k_buffer: ``[S, Hkv, D]`` key cache, same dtype and device as ``q``.
        v_buffer: ``[S, Hkv, Dv]`` value cache, same dtype and device as ``q``.
        o: ``[B, Hq, Dv]`` output, same dtype as ``q``; written in place.
        kv_indptr: int32/int64 ``[>= B+1]`` prefix sum of context lengths.
        kv_indices: int32/int64 slot ids of all contexts, request after request.
        num_splits: int32 ``[>= B]``, ``1 <= num_splits[b] <= max_splits`` (see
            :func:`decode_num_splits`); values outside that range are clamped into it.
        partial_o: fp32 ``[>= B, Hq, >= max_splits, Dv]`` scratch, overwritten.
        partial_lse: fp32 ``[>= B, Hq, >= max_splits]`` scratch (log2 domain), overwritten.
        sm_scale: softmax scale, usually ``D ** -0.5``.
        max_splits: split grid dimension (``>= 1``), see :func:`choose_max_splits`.
        block_n: tokens per stage-1 loop step (power of two >= 16).
        num_warps: warps per stage-1 program.
        num_stages: software pipelining depth of the stage-1 loop.

    Raises:
        ValueError: on unsupported dtypes, shapes, head dims (> 256), head counts
            (``Hq % Hkv != 0``), devices, block sizes or ``max_splits < 1``.
    """
    batch, num_q_heads, num_kv_heads, head_dim, head_dim_v = _check_qkvo(q, k_buffer, v_buffer, o)
    if max_splits < 1:
        _fail(f"max_splits {max_splits} unsupported (supported: >= 1)")
    _check_block("block_n", block_n)
    _check_index("kv_indptr", kv_indptr, batch + 1, _INDEX_DTYPES)
    _check_index("kv_indices", kv_indices, 0, _INDEX_DTYPES)
    _check_index("num_splits", num_splits, batch, (torch.int32,))
    if partial_o.dtype != torch.float32 or partial_lse.dtype != torch.float32:
        _fail(
            f"partial_o/partial_lse dtypes {partial_o.dtype}/{partial_lse.dtype} unsupported "
            "(supported: float32)"
        )
    if (
        partial_o.dim() != 4
        or partial_o.shape[0] < batch
        or partial_o.shape[1] != num_q_heads
        or partial_o.shape[2] < max_splits
        or partial_o.shape[3] != head_dim_v
    ):
        _fail(
            f"partial_o shape {tuple(partial_o.shape)} unsupported "
            f"(need [>= {batch}, {num_q_heads}, >= {max_splits}, {head_dim_v}])"
        )
    if (
        partial_lse.dim() != 3
        or partial_lse.shape[0] < batch
        or partial_lse.shape[1] != num_q_heads
        or partial_lse.shape[2] < max_splits
    ):
        _fail(
            f"partial_lse shape {tuple(partial_lse.shape)} unsupported "
            f"(need [>= {batch}, {num_q_heads}, >= {max_splits}])"
        )
    _check_devices(
        q,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        o=o,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        num_splits=num_splits,
        partial_o=partial_o,
        partial_lse=partial_lse,
    )
    _check_last_dim_contiguous(
        q=q, k_buffer=k_buffer, v_buffer=v_buffer, o=o, partial_o=partial_o, partial_lse=partial_lse
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
        sm_scale * _LOG2E,
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
        BLOCK_H=_pow2_at_least(group),
        BLOCK_N=block_n,
        BLOCK_D=_pow2_at_least(head_dim),
        BLOCK_DV=_pow2_at_least(head_dim_v),
        num_warps=num_warps,
        num_stages=num_stages,
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
        BLOCK_S=_pow2_at_least(max_splits, 2),
        BLOCK_DV=_pow2_at_least(head_dim_v),
        num_warps=4 if head_dim_v > 128 else 2,
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
    num_tokens, num_q_heads, num_kv_heads, head_dim, head_dim_v = _check_qkvo(
        q, k_buffer, v_buffer, o
    )
    if max_extend_len < 0:
        _fail(f"max_extend_len {max_extend_len} unsupported (supported: >= 0)")
    auto_m, auto_n = _extend_blocks(q.element_size() * max(head_dim, head_dim_v))
    block_m = auto_m if block_m is None else block_m
    block_n = auto_n if block_n is None else block_n
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    if qo_indptr.dim() != 1 or qo_indptr.shape[0] < 1:
        _fail(f"qo_indptr must be 1-D [B+1], got shape {tuple(qo_indptr.shape)}")
    batch = qo_indptr.shape[0] - 1
    _check_index("qo_indptr", qo_indptr, batch + 1, _INDEX_DTYPES)
    _check_index("kv_indptr", kv_indptr, batch + 1, _INDEX_DTYPES)
    _check_index("kv_indices", kv_indices, 0, _INDEX_DTYPES)
    _check_index("prefix_lens", prefix_lens, batch, _INDEX_DTYPES)
    _check_devices(
        q,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        o=o,
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        prefix_lens=prefix_lens,
    )
    _check_last_dim_contiguous(q=q, k_buffer=k_buffer, v_buffer=v_buffer, o=o)
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
        sm_scale * _LOG2E,
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
        BLOCK_D=_pow2_at_least(head_dim),
        BLOCK_DV=_pow2_at_least(head_dim_v),
        num_warps=num_warps,
        num_stages=num_stages,
    )
