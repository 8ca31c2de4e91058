"""Triton skinny GEMM: ``y [M, N] = x [M, K] @ W [N, K]^T`` for a decode batch, streaming W once.

One program per ``BLOCK_N`` weight rows walks the whole K dimension (no split-K, so the sum
order is fixed and there is no second launch or atomic): it loads a ``[BLOCK_N, BLOCK_K]``
weight tile (16-byte loads along K) and the matching ``[BLOCK_M, BLOCK_K]`` activations, and
accumulates in fp32 either on the CUDA cores (``use_dot=False``: elementwise products kept per
lane and reduced once at the end, for one to a few rows) or on the tensor cores (``tl.dot``
with the rows padded to a power of two, at least 16: up to a whole decode batch in one
program). Narrow ``BLOCK_N`` keeps enough programs in flight for the small N of a small
model's projections. With ``SWIGLU`` the activations are ``silu(gate) * up`` computed from
the gate/up output as they are loaded; with ``SWIGLU_OUT`` a gate/up product writes
``silu(gate) * up`` itself (each program accumulates its gate rows and the matching up rows).
Which variant runs where is the tuned table's choice (``choose``; format 2 keys by variant).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from execrt.kernels._triton import (
    cdiv,
    check_device,
    check_same_device,
    fail,
    interpreter_enabled,
    next_power_of_2,
    pdl_kwargs,
    pdl_prefetch,
    pdl_preload,
    pow2_at_least,
    stream_scratch,
    tuned_table_name,
)
from execrt.kernels.triton_dot import dot
from execrt.kernels.triton_pdl import pdl_prologue, prefetch_rows_l2

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "linear_configs")


#: The most K slices one output tile is cut into (``SkinnyTile.split_k``).
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class SkinnyTile:
    """Launch shape of one call. ``use_dot`` needs ``block_n >= 16`` (rows padded to 16).
    ``fuse_norm``: a norm in front (``NormIn``) runs inside this kernel; False where the tuner
    measured the separate norm kernel + this tile faster. ``split_k`` > 1: each output tile's
    K is cut into that many slices, one program each (more programs for a small N: at M = 8
    the tensor-core tiles gave 64-128 programs for 132 SMs); the slices' fp32 partials are
    summed in slice order by whichever program finishes last, so the result does not depend
    on timing. ``late_norm``: a norm inside scales the product by each row's ``1 / rms``
    (summed in the main loop) instead of the input, so no pass over the rows comes before the
    first weight load; it rounds ``x * weight`` where the norm kernel rounds ``x / rms`` first
    (not bitwise the unfused path's output)."""

    block_n: int
    block_k: int
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 2
    fuse_norm: bool = True
    split_k: int = 1
    late_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                fail("linear", f"{name} {value} unsupported (a power of two)")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            fail("linear", f"tile {self} uses tl.dot, which needs block_n and block_k >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            fail("linear", f"tile {self}: num_warps 1..16 (a power of two), num_stages >= 1")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            fail("linear", f"tile {self}: split_k 1..{MAX_SPLIT_K}")
        if self.late_norm and self.split_k > 1:
            fail("linear", f"tile {self}: late_norm needs split_k 1 (a slice sees part of a row)")


#: Rows up to which a CUDA-core tile (``use_dot=False``) may serve a call: its fp32
#: accumulators are ``BLOCK_M x BLOCK_N x BLOCK_K`` per program. The tensor-core tiles take
#: any decode batch (``linear.MAX_SKINNY_ROWS``): all of its rows in one program.
CUDA_CORE_ROWS = 16


def block_m_for(m: int, use_dot: bool) -> int:
    """Rows per program: ``m`` padded to a power of two (at least 16 for the tensor cores)."""
    return pow2_at_least(m) if use_dot else next_power_of_2(m)


@triton.jit
def _norm_rows(x_ptrs, r_ptrs, nr_ptrs, rm_ok, rk, K, eps, ADD: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """First pass of a fused RMSNorm: ``1 / rms`` of each row of ``x (+ r)`` (fp32), and
    program 0 stores the rows of ``x + r`` (the new residual stream)."""
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + rk)[None, :] < K
        h = tl.load(x_ptrs + k0, mask=kmask, other=0.0)
        if ADD:
            r = tl.load(r_ptrs + k0, mask=kmask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            if first:
                tl.store(nr_ptrs + k0, h, mask=kmask & rm_ok[:, None])
        hf = h.to(tl.float32)
        sq += hf * hf
    return tl.rsqrt(tl.sum(sq, axis=1) / K + eps)  # [BM]


@triton.jit
def _acc_step(acc, xa, w, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr):
    """One K step of the fp32 accumulation of ``xa [BM, BK] @ w [BN, BK]^T`` (IEEE fp32 for
    fp32 operands on the tensor cores, ``triton_dot.dot``)."""
    if USE_DOT:
        acc = dot(xa, tl.trans(w), acc)
    elif BLOCK_M == 1:
        acc += w.to(tl.float32) * xa.to(tl.float32)  # [BN, BK] * [1, BK]
    else:
        acc += xa.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _acc_out(acc, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The accumulator reduced to ``[BM, BN]`` fp32."""
    if USE_DOT:
        out = acc
    elif BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    return out


@triton.jit
def _load_w(w_ptrs, wu_ptrs, k0, K, EVEN_K: tl.constexpr, SWIGLU_OUT: tl.constexpr,
            BLOCK_K: tl.constexpr):  # fmt: skip
    """One K step's weight tile (and its up rows' tile with ``SWIGLU_OUT``; else ``w`` again)."""
    if EVEN_K:
        w = tl.load(w_ptrs)
        wu = tl.load(wu_ptrs) if SWIGLU_OUT else w
    else:
        kmask = (k0 + tl.arange(0, BLOCK_K))[None, :] < K
        w = tl.load(w_ptrs, mask=kmask, other=0.0)
        wu = tl.load(wu_ptrs, mask=kmask, other=0.0) if SWIGLU_OUT else w
    return w, wu


@triton.jit
def _k_step(acc, acc_u, sq, rstd, w, wu, x_ptrs, nw_ptrs, r_ptrs, nr_ptrs, rm_ok, k0, K,
            EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, SWIGLU_OUT: tl.constexpr,
            NORM: tl.constexpr, ADD: tl.constexpr, LATE_NORM: tl.constexpr,
            USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One K step of the main loop with its weight tiles loaded: the activations (SwiGLU'd,
    normalised), then the accumulation. Returns ``acc``, ``acc_u`` and ``sq`` (the late
    norm's sums of squares; passed through otherwise)."""
    rk = tl.arange(0, BLOCK_K)
    if EVEN_K:
        xa = tl.load(x_ptrs)
        xb = tl.load(x_ptrs + K) if SWIGLU else xa
        if NORM:
            nw = tl.load(nw_ptrs)
            r = tl.load(r_ptrs) if ADD else xa
    else:
        kmask = (k0 + rk)[None, :] < K
        xa = tl.load(x_ptrs, mask=kmask, other=0.0)
        xb = tl.load(x_ptrs + K, mask=kmask, other=0.0) if SWIGLU else xa
        if NORM:
            nw = tl.load(nw_ptrs, mask=(k0 + rk) < K, other=0.0)
            r = tl.load(r_ptrs, mask=kmask, other=0.0) if ADD else xa
    if SWIGLU:  # silu(gate) * up in fp32, rounded once to the dtype (as silu_and_mul)
        gate = xa.to(tl.float32)
        xa = (gate / (1.0 + tl.exp(-gate)) * xb.to(tl.float32)).to(w.dtype)
    if NORM:  # the rmsnorm kernel's roundings: x + r, then x / rms, then times the weight
        if ADD:
            xa = (xa.to(tl.float32) + r.to(tl.float32)).to(w.dtype)
        if LATE_NORM:  # x + r, then times the weight; 1 / rms scales the product below
            if ADD:
                if tl.program_id(0) == 0:  # the new residual stream, once
                    kin = (k0 + rk)[None, :] < K
                    tl.store(nr_ptrs + k0, xa, mask=rm_ok[:, None] & kin)
            hf = xa.to(tl.float32)
            sq += tl.sum(hf * hf, axis=1)
            xa = (hf * nw.to(tl.float32)[None, :]).to(w.dtype)
        else:
            xa = (xa.to(tl.float32) * rstd[:, None]).to(w.dtype)
            xa = (xa.to(tl.float32) * nw.to(tl.float32)[None, :]).to(w.dtype)
    acc = _acc_step(acc, xa, w, USE_DOT, BLOCK_M)
    if SWIGLU_OUT:
        acc_u = _acc_step(acc_u, xa, wu, USE_DOT, BLOCK_M)
    return acc, acc_u, sq


@triton.jit
def _next_k(w_ptrs, wu_ptrs, x_ptrs, nw_ptrs, r_ptrs, BLOCK_K: tl.constexpr):
    """The main loop's pointers one K step on."""
    return (w_ptrs + BLOCK_K, wu_ptrs + BLOCK_K, x_ptrs + BLOCK_K, nw_ptrs + BLOCK_K,
            r_ptrs + BLOCK_K)  # fmt: skip


@triton.jit
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    r_ptr,
    nw_ptr,
    nr_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_ym,
    eps,
    pf_cols,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    SWIGLU_OUT: tl.constexpr,
    NORM: tl.constexpr,
    ADD: tl.constexpr,
    LATE_NORM: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    PF_LINES: tl.constexpr,
    PRELOAD: tl.constexpr,
):
    """``N`` is the output width: with ``SWIGLU_OUT`` the weight has ``2N`` rows (gate rows,
    then up rows) and each program accumulates its gate rows and the matching up rows.
    ``SPLIT``: program ``(n, s)`` sums K range ``[s * k_per_split, (s + 1) * k_per_split)``
    into ``part_ptr`` (fp32 ``[splits, BLOCK_M, N or 2N]``) and counts itself in
    ``count_ptr[n]`` (zero on entry and on return); the last of a tile's slices to arrive sums
    them all in slice order and runs the epilogue. ``PREFETCH``: the first ``pf_cols``
    columns of the program's weight slice are asked of L2 before the wait for the grid ahead
    (``PF_LINES`` lines per row at a time). ``PRELOAD``: the program's first weight tile is
    loaded into registers before that wait (its first K step then runs from them)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_ok = rn < N
    # Rows past N (or M) load row N - 1 (M - 1): in bounds and never stored, so the loads
    # need no row mask and stay full 16-byte vectors.
    rn_ld = tl.minimum(rn, N - 1).to(tl.int64)
    k_lo = 0
    k_hi = K
    if SPLIT:
        k_lo = tl.program_id(1) * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn_ld[:, None] * K + (k_lo + rk)[None, :]  # [BN, BK]
    wu_ptrs = w_ptr + (rn_ld + N)[:, None] * K + (k_lo + rk)[None, :]  # the up rows (SWIGLU_OUT)
    if PREFETCH:  # no kernel writes a weight: its first loads need not wait for the grid ahead
        pf_hi = tl.minimum(k_hi, k_lo + pf_cols)
        prefetch_rows_l2(w_ptr, rn_ld * K, k_lo, pf_hi, PF_LINES)
        if SWIGLU_OUT:
            prefetch_rows_l2(w_ptr, (rn_ld + N) * K, k_lo, pf_hi, PF_LINES)
    if PRELOAD:  # nor need they wait to reach registers: the first K step's tiles
        w0, wu0 = _load_w(w_ptrs, wu_ptrs, k_lo, K, EVEN_K, SWIGLU_OUT, BLOCK_K)
    pdl_prologue(PDL)
    rm = tl.arange(0, BLOCK_M)
    rm_ok = rm < M
    rm_ld = tl.minimum(rm, M - 1).to(tl.int64)
    x_off = rm_ld[:, None] * stride_xm + rk[None, :]  # [BM, BK]
    x_ptrs = x_ptr + x_off
    r_ptrs = r_ptr + x_off + k_lo
    nr_ptrs = nr_ptr + rm[:, None] * K + rk[None, :]
    nw_ptrs = nw_ptr + rk + k_lo
    sq = 0.0  # the late norm's sums of squares
    rstd = 1.0  # the norm's 1 / rms per row
    if NORM:
        if LATE_NORM:  # the squares summed in the main loop; program 0 stores x + r there
            sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        else:  # every program normalises the (few) rows itself: one extra pass, from L2
            rstd = _norm_rows(x_ptrs, r_ptr + x_off, nr_ptrs, rm_ok, rk, K, eps, ADD, BLOCK_M,
                              BLOCK_K)  # fmt: skip
    x_ptrs += k_lo
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = acc  # SWIGLU_OUT: the up rows' accumulator
    k_first = k_lo
    if PRELOAD:  # every program has at least one K step
        acc, acc_u, sq = _k_step(acc, acc_u, sq, rstd, w0, wu0, x_ptrs, nw_ptrs, r_ptrs, nr_ptrs,
                                 rm_ok, k_lo, K, EVEN_K, SWIGLU, SWIGLU_OUT, NORM, ADD,
                                 LATE_NORM, USE_DOT, BLOCK_M, BLOCK_K)  # fmt: skip
        w_ptrs, wu_ptrs, x_ptrs, nw_ptrs, r_ptrs = _next_k(w_ptrs, wu_ptrs, x_ptrs, nw_ptrs,
                                                          r_ptrs, BLOCK_K)  # fmt: skip
        k_first += BLOCK_K
    for k0 in range(k_first, k_hi, BLOCK_K):
        w, wu = _load_w(w_ptrs, wu_ptrs, k0, K, EVEN_K, SWIGLU_OUT, BLOCK_K)
        acc, acc_u, sq = _k_step(acc, acc_u, sq, rstd, w, wu, x_ptrs, nw_ptrs, r_ptrs, nr_ptrs,
                                 rm_ok, k0, K, EVEN_K, SWIGLU, SWIGLU_OUT, NORM, ADD,
                                 LATE_NORM, USE_DOT, BLOCK_M, BLOCK_K)  # fmt: skip
        w_ptrs, wu_ptrs, x_ptrs, nw_ptrs, r_ptrs = _next_k(w_ptrs, wu_ptrs, x_ptrs, nw_ptrs,
                                                          r_ptrs, BLOCK_K)  # fmt: skip
    out = _acc_out(acc, USE_DOT, BLOCK_M)  # [BM, BN]
    up = _acc_out(acc_u, USE_DOT, BLOCK_M) if SWIGLU_OUT else out
    if NORM and LATE_NORM:  # (rms-free x) @ W^T, times each row's 1 / rms
        rstd = tl.rsqrt(sq / K + eps)[:, None]
        out = out * rstd
        up = up * rstd
    if SPLIT:
        width = 2 * N if SWIGLU_OUT else N
        slice_ptrs = part_ptr + (tl.program_id(1) * BLOCK_M + rm)[:, None] * width + rn[None, :]
        tl.store(slice_ptrs, out, mask=rn_ok[None, :])
        if SWIGLU_OUT:
            tl.store(slice_ptrs + N, up, mask=rn_ok[None, :])
        # Every thread's partial stores come before the arrival (the barrier), and the arrival
        # releases them at GPU scope; the tile's last slice to arrive acquires the others'.
        tl.debug_barrier()
        counter = count_ptr + tl.program_id(0)
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            out, up = _sum_slices(part_ptr, rm, rn, rn_ok, N, width, BLOCK_M, SWIGLU_OUT)
            _epilogue(out, up, b_ptr, y_ptr, rm, rm_ok, rn, rn_ok, N, stride_ym, HAS_BIAS,
                      SWIGLU_OUT)  # fmt: skip
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        _epilogue(out, up, b_ptr, y_ptr, rm, rm_ok, rn, rn_ok, N, stride_ym, HAS_BIAS,
                  SWIGLU_OUT)  # fmt: skip


@triton.jit
def _sum_slices(part_ptr, rm, rn, rn_ok, N, width, BLOCK_M: tl.constexpr,
                SWIGLU_OUT: tl.constexpr):  # fmt: skip
    """A split tile's fp32 partials summed in slice order (read past L1: ``.cg``; this SM may
    hold lines of the same scratch from an earlier launch)."""
    ptrs = part_ptr + rm[:, None] * width + rn[None, :]
    out = tl.zeros((BLOCK_M, rn.shape[0]), dtype=tl.float32)
    up = out
    for s in range(0, tl.num_programs(1)):
        at = ptrs + s * BLOCK_M * width
        out += tl.load(at, mask=rn_ok[None, :], other=0.0, cache_modifier=".cg")
        if SWIGLU_OUT:
            up += tl.load(at + N, mask=rn_ok[None, :], other=0.0, cache_modifier=".cg")
    return out, up


@triton.jit
def _epilogue(out, up, b_ptr, y_ptr, rm, rm_ok, rn, rn_ok, N, stride_ym, HAS_BIAS: tl.constexpr,
              SWIGLU_OUT: tl.constexpr):  # fmt: skip
    """Bias, SwiGLU on the output, and the store of the fp32 tile ``out`` (``up``: the up
    rows' tile with ``SWIGLU_OUT``)."""
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=rn_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU_OUT:  # gate and up rounded as the product's output, then silu_and_mul's rounding
        if HAS_BIAS:
            up += tl.load(b_ptr + N + rn, mask=rn_ok, other=0.0).to(tl.float32)[None, :]
        gate = out.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(y_ptr.dtype.element_ty).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=rm_ok[:, None] & rn_ok[None, :])


@dataclass(frozen=True)
class NormIn:
    """An RMSNorm fused in front of the GEMM: ``x`` is ``delta`` (added to ``residual`` first
    when given) and the product reads ``rmsnorm(x (+ residual)) * weight``."""

    weight: torch.Tensor  # [K]
    eps: float
    residual: torch.Tensor | None = None  # [M, K], same strides as x
    new_residual: torch.Tensor | None = None  # [M, K] contiguous, written when residual is given


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tile: SkinnyTile,
    *,
    swiglu: bool = False,
    swiglu_out: bool = False,
    norm: NormIn | None = None,
    out: torch.Tensor | None = None,
    preload: bool | None = None,
) -> torch.Tensor:
    """Run the kernel with ``tile`` (the tuner calls this directly); see ``skinny_linear``.
    ``preload``: the first weight tile loaded ahead of the PDL wait (None: ``pdl_preload``).
    ``swiglu_out``: ``weight`` is a gate/up matrix ``[2N, K]`` (gate rows first, ``bias``
    ``[2N]``) and the result is ``silu(gate) * up`` ``[M, N]``, rounded as ``silu_and_mul``
    rounds the product's output."""
    if swiglu and swiglu_out:
        fail("linear", "swiglu (on the input) and swiglu_out (on the output) are exclusive")
    if swiglu_out and weight.shape[0] % 2:
        fail("linear", f"swiglu_out weight {tuple(weight.shape)} needs an even row count [2N, K]")
    m, k = x.shape[0], weight.shape[1]
    n = weight.shape[0] // 2 if swiglu_out else weight.shape[0]
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        if bias is None:
            return y.zero_()
        full = bias.float().expand(m, weight.shape[0])
        if not swiglu_out:
            return y.copy_(full)
        gate, up = full[:, :n].to(x.dtype).float(), full[:, n:].to(x.dtype).float()
        return y.copy_(gate * torch.sigmoid(gate) * up)
    if m > CUDA_CORE_ROWS and not tile.use_dot:
        fail("linear", f"tile {tile} uses the CUDA cores: at most {CUDA_CORE_ROWS} rows, got {m}")
    tiles = cdiv(n, tile.block_n)
    block_m = block_m_for(m, tile.use_dot)
    # Whole BLOCK_K steps per slice; fewer slices where K has fewer steps than split_k.
    k_per_split = cdiv(cdiv(k, tile.split_k), tile.block_k) * tile.block_k
    pf_cols = prefetch_columns(tile, weight.element_size(), swiglu_out)
    splits = cdiv(k, k_per_split)
    if splits > 1:
        width = 2 * n if swiglu_out else n
        part, counts = split_workspace(x.device, splits * block_m * width, tiles)
    else:
        part, counts = y, y  # unread
    grid = (tiles, splits)
    residual = norm.residual if norm is not None else None
    _skinny_linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        residual if residual is not None else x,
        norm.weight if norm is not None else weight,
        norm.new_residual if norm is not None and norm.new_residual is not None else x,
        part,
        counts,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        y.stride(0),
        norm.eps if norm is not None else 0.0,
        pf_cols,
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        SWIGLU_OUT=swiglu_out,
        NORM=norm is not None,
        ADD=residual is not None,
        LATE_NORM=norm is not None and tile.late_norm,
        USE_DOT=tile.use_dot,
        EVEN_K=k % tile.block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        SPLIT=splits > 1,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        PREFETCH=pdl_prefetch(x.device, "linear", x.shape[0]),
        # a pass's lines: about one per thread, no more than a row's prefetch holds
        PF_LINES=min(
            max(1, 32 * tile.num_warps // tile.block_n),
            next_power_of_2(cdiv(min(k_per_split, pf_cols) * weight.element_size(), 128)),
        ),
        PRELOAD=pdl_preload(x.device, m) if preload is None else preload,
        **pdl_kwargs(x.device),
    )
    return y


#: Weight bytes one program asks of L2 ahead of its PDL wait, at most (``prefetch_columns``).
PREFETCH_BYTES = 32 * 1024


def prefetch_columns(tile: SkinnyTile, element_size: int, swiglu_out: bool = False) -> int:
    """Columns of its weight rows a program prefetches ahead of its PDL wait: what covers
    the first DRAM round trip, ``PREFETCH_BYTES`` over its rows (gate and up rows for
    ``swiglu_out``), whole ``block_k`` steps and at least one. Capped so that the programs
    resident at once (a few per SM) ask L2 for far less than it holds: a wide tile's whole
    slice (the LM head's 128 rows x 1024 columns, 256 KB) would evict itself."""
    rows = tile.block_n * (2 if swiglu_out else 1)
    steps = max(1, PREFETCH_BYTES // (rows * element_size * tile.block_k))
    return steps * tile.block_k


# Split-K scratch: fp32 partials and int32 arrival counters (zero between launches: the last
# slice of each tile resets its counter), per device and stream (``stream_scratch``).
_MIN_PART_ELEMS = 1 << 20  # 4 MiB: every 0.6B projection at 8 slices of 16 rows
_MIN_COUNTERS = 4096


def split_workspace(
    device: torch.device, part_elems: int, counters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K scratch of ``device``'s current stream: at least ``part_elems`` fp32
    partials and ``counters`` zeroed int32 counters."""
    part = stream_scratch(
        "split-k partials", device, part_elems, torch.float32, zeroed=False, least=_MIN_PART_ELEMS
    )
    counts = stream_scratch(
        "split-k counters", device, counters, torch.int32, zeroed=True, least=_MIN_COUNTERS
    )
    return part, counts


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    swiglu: bool = False,
) -> torch.Tensor | None:
    """``x [M, K] @ weight [N, K]^T (+ bias)`` with the tile this device's table or the default
    gives, or None where the table runs this call otherwise (the caller then runs ``F.linear``;
    with ``swiglu``, ``silu_and_mul`` first and then the plain call's own choice). The caller
    has checked ``linear.skinny_eligible``; a norm in front goes through ``tile_for`` and
    ``launch`` (``linear.norm_linear``)."""
    tile = tile_for(x, weight, bias, SWIGLU_IN if swiglu else PLAIN)
    return None if tile is None else launch(x, weight, bias, tile, swiglu=swiglu)


def tile_for(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, variant: str = ""
) -> SkinnyTile | None:
    """Check the arguments and pick the tile of the call ``variant`` (``VARIANTS``); None where
    this call runs otherwise (see ``choose``)."""
    check_device("linear", "x", x)
    check_same_device("linear", x, weight=weight, bias=bias)
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        fail("linear", f"bias {tuple(bias.shape)} must be contiguous [{weight.shape[0]}]")
    tile = pick_tile(x.shape[0], weight.shape[0], weight.shape[1], x.dtype, x.device, variant)
    if variant == NORM and tile is not None and not tile.fuse_norm:
        return None
    return tile


# -- tiles ---------------------------------------------------------------------------------------

#: The calls a tuned table can give a tile of their own, and what an entry of None means:
#: ``PLAIN`` the product alone (None: cuBLAS); ``NORM`` a norm in front, inside the kernel
#: (None: the norm kernel, then the ``PLAIN`` choice); ``SWIGLU_IN`` down's SwiGLU on the
#: input, inside the kernel (None: ``silu_and_mul``, then the ``PLAIN`` choice);
#: ``SWIGLU_OUT`` gate/up with SwiGLU on the output (None: gate/up as ``PLAIN`` / ``NORM``, and
#: down takes the SwiGLU). A ``SWIGLU_OUT`` tile's ``fuse_norm`` says where a norm in front runs.
PLAIN, NORM, SWIGLU_IN, SWIGLU_OUT = "", "norm", "swiglu_in", "swiglu_out"
VARIANTS = (PLAIN, NORM, SWIGLU_IN, SWIGLU_OUT)
#: Tables without a ``format`` are format 1: ``"N,K"`` keys only, a norm's place in the tile's
#: ``fuse_norm``, SwiGLU on the input on the plain tile, never SwiGLU on the output.
TABLE_FORMATS = (1, 2)

Table = dict[tuple[int, int, str], dict[int, "SkinnyTile | None"]]


def default_tile(m: int, n: int, k: int, variant: str = PLAIN) -> SkinnyTile | None:
    """Untuned shapes: the kernel for one row, cuBLAS (None) for more; SwiGLU on the output
    only under the interpreter (its tiles are untimed on GPUs).

    At one row the CUDA-core tile won on every shape the H200 tuner tried (1.1-3.7x over
    cuBLAS: four weight rows per program, 1024-wide K steps); with more rows the best tile
    depends on the shape and a wrong guess can lose 3x (the tensor-core tiles of a narrow-N,
    deep-K down projection), so only a tuned table enables them. Four rows per program keep
    two programs per SM down to N = 1056 on 132 SMs.
    """
    if m > CUDA_CORE_ROWS:  # a tuned table's tensor-core tiles only
        return None
    if interpreter_enabled():  # programs run one by one: few, wide ones (every path tested)
        return SkinnyTile(block_n=min(128, pow2_at_least(n)), block_k=min(256, pow2_at_least(k)))
    if m > 1 or variant == SWIGLU_OUT:
        return None
    return SkinnyTile(block_n=4, block_k=min(1024, pow2_at_least(k, 64)), num_warps=4, num_stages=3)


def _parse_entry(where: str, value: Any) -> SkinnyTile | None:
    if value in ("cublas", "apart"):
        return None
    if not isinstance(value, dict):
        fail("linear", f"tuned table {where}: {value!r} is not a tile, 'cublas' or 'apart'")
    return SkinnyTile(**value)


@functools.lru_cache(maxsize=16)
def load_table(path: str) -> Table | None:
    """``{(N, K, variant): {M: tile, or None}}`` from a tuned table, or None if absent.

    JSON: ``{"format": 2, "shapes": {"N,K[,variant]": {"M": tile | "cublas" | "apart"}}}``;
    format 1 (no ``format``) has ``"N,K"`` keys only and still loads. A ``NORM`` entry's tile
    runs the norm inside (its ``fuse_norm`` is set)."""
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        data = json.load(fh)
    fmt = data.get("format", 1)
    if fmt not in TABLE_FORMATS:
        fail("linear", f"tuned table {path}: format {fmt!r} unsupported (supported: 1, 2)")
    table: Table = {}
    for key, by_m in data["shapes"].items():
        parts = key.split(",")
        variant = parts[2] if len(parts) == 3 else PLAIN
        if len(parts) not in (2, 3) or variant not in VARIANTS or (fmt == 1 and variant):
            fail(
                "linear",
                f"tuned table {path}: key {key!r} unsupported (format {fmt}: 'N,K'"
                + (f" or 'N,K,variant' with variant one of {VARIANTS[1:]}" if fmt > 1 else "")
                + ")",
            )
        n, k = int(parts[0]), int(parts[1])
        entries = {int(m): _parse_entry(f"{key} M={m}", t) for m, t in by_m.items()}
        if variant == NORM:
            entries = {m: t and replace(t, fuse_norm=True) for m, t in entries.items()}
        table[(n, k, variant)] = entries
    return table


def tile_to_json(tile: SkinnyTile | None, variant: str = PLAIN) -> dict[str, Any] | str:
    if tile is not None:
        return asdict(tile)
    return "cublas" if variant in (PLAIN, SWIGLU_IN) else "apart"


def choose(table: Table | None, m: int, n: int, k: int, variant: str = PLAIN) -> SkinnyTile | None:
    """The table's choice for ``variant`` of (N, K) at the smallest tuned M >= m (past the
    largest tuned M: None), else ``default_tile``. A shape tuned without this variant's own
    entry (format 1): ``NORM`` takes the plain tile if its ``fuse_norm`` is set, ``SWIGLU_IN``
    the plain tile, ``SWIGLU_OUT`` None. Rounding M up keeps a CUDA-core tile tuned for M = 4
    from being stretched over more rows than its accumulators were sized for."""
    if variant not in VARIANTS:
        fail("linear", f"call variant {variant!r} unsupported (supported: {VARIANTS})")
    own = table.get((n, k, variant)) if table else None
    if own:
        return lookup(own, m)
    plain = table.get((n, k, PLAIN)) if table else None
    if not plain:
        return default_tile(m, n, k, variant)
    if variant == SWIGLU_OUT:
        return None
    tile = lookup(plain, m)
    if variant == NORM and tile is not None and not tile.fuse_norm:
        return None
    return tile


def pick_tile(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    variant: str = PLAIN,
) -> SkinnyTile | None:
    """``choose`` with this device's table (CUDA; none elsewhere). Cached: eager decoding
    calls this for every projection of every step."""
    return _pick_tile(m, n, k, dtype, device, variant, interpreter_enabled())


@functools.lru_cache(maxsize=4096)
def _pick_tile(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, variant: str, interp: bool
) -> SkinnyTile | None:
    table = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        table = load_table(os.path.join(CONFIG_DIR, tuned_table_name(name, dtype)))
    return choose(table, m, n, k, variant)


def lookup(by_m: dict[int, SkinnyTile | None], m: int) -> SkinnyTile | None:
    above = [key for key in by_m if key >= m]
    return by_m[min(above)] if above else None
