"""Triton per-head q/k RMSNorm + rotate-half RoPE, optionally storing the rotated k and v."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from execrt.core.kv_quant import K_INV_SCALE, V_INV_SCALE, fp8_format, is_fp8
from execrt.kernels._triton import (
    cdiv,
    check_device,
    check_float,
    check_last_dim_contiguous,
    check_same_device,
    fail,
    next_power_of_2,
    pdl_kwargs,
    sm_count,
)
from execrt.kernels.rotary import KVStore
from execrt.kernels.triton_pdl import pdl_prologue

NAME = "qk_norm_rope"
MAX_HEAD_DIM = 512
MAX_HEADS_PER_PROGRAM = 16
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _fp8_grid(x, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """fp32 ``x`` clamped to +-FP8_MAX and rounded to the nearest fp8 value (ties to even),
    still in fp32, so the cast after it is exact. The GPU's cast rounds the same way, but the
    Triton interpreter's drops the carry into the exponent (125 -> 64 in e4m3): rounding here
    gives torch's bytes on every backend. ``(a + c) - c`` with ``c = 1.5 * 2**(q + 23)``
    rounds ``a`` to a multiple of ``2**q``, the format's spacing at ``a``'s exponent."""
    bits = x.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(x), FP8_MAX)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    q = tl.maximum(exponent, EMIN) - MANT
    c = (((q + 150) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (a + c) - c
    sign = bits & -2147483648  # 0x80000000: -0.0 and tiny negatives keep their sign
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_cache(
    x,
    cache_ptr,
    scales_ptr,
    INV: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr,
):
    """``x`` as the cache stores it: ``kv_quant.quantize``, bit for bit."""
    if FP8:
        y = x.to(tl.float32)
        if HAS_SCALES:
            y = y * tl.load(scales_ptr + INV)  # real / scale, by the stored inverse
        out = _fp8_grid(y, FP8_MAX, FP8_MANT, FP8_EMIN).to(cache_ptr.dtype.element_ty)
    else:
        out = x.to(cache_ptr.dtype.element_ty)
    return out


@triton.jit
def _walsh_hadamard(x, BLOCK_H: tl.constexpr, N: tl.constexpr):
    """``x [BH, N]`` (fp32, N a power of two) times the unnormalised Sylvester Hadamard
    matrix: butterflies ``(a + b, a - b)`` of elements ``h`` apart, from h = N/2 down to 1 (the
    order of ``rotary.hadamard_rotate``), by reshapes, so that no element leaves registers
    but through Triton's own layout conversions."""
    for stage in tl.static_range(N.bit_length() - 1):  # h = N >> (stage + 1)
        pairs = tl.reshape(x, (BLOCK_H, 1 << stage, 2, N >> (stage + 1)))  # [BH, N/2h, 2, h]
        a, b = tl.split(tl.permute(pairs, (0, 1, 3, 2)))  # [BH, N / 2h, h] each
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK_H, N))
    return x


@triton.jit
def norm_rope_heads(
    src_ptr,
    stride_st,
    stride_sh,
    dst_ptr,
    stride_dt,
    stride_dh,
    w_ptr,
    cos_row,
    sin_row,
    token,
    head0,
    num_heads,
    eps,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HADAMARD: tl.constexpr,
    WRITE: tl.constexpr = True,
):
    """Heads ``head0 .. head0 + BLOCK_H`` (those below ``num_heads``) of one token: norm,
    rotate (RoPE, then with ``HADAMARD`` the Hadamard rotation), write to ``dst`` (unless
    ``WRITE`` is off); returns the two halves ``[BH, BD/2]`` in ``dst``'s dtype (for the K
    store). The decode attention kernel's prologue runs the same code
    (``attention/decode.py``), so fused and separate rotations give the same values."""
    heads = head0 + tl.arange(0, BLOCK_H)  # [BH]
    d = tl.arange(0, BLOCK_HALF)  # [BD/2]
    d_mask = d < HALF
    mask = (heads < num_heads)[:, None] & d_mask[None, :]  # [BH, BD/2]
    src = src_ptr + token * stride_st + heads[:, None].to(tl.int64) * stride_sh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)  # first half of each head
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    if HAS_NORM:
        # As RMSNorm: normalise in fp32, round to the input dtype, scale, round again.
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        mean_sq = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF)  # [BH]
        r = tl.rsqrt(mean_sq + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x1 = ((f1 * r).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
        x2 = ((f2 * r).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
    c1 = tl.load(cos_row + d, mask=d_mask, other=0.0)[None, :]  # fp32 [1, BD/2]
    c2 = tl.load(cos_row + HALF + d, mask=d_mask, other=0.0)[None, :]
    s1 = tl.load(sin_row + d, mask=d_mask, other=0.0)[None, :]
    s2 = tl.load(sin_row + HALF + d, mask=d_mask, other=0.0)[None, :]
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # rotate_half([x1, x2]) = [-x2, x1]; fp32 throughout, one rounding at the end.
    r1 = f1 * c1 - f2 * s1
    r2 = f2 * c2 + f1 * s2
    if HADAMARD:  # [r1, r2] H: the widest butterfly joins the halves, the rest is per half
        r1, r2 = r1 + r2, r1 - r2
        norm = 1.0 / tl.sqrt(2.0 * HALF)
        r1 = _walsh_hadamard(r1, BLOCK_H, BLOCK_HALF) * norm
        r2 = _walsh_hadamard(r2, BLOCK_H, BLOCK_HALF) * norm
    o1 = r1.to(dst_ptr.dtype.element_ty)
    o2 = r2.to(dst_ptr.dtype.element_ty)
    if WRITE:
        dst = dst_ptr + token * stride_dt + heads[:, None].to(tl.int64) * stride_dh + d[None, :]
        tl.store(dst, o1, mask=mask)
        tl.store(dst + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def store_kv_heads(
    k1,
    k2,
    v_ptr,
    stride_vt,
    stride_vh,
    k_cache_ptr,
    v_cache_ptr,
    scales_ptr,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    token,
    slot,
    head0,
    num_heads,
    K_INV: tl.constexpr,
    V_INV: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Store the rotated k heads ``head0 .. head0 + BLOCK_H`` (below ``num_heads``; ``k1``,
    ``k2``: their halves from ``norm_rope_heads``) and the same heads of v (read from
    ``v_ptr``'s row ``token``) at cache ``slot``, as ``kv_quant.store`` stores them."""
    heads = head0 + tl.arange(0, BLOCK_H)  # [BH]
    heads64 = heads[:, None].to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads)[:, None] & (d < HALF)  # [BH, BD/2]
    # No tuple or starred arguments here: older Triton compilers take neither.
    k1 = _to_cache(k1, k_cache_ptr, scales_ptr, K_INV, HAS_SCALES, FP8, FP8_MAX, FP8_MANT, FP8_EMIN)
    k2 = _to_cache(k2, k_cache_ptr, scales_ptr, K_INV, HAS_SCALES, FP8, FP8_MAX, FP8_MANT, FP8_EMIN)
    dst = k_cache_ptr + slot * stride_kcs + heads64 * stride_kch + d
    tl.store(dst, k1, mask=mask)
    tl.store(dst + HALF, k2, mask=mask)
    dv = tl.arange(0, BLOCK_DV)[None, :]
    mask = (heads < num_heads)[:, None] & (dv < HEAD_DIM_V)  # [BH, BDv]
    vals = tl.load(v_ptr + token * stride_vt + heads64 * stride_vh + dv, mask=mask)
    vals = _to_cache(
        vals, v_cache_ptr, scales_ptr, V_INV, HAS_SCALES, FP8, FP8_MAX, FP8_MANT, FP8_EMIN
    )
    tl.store(v_cache_ptr + slot * stride_vcs + heads64 * stride_vch + dv, vals, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    q_w_ptr,
    k_w_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    loc_ptr,
    k_cache_ptr,
    v_cache_ptr,
    scales_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    num_q_heads,
    num_kv_heads,
    q_blocks,
    eps,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    K_INV: tl.constexpr,
    V_INV: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HADAMARD: tl.constexpr,
    PDL: tl.constexpr,
):
    # Grid (T, q_blocks + kv_blocks): a program rotates BLOCK_H heads of q, or of k (and then
    # stores them and the same heads of v into the cache).
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    if hb < q_blocks:
        norm_rope_heads(
            q_ptr, stride_qt, stride_qh, q_out_ptr, stride_qot, stride_qoh, q_w_ptr,
            cos_row, sin_row, token, hb * BLOCK_H, num_q_heads, eps, HAS_Q_NORM, HALF, BLOCK_H,
            BLOCK_HALF, HADAMARD,
        )  # fmt: skip
    else:
        head0 = (hb - q_blocks) * BLOCK_H
        k1, k2 = norm_rope_heads(
            k_ptr, stride_kt, stride_kh, k_out_ptr, stride_kot, stride_koh, k_w_ptr,
            cos_row, sin_row, token, head0, num_kv_heads, eps, HAS_K_NORM, HALF, BLOCK_H,
            BLOCK_HALF, HADAMARD,
        )  # fmt: skip
        if STORE_KV:
            store_kv_heads(
                k1, k2, v_ptr, stride_vt, stride_vh, k_cache_ptr, v_cache_ptr, scales_ptr,
                stride_kcs, stride_kch, stride_vcs, stride_vch, token,
                tl.load(loc_ptr + token).to(tl.int64), head0, num_kv_heads, K_INV, V_INV,
                HAS_SCALES, FP8, FP8_MAX, FP8_MANT, FP8_EMIN, HALF, HEAD_DIM_V, BLOCK_H,
                BLOCK_HALF, BLOCK_DV,
            )  # fmt: skip


def heads_per_program(tokens: int, num_q_heads: int, num_kv_heads: int, sms: int) -> int:
    """Heads per program: grow the tile while the grid still gives every SM four programs.

    At decode (few tokens) one head per program spreads the step over many SMs; at prefill
    bigger tiles cut the per-program overhead and widen the loads.
    """
    cap = min(MAX_HEADS_PER_PROGRAM, next_power_of_2(max(num_q_heads, num_kv_heads)))
    bh = 1
    while bh < cap:
        nxt = 2 * bh
        programs = tokens * (cdiv(num_q_heads, nxt) + cdiv(num_kv_heads, nxt))
        if programs < 4 * sms:
            break
        bh = nxt
    return bh


def rope_warps(heads: int) -> int:
    """Warps of a program of ``heads`` heads: one up to two heads, else one per head (at most
    8). The H200 sweep (``bench_layer_kernels.py --sweep``, 0.6B shape, µs per call) at 128
    tokens: 4 heads on 4 warps 3.05 against 4.17 on the one warp that 8 elements per thread
    gave; at 256 tokens 8 heads on 8 warps 3.67 against 4.74 on 2; 2 heads on 2 warps lost to
    one (4.09 against 3.09)."""
    return 1 if heads <= 2 else min(8, heads)


def check_rotation(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """Validate the rotation inputs; return ``(T, Hq, Hkv, D)``."""
    if q.dim() != 3 or k.dim() != 3:
        fail(NAME, f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D]")
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d:
        fail(NAME, f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in T or D")
    if d % 2 or not 2 <= d <= MAX_HEAD_DIM:
        fail(NAME, f"head_dim {d} unsupported (supported: even, 2..{MAX_HEAD_DIM})")
    check_float(NAME, "q", q)
    if k.dtype != q.dtype:
        fail(NAME, f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (w.shape != (d,) or w.dtype != q.dtype):
            fail(NAME, f"{name} {tuple(w.shape)} {w.dtype} must be [{d}] {q.dtype}")
    if positions.dim() != 1 or positions.shape[0] != t or positions.dtype not in INDEX_DTYPES:
        fail(NAME, f"positions {tuple(positions.shape)} {positions.dtype} must be [{t}] int32/64")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != d or table.dtype != torch.float32:
            fail(NAME, f"{name} {tuple(table.shape)} {table.dtype} must be [P, {d}] float32")
    check_device(NAME, "q", q)
    check_same_device(
        NAME, q, k=k, positions=positions, cos=cos, sin=sin,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
    )  # fmt: skip
    check_last_dim_contiguous(
        NAME, q=q, k=k, cos=cos, sin=sin, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight
    )
    return t, hq, hkv, d


def check_kv_store(store: KVStore, q: torch.Tensor, t: int, hkv: int, d: int) -> int:
    """Validate the K/V store; return ``Dv``."""
    v, k_cache, v_cache, loc, scales = store
    if v.dim() != 3 or v.shape[:2] != (t, hkv):
        fail(NAME, f"v {tuple(v.shape)} must be [{t}, {hkv}, Dv]")
    dv = v.shape[2]
    if not 1 <= dv <= MAX_HEAD_DIM:
        fail(NAME, f"v head dim {dv} unsupported (supported: 1..{MAX_HEAD_DIM})")
    if k_cache.dim() != 3 or k_cache.shape[1:] != (hkv, d):
        fail(NAME, f"k_cache {tuple(k_cache.shape)} must be [S, {hkv}, {d}]")
    if v_cache.dim() != 3 or v_cache.shape[1:] != (hkv, dv) or v_cache.shape[0] != k_cache.shape[0]:
        fail(NAME, f"v_cache {tuple(v_cache.shape)} must be [{k_cache.shape[0]}, {hkv}, {dv}]")
    if loc.dim() != 1 or loc.shape[0] != t or loc.dtype not in INDEX_DTYPES:
        fail(NAME, f"out_cache_loc {tuple(loc.shape)} {loc.dtype} must be [{t}] int32/64")
    check_float(NAME, "v", v)
    if not is_fp8(k_cache.dtype):
        check_float(NAME, "k_cache", k_cache)
    if v_cache.dtype != k_cache.dtype:
        fail(NAME, f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    if scales is not None and (scales.shape != (4,) or scales.dtype != torch.float32):
        fail(NAME, f"cache_scales {tuple(scales.shape)} {scales.dtype} must be [4] float32")
    check_same_device(
        NAME, q, v=v, k_cache=k_cache, v_cache=v_cache, out_cache_loc=loc, cache_scales=scales
    )
    check_last_dim_contiguous(NAME, v=v, k_cache=k_cache, v_cache=v_cache)
    return dv


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    store: KVStore | None = None,
    heads_per_block: int | None = None,
    hadamard: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch for q and k of every token; see ``rotary.qk_norm_rope``.

    ``heads_per_block`` (a power of two) overrides the tile heuristic, for tests.
    """
    t, hq, hkv, d = check_rotation(q, k, positions, cos, sin, q_norm_weight, k_norm_weight)
    dv = check_kv_store(store, q, t, hkv, d) if store is not None else 1
    if hadamard and d & (d - 1):
        fail(NAME, f"hadamard rotation: head_dim {d} unsupported (supported: a power of two)")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    v, k_cache, v_cache, loc, scales = store or KVStore(k, k_out, k_out, positions, None)
    fp8 = is_fp8(k_cache.dtype)
    fmt = fp8_format(k_cache.dtype if fp8 else torch.float8_e4m3fn)  # unused unless fp8
    bh = heads_per_block or heads_per_program(t, hq, hkv, sm_count(q.device))
    if bh & (bh - 1):
        fail(NAME, f"heads_per_block {bh} unsupported (supported: a power of two)")
    q_blocks = cdiv(hq, bh)
    grid = (t, q_blocks + cdiv(hkv, bh))
    _qk_norm_rope_kernel[grid](
        q, k, v, q_out, k_out,
        q_norm_weight if q_norm_weight is not None else q_out,
        k_norm_weight if k_norm_weight is not None else k_out,
        positions, cos, sin, loc, k_cache, v_cache, k_out if scales is None else scales,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        hq, hkv, q_blocks, eps,
        HAS_Q_NORM=q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None,
        STORE_KV=store is not None,
        K_INV=K_INV_SCALE,
        V_INV=V_INV_SCALE,
        HAS_SCALES=scales is not None,
        FP8=fp8,
        FP8_MAX=fmt.max,
        FP8_MANT=fmt.mantissa_bits,
        FP8_EMIN=fmt.min_exponent,
        HALF=d // 2,
        HEAD_DIM_V=dv,
        BLOCK_H=bh,
        BLOCK_HALF=next_power_of_2(d // 2),
        BLOCK_DV=next_power_of_2(dv),
        HADAMARD=hadamard,
        num_warps=rope_warps(bh),
        **pdl_kwargs(q.device),
    )  # fmt: skip
    return q_out, k_out
