"""Per-head q/k RMSNorm + rotate-half RoPE (+ optional K/V cache store): reference and switch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from execrt.core.kv_quant import K_INV_SCALE, V_INV_SCALE
from execrt.core.kv_quant import store as store_kv
from execrt.kernels._triton import fail, import_triton
from execrt.kernels.norm import rmsnorm_torch


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` in fp32 over the last dim (a power of two, D): ``H`` the Sylvester Hadamard
    matrix over sqrt(D), orthogonal and symmetric, so rotating q and k alike keeps every q.k.
    A fast Walsh-Hadamard transform, its butterflies from the widest (D/2) down, in the order
    the Triton kernel adds them (the same fp32 values)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"hadamard_rotate: last dim {d} must be a power of two")
    y = x.float()
    h = d // 2
    while h >= 1:
        pairs = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h //= 2
    return y * d**-0.5


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """NeoX convention: ``[x1, x2] -> [-x2, x1]`` over the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def qk_norm_rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    *,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    out_cache_loc: torch.Tensor | None = None,
    cache_scales: torch.Tensor | None = None,
    hadamard: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference with the model's roundings: norm as ``RMSNorm``, then RoPE in ``q.dtype``.

    The table rows are cast to ``q.dtype`` before use and ``q * cos``, ``rotate_half(q) * sin``
    and their sum are each rounded to the dtype, exactly as ``RotaryEmbedding`` does;
    ``hadamard`` then rotates both (``hadamard_rotate``, rounded to the dtype once). The
    rotated k and v are stored through ``kv_quant.store``, as ``KVCache.set_kv`` stores.
    """
    store = _store_args(v, k_cache, v_cache, out_cache_loc, cache_scales)
    if q_norm_weight is not None:
        q = rmsnorm_torch(q, q_norm_weight, eps)  # [T, Hq, D]
    if k_norm_weight is not None:
        k = rmsnorm_torch(k, k_norm_weight, eps)  # [T, Hkv, D]
    c = cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
    s = sin[positions].to(q.dtype)[:, None, :]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    if hadamard:
        q, k = hadamard_rotate(q).to(q.dtype), hadamard_rotate(k).to(k.dtype)
    if store is not None:
        inv = store.scales
        store_kv(store.k_cache, store.loc, k, None if inv is None else inv[K_INV_SCALE])
        store_kv(store.v_cache, store.loc, store.v, None if inv is None else inv[V_INV_SCALE])
    return q, k


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    *,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    out_cache_loc: torch.Tensor | None = None,
    cache_scales: torch.Tensor | None = None,
    hadamard: bool = False,
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (and, with weights, per-head RMS-normed) ``(q [T, Hq, D], k [T, Hkv, D])``.

    ``positions [T]`` index the fp32 tables ``cos``/``sin [P, D]`` (rows must be < P; not
    checked on the device, that would need a sync). ``q``, ``k`` (and ``v``) may be strided views,
    e.g. of a fused qkv projection ``[T, (Hq + 2 Hkv) D]``; the inputs are never written and
    the results are new contiguous tensors. With ``v [T, Hkv, Dv]``, ``k_cache [S, Hkv, D]``,
    ``v_cache [S, Hkv, Dv]`` and ``out_cache_loc [T]``, the rotated k and v are also stored at
    those cache slots (cast to the cache dtype), so the attention backend need not store them.
    An fp8 cache stores them quantized as ``kv_quant.quantize`` does, with the layer's scale
    row ``cache_scales`` (fp32 ``[4]``, ``KVCache.layer_scales[layer]``; None: scales 1.0):
    both paths give the same bytes. ``hadamard`` (a power-of-two head dim) rotates q and k,
    after RoPE, by the same orthogonal matrix (``hadamard_rotate``): q.k is unchanged and k is
    stored rotated, its outlier channels spread over the head before an fp8 rounding.

    The Triton kernel (``use_triton``) rounds the norm like the reference but computes the
    rotation in fp32 from the fp32 tables and rounds once: within 1e-6 relative of the
    reference in fp32 and a few ulps in fp16/bf16 (the reference rounds the table rows, both
    products and their sum to the dtype), and closer to exact math than the reference.
    """
    if not use_triton:
        return qk_norm_rope_torch(
            q, k, positions, cos, sin, q_norm_weight, k_norm_weight, eps,
            v=v, k_cache=k_cache, v_cache=v_cache, out_cache_loc=out_cache_loc,
            cache_scales=cache_scales, hadamard=hadamard,
        )  # fmt: skip
    import_triton()
    from execrt.kernels.triton_rotary import qk_norm_rope_triton

    return qk_norm_rope_triton(
        q, k, positions, cos, sin, q_norm_weight, k_norm_weight, eps,
        store=_store_args(v, k_cache, v_cache, out_cache_loc, cache_scales), hadamard=hadamard,
    )  # fmt: skip


class KVStore(NamedTuple):
    """Where the rotated k (and v) go: cache buffers, slots, the layer's scale row."""

    v: torch.Tensor  # [T, Hkv, Dv]
    k_cache: torch.Tensor  # [S, Hkv, D]
    v_cache: torch.Tensor  # [S, Hkv, Dv]
    loc: torch.Tensor  # [T] int32/int64
    scales: torch.Tensor | None  # fp32 [4]: k, v, 1/k, 1/v (kv_quant); None: 1.0


def _store_args(
    v: torch.Tensor | None,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    out_cache_loc: torch.Tensor | None,
    cache_scales: torch.Tensor | None,
) -> KVStore | None:
    """The K/V store when it is asked for, else None."""
    given = [t is not None for t in (v, k_cache, v_cache, out_cache_loc)]
    if not any(given):
        if cache_scales is not None:
            fail("qk_norm_rope", "cache_scales given without a K/V store")
        return None
    if not all(given):
        fail("qk_norm_rope", "the K/V store needs all of v, k_cache, v_cache and out_cache_loc")
    assert v is not None and k_cache is not None and v_cache is not None
    assert out_cache_loc is not None
    return KVStore(v, k_cache, v_cache, out_cache_loc, cache_scales)
