"""Decode attention with ``qk_norm_rope`` inside its launch (``decode_attention(prologue=)``).

The oracle is what the step runs without it: the separate rotation kernel (storing K/V) and
then the same decode launch on its output. Under the interpreter both must give the same
bytes, in the cache and in the output; compiled on a GPU the stored K and the output may
differ by a rounding (the norm's sum over another tile shape, a differently contracted
multiply-add: seen at head dim 96 in fp32 on the H200). A float64 attention over the torch
reference's rotation checks both against the math.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from execrt.kernels import attention as tk
from execrt.kernels.rotary import qk_norm_rope, qk_norm_rope_torch
from execrt.testing.attention_harness import rope_tables
from tests.kernels.attention.test_decode import (
    CUDA,
    SMALL,
    SMALL_TOL,
    assert_close,
    flat_indices,
    fp8_cache,
    make_cache,
    ref_attention,
)

FP8 = torch.float8_e4m3fn


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads included)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_case(
    seq_lens: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    norm: bool = True,
    hadamard: bool = False,
    fused: bool = False,
    max_splits: int = 4,
    seed: int = 0,
    programs: str = "request",
) -> None:
    gen = torch.Generator().manual_seed(seed)
    dev, batch, d = SMALL, len(seq_lens), head_dim
    cache = make_cache(seq_lens, num_kv_heads, d, d, dtype, dev, gen)
    cache, _, scales = fp8_cache(cache, kv_dtype, kv_scales)
    indptr, indices = flat_indices(cache)
    last = indptr[1:].long() - 1
    loc = indices[last].long()  # this step's slots: each request's last context token
    poison = float("nan") if kv_dtype is None else 0.0  # (fp8 e4m3 has no NaN to cast to)
    cache.k[loc] = poison
    cache.v[loc] = poison
    width = (num_q_heads + 2 * num_kv_heads) * d
    qkv = (torch.randn(batch, width, generator=gen) * 3).to(dtype).to(dev)
    q = qkv[:, : num_q_heads * d].view(batch, num_q_heads, d)  # strided views, as the model's
    k = qkv[:, num_q_heads * d : (num_q_heads + num_kv_heads) * d].view(batch, num_kv_heads, d)
    v = qkv[:, (num_q_heads + num_kv_heads) * d :].view(batch, num_kv_heads, d)
    positions = torch.tensor(seq_lens, device=dev) - 1 + 3  # any rows of the tables
    cos, sin = rope_tables(max(seq_lens) + 8, d, dev)
    q_w = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(dev) if norm else None
    k_w = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(dev) if norm else None
    eps = 1e-6
    splits = torch.empty(batch, dtype=torch.int32, device=dev)
    tk.decode_num_splits(
        torch.tensor(seq_lens, dtype=torch.int32, device=dev), splits, max_splits,
        tk.SplitPolicy(16, 16),
    )  # fmt: skip
    sm_scale = d**-0.5

    def attend(q_in: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, **kw: object):
        o = torch.full((batch, num_q_heads, d), float("nan"), dtype=dtype, device=dev)
        part = (batch, num_q_heads, max_splits)
        arrivals = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=dev)
        tk.decode_attention(
            q_in, k_cache, v_cache, o, indptr, indices, splits,
            torch.full((*part, d), float("nan"), device=dev),
            torch.full(part, float("nan"), device=dev), sm_scale, max_splits, kv_scales=scales,
            block_n=16, arrivals=arrivals if fused else None, programs=programs,
            **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        assert arrivals.eq(0).all()
        return o

    # The step without the prologue: the rotation kernel stores K/V, decode reads them.
    k_sep, v_sep = cache.k.clone(), cache.v.clone()
    q_rot, _ = qk_norm_rope(
        q, k, positions, cos, sin, q_w, k_w, eps, v=v, k_cache=k_sep, v_cache=v_sep,
        out_cache_loc=loc, cache_scales=scales, hadamard=hadamard, use_triton=True,
    )  # fmt: skip
    o_sep = attend(q_rot, k_sep, v_sep)
    qkv_before = qkv.clone()
    pro = tk.DecodePrologue(k, v, positions, cos, sin, q_w, k_w, eps, loc, hadamard)
    o = attend(q, cache.k, cache.v, prologue=pro)

    assert same_bytes(qkv, qkv_before), "the prologue must not write its inputs"
    assert same_bytes(cache.v, v_sep), "V stored otherwise"
    if CUDA:  # compiled: the norm's sum (another tile shape) and rsqrt may round 1 / rms
        # differently, which moves every element of a head by a few units of the head's
        # largest input (an element where the rotation cancels errs by many of its own units:
        # 13 in fp32 on the H200, 1.3 units of its head's largest value)
        info = torch.finfo(cache.k.dtype)
        got, want = cache.k.double(), k_sep.double()
        both_nan = got.isnan() & want.isnan()
        err = (got - want).abs().masked_fill(both_nan, 0.0)
        bound = 4 * info.eps * want.nan_to_num(0.0).abs().amax(dim=-1, keepdim=True)
        assert (err <= bound + info.smallest_normal).all(), (err / bound).nan_to_num(1e9).max()
        assert_close(o, o_sep.double(), (2e-3, 2e-2))
    else:
        assert same_bytes(cache.k, k_sep), "K stored otherwise"
        assert same_bytes(o, o_sep), "the fused launch must give the separate launches' output"

    # Against the math: the torch rotation, stored as the cache stores it, float64 attention.
    k_ref, v_ref = cache.k.clone(), cache.v.clone()
    k_ref[loc], v_ref[loc] = poison, poison
    q_ref, _ = qk_norm_rope_torch(
        q, k, positions, cos, sin, q_w, k_w, eps, v=v, k_cache=k_ref, v_cache=v_ref,
        out_cache_loc=loc, cache_scales=scales, hadamard=hadamard,
    )  # fmt: skip
    k_scale, v_scale = kv_scales if kv_dtype is not None else (1.0, 1.0)
    ref = torch.zeros(batch, num_q_heads, d, dtype=torch.float64)
    for b, length in enumerate(seq_lens):
        slots = indices[int(indptr[b]) : int(indptr[b]) + length].long()
        ref[b] = ref_attention(
            q_ref[b : b + 1], k_ref[slots].double() * k_scale, v_ref[slots].double() * v_scale,
            torch.tensor([length - 1]), sm_scale,
        )[0].cpu()  # fmt: skip
    tol = SMALL_TOL.get(dtype, (1e-2, 6e-2))
    if kv_dtype is not None or dtype != torch.float32:  # the rotation's roundings differ
        # max-abs: also 2^-6 of the largest output (a 16-bit output's own rounding is up to
        # 2^-9 of it; the H200 run of 320 fp8 requests with v_scale 2 reached 0.107 at
        # outputs up to 13, norm-rel 1.5e-3). A wrong rotation errs by O(1): norm-rel holds it.
        tol = (max(tol[0], 2e-2), max(tol[1], 0.1, 2**-6 * float(ref.abs().max())))
    assert_close(o.cpu(), ref, tol)


CASES = {
    # ragged, several splits per request (and several items per program on the interpreter)
    "ragged": dict(seq_lens=[1, 17, 70, 33, 64]),
    "gqa-3": dict(seq_lens=[5, 40, 90], num_q_heads=6, num_kv_heads=2),  # BLOCK_H 4 > group 3
    "mha": dict(seq_lens=[20, 50], num_q_heads=2, num_kv_heads=2),
    "no-norm": dict(seq_lens=[9, 48], norm=False),
    "fused-merge": dict(seq_lens=[1, 17, 70, 33, 64], fused=True),
    "hadamard": dict(seq_lens=[3, 60], hadamard=True),
    "head-dim-96": dict(seq_lens=[12, 41], head_dim=96),
    "fp16": dict(seq_lens=[7, 66, 31], dtype=torch.float16),
    "fp8": dict(seq_lens=[7, 66, 31], dtype=torch.float16, kv_dtype=FP8, kv_scales=(0.25, 4.0)),
    "fp8-hadamard-fused": dict(
        seq_lens=[2, 50],
        dtype=torch.float16,
        kv_dtype=FP8,
        kv_scales=(4.0, 0.25),
        hadamard=True,
        fused=True,
    ),  # fmt: skip
    "fp8-e5m2": dict(seq_lens=[30], dtype=torch.float16, kv_dtype=torch.float8_e5m2),
    # one wave of programs (decode_programs "sm"): each rotates several items' heads first
    "one-wave-fused": dict(seq_lens=[1, 17, 70, 33, 64, 9, 120], fused=True, programs="sm"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prologue_gives_the_separate_rotation_and_store(case: str) -> None:
    run_case(**CASES[case])  # type: ignore[arg-type]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (compiled Triton kernels)")
@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("programs", ["request", "sm"])
def test_gpu_prologue_bf16(kv_dtype: torch.dtype | None, fused: bool, programs: str) -> None:
    lens = [1, 200, 1000, 513, 64, 7, 4096, 300] * (40 if programs == "sm" else 1)
    run_case(
        lens, num_q_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
        kv_dtype=kv_dtype, kv_scales=(0.5, 2.0), fused=fused, max_splits=16, programs=programs,
    )  # fmt: skip


def test_prologue_refusals() -> None:
    dev = SMALL
    q = torch.zeros(2, 4, 8, device=dev)
    k = torch.zeros(2, 2, 8, device=dev)
    cache_k = torch.zeros(10, 2, 8, device=dev)
    cos = sin = torch.zeros(16, 8, device=dev)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)
    loc = torch.tensor([1, 2], device=dev)
    splits = torch.ones(2, dtype=torch.int32, device=dev)

    def call(v_cache: torch.Tensor, o_dim: int = 8, scales=None, hadamard=False, v=None):
        pro = tk.DecodePrologue(
            k, k if v is None else v, loc, cos, sin, None, None, 1e-6, loc, hadamard
        )
        tk.decode_attention(
            q, cache_k, v_cache, torch.zeros(2, 4, o_dim, device=dev), idx, idx[:2], splits,
            torch.zeros(2, 4, 1, o_dim, device=dev), torch.zeros(2, 4, 1, device=dev),
            1.0, 1, kv_scales=scales, prologue=pro,
        )  # fmt: skip

    with pytest.raises(ValueError, match="v head dim 4 must equal the head dim 8"):
        call(torch.zeros(10, 2, 4, device=dev), o_dim=4, v=torch.zeros(2, 2, 4, device=dev))
    with pytest.raises(ValueError, match="kv_scales given for a torch.float32 cache"):
        call(cache_k, scales=torch.ones(4, device=dev))
    with pytest.raises(ValueError, match="positions"):
        tk.decode_attention(
            q, cache_k, cache_k, torch.zeros(2, 4, 8, device=dev), idx, idx[:2], splits,
            torch.zeros(2, 4, 1, 8, device=dev), torch.zeros(2, 4, 1, device=dev), 1.0, 1,
            prologue=tk.DecodePrologue(k, k, loc[:1], cos, sin, None, None, 1e-6, loc),
        )  # fmt: skip
    q6 = torch.zeros(2, 4, 6, device=dev)
    with pytest.raises(ValueError, match="hadamard needs a power-of-two head dim, got 6"):
        c6 = torch.zeros(10, 2, 6, device=dev)
        t6 = torch.zeros(16, 6, device=dev)
        tk.decode_attention(
            q6, c6, c6, torch.zeros(2, 4, 6, device=dev), idx, idx[:2], splits,
            torch.zeros(2, 4, 1, 6, device=dev), torch.zeros(2, 4, 1, device=dev), 1.0, 1,
            prologue=tk.DecodePrologue(
                torch.zeros(2, 2, 6, device=dev), torch.zeros(2, 2, 6, device=dev), loc, t6, t6,
                None, None, 1e-6, loc, True,
            ),
        )  # fmt: skip
