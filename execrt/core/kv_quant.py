"""FP8 KV cache: the storage dtypes, per-layer K/V scales, and the one torch quantize-on-store.

An fp8 cache stores ``real / scale`` per layer (one ``k_scale``, one ``v_scale``; 1.0 unless the
checkpoint has them), clamped to the format's finite range before the cast: torch's CUDA cast
to e4m3 turns values >= 480 into NaN where Triton and CPU torch saturate at 448, so every path
clamps first. ``store`` is the only torch writer (``KVCache.set_kv`` and the rotary kernel's
torch reference call it); the fused rotary kernel is its Triton twin and gives the same bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
#: ``kv_cache_dtype`` values -> the storage dtype (None: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: Positions in a layer's scale row ``KVCache.layer_scales[layer]`` (fp32 ``[4]``).
K_SCALE, V_SCALE, K_INV_SCALE, V_INV_SCALE = 0, 1, 2, 3


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype ``kv_cache_dtype = name`` stores in a ``model_dtype`` run."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv cache: kv_cache_dtype {name!r} unsupported "
            f"(supported: {', '.join(KV_CACHE_DTYPES)})"
        )
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


@dataclass(frozen=True)
class Fp8Format:
    """What a kernel needs to round to an fp8 format as torch's cast does (round to nearest
    even, after clamping to ``max``)."""

    max: float  # the largest finite value
    mantissa_bits: int
    min_exponent: int  # of the smallest normal number; subnormals step by 2**(this - mantissa)


@functools.cache
def fp8_format(dtype: torch.dtype) -> Fp8Format:
    info = torch.finfo(dtype)
    return Fp8Format(
        max=float(info.max),
        mantissa_bits=round(-math.log2(info.eps)),
        min_exponent=round(math.log2(info.tiny)),
    )


def quantize(
    x: torch.Tensor, dtype: torch.dtype, inv_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it. fp8: ``x * inv_scale`` (real / scale; None:
    1.0) in fp32, clamped to the finite range, cast with round to nearest even. Any other
    dtype: a plain cast (``inv_scale`` unused). ``x`` itself is never modified."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    bound = torch.finfo(dtype).max
    if inv_scale is None:
        y = x.float().clamp(-bound, bound)  # out of place: x.float() may be x itself
    else:
        y = (x.float() * inv_scale).clamp_(-bound, bound)
    return y.to(dtype)


def store(
    buffer: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, inv_scale: torch.Tensor | None
) -> None:
    """``buffer[loc] = quantize(x, buffer.dtype, inv_scale)``: the one torch K/V store.

    ``buffer [S, H, D]``, ``loc [T]`` int64, ``x [T, H, D]`` in any float dtype."""
    buffer[loc] = quantize(x, buffer.dtype, inv_scale)


def dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Values read from an fp8 cache as fp32: ``stored * scale``."""
    return x.float() * scale


@dataclass(frozen=True)
class KVScales:
    """One K and one V scale per layer, as a checkpoint stores them (real = stored * scale)."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"kv scales: {len(self.k)} k scales but {len(self.v)} v scales")
        bad = [s for s in (*self.k, *self.v) if not (math.isfinite(s) and s > 0)]
        if bad:
            raise ValueError(f"kv scales: {bad[0]!r} unsupported (supported: finite and > 0)")

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    def row(self, layer: int) -> list[float]:
        """Layer ``layer``'s scale row: k, v, 1/k, 1/v (the inverses rounded to fp32 once, so
        the torch and Triton stores multiply by the same number)."""
        k, v = self.k[layer], self.v[layer]
        return [k, v, 1.0 / k, 1.0 / v]
