"""Triton sampling: the exponential race in one split pass, sort-free top-k / top-p after it.

Two launches of ``_sample_kernel``, no host sync, shapes fixed by ``[B, V]``: capturable in a
CUDA graph.

1. The race, grid (row, part): each program streams a part of a row and keeps the best
   race key ``s + T * G`` (``s`` the logit, ``G = -log E`` the Gumbel form of the core's
   Exp(1) noise at (seed, step, token id)), that is ``argmax p / E`` without the softmax: the
   order of ``log p - log E = (s - max) / T - log Z + G`` is that of ``s + T * G`` for T > 0.
   Greedy rows (T == 0 or top_k == 1) use T = 0 and no noise: the key is the logit. It also
   keeps the part's largest logit. A block whose largest logit cannot reach the best key so
   far (``G`` is at most ``G_BOUND``) skips the hash; the parts of a row share their best key
   through a relaxed atomic max (every ``SHARE_EVERY`` blocks), so the skip works row-wide.
   A block that cannot be skipped is raced with cheap keys first (``_fast_gumbel``: SFU
   logs, G within ~1e-5) and computed exactly only when one of them comes within
   ``FAST_G_MARGIN`` of the best; greedy rows stream a plain max (``_race_greedy``).
2. The finish (``FINISH``), one program per row: merges the parts. A row without top-k / top-p
   (or greedy) is done: the unfiltered winner is its token. Otherwise the kept set is a prefix
   of the ranking (logit descending, lowest id first among equals), found without sorting:

   - one pass counts the tokens and sums the mass ``exp((s - max) / T)`` above the winner's
     logit (and the total mass Z). If the winner is inside the kept set it wins among the kept
     tokens too, and the row is done (usually: a top-p 0.9 race lands inside with
     probability ~0.9);
   - with both filters, top_p applies to the top-k set renormalised: ``Z`` below is then
     that set's mass ``M_k``. The tokens up to a kept-rank winner bound it below, which
     usually settles the first check; else ``_top_k_mass`` searches for the top-k threshold
     first (count-only search passes);
   - else the set's threshold ``t*`` (the smallest logit ``t`` with ``count(s > t) < top_k``
     and ``mass(s > t) < top_p * Z``) lies in a bracket ``(lo, hi]``: ``lo`` a threshold that
     fails (at first the winner's logit), ``hi`` one that passes. The kept set lies above
     ``lo`` and holds every token above ``hi``, so a race among the tokens above ``lo`` keeps
     its winner with probability at least ``mass(s > hi) / mass(s > lo)``. Each step of the
     loop is, by that bound:

     - a round (at least ``ROUND_SHARE``): that race, and a counting pass that checks its
       winner as the first pass did, with thresholds from its logit up to ``hi``. A kept
       winner is the token; a winner at whose logit the set ends gives ``t*``; else the
       bracket has narrowed (the winner's logit fails);
     - a search pass (below it): ``SEARCH_THRESHOLDS`` evenly spaced thresholds inside the
       bracket, snapped to the data (the smallest and largest logit inside it), until the
       bracket holds one distinct value, ``t*``.

     A top-p row whose winner falls outside usually ends after one round (its set holds
     ``top_p`` of the mass; ``benchmarks/sampling_passes.py`` counts the passes);
   - unless a round found the token, ``r`` tokens equal to ``t*`` stay (the first by id: the
     reference's stable ranking), and a last pass races the kept tokens: ``s > t*`` and the
     first ``r`` with ``s == t*``.

A seeded row's token depends only on its own logits, parameters, seed and step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from execrt.core.sampler import SamplingBatchInfo
from execrt.kernels._triton import (
    cdiv,
    check_device,
    check_float,
    check_same_device,
    fail,
    interpreter_enabled,
    next_power_of_2,
    pdl_kwargs,
    sm_count,
)
from execrt.kernels.triton_pdl import pdl_prologue

#: Tokens per block of the race kernel (4 warps: 8 per thread) and of the per-row passes; no
#: narrower than MIN_BLOCK, no wider than a small vocabulary needs.
RACE_BLOCK = 1024
ROW_BLOCK = 1024
MIN_BLOCK = 64
#: Race programs wanted per SM: rows are split into parts until the grid fills the GPU.
PROGRAMS_PER_SM = 4
#: Warps of a race program (fewer for a block under 256 tokens per warp).
RACE_WARPS = 4
#: The race launch's register cap (``maxnreg``), or None for the compiler's choice. Programs of
#: 4 warps fit 6 to an SM at 80 registers or fewer (65536 / (80 * 128)), 5 at 88-96, 4 at
#: 104-128: a bs-256 grid (3 parts a row, 768 programs) fits the 792 an H100/H200 holds at 6,
#: and runs in two waves below. Compiled for sm90 (triton 3.6, the GPU machine's) the race
#: takes 80 registers with fp32 logits, 92 with bf16 (what a bf16 model hands the sampler),
#: up to 111 with the knobs; capped at 80 it spills nothing there, 8 bytes with triton 3.9
#: (``test_sm90_compile.py``; docs/kernels.md). Timed on an H100 (bf16 logits, session 44):
#: at bs 256 greedy rows 55.6 -> 37.6 us and temperature rows 154.8 -> 124.9, at bs 1 and 32
#: level or up to ~1 us slower (grids that fit one wave anyway), hence RACE_REGS_ABOVE.
#: ``bench_sampling.py --race-regs 0,80`` (0 there is None).
RACE_REGS: int | None = 80
#: The cap applies only to a race grid of more than this many programs per SM (a bs-256
#: grid: 768 programs, 5.8 per SM on 132 SMs); smaller grids fit one wave uncapped, and the
#: cap only cost them (bs 32: 544 programs, +0.7-1.5 us on temperature rows). 0 caps every
#: launch.
RACE_REGS_ABOVE = 5
#: The finish runs a race round (two passes: a race above the bracket, and the count that
#: checks its winner) when the bracket says the round keeps its winner with at least this
#: probability, else a search pass (one, narrowing the bracket ~5-fold); see the module doc.
ROUND_SHARE = 0.5
#: Thresholds one search pass tests (NT in shape comments): each costs ~4 instructions per
#: token, and a pass is memory-bound up to about this many.
SEARCH_THRESHOLDS = tl.constexpr(4)
#: The top-k threshold search tests thresholds this share of the bracket either side of its
#: guess (see ``_top_k_mass``).
KSEARCH_NEAR = tl.constexpr(0.04)
#: Passes after which a search stops: finite logits converge long before (each pass removes at
#: least one distinct value and typically narrows the bracket SEARCH_THRESHOLDS-fold); only a
#: row with NaNs can get here, and it then takes its top token.
MAX_PASSES = tl.constexpr(160)
#: Above the largest G = -log(-log u) the noise gives: u <= 1 - 2**-24, G <= 16.635.
G_BOUND = tl.constexpr(16.7)
#: Largest 1 / T used (a smaller T is not representable as a finite reciprocal): keeps
#: (s - max) / T at 0 for the top logit instead of 0 * inf.
MAX_INV_T = tl.constexpr(3.0e38)  # clamps 1 / T times log2(e) too (the finish works in exp2)
#: Above the error of ``_fast_gumbel``'s G (~1e-5, see there): a block whose cheap keys all
#: stay this far (times T) below the best key so far cannot hold the winner.
FAST_G_MARGIN = tl.constexpr(1e-3)
#: Blocks between two exchanges of a row's best key among its parts (an atomic's round trip
#: each; the first block exchanges too).
SHARE_EVERY = tl.constexpr(4)
#: ``1 - u`` below which ``_fast_gumbel`` takes E from its series: 2**-5.
SERIES_W = tl.constexpr(0.03125)
#: Whether the parts' race keeps each block's largest logit and the finish's passes skip the
#: blocks those rule out (the same tokens). On since session 44, with RACE_SUMS and
#: COUNT_BLOCKS 2 (H100, bf16 logits, graph-replayed us, defaults -> the three with
#: RACE_REGS 80): top-k 20 + top-p 0.95 at bs 1/32/256 87.2 -> 20.7, 454.2 -> 151.9,
#: 821.7 -> 323.6; unfiltered rows level within ~3 us (docs/kernels.md, Sampling).
#: ``bench_sampling.py --skip-blocks 0,1``.
SKIP_BLOCKS = True
#: Whether the parts' race sums each filtered row's Z and finite count, so that the finish's
#: first pass reads only the blocks at or above the winner's logit (with SKIP_BLOCKS). On
#: since session 44 (see SKIP_BLOCKS; ``bench_sampling.py --race-sums 0,1``); Z then sums in
#: another order (docs/kernels.md).
RACE_SUMS = True
#: Whether the parts' race loads each block a trip ahead: its loop reduces every block to its
#: largest logit (a barrier) before it goes on, so one block per program is in flight, where
#: the greedy loop (no barrier) keeps its warps' loads overlapping. The same tokens. Off:
#: timed on an H100 (session 44, with the other knobs and RACE_REGS 80) it was level, within
#: 2 us everywhere (``bench_sampling.py --race-ahead 0,1``).
RACE_AHEAD = False
#: Blocks a count pass of the finish loads before it sums them (1 or 2): one finish program
#: streams a whole row, so its speed may be the loads it has in flight (docs/kernels.md). 2
#: since session 44: with SKIP_BLOCKS and RACE_SUMS, filtered rows at bs 256 437 -> 375 us and
#: at bs 32 162 -> 145 (H100, fp32 logits, session 43); unfiltered rows never run a count
#: (``bench_sampling.py --count-blocks 1,2``); the same tokens.
COUNT_BLOCKS = 2
#: What ``_race`` does with the row's block maxima: write them (the parts' race: every block
#: of a sampled row; greedy rows race without them and are never filtered), or skip the
#: blocks whose maximum keeps no token (the finish's races).
STORE_MAXES = tl.constexpr(1)
SKIP_BY_MAXES = tl.constexpr(2)


@triton.jit
def _hash3(x, a, b, ADD_B: tl.constexpr):
    """``mix(mix(mix(x) ^ a) ^ b)`` (``+ b`` with ADD_B) on uint32, ``mix`` the core's
    ``_mix32``: uint32 arithmetic wraps mod 2**32 as its int64 form masked to 32 bits does."""
    for i in tl.static_range(3):
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = (x >> 16) ^ x
        if i == 0:
            x = x ^ a
        elif i == 1:
            if ADD_B:
                x = x + b
            else:
                x = x ^ b
    return x


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    """log2(x) for x > 0: the SFU's approximation (``lg2.approx``, ~2**-22 relative) with
    FAST_LOG, else the exact software log (the interpreter cannot run inline PTX)."""
    if FAST_LOG:
        return tl.inline_asm_elementwise(
            "lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.log2(x)


@triton.jit
def _fast_gumbel(h, FAST_LOG: tl.constexpr):
    """The race's ``G = -ln(-ln u)`` (``u = ((h >> 9) + 0.5) / 2**23``) within ~1e-5, at a
    fraction of the exact logs' instructions: ``E = -ln u`` from its series in ``w = 1 - u``
    (exact in fp32) where u is near 1 (a log of u would cancel there: those are the largest
    G, the likely winners), else from the SFU's log2; then G from the SFU's log2 of E. Used
    only to rule blocks out (``FAST_G_MARGIN``); every key that can win is computed exactly."""
    m = (h >> 9).to(tl.float32)
    w = (8388608.0 - m - 0.5) * (1.0 / 8388608.0)
    series = w * (1.0 + w * (0.5 + w * (0.3333333333 + w * (0.25 + w * 0.2))))
    u = (m + 0.5) * (1.0 / 8388608.0)
    e = tl.where(w <= SERIES_W, series, _log2(u, FAST_LOG) * -0.6931471805599453)  # ln 2
    return _log2(e, FAST_LOG) * -0.6931471805599453


@triton.jit
def _row_key(seeds_ptr, steps_ptr, row):
    """The per-row key of ``core.sampler.uniform_noise`` (uint32)."""
    seed = tl.load(seeds_ptr + row)  # int64
    step = tl.load(steps_ptr + row)
    lo = seed.to(tl.uint32)  # truncation: the low 32 bits
    hi = (seed >> 32).to(tl.uint32)
    return _hash3(lo ^ 0x9E3779B9, hi, step.to(tl.uint32), ADD_B=False)


@triton.jit
def _row_temperature(temps_ptr, top_ks_ptr, row):
    """(T used by the race, greedy): greedy rows race with T = 0; T < 0 samples at 1 as the
    reference does."""
    t = tl.load(temps_ptr + row)
    greedy = (t == 0) | (tl.load(top_ks_ptr + row) == 1)
    temp = tl.where(greedy, 0.0, tl.where(t > 0, t, 1.0))
    return temp, greedy


@triton.jit
def _inv_t2(temp):
    """1 / T in log2 units: every mass is ``exp2((s - m) * inv_t2)``, computed alike
    everywhere (clamped: a tiny T gives the top logits mass 1 and the rest 0, never NaN)."""
    return tl.minimum((1.0 / temp) * 1.4426950408889634, MAX_INV_T)


@triton.jit
def _filters(top_ks_ptr, top_ps_ptr, row, temp, vocab):
    """A row's ``(top_k, top_p, use_k, use_p, filtered)``: top-k is on for 1 < k < V (<= 0 or
    beyond the vocabulary: off; 1: greedy), top-p below 1; the finish filters a sampled row
    (T > 0) with either."""
    top_k = tl.load(top_ks_ptr + row)
    top_p = tl.load(top_ps_ptr + row)
    use_k = (top_k > 1) & (top_k < vocab)
    use_p = top_p < 1.0
    return top_k, top_p, use_k, use_p, (temp > 0) & (use_k | use_p)


@triton.jit
def _first(keys, gs, ids):
    """(key, G, id) of the race winner among candidates: the largest key, then the largest G
    (equal logits whose ``T * G`` rounds away), then the lowest id (greedy rows, where G is 0).
    Candidate keys are never NaN (a NaN logit never becomes one)."""
    best_k = tl.max(keys, axis=0)
    best_g = tl.max(tl.where(keys == best_k, gs, float("-inf")), axis=0)
    best_i = tl.min(tl.where((keys == best_k) & (gs == best_g), ids, 2147483647), axis=0)
    return best_k, best_g, best_i


@triton.jit
def _race(
    base,
    start,
    end,
    temp,
    key,
    t_star,
    r_ties,
    best_ptr,
    maxes,
    inv_t2,
    sums,
    FILTER: tl.constexpr,
    TIES: tl.constexpr,
    SHARE: tl.constexpr,
    MAXES: tl.constexpr,
    MAX_BLOCK: tl.constexpr,
    SUMS: tl.constexpr,
    AHEAD: tl.constexpr,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """(key, G, id) of the race winner over tokens [start, end) of a row, and their largest
    logit. With FILTER only the kept tokens race: ``s > t_star`` and the first ``r_ties``
    (by id) with ``s == t_star``; ``start`` must then be 0. That needs a running count of the
    equal tokens (TIES: a scan per block); without TIES ``r_ties`` > 0 keeps every one of
    them, the case where no equal token is cut. With SHARE the programs racing
    parts of one row publish their best key at ``best_ptr`` every ``SHARE_EVERY`` blocks and
    skip by the row's best, not only their own (a hint: any key some token has is a lower
    bound on the winner's, so the skipped blocks never hold it). A block that cannot be skipped
    is first raced with cheap keys (``_fast_gumbel``) and computed exactly only if one of them
    comes within the margin of the best: after the first blocks few do. ``maxes``: the row's
    largest logit per ``MAX_BLOCK`` tokens, which MAXES ``STORE_MAXES`` writes (the parts'
    race) and ``SKIP_BY_MAXES`` reads to pass over blocks with no kept token (FILTER: every
    logit below ``t_star``) without loading them. With SUMS, a row whose ``sums`` is set also
    sums its mass ``exp2((s - top) * inv_t2)`` relative to the returned largest logit ``top``
    (rescaled as ``top`` grows) and counts its finite logits: the finish's Z and finite count,
    so that its first pass need not read every block. Both are scalars summed block by block
    (two more reductions per block of such a row): per-lane sums took ~30 more registers,
    which every row's race paid (sm90, fp32 logits: 80 -> 112, 6 -> 4 programs per SM).
    AHEAD (not with SKIP_BY_MAXES) loads each block a trip ahead. Returns (key, G, id, top,
    mass, finite)."""
    lanes = tl.arange(0, BLOCK)
    best_k = tl.full([BLOCK], float("-inf"), tl.float32)
    best_g = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = start + lanes
    best = tl.full([], float("-inf"), tl.float32)  # the best key so far, to skip blocks
    top = tl.full([], float("-inf"), tl.float32)
    ties = tl.zeros([], tl.int32)
    z = tl.zeros([], tl.float32)  # SUMS: the mass relative to top
    finite = tl.zeros([], tl.float32)
    off = start
    if AHEAD:
        ahead = tl.load(base + start + lanes, mask=start + lanes < end, other=float("-inf"))
    while off < end:
        live = True
        if MAX_BLOCK > 0:  # 0: no block maxima (SKIP_BLOCKS off)
            if MAXES == SKIP_BY_MAXES:  # a block of logits below t_star keeps no token
                live = (tl.load(maxes + off // MAX_BLOCK) < t_star) == 0  # NaN: live
        if live:
            ids = off + lanes
            if AHEAD:  # this block was loaded a trip ago; the next one's load goes out now
                s = ahead.to(tl.float32)
                ahead = tl.load(base + ids + BLOCK, mask=ids + BLOCK < end, other=float("-inf"))
            else:
                s = tl.load(base + ids, mask=ids < end, other=float("-inf")).to(tl.float32)
            if FILTER:
                if TIES:
                    eq = (s == t_star).to(tl.int32)
                    before = ties + tl.cumsum(eq, axis=0) - eq  # equal tokens at lower ids
                    kept = (s > t_star) | ((eq > 0) & (before < r_ties))
                    ties += tl.sum(eq, axis=0)
                else:
                    kept = (s > t_star) | ((s == t_star) & (r_ties > 0))
                s = tl.where(kept, s, float("-inf"))
            block_top = tl.max(s, axis=0)
            if SUMS:
                if sums:  # as the finish's first pass sums them, relative to the top so far
                    new_top = tl.maximum(top, block_top)
                    scale = tl.where(new_top == top, 1.0, tl.exp2((top - new_top) * inv_t2))
                    e = tl.where(s == float("-inf"), 0.0, tl.exp2((s - new_top) * inv_t2))
                    z = z * scale + tl.sum(e, axis=0)
                    finite += tl.sum(tl.where(s > float("-inf"), 1.0, 0.0), axis=0)
            top = tl.maximum(top, block_top)
            if MAX_BLOCK > 0:
                if MAXES == STORE_MAXES:  # the parts' blocks start at multiples of MAX_BLOCK
                    tl.store(maxes + off // MAX_BLOCK, block_top)
            # Every key in the block is at most block_top + T * G_BOUND: skip the block when that
            # stays below the best so far, with a margin for rounding (a block of -inf logits
            # reaches -inf: skipped once there is a best).
            reach = block_top + temp * G_BOUND
            margin = (tl.minimum(tl.abs(block_top), 3.0e38) + temp * G_BOUND) * 1e-6
            take = reach + margin >= best
            if take:  # T > 0: greedy rows race in _race_greedy
                # Cheap keys first; the exact ones only if one comes within the margin of the best.
                h = _hash3(ids.to(tl.uint32) ^ 0x85EBCA6B, key, key, ADD_B=True)
                k = s + temp * _fast_gumbel(h, FAST_LOG)
                take = tl.max(k, axis=0) + margin + temp * FAST_G_MARGIN >= best
                if take:
                    # G = -log(E), E = -log(u), u the core's uniform noise at (row key, ids):
                    # (h + 0.5) / 2**23, exact.
                    g = -tl.log(-tl.log(((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)))
                    k = s + temp * g
                    g = tl.where(s > float("-inf"), g, float("-inf"))  # masked lanes lose ties
                    # ids grow: ties keep the first
                    better = (k > best_k) | ((k == best_k) & (g > best_g))
                    best_k = tl.where(better, k, best_k)
                    best_g = tl.where(better, g, best_g)
                    best_i = tl.where(better, ids, best_i)
                    best = tl.maximum(best, tl.max(k, axis=0))
            if SHARE:
                # Every SHARE_EVERY blocks: the atomic's round trip stalls the loop.
                if (off - start) % (SHARE_EVERY * BLOCK) == 0:
                    best = tl.maximum(best, tl.atomic_max(best_ptr, best, sem="relaxed"))
        off += BLOCK
    win_k, win_g, win_i = _first(best_k, best_g, best_i)
    return win_k, win_g, win_i, top, z, finite.to(tl.int32)


@triton.jit
def _race_greedy(base, start, end, BLOCK: tl.constexpr):
    """``_race`` for a greedy row (T = 0, no filter): the largest logit over [start, end),
    the lowest id among equals, as (key, G, id, largest logit). No noise, so nothing to skip:
    a plain streaming max with no reduction or atomic inside the loop."""
    lanes = tl.arange(0, BLOCK)
    best_k = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = start + lanes
    off = start
    while off < end:
        ids = off + lanes
        s = tl.load(base + ids, mask=ids < end, other=float("-inf")).to(tl.float32)
        better = s > best_k  # ids grow: ties keep the first; NaN never wins
        best_k = tl.where(better, s, best_k)
        best_i = tl.where(better, ids, best_i)
        off += BLOCK
    win_k = tl.max(best_k, axis=0)
    win_i = tl.min(tl.where(best_k == win_k, best_i, 2147483647), axis=0)
    # G as the race gives it: 0, or -inf when no token is finite (that part loses ties).
    win_g = tl.where(win_k > float("-inf"), 0.0, float("-inf"))
    return win_k, win_g, win_i, win_k


@triton.jit
def _block_max(maxes, off, vocab, MAX_BLOCK: tl.constexpr):
    """The largest logit of the block at ``off`` (-inf past the row; +inf without block
    maxima, ``MAX_BLOCK`` 0: every block in the row is read)."""
    top = tl.full([], float("inf"), tl.float32)
    if MAX_BLOCK > 0:
        top = tl.load(maxes + off // MAX_BLOCK, mask=off < vocab, other=float("-inf"))
    return top


@triton.jit
def _block_live(top, off, vocab, lo, floor):
    """Whether the block at ``off``, of largest logit ``top``, is in the row and may hold a
    logit above a finite ``lo`` and at or above ``floor``. A NaN maximum compares false: its
    block is read."""
    dead = (top < floor) | ((top <= lo) & (lo > float("-inf")))
    return (off < vocab) & (dead == 0)


@triton.jit
def _count_block(s, ids, m, inv_t2, lo, hi, thr, t0, winner, cnt, mass, z, dmin, dmax, finite,
                 eq0, eq_w):  # fmt: skip
    """``_count``'s sums with one block of logits ``s`` (fp32) at token ids ``ids`` added."""
    e = tl.exp2((s - m) * inv_t2)  # [BLOCK]; 0 for -inf
    above = s[None, :] > thr[:, None]  # [NT, BLOCK]
    cnt += tl.where(above, 1.0, 0.0)
    mass += tl.where(above, e[None, :], 0.0)
    z += e
    inside = (s > lo) & (s <= hi)
    dmin = tl.minimum(dmin, tl.where(inside, s, float("inf")))
    dmax = tl.maximum(dmax, tl.where(inside, s, float("-inf")))
    finite += tl.where(s > float("-inf"), 1.0, 0.0)
    eq = s == t0
    eq0 += tl.where(eq, 1.0, 0.0)
    eq_w += tl.where(eq & (ids < winner), 1.0, 0.0)
    return cnt, mass, z, dmin, dmax, finite, eq0, eq_w


@triton.jit
def _count(
    base,
    vocab,
    m,
    inv_t2,
    lo,
    hi,
    thr,
    t0,
    winner,
    maxes,
    floor,
    MAX_BLOCK: tl.constexpr,
    COUNT_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One pass over a row: count and mass ``exp((s - m) / T)`` (``inv_t2``: 1 / T times
    log2(e), for exp2) of the tokens above each
    threshold ``thr [SEARCH_THRESHOLDS]``; the total mass; the smallest and largest logit in
    ``(lo, hi]``; how many are finite; how many equal ``t0``, and how many of those precede
    ``winner`` (what a caller leaves unused, the compiler drops). Masses are summed for top-k
    rows too: they choose between round and search. With block maxima (``maxes``, the largest
    logit per ``MAX_BLOCK`` tokens; ``MAX_BLOCK`` 0: none, every block is read) and a finite
    ``lo``, the blocks whose largest logit is at most ``lo`` are not loaded:
    every caller's thresholds and ``t0`` lie above ``lo``, so such a block adds nothing to
    what it reads then (Z and the finite count are read from the first pass, whose ``lo`` is
    -inf). Nor are the blocks whose largest logit is below ``floor`` (the first pass's when the
    race summed Z and the finite count: the winner's logit; else -inf): Z, the finite count
    and the smallest logit it returns then cover only the blocks read.
    ``COUNT_BLOCKS`` (1 or 2): blocks loaded per trip of the loop; each lane sums its values in
    the same order either way."""
    lanes = tl.arange(0, BLOCK)
    # Counts in fp32 (a compare that yields 1.0 and an add; an int count costs a move more):
    # exact, a lane counts at most vocab / BLOCK < 2**21 tokens.
    cnt = tl.zeros([SEARCH_THRESHOLDS, BLOCK], tl.float32)
    mass = tl.zeros([SEARCH_THRESHOLDS, BLOCK], tl.float32)
    z = tl.zeros([BLOCK], tl.float32)
    dmin = tl.full([BLOCK], float("inf"), tl.float32)
    dmax = tl.full([BLOCK], float("-inf"), tl.float32)
    finite = tl.zeros([BLOCK], tl.float32)
    eq0 = tl.zeros([BLOCK], tl.float32)
    eq_w = tl.zeros([BLOCK], tl.float32)
    off = 0
    # The blocks' maxima are loaded a trip ahead, so a block read does not wait on its own.
    top = _block_max(maxes, 0, vocab, MAX_BLOCK)
    top1 = top  # COUNT_BLOCKS 2: the second block's
    if COUNT_BLOCKS == 2:
        top1 = _block_max(maxes, BLOCK, vocab, MAX_BLOCK)
    while off < vocab:
        ahead = off + COUNT_BLOCKS * BLOCK
        top_next = _block_max(maxes, ahead, vocab, MAX_BLOCK)
        top1_next = top_next
        if COUNT_BLOCKS == 2:
            top1_next = _block_max(maxes, ahead + BLOCK, vocab, MAX_BLOCK)
        live = _block_live(top, off, vocab, lo, floor)
        if COUNT_BLOCKS == 2:  # both blocks' loads in flight before either is summed
            off1 = off + BLOCK
            live1 = _block_live(top1, off1, vocab, lo, floor)
            if live | live1:
                ids = off + lanes
                ids1 = off1 + lanes
                # A dead block of a live pair reads as -inf: it adds only zeros (thr, t0 > lo).
                s = tl.load(base + ids, mask=ids < tl.where(live, vocab, 0), other=float("-inf"))
                s1 = tl.load(
                    base + ids1, mask=ids1 < tl.where(live1, vocab, 0), other=float("-inf")
                )
                cnt, mass, z, dmin, dmax, finite, eq0, eq_w = _count_block(
                    s.to(tl.float32), ids, m, inv_t2, lo, hi, thr, t0, winner,
                    cnt, mass, z, dmin, dmax, finite, eq0, eq_w,
                )  # fmt: skip
                cnt, mass, z, dmin, dmax, finite, eq0, eq_w = _count_block(
                    s1.to(tl.float32), ids1, m, inv_t2, lo, hi, thr, t0, winner,
                    cnt, mass, z, dmin, dmax, finite, eq0, eq_w,
                )  # fmt: skip
        elif live:
            ids = off + lanes
            s = tl.load(base + ids, mask=ids < vocab, other=float("-inf"))
            cnt, mass, z, dmin, dmax, finite, eq0, eq_w = _count_block(
                s.to(tl.float32), ids, m, inv_t2, lo, hi, thr, t0, winner,
                cnt, mass, z, dmin, dmax, finite, eq0, eq_w,
            )  # fmt: skip
        top = top_next
        top1 = top1_next
        off = ahead
    return (
        tl.sum(cnt.to(tl.int32), axis=1),
        tl.sum(mass, axis=1),
        tl.sum(z, axis=0),
        tl.min(dmin, axis=0),
        tl.max(dmax, axis=0),
        tl.sum(finite.to(tl.int32), axis=0),
        tl.sum(eq0.to(tl.int32), axis=0),
        tl.sum(eq_w.to(tl.int32), axis=0),
    )


@triton.jit
def _narrow(ok, thr, cnt, mass, lo, hi, c_lo, c_hi, m_lo, m_hi):
    """The bracket after a pass: the highest failing threshold and the lowest passing one,
    with their counts and masses (both fall as the threshold rises, and ``ok`` is monotone)."""
    fail = ok == 0
    lo = tl.maximum(lo, tl.max(tl.where(fail, thr, float("-inf")), axis=0))
    c_lo = tl.minimum(c_lo, tl.min(tl.where(fail, cnt, 2147483647), axis=0))
    m_lo = tl.minimum(m_lo, tl.min(tl.where(fail, mass, float("inf")), axis=0))
    hi = tl.minimum(hi, tl.min(tl.where(ok, thr, float("inf")), axis=0))
    c_hi = tl.maximum(c_hi, tl.max(tl.where(ok, cnt, 0), axis=0))
    m_hi = tl.maximum(m_hi, tl.max(tl.where(ok, mass, 0.0), axis=0))
    return lo, hi, c_lo, c_hi, m_lo, m_hi


@triton.jit
def _rank_check(
    base, vocab, m, inv_t2, winner, lo, hi, k_lim, top_p, zlim, p_off, maxes,
    MAX_BLOCK: tl.constexpr, COUNT_BLOCKS: tl.constexpr, FROM_WINNER: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One ``_count`` pass with the thresholds from ``winner``'s logit towards ``hi``, and the
    data range ``(lo, hi]``: whether the winner is inside the kept set, whether the set ends at
    its logit (``at_own``: every token above it stays), and the pass's data. ``zlim`` is top_p
    times Z (or times the top-k set's mass), or < 0 on the first pass, which sums Z.
    FROM_WINNER: the pass reads only the blocks at or above the winner's logit (the race summed
    Z: ``zlim`` is given), all its counts need."""
    jf = tl.arange(0, SEARCH_THRESHOLDS).to(tl.float32) / SEARCH_THRESHOLDS
    s_w = tl.load(base + winner).to(tl.float32)
    thr = s_w + (hi - s_w) * jf  # thr[0] is the winner's logit
    floor = float("-inf")
    if FROM_WINNER:
        floor = s_w
    cnt, mass, z, dmin, dmax, finite, eq0, eq_w = _count(
        base, vocab, m, inv_t2, lo, hi, thr, s_w, winner, maxes, floor, MAX_BLOCK, COUNT_BLOCKS,
        BLOCK,
    )  # fmt: skip
    zlim = tl.where(zlim < 0, top_p * z, zlim)
    first = jf == 0
    c0 = tl.sum(tl.where(first, cnt, 0), axis=0)
    m0 = tl.sum(tl.where(first, mass, 0.0), axis=0)
    rank = c0 + eq_w
    mass_before = m0 + eq_w.to(tl.float32) * tl.exp2((s_w - m) * inv_t2)
    inside = (rank < k_lim) & ((rank == 0) | p_off | (mass_before < zlim))
    at_own = (c0 < k_lim) & (p_off | (m0 < zlim))
    return (
        inside, at_own, s_w, thr, cnt, mass, z, zlim, c0, m0, eq0, dmin, dmax, finite, rank,
        mass_before,
    )  # fmt: skip


@triton.jit
def _search_pass(
    base, vocab, m, inv_t2, thr, lo, hi, c_lo, c_hi, m_lo, m_hi, t, c_gt, m_gt, c_eq, k_lim,
    zlim, p_off, maxes, MAX_BLOCK: tl.constexpr, COUNT_BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One search pass of the bracket ``(lo, hi]`` at thresholds ``thr``: a threshold passes
    while fewer than ``k_lim`` tokens lie above it and (unless ``p_off``) their mass is below
    ``zlim``. When the bracket holds one distinct value, that value is ``t`` with the count and
    mass above it and its count (``c_gt``, ``m_gt``, ``c_eq``); else those are kept. Returns the
    narrowed bracket, those four, the data range of the pass and whether it was one value."""
    cnt, mass, _z, dmin, dmax, _f, _e0, _ew = _count(
        base, vocab, m, inv_t2, lo, hi, thr, m, 0, maxes, float("-inf"), MAX_BLOCK, COUNT_BLOCKS,
        BLOCK,
    )  # fmt: skip
    single = dmin == dmax  # one distinct value in (lo, hi]
    t = tl.where(single, dmin, t)
    c_gt = tl.where(single, c_hi, c_gt)
    m_gt = tl.where(single, m_hi, m_gt)
    c_eq = tl.where(single, c_lo - c_hi, c_eq)
    ok = (cnt < k_lim) & (p_off | (mass < zlim))
    lo, hi, c_lo, c_hi, m_lo, m_hi = _narrow(ok, thr, cnt, mass, lo, hi, c_lo, c_hi, m_lo, m_hi)
    return lo, hi, c_lo, c_hi, m_lo, m_hi, t, c_gt, m_gt, c_eq, dmin, dmax, single


@triton.jit
def _top_k_mass(
    base, vocab, m, inv_t2, k_lim, thr, cnt, mass, z, dmin, dmax, finite, maxes,
    MAX_BLOCK: tl.constexpr, COUNT_BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The mass ``M_k`` of the top-k set (the first ``k_lim`` tokens of the ranking), from a
    first pass's data (thresholds ``thr`` with their counts and masses, Z, the finite logits'
    range and count): search passes as the finish's, with the count alone deciding, until the
    bracket holds one distinct value ``t_k``; then the mass above it and that of the first of
    its equals that fit. Returns ``(M_k, t_k, count(s > t_k), mass(s > t_k), count(s ==
    t_k), found)``; not found (M_k = Z) when fewer than ``k_lim`` tokens are finite (all stay)
    or the search does not converge (NaNs only)."""
    jf = tl.arange(0, SEARCH_THRESHOLDS).to(tl.float32) / SEARCH_THRESHOLDS
    lo, hi, c_lo, c_hi, m_lo, m_hi = _narrow(
        cnt < k_lim, thr, cnt, mass, float("-inf"), m, finite, 0, z, 0.0
    )
    t_k = m
    c_gt = c_hi
    m_gt = m_hi
    c_eq = c_lo - c_hi
    done = (finite < k_lim).to(tl.int32)
    passes = 0
    # Where count(s > t) reaches k_lim, if log count falls linearly across the bracket (the
    # tail of a row's logits is near that; k_lim is usually far nearer the top's count than
    # the bulk's): thresholds close around that guess, and halfway to each end, so a pass
    # narrows the bracket at least 2-fold and, guessed well, far more.
    lk = tl.log2(k_lim.to(tl.float32) - 0.5)
    while (done == 0) & (passes < MAX_PASSES):
        a = tl.maximum(lo, dmin)
        b = tl.minimum(hi, dmax)
        la = tl.log2(tl.maximum(c_lo.to(tl.float32), 1.0))
        lb = tl.log2(tl.maximum(c_hi.to(tl.float32), 0.5))
        f = tl.minimum(tl.maximum((la - lk) / tl.maximum(la - lb, 1e-6), 0.0), 1.0)
        guess = a + (b - a) * f
        near = (b - a) * KSEARCH_NEAR
        thr = tl.where(
            jf == 0,
            (a + guess) * 0.5,
            tl.where(jf < 0.5, guess - near, tl.where(jf < 0.75, guess + near, (guess + b) * 0.5)),
        )
        thr = tl.minimum(tl.maximum(thr, a), b)
        # The count alone decides (p_off): the value found is t_k.
        lo, hi, c_lo, c_hi, m_lo, m_hi, t_k, c_gt, m_gt, c_eq, dmin, dmax, single = _search_pass(
            base, vocab, m, inv_t2, thr, lo, hi, c_lo, c_hi, m_lo, m_hi, t_k, c_gt, m_gt, c_eq,
            k_lim, 0.0, finite >= 0, maxes, MAX_BLOCK, COUNT_BLOCKS, BLOCK,
        )  # fmt: skip
        done = single.to(tl.int32)
        passes += 1
    p_t = tl.exp2((t_k - m) * inv_t2)
    found = (finite >= k_lim) & (done != 0)
    m_k = m_gt + tl.minimum(c_eq, k_lim - c_gt).to(tl.float32) * p_t
    return tl.where(found, m_k, z), t_k, c_gt, m_gt, c_eq, found.to(tl.int32)


@triton.jit
def _filtered_token(
    base,
    vocab,
    temp,
    key,
    m,
    winner,
    k_lim,
    top_p,
    use_p,
    maxes,
    z_race,
    finite_race,
    ROUND_SHARE: tl.constexpr,
    MAX_BLOCK: tl.constexpr,
    COUNT_BLOCKS: tl.constexpr,
    RACE_SUMS: tl.constexpr,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """The race winner among the top-k / top-p kept tokens of a row (see the module doc): a
    race round when the bracket says it keeps its winner with probability >= ``ROUND_SHARE``,
    else a search pass. RACE_SUMS: the parts' race summed Z and the finite count
    (``z_race``, ``finite_race``), and the first pass reads only the blocks it counts in."""
    inv_t2 = _inv_t2(temp)
    jf = tl.arange(0, SEARCH_THRESHOLDS).to(tl.float32) / SEARCH_THRESHOLDS
    p_off = use_p == 0
    # Pass 1: the winner's rank and the mass before it, and Z.
    inside, at_own, s_w, thr, cnt, mass, z, zlim, c0, m0, eq0, dmin, dmax, finite, rank, m_w = (
        _rank_check(
            base,
            vocab,
            m,
            inv_t2,
            winner,
            float("-inf"),
            m,
            k_lim,
            top_p,
            top_p * z_race if RACE_SUMS else -1.0,
            p_off,
            maxes,
            MAX_BLOCK,
            COUNT_BLOCKS,
            RACE_SUMS,
            BLOCK,
        )  # fmt: skip
    )
    if RACE_SUMS:  # the pass read only some blocks: the race's sums over all of them
        z = z_race
        finite = finite_race
    k_found = tl.zeros([], tl.int32)  # whether _top_k_mass found t_k (with its data)
    t_k = m
    c_gt_k = tl.zeros([], tl.int32)
    m_gt_k = tl.zeros([], tl.float32)
    c_eq_k = tl.zeros([], tl.int32)
    if (k_lim <= vocab) & (use_p != 0):
        # Both filters: top_p applies to the top-k set renormalised, zlim = top_p times its
        # mass M_k. The tokens up to the winner are in that set when its rank is below top_k,
        # so their mass bounds M_k below: a winner kept by that bound is kept (usually, and
        # the row is done); else M_k is searched for, and the winner checked against it.
        p_w = tl.exp2((s_w - m) * inv_t2)
        sure = (rank < k_lim) & ((rank == 0) | (m_w < top_p * (m_w + p_w)))
        if sure == 0:
            m_k, t_k, c_gt_k, m_gt_k, c_eq_k, k_found = _top_k_mass(
                base, vocab, m, inv_t2, k_lim, thr, cnt, mass, z, dmin, dmax, finite, maxes,
                MAX_BLOCK, COUNT_BLOCKS, BLOCK,
            )  # fmt: skip
            zlim = top_p * m_k
            inside = (rank < k_lim) & ((rank == 0) | (m_w < zlim))
            at_own = (c0 < k_lim) & (m0 < zlim)
    ok = (cnt < k_lim) & (p_off | (mass < zlim))
    lo, hi, c_lo, c_hi, m_lo, m_hi = _narrow(
        ok, thr, cnt, mass, float("-inf"), m, finite, 0, z, 0.0
    )
    # The top-k threshold t_k (when searched): no lower threshold passes (the count fails).
    # If t_k passes (the mass above it is below zlim) the kept set ends there: t* = t_k, no
    # top-p search; else it fails, and the bracket starts above it.
    ends_k = (k_found != 0) & (m_gt_k < zlim)
    lift = (k_found != 0) & (t_k > lo) & (m_gt_k >= zlim)
    lo = tl.where(lift, t_k, lo)
    c_lo = tl.where(lift, c_gt_k, c_lo)
    m_lo = tl.where(lift, m_gt_k, m_lo)
    token = winner
    # When at_own: t* is the winner's logit, and its equals after it are cut.
    t_star = tl.where(ends_k, t_k, s_w)
    c_gt = tl.where(ends_k, c_gt_k, c0)
    m_gt = tl.where(ends_k, m_gt_k, m0)
    c_eq = tl.where(ends_k, c_eq_k, eq0)
    done = (inside | at_own | ends_k).to(tl.int32)
    passes = 1
    while (done == 0) & (passes < MAX_PASSES):
        # The kept set lies in s > lo and holds s > hi: a race above lo lands in it with
        # probability >= m_hi / m_lo.
        if m_hi >= ROUND_SHARE * m_lo:
            _k, _g, winner, _t, _zr, _fr = _race(
                base, 0, vocab, temp, key, lo, 0, base, maxes, inv_t2, 0, True, False, False,
                SKIP_BY_MAXES, MAX_BLOCK, False, False, BLOCK, FAST_LOG,
            )  # fmt: skip
            inside, at_own, s_w, thr, cnt, mass, _z, zlim, c0, m0, eq0, dmin, dmax, _f, _r, _m = (
                _rank_check(
                    base,
                    vocab,
                    m,
                    inv_t2,
                    winner,
                    lo,
                    hi,
                    k_lim,
                    top_p,
                    zlim,
                    p_off,
                    maxes,
                    MAX_BLOCK,
                    COUNT_BLOCKS,
                    False,
                    BLOCK,
                )  # fmt: skip
            )
            token = tl.where(inside, winner, token)
            t_star = tl.where(at_own, s_w, t_star)
            c_gt = tl.where(at_own, c0, c_gt)
            m_gt = tl.where(at_own, m0, m_gt)
            c_eq = tl.where(at_own, eq0, c_eq)
            ok = (cnt < k_lim) & (p_off | (mass < zlim))
            lo, hi, c_lo, c_hi, m_lo, m_hi = _narrow(
                ok, thr, cnt, mass, lo, hi, c_lo, c_hi, m_lo, m_hi
            )
            done = (inside | at_own).to(tl.int32)
            passes += 2
        else:
            # The data left in the bracket lies in [dmin, dmax] of the last pass.
            a = tl.maximum(lo, dmin)
            b = tl.minimum(hi, dmax)
            thr = a + (b - a) * jf
            # The value found is t*.
            lo, hi, c_lo, c_hi, m_lo, m_hi, t_star, c_gt, m_gt, c_eq, dmin, dmax, single = (
                _search_pass(
                    base, vocab, m, inv_t2, thr, lo, hi, c_lo, c_hi, m_lo, m_hi, t_star, c_gt,
                    m_gt, c_eq, k_lim, zlim, p_off, maxes, MAX_BLOCK, COUNT_BLOCKS, BLOCK,
                )
            )  # fmt: skip
            done = single.to(tl.int32)
            passes += 1
    if inside == 0:  # else the winner is the token (no last race)
        # How many tokens equal to t* stay: top-k's remainder, and those whose mass before
        # stays below top_p * Z (each adds p(t*)); at least one (the first token always stays).
        p_t = tl.exp2((t_star - m) * inv_t2)
        room = tl.where(p_t > 0, (zlim - m_gt) / p_t, float("inf"))
        r = tl.minimum(c_eq, k_lim - c_gt).to(tl.float32)
        r = tl.where(p_off, r, tl.minimum(r, tl.ceil(room)))
        r_ties = tl.maximum(r, 1.0).to(tl.int32)
        if (done > 0) & (r_ties >= c_eq):  # every token equal to t* stays: no scan
            _k, _g, token, _t, _zr, _fr = _race(
                base, 0, vocab, temp, key, t_star, 1, base, maxes, inv_t2, 0, True, False, False,
                SKIP_BY_MAXES, MAX_BLOCK, False, False, BLOCK, FAST_LOG,
            )  # fmt: skip
        else:
            # Some equal tokens are cut: the first r_ties by id stay. A row that did not
            # converge (NaNs only) takes its top token.
            t_star = tl.where(done > 0, t_star, m)
            r_ties = tl.where(done > 0, r_ties, 1)
            _k, _g, token, _t, _zr, _fr = _race(
                base, 0, vocab, temp, key, t_star, r_ties, base, maxes, inv_t2, 0, True, True,
                False, SKIP_BY_MAXES, MAX_BLOCK, False, False, BLOCK, FAST_LOG,
            )  # fmt: skip
    return token


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    vocab,
    chunk,
    temps_ptr,
    top_ks_ptr,
    top_ps_ptr,
    seeds_ptr,
    steps_ptr,
    part_ptr,
    part_id_ptr,
    best_ptr,
    maxes_ptr,
    out_ptr,
    FINISH: tl.constexpr,
    ROUND_SHARE: tl.constexpr,
    SHARE: tl.constexpr,
    MAX_BLOCK: tl.constexpr,
    COUNT_BLOCKS: tl.constexpr,
    RACE_SUMS: tl.constexpr,
    AHEAD: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """Launched twice: grid (row, part) races a part of a row into the part buffers (key, G,
    largest logit: three planes of ``part_ptr``; id: ``part_id_ptr``), the parts of a row
    sharing their best key through ``best_ptr [B]`` (-inf) when SHARE and, with ``MAX_BLOCK``
    > 0 (SKIP_BLOCKS), writing the largest logit of each ``MAX_BLOCK`` tokens of a sampled row
    to ``maxes_ptr [B, cdiv(V, MAX_BLOCK)]``; then, with FINISH, grid (row,) merges a row's
    parts and applies its filters (see the module doc), its passes over the row skipping the
    blocks those maxima rule out."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    temp, greedy = _row_temperature(temps_ptr, top_ks_ptr, row)
    key = _row_key(seeds_ptr, steps_ptr, row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    maxes = maxes_ptr
    if MAX_BLOCK > 0:
        maxes = maxes_ptr + row * tl.cdiv(vocab, MAX_BLOCK)
    num_parts = tl.cdiv(vocab, chunk)
    plane = tl.num_programs(0) * num_parts
    if FINISH:
        p = tl.arange(0, BLOCK_P)
        valid = p < num_parts
        at = row * num_parts + p
        part_k = tl.load(part_ptr + at, mask=valid, other=float("-inf"))
        part_g = tl.load(part_ptr + plane + at, mask=valid, other=float("-inf"))
        part_i = tl.load(part_id_ptr + at, mask=valid, other=2147483647)
        _k, _g, token = _first(part_k, part_g, part_i)
        top_k, top_p, use_k, use_p, filtered = _filters(top_ks_ptr, top_ps_ptr, row, temp, vocab)
        if filtered:
            top = tl.load(part_ptr + 2 * plane + at, mask=valid, other=float("-inf"))
            k_lim = tl.where(use_k, top_k, vocab + 1).to(tl.int32)
            m = tl.max(top, axis=0)
            z = -1.0  # not summed by the race: the first pass sums it
            finite = tl.zeros([], tl.int32)
            if RACE_SUMS:  # the parts' masses, each relative to its own largest logit
                inv_t2 = _inv_t2(temp)
                z_p = tl.load(part_ptr + 3 * plane + at, mask=valid, other=0.0)
                f_p = tl.load(part_ptr + 4 * plane + at, mask=valid, other=0.0)
                z_p = tl.where(top > float("-inf"), z_p * tl.exp2((top - m) * inv_t2), 0.0)
                z = tl.sum(z_p, axis=0)
                finite = tl.sum(f_p.to(tl.int32), axis=0)
            token = _filtered_token(
                base, vocab, temp, key, m, token, k_lim, top_p, use_p, maxes, z, finite,
                ROUND_SHARE, MAX_BLOCK, COUNT_BLOCKS, RACE_SUMS, BLOCK, FAST_LOG,
            )  # fmt: skip
        tl.store(out_ptr + row, token.to(tl.int64))
    else:
        part = tl.program_id(1)
        start = part * chunk
        end = tl.minimum(start + chunk, vocab)
        at = row * num_parts + part
        if greedy:
            win_k, win_g, win_i, top = _race_greedy(base, start, end, BLOCK)
        else:
            sums = False  # RACE_SUMS: whether the finish filters this row (it reads the sums)
            if RACE_SUMS:
                _tk, _tp, _uk, _up, sums = _filters(top_ks_ptr, top_ps_ptr, row, temp, vocab)
            win_k, win_g, win_i, top, z_p, finite_p = _race(
                base, start, end, temp, key, 0.0, 0, best_ptr + row, maxes, _inv_t2(temp),
                sums, False, False, SHARE,
                STORE_MAXES, MAX_BLOCK, RACE_SUMS, AHEAD, BLOCK, FAST_LOG,
            )  # fmt: skip
            if RACE_SUMS:
                tl.store(part_ptr + 3 * plane + at, z_p)
                tl.store(part_ptr + 4 * plane + at, finite_p.to(tl.float32))  # exact: < 2**24
        tl.store(part_ptr + at, win_k)
        tl.store(part_ptr + plane + at, win_g)
        tl.store(part_ptr + 2 * plane + at, top)
        tl.store(part_id_ptr + at, win_i)


#: The parameter tensors the kernels read, with the dtype each must have.
PARAM_DTYPES = {
    "temperatures": torch.float32,
    "top_ks": torch.int64,
    "top_ps": torch.float32,
    "seeds": torch.int64,
    "steps": torch.int64,
}


def _params(logits: torch.Tensor, info: SamplingBatchInfo) -> list[torch.Tensor]:
    """``info``'s tensors in PARAM_DTYPES order, checked against ``logits``."""
    name = "sample"
    check_float(name, "logits", logits)
    check_device(name, "logits", logits)
    if logits.dim() != 2 or logits.shape[1] == 0:
        fail(name, f"logits {tuple(logits.shape)} must be [B, V] with V >= 1")
    if logits.shape[1] >= 2**31 - RACE_BLOCK:
        fail(name, f"vocabulary {logits.shape[1]} unsupported (supported: < 2**31 - 1024)")
    out = []
    for key, dtype in PARAM_DTYPES.items():
        t = getattr(info, key)
        check_same_device(name, logits, **{key: t})
        if t.dtype != dtype:
            fail(name, f"{key} dtype {t.dtype} unsupported (supported: {dtype})")
        if t.shape != (logits.shape[0],):
            fail(name, f"{key} {tuple(t.shape)} must be [B] for logits {tuple(logits.shape)}")
        out.append(t.contiguous())  # views of one staging buffer are
    return out


def _blocks(vocab: int) -> tuple[int, int]:
    """Block sizes of the two launches: no wider than the vocabulary needs."""
    fit = max(MIN_BLOCK, next_power_of_2(vocab))
    return min(RACE_BLOCK, fit), min(ROW_BLOCK, fit)


def _parts(rows: int, vocab: int, block: int, sms: int) -> tuple[int, int]:
    """(parts per row, tokens per part): split rows until the race grid fills ``sms`` SMs."""
    blocks = cdiv(vocab, block)
    wanted = max(1, cdiv(PROGRAMS_PER_SM * sms, rows))
    chunk = cdiv(blocks, min(blocks, wanted)) * block
    return cdiv(vocab, chunk), chunk


def race_regs(programs: int, sms: int) -> int | None:
    """The race's register cap (RACE_REGS) for a grid of ``programs`` on ``sms`` SMs: only
    above RACE_REGS_ABOVE programs per SM (``benchmarks/kernel_sass.py`` reports by it too)."""
    return RACE_REGS if RACE_REGS and programs > RACE_REGS_ABOVE * sms else None


def _race_cap(programs: int, sms: int) -> dict[str, int]:
    """The race launch's ``maxnreg`` keyword (``race_regs``); none under the interpreter."""
    regs = race_regs(programs, sms)
    return {} if regs is None or interpreter_enabled() else {"maxnreg": regs}


def sample_triton(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Two launches over ``logits [B, V]``; see ``sampling.sample``."""
    params = _params(logits, info)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    device = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    race_block, row_block = _blocks(vocab)
    sms = sm_count(device)
    parts, chunk = _parts(rows, vocab, race_block, sms)
    # key, G, top, and (RACE_SUMS) the part's Z relative to its top and its finite count
    part = torch.empty((5 if RACE_SUMS else 3, rows, parts), dtype=torch.float32, device=device)
    part_id = torch.empty((rows, parts), dtype=torch.int32, device=device)
    share = parts > 1
    best = torch.full((rows,), float("-inf"), device=device) if share else part
    # The race's block maxima, read by the finish's blocks (which must not straddle them).
    max_block, maxes = 0, part
    if SKIP_BLOCKS:
        if race_block % row_block:
            fail("sample", f"finish block {row_block} must divide the race block {race_block}")
        max_block = race_block
        maxes = torch.empty((rows, cdiv(vocab, race_block)), dtype=torch.float32, device=device)
    args = (logits, logits.stride(0), vocab, chunk, *params, part, part_id, best, maxes, out)
    # The most parts this vocabulary can be split into, not this batch's count: one compiled
    # variant per vocabulary instead of one per batch-size range (a run whose batch shrinks
    # from 256 to 1 otherwise compiles about ten finish kernels while it is timed).
    block_p = max(2, next_power_of_2(cdiv(vocab, race_block)))
    pdl = pdl_kwargs(device)
    # (finish?, grid, block, warps, register cap): the cap is the race's alone
    stages: tuple[tuple[bool, tuple[int, ...], int, int, dict[str, int]], ...] = (
        (
            False,
            (rows, parts),
            race_block,
            max(1, min(RACE_WARPS, race_block // 256)),
            _race_cap(rows * parts, sms),
        ),
        (True, (rows,), row_block, max(1, min(8, row_block // 128)), {}),
    )
    for finish, grid, block, warps, cap in stages:
        _sample_kernel[grid](
            *args,
            FINISH=finish,
            ROUND_SHARE=ROUND_SHARE,
            SHARE=share and not finish,
            MAX_BLOCK=max_block,
            COUNT_BLOCKS=COUNT_BLOCKS,
            RACE_SUMS=RACE_SUMS,
            AHEAD=RACE_AHEAD and not finish,
            BLOCK=block,
            BLOCK_P=block_p,
            FAST_LOG=not interpreter_enabled(),
            num_warps=warps,
            **cap,
            **pdl,
        )
    return out
