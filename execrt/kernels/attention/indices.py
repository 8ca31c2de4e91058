"""Device-side index building: request slot lists and per-request KV split counts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from execrt.kernels._triton import (
    check_index,
    check_index_build,
    check_same_device,
    fail,
    pdl_kwargs,
    pow2_at_least,
)
from execrt.kernels.attention.common import (
    COMPONENT,
    DEFAULT_MAX_SPLITS_CAP,
    DEFAULT_MIN_SPLIT_LEN,
    DEFAULT_PROGRAMS_PER_SM,
    DEFAULT_TARGET_SPLIT_LEN,
)
from execrt.kernels.triton_pdl import pdl_prologue

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
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    out_start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    _copy_request_slots(
        req_to_token_ptr, req_pool_indices_ptr, kv_indices_ptr, stride_req_row, b, seq_len,
        out_start, BLOCK,
    )  # fmt: skip


@triton.jit
def _copy_request_slots(
    req_to_token_ptr,
    req_pool_indices_ptr,
    kv_indices_ptr,
    stride_req_row,
    b,
    seq_len,
    out_start,
    BLOCK: tl.constexpr,
):
    """Request b's first ``seq_len`` slot ids -> ``kv_indices[out_start:]``."""
    # int64 row offset: R * max_ctx can exceed 2**31 for large pools.
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    src = req_to_token_ptr + row * stride_req_row
    dst = kv_indices_ptr + out_start
    for start in range(0, seq_len, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < seq_len
        slots = tl.load(src + offs, mask=mask)
        tl.store(dst + offs, slots.to(kv_indices_ptr.dtype.element_ty), mask=mask)


def launch_build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """One program per request; inputs validated by ``kv_indices.fill_kv_index``."""
    _build_kv_indices_kernel[(seq_lens.shape[0],)](
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_indptr,
        kv_indices,
        req_to_token.stride(0),
        BLOCK=512,
        **pdl_kwargs(req_to_token.device),
    )


# ----------------------------------------------------------------------------------------------
# Split policy
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitPolicy:
    """How decode cuts each context into KV splits (measured on an H200, see docs/kernels.md).

    Each split is one stage-1 program per KV head. Splits near ``target_split_len`` tokens
    stream best; shorter ones pay the fixed per-program cost (q load, partial write, merge)
    too often, longer ones leave too few programs in flight. When the batch is too small to
    give every SM ``programs_per_sm`` programs, splits shrink (down to ``min_split_len``)
    until it does.
    """

    min_split_len: int = DEFAULT_MIN_SPLIT_LEN
    target_split_len: int = DEFAULT_TARGET_SPLIT_LEN
    cap: int = DEFAULT_MAX_SPLITS_CAP
    programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM

    def __post_init__(self) -> None:
        if (
            not 1 <= self.min_split_len <= self.target_split_len
            or min(self.cap, self.programs_per_sm) < 1
        ):
            fail(
                COMPONENT,
                f"split policy {self} unsupported (need 1 <= min <= target, cap >= 1, "
                "programs_per_sm >= 1)",
            )

    @classmethod
    def with_target(cls, target_split_len: int) -> SplitPolicy:
        """The default policy with ``target_split_len`` tokens per split (the minimum split
        lowered to it where it is shorter)."""
        return cls(
            min_split_len=min(DEFAULT_MIN_SPLIT_LEN, target_split_len),
            target_split_len=target_split_len,
        )

    def min_splits(self, batch_size: int, num_kv_heads: int, num_sms: int) -> int:
        """Splits every request should have for ``programs_per_sm`` programs on every SM."""
        return max(1, -(-self.programs_per_sm * num_sms // max(1, batch_size * num_kv_heads)))

    def max_splits(self, batch_size: int, max_seq_len: int, num_kv_heads: int, num_sms: int) -> int:
        """The most splits any request of the batch can get (the partial buffers' split
        dimension; stage 1's grid no longer follows it, see ``decode_programs``)."""
        fill = self.min_splits(batch_size, num_kv_heads, num_sms)
        by_len = -(-max_seq_len // self.target_split_len)
        useful = -(-max_seq_len // self.min_split_len)
        return max(1, min(max(fill, by_len), useful, self.cap))


def decode_num_splits(
    seq_lens: torch.Tensor,
    num_splits_out: torch.Tensor,
    max_splits: int,
    policy: SplitPolicy,
    min_splits: int = 1,
    wave: int = 0,
) -> None:
    """Write each request's KV split count for :func:`decode_attention` (device op, no sync).

    ``n[b] = max(cdiv(len, target), min_splits)``, then at most ``cdiv(len, min_split_len)``
    and clamped to ``[1, max_splits]``, for ``b < B``; entries past ``B`` are untouched.
    ``n[b]`` depends only on ``len[b]``, ``min_splits`` (from the batch size) and the policy,
    so eager steps and graph replays of the same batch size split identically.

    ``wave`` (0: off): the work items per kv head the decode launch runs at once (its
    programs resident together, :func:`execrt.kernels.attention.decode_wave`). Where the
    items are more than a wave, each request is cut at ``wave // B`` splits when one wave of
    those beats the waves it would take (:func:`wave_cap`'s rule): 32 requests of 8.2k tokens
    on one-warp programs of which an H200 holds 1,188 went from 5 splits (1,280 programs,
    two waves) to 4. Then ``n[b]`` depends on the whole batch's lengths too.

    Args:
        seq_lens: int32/int64 ``[B]`` context lengths.
        num_splits_out: int32 ``[>= B]`` output, same device as ``seq_lens``.
        max_splits: the most splits per request the decode launch will use (``>= 1``).
        policy: the split policy.
        min_splits: splits wanted per request to fill the GPU (see SplitPolicy.min_splits).
        wave: work items per kv head the launch runs at once (0: no wave rule).

    Raises:
        ValueError: on bad dtypes, lengths, devices or non-positive counts.
    """
    check_index(COMPONENT, "seq_lens", seq_lens, 0)
    batch = seq_lens.shape[0]
    check_index(COMPONENT, "num_splits_out", num_splits_out, batch, (torch.int32,))
    check_same_device(COMPONENT, seq_lens, num_splits_out=num_splits_out)
    check_split_range(max_splits, min_splits)
    check_wave(wave)
    if batch == 0:
        return
    lens = seq_lens.to(torch.int64)
    by_len = torch.div(
        lens + (policy.target_split_len - 1), policy.target_split_len, rounding_mode="floor"
    )
    useful = torch.div(
        lens + (policy.min_split_len - 1), policy.min_split_len, rounding_mode="floor"
    )
    splits = torch.minimum(by_len.clamp_(min=min_splits), useful).clamp_(1, max_splits)
    if wave > 0 and wave >= batch:
        cap = wave // batch
        capped = splits.clamp(max=cap)
        # wave_cap's rule: the longest item's tokens, and the waves the items take.
        longest = torch.div(lens + splits - 1, splits, rounding_mode="floor").max()
        longest_capped = torch.div(lens + capped - 1, capped, rounding_mode="floor").max()
        waves = torch.div(splits.sum() + wave - 1, wave, rounding_mode="floor")
        splits = torch.where(longest_capped < waves * longest, capped, splits)
    num_splits_out[:batch].copy_(splits)


def wave_cap(lens: list[int], counts: list[int], wave: int) -> list[int]:
    """The split counts after the wave rule, on the host (the kernels' rule, for tests and
    docs): with ``B`` requests whose ``counts`` come to more items than ``wave``, every count
    is cut to ``wave // B`` (all items then run in one wave) where the longest item that
    leaves is shorter than ``waves`` x today's longest (``waves`` = ceil(items / wave): a
    launch of equal items takes about that many item times). Unchanged otherwise, or with
    ``wave`` 0 or below ``B``."""
    batch = len(counts)
    if wave <= 0 or wave < batch or sum(counts) <= wave:
        return list(counts)
    cap = wave // batch
    capped = [min(n, cap) for n in counts]
    longest = max(-(-ln // n) for ln, n in zip(lens, counts, strict=True))
    longest_capped = max(-(-ln // n) for ln, n in zip(lens, capped, strict=True))
    waves = -(-sum(counts) // wave)
    return capped if longest_capped < waves * longest else list(counts)


def check_wave(wave: int) -> None:
    if not isinstance(wave, int) or isinstance(wave, bool) or wave < 0:
        fail(COMPONENT, f"wave {wave!r} unsupported (work items per kv head >= 0; 0: off)")


def check_split_range(max_splits: int, min_splits: int) -> None:
    if max_splits < 1 or min_splits < 1:
        fail(
            COMPONENT, f"max_splits {max_splits} / min_splits {min_splits} unsupported (need >= 1)"
        )


# ----------------------------------------------------------------------------------------------
# The whole decode metadata in one launch
# ----------------------------------------------------------------------------------------------


@triton.jit
def slot_offsets(ids, SLOT_I32: tl.constexpr):
    """Slot ids as row offsets for the kernels' K/V gathers: int32 where every offset fits
    (``common.int32_slot_offsets``), whose address arithmetic is half the instructions; else
    int64 (slot x row stride overflows int32 past ~2M slots at 1k elements per row)."""
    if SLOT_I32:
        slots = ids.to(tl.int32)
    else:
        slots = ids.to(tl.int64)
    return slots


@triton.jit
def clamp_splits(count, max_splits):
    """A request's split count as every decode kernel reads it: out-of-range counts are
    clamped to ``[1, max_splits]``, so the splits still cover the whole context and a count of
    0 cannot divide by zero (``count`` a scalar or a vector)."""
    return tl.minimum(tl.maximum(count, 1), max_splits)


@triton.jit
def _split_count(seq_len, min_splits, max_splits, TARGET: tl.constexpr, MIN_LEN: tl.constexpr):
    """decode_num_splits' rule, elementwise (``seq_len`` a scalar or a vector)."""
    by_len = tl.maximum((seq_len + TARGET - 1) // TARGET, min_splits)
    splits = tl.minimum(by_len, (seq_len + MIN_LEN - 1) // MIN_LEN)
    return clamp_splits(splits, max_splits)


@triton.jit
def _wave_counts(lens, counts, valid, batch, wave):
    """wave_cap's rule on the device: ``counts`` (every request's, lanes ``valid``) cut to
    ``wave // batch`` where one wave of those beats the waves today's take, and the cut
    (a bound no count reaches where there is none)."""
    cap = tl.maximum(wave // batch, 1)
    capped = tl.minimum(counts, cap)
    longest = tl.max(tl.where(valid, (lens + counts - 1) // counts, 0), axis=0)
    longest_capped = tl.max(tl.where(valid, (lens + capped - 1) // capped, 0), axis=0)
    waves = (tl.sum(tl.where(valid, counts, 0), axis=0) + wave - 1) // wave
    use = (wave >= batch) & (longest_capped < waves * longest)
    return tl.where(use, capped, counts), tl.where(use, cap, 1 << 30)


@triton.jit
def _work_first(lens, counts, valid, b, seq_len, count, LONGEST_FIRST: tl.constexpr):
    """Where request ``b``'s items start in the work list, and the list's total: ``counts``
    (clamped) and ``lens`` are every request's (lanes ``valid``). Longest first orders the
    requests by the tokens in each of their splits, the longest first (ties by index), so
    the programs a launch starts last get the shortest items; else request after request."""
    lanes = tl.arange(0, lens.shape[0])
    if LONGEST_FIRST:
        per_split = (lens + counts - 1) // counts
        mine = (seq_len + count - 1) // count
        ahead = valid & ((per_split > mine) | ((per_split == mine) & (lanes < b)))
    else:
        ahead = lanes < b
    first = tl.sum(tl.where(ahead, counts, 0), axis=0)
    return first, tl.sum(tl.where(valid, counts, 0), axis=0)


@triton.jit
def _write_work(work_ptr, b, first, total, count, max_splits, BLOCK_S: tl.constexpr):
    """Request ``b``'s decode work items: ``work[1 + first + s] = b * max_splits + s`` for its
    ``count`` splits; request 0 also writes the total, ``work[0]``."""
    offs_s = tl.arange(0, BLOCK_S)
    tl.store(work_ptr + 1 + first + offs_s, b * max_splits + offs_s, mask=offs_s < count)
    if b == 0:
        tl.store(work_ptr, total)


@triton.jit
def _decode_work_kernel(num_splits_ptr, seq_lens_ptr, work_ptr, batch, max_splits,
                        BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
                        LONGEST_FIRST: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_prologue(PDL)
    b = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    valid = offs_b < batch
    counts = clamp_splits(tl.load(num_splits_ptr + offs_b, mask=valid, other=1), max_splits)
    count = clamp_splits(tl.load(num_splits_ptr + b), max_splits)
    lens = offs_b  # unread unless LONGEST_FIRST
    seq_len = b
    if LONGEST_FIRST:
        lens = tl.load(seq_lens_ptr + offs_b, mask=valid, other=0).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    first, total = _work_first(lens, counts, valid, b, seq_len, count, LONGEST_FIRST)
    _write_work(work_ptr, b, first.to(tl.int32), total.to(tl.int32), count, max_splits, BLOCK_S)


def work_size(batch: int, max_splits: int) -> int:
    """Entries of a decode work list for ``batch`` requests of at most ``max_splits`` splits."""
    return 1 + batch * max_splits


def check_work(work: torch.Tensor, batch: int, max_splits: int, device: torch.device) -> None:
    check_index(COMPONENT, "work", work, work_size(batch, max_splits), (torch.int32,))
    if work.device != device:
        fail(COMPONENT, f"work on {work.device} unsupported (must be on {device})")


def check_arrivals(
    arrivals: torch.Tensor, batch: int, num_kv_heads: int, device: torch.device
) -> None:
    """The fused merge's arrival counters: int32 ``[>= batch * num_kv_heads]`` on ``device``."""
    check_index(COMPONENT, "arrivals", arrivals, batch * num_kv_heads, (torch.int32,))
    if arrivals.device != device:
        fail(COMPONENT, f"arrivals on {arrivals.device} unsupported (must be on {device})")


def decode_work(
    num_splits: torch.Tensor,
    max_splits: int,
    work_out: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
) -> None:
    """The decode work list of ``num_splits`` (int32 ``[B]``, each clamped into
    ``[1, max_splits]`` as decode reads it): ``work_out[0]`` = the total number of (request,
    split) items, then ``b * max_splits + s`` for each (device op, no sync, no allocation:
    capturable). A request's items are consecutive. Given ``seq_lens`` (``[B]``), the
    requests come longest split first (see :func:`decode_metadata`); else request after
    request. :func:`decode_metadata` writes the same list itself.

    Raises:
        ValueError: on bad dtypes, sizes (``work_out`` needs ``1 + B * max_splits`` entries)
            or devices.
    """
    check_index(COMPONENT, "num_splits", num_splits, 0, (torch.int32,))
    batch = num_splits.shape[0]
    check_split_range(max_splits, 1)
    check_work(work_out, batch, max_splits, num_splits.device)
    if seq_lens is not None:
        check_index(COMPONENT, "seq_lens", seq_lens, batch, (torch.int32, torch.int64))
        if seq_lens.device != num_splits.device:
            fail(
                COMPONENT,
                f"seq_lens on {seq_lens.device} unsupported (must be on {num_splits.device})",
            )
    if batch == 0:
        work_out[:1].zero_()
        return
    _decode_work_kernel[(batch,)](
        num_splits, num_splits if seq_lens is None else seq_lens, work_out, batch, max_splits,
        BLOCK_B=pow2_at_least(batch), BLOCK_S=pow2_at_least(max_splits, 2),
        LONGEST_FIRST=seq_lens is not None, **pdl_kwargs(num_splits.device),
    )  # fmt: skip


@triton.jit
def _decode_metadata_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    num_splits_ptr,
    work_ptr,
    stride_req_row,
    batch,
    min_splits,
    max_splits,
    wave,
    TARGET: tl.constexpr,
    MIN_LEN: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK: tl.constexpr,
    WORK: tl.constexpr,
    WAVE: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    # This request's offset: the sum of the lengths before it (B is at most a few hundred at
    # decode, so every program summing its prefix is cheaper than a separate scan launch).
    offs_b = tl.arange(0, BLOCK_B)
    valid = offs_b < batch
    lens = tl.load(seq_lens_ptr + offs_b, mask=valid, other=0).to(tl.int64)
    out_start = tl.sum(tl.where(offs_b < b, lens, 0), axis=0)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    if b == 0:
        tl.store(kv_indptr_ptr, out_start.to(kv_indptr_ptr.dtype.element_ty))  # 0
    tl.store(kv_indptr_ptr + b + 1, (out_start + seq_len).to(kv_indptr_ptr.dtype.element_ty))
    # Split count: decode_num_splits' rule; the requests before this one were counted the
    # same way, for where this request's work items start.
    splits = _split_count(seq_len, min_splits, max_splits, TARGET, MIN_LEN)
    if WAVE or WORK:
        counts = _split_count(lens, min_splits, max_splits, TARGET, MIN_LEN)
    if WAVE:  # the wave rule: a batch-wide choice every program makes alike
        counts, cap = _wave_counts(lens, counts, valid, batch, wave)
        splits = tl.minimum(splits, cap)
    tl.store(num_splits_ptr + b, splits.to(tl.int32))
    if WORK:
        first, total = _work_first(lens, counts, valid, b, seq_len, splits, LONGEST_FIRST)
        _write_work(
            work_ptr, b, first.to(tl.int32), total.to(tl.int32), splits.to(tl.int32),
            max_splits, BLOCK_S,
        )  # fmt: skip
    _copy_request_slots(
        req_to_token_ptr, req_pool_indices_ptr, kv_indices_ptr, stride_req_row, b,
        seq_len.to(tl.int32), out_start, BLOCK,
    )  # fmt: skip


def decode_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_splits_out: torch.Tensor,
    max_splits: int,
    policy: SplitPolicy,
    min_splits: int = 1,
    work_out: torch.Tensor | None = None,
    longest_first: bool = True,
    wave: int = 0,
) -> None:
    """``kv_indices.fill_kv_index``, :func:`decode_num_splits` and :func:`decode_work` in one
    launch (no sync, no allocation: capturable). A decode step's metadata used to take a scan
    (two kernels and a costly host path), the gather and ~6 small torch ops for the split
    counts.

    Args are those of the functions it replaces; ``req_to_token`` is int32/int64
    ``[R, max_ctx]`` with a contiguous last dim; ``work_out`` (int32, ``1 + B * max_splits``
    entries) receives the work list when given. ``longest_first`` orders it by the tokens
    per split of each request, longest first (ties by index): decode's programs start in
    list order, so a ragged batch's longest splits start first and its shortest fill the
    end, where request order can leave one long split running on an otherwise idle GPU.
    False: request after request. ``wave``: :func:`decode_num_splits`' wave rule (0: off).

    Raises:
        ValueError: on bad ranks, dtypes, lengths, devices or counts.
    """
    batch = check_index_build(
        COMPONENT, req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
        num_splits_out=num_splits_out,
    )  # fmt: skip
    check_index(COMPONENT, "num_splits_out", num_splits_out, batch, (torch.int32,))
    check_split_range(max_splits, min_splits)
    check_wave(wave)
    if work_out is not None:
        check_work(work_out, batch, max_splits, num_splits_out.device)
    if batch == 0:
        kv_indptr[:1].zero_()
        if work_out is not None:
            work_out[:1].zero_()
        return
    _decode_metadata_kernel[(batch,)](
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_indptr,
        kv_indices,
        num_splits_out,
        num_splits_out if work_out is None else work_out,  # unread without WORK
        req_to_token.stride(0),
        batch,
        min_splits,
        max_splits,
        wave,
        TARGET=policy.target_split_len,
        MIN_LEN=policy.min_split_len,
        BLOCK_B=pow2_at_least(batch),
        BLOCK_S=pow2_at_least(max_splits, 2),
        BLOCK=512,
        WORK=work_out is not None,
        WAVE=wave > 0,
        LONGEST_FIRST=longest_first,
        **pdl_kwargs(req_to_token.device),
    )
