"""Triton decode attention and index kernels checked against a float64 torch oracle.

The cache builders and the oracle here are shared with test_extend.py.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from execrt.core.errors import ConfigError
from execrt.core.kv_quant import quantize
from execrt.kernels import attention as tk
from execrt.kernels.kv_indices import fill_kv_index, host_indptr

CUDA = torch.cuda.is_available()
# The small scenarios run compiled on a GPU when there is one, under the interpreter otherwise.
SMALL = torch.device("cuda" if CUDA else "cpu")

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (compiled Triton kernels)")

# Tolerances: (norm-relative error, max abs error). The interpreter computes fp32 dots exactly;
# fp16 loses precision where the kernels round p to fp16 for the PV dot and on the final store.
# On the GPU fp32 dots run in TF32, and bf16 keeps only 8 mantissa bits.
CPU_TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 1e-2)}
GPU_TOL = {
    torch.float32: (5e-3, 3e-2),
    torch.float16: (1e-2, 3e-2),
    torch.bfloat16: (1e-2, 6e-2),
}
SMALL_TOL = GPU_TOL if CUDA else CPU_TOL


# ----------------------------------------------------------------------------------------------
# Cache construction and oracle
# ----------------------------------------------------------------------------------------------


@dataclass
class Cache:
    """A slot KV cache holding some requests, with their slot table rows."""

    k: torch.Tensor  # [S, Hkv, D]
    v: torch.Tensor  # [S, Hkv, Dv]
    req_to_token: torch.Tensor  # [R, max_ctx] int32
    rows: torch.Tensor  # [B] int32, row of each request in req_to_token
    seq_lens: list[int]

    def context(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of request b's context in order: ([L, Hkv, D], [L, Hkv, Dv])."""
        slots = self.req_to_token[int(self.rows[b]), : self.seq_lens[b]].long()
        return self.k[slots], self.v[slots]

    def quantized(self, dtype: torch.dtype, k_scale: float, v_scale: float) -> Cache:
        """The cache an fp8 store makes of this one: K / k_scale and V / v_scale in ``dtype``."""
        k = quantize(self.k, dtype, torch.tensor(1 / k_scale, device=self.k.device))
        v = quantize(self.v, dtype, torch.tensor(1 / v_scale, device=self.v.device))
        return Cache(k, v, self.req_to_token, self.rows, self.seq_lens)


def make_cache(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> Cache:
    """Random cache with each request's slots drawn from a shuffled range.

    Slot 0 and spare slots hold NaN, so any read outside a request's context poisons the output.
    """
    batch, total = len(seq_lens), sum(seq_lens)
    num_slots = 1 + total + 11
    shape_k, shape_v = (num_slots, num_kv_heads, head_dim), (num_slots, num_kv_heads, head_dim_v)
    k = torch.full(shape_k, float("nan"), dtype=dtype, device=device)
    v = torch.full(shape_v, float("nan"), dtype=dtype, device=device)
    slots = (torch.randperm(num_slots - 1, generator=gen) + 1)[:total]
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    dev_gen = gen if device.type == "cpu" else torch.Generator(device).manual_seed(seed)
    slots_dev = slots.to(device)
    k[slots_dev] = torch.randn(
        (total, *shape_k[1:]), generator=dev_gen, device=device, dtype=torch.float32
    ).to(dtype)
    v[slots_dev] = torch.randn(
        (total, *shape_v[1:]), generator=dev_gen, device=device, dtype=torch.float32
    ).to(dtype)
    # Row 0 is the reserved padding row; requests get shuffled rows among the rest.
    rows = (torch.randperm(batch + 2, generator=gen) + 1)[:batch].to(torch.int32)
    max_ctx = max(seq_lens, default=0) + 5
    # Entries past a request's length hold slot 0 (NaN data) so over-reads show up.
    req_to_token = torch.zeros(batch + 3, max_ctx, dtype=torch.int32)
    start = 0
    for b, length in enumerate(seq_lens):
        req_to_token[rows[b], :length] = slots[start : start + length].to(torch.int32)
        start += length
    return Cache(k, v, req_to_token.to(device), rows.to(device), list(seq_lens))


def flat_indices(cache: Cache) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_indptr [B+1] and kv_indices [sum(L)], built in torch (independent of the kernels)."""
    device = cache.k.device
    lens = torch.tensor(cache.seq_lens, dtype=torch.int64)
    indptr = torch.zeros(len(cache.seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    parts = [
        cache.req_to_token[int(cache.rows[b]), :length].cpu()
        for b, length in enumerate(cache.seq_lens)
    ]
    indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    return indptr.to(device), indices.to(torch.int32).to(device)


def ref_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """float64 attention of queries [n, Hq, D] over a context k [L, Hkv, D], v [L, Hkv, Dv].

    Query i attends context positions j <= positions[i]. Returns [n, Hq, Dv] float64; an empty
    context gives zeros.
    """
    n, num_q_heads, _ = q.shape
    length, num_kv_heads, head_dim_v = v.shape
    if length == 0:
        return torch.zeros(n, num_q_heads, head_dim_v, dtype=torch.float64, device=q.device)
    group = num_q_heads // num_kv_heads
    kk = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vv = v.double().repeat_interleave(group, dim=1)  # [L, Hq, Dv]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * sm_scale  # [Hq, n, L]
    pos = torch.arange(length, device=q.device)
    hidden = pos[None, :] > positions.to(q.device)[:, None]  # [n, L]
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: tuple[float, float]) -> None:
    """Every element written (no NaN left from the poison) and within (norm-rel, max-abs)."""
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} NaN in the output"
    diff = out.double() - ref
    rel = float(diff.norm() / ref.norm().clamp_min(1e-30)) if ref.numel() else 0.0
    max_abs = float(diff.abs().max()) if ref.numel() else 0.0
    assert rel <= tol[0] and max_abs <= tol[1], f"norm-rel {rel:.3g}, max-abs {max_abs:.3g}"


# ----------------------------------------------------------------------------------------------
# Runners
# ----------------------------------------------------------------------------------------------


def run_decode(
    seq_lens: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device = SMALL,
    max_splits: int = 4,
    num_splits: list[int] | None = None,
    min_split_len: int = 32,
    block_n: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    seed: int = 0,
    spare: int = 0,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    fused: bool = False,
    arrivals_len: int | None = None,
    arrivals_dtype: torch.dtype = torch.int32,
    fp8_words: bool | None = None,
    programs: str = "request",
    fp8_kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run decode_attention on a fresh random case; return (output, float64 reference).

    ``fused``: one launch, the merge inside stage 1 (arrival counters given, and checked to
    be zero again afterwards).

    ``num_splits=None`` derives the split counts with decode_num_splits. ``spare`` pads every
    index / scratch buffer past what the batch needs, as static graph buffers would be.
    ``kv_dtype`` (fp8): the cache is stored in it with ``kv_scales``; the reference reads it
    back times the scales.
    """
    gen = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    batch = len(seq_lens)
    cache = make_cache(seq_lens, num_kv_heads, head_dim, head_dim_v, dtype, device, gen)
    cache, read, scales = fp8_cache(cache, kv_dtype, kv_scales)
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    indptr, indices = flat_indices(cache)
    if spare:
        indptr = torch.cat([indptr, indptr[-1:].repeat(spare)])
        indices = torch.cat([indices, torch.zeros(spare, dtype=torch.int32, device=device)])
    splits = torch.full((batch + spare,), -5, dtype=torch.int32, device=device)
    if num_splits is None:
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        policy = tk.SplitPolicy(min_split_len, min_split_len)
        tk.decode_num_splits(lens, splits, max_splits, policy)
    else:
        splits[:batch] = torch.tensor(num_splits, dtype=torch.int32)
    o = torch.full((batch, num_q_heads, head_dim_v), float("nan"), dtype=dtype, device=device)
    part_shape = (batch + spare, num_q_heads, max_splits + spare)
    partial_o = torch.full((*part_shape, head_dim_v), float("nan"), device=device)
    partial_lse = torch.full(part_shape, float("nan"), device=device)
    sm_scale = head_dim**-0.5
    arrivals = None
    if fused:
        n = (batch + spare) * num_kv_heads if arrivals_len is None else arrivals_len
        arrivals = torch.zeros(n, dtype=arrivals_dtype, device=device)
    tk.decode_attention(
        q, cache.k, cache.v, o, indptr, indices, splits, partial_o, partial_lse, sm_scale,
        max_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
        kv_scales=scales, arrivals=arrivals, fp8_words=fp8_words, programs=programs,
        fp8_kernel=fp8_kernel,
    )  # fmt: skip
    if arrivals is not None:
        assert arrivals.eq(0).all(), "the last split of each request resets its counter"
    return o, decode_reference(q, read, seq_lens, sm_scale)


def decode_reference(
    q: torch.Tensor, read: Cache, seq_lens: list[int], sm_scale: float
) -> torch.Tensor:
    """float64 ``[B, Hq, Dv]``: each request's query over its whole context in ``read``."""
    ref = torch.zeros(
        q.shape[0], q.shape[1], read.v.shape[-1], dtype=torch.float64, device=q.device
    )
    for b in range(len(seq_lens)):
        last = torch.tensor([seq_lens[b] - 1])
        ref[b] = ref_attention(q[b : b + 1], *read.context(b), last, sm_scale)[0]
    return ref


def fp8_cache(
    cache: Cache, kv_dtype: torch.dtype | None, kv_scales: tuple[float, float]
) -> tuple[Cache, Cache, torch.Tensor | None]:
    """``(cache as the kernel reads it, what it holds in fp32, the kv_scales argument)``."""
    if kv_dtype is None:
        return cache, cache, None
    stored = cache.quantized(kv_dtype, *kv_scales)
    k_scale, v_scale = kv_scales
    read = Cache(
        stored.k.float() * k_scale, stored.v.float() * v_scale, cache.req_to_token, cache.rows,
        cache.seq_lens,
    )  # fmt: skip
    scales = torch.tensor([k_scale, v_scale, 1 / k_scale, 1 / v_scale], device=cache.k.device)
    return stored, read, scales


FLOATS_CPU = [torch.float32, torch.float16]


# ----------------------------------------------------------------------------------------------
# The kv_indices Triton kernel (the torch path: tests/kernels/test_kv_indices.py)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kv_indices_kernel_matches_slot_table(index_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    seq_lens = [1, 7, 600, 33, 0, 1030]
    cache = make_cache(seq_lens, 1, 16, 16, torch.float32, SMALL, gen)
    want_indptr, want = flat_indices(cache)
    tail = 37
    kv_indices = torch.full((want.numel() + tail,), -7, dtype=torch.int32, device=SMALL)
    fill_kv_index(
        cache.req_to_token,
        cache.rows.to(index_dtype),
        torch.tensor(seq_lens, dtype=index_dtype, device=SMALL),
        want_indptr,
        kv_indices,
        mode="on",
        fill_indptr=False,
    )
    assert torch.equal(kv_indices[: want.numel()], want)
    assert torch.all(kv_indices[want.numel() :] == -7), "wrote past kv_indptr[B]"


def test_kv_indices_kernel_empty_batch_is_noop() -> None:
    req_to_token = torch.arange(12, dtype=torch.int32).reshape(3, 4).to(SMALL)
    kv_indices = torch.full((5,), -7, dtype=torch.int32, device=SMALL)
    empty = torch.zeros(0, dtype=torch.int32, device=SMALL)
    indptr = torch.zeros(1, dtype=torch.int32, device=SMALL)
    fill_kv_index(req_to_token, empty, empty, indptr, kv_indices, mode="on", fill_indptr=False)
    assert torch.all(kv_indices == -7)


def test_kv_indices_rejects_bad_input() -> None:
    req_to_token = torch.zeros(3, 4, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv indices: req_to_token must be a 2-D int32/int64"):
        fill_kv_index(req_to_token.float(), one, one, one.repeat(2), one)
    with pytest.raises(ValueError, match="kv_indptr has 1 entries, need at least 2"):
        fill_kv_index(req_to_token, one, one, one, one)


# ----------------------------------------------------------------------------------------------
# Split policy
# ----------------------------------------------------------------------------------------------


def test_decode_num_splits_values_and_untouched_tail() -> None:
    lens = [0, 1, 31, 32, 33, 64, 65, 1000, 100000]
    policy = tk.SplitPolicy(min_split_len=32, target_split_len=128)
    out = torch.full((len(lens) + 3,), -9, dtype=torch.int32, device=SMALL)
    for dtype in (torch.int32, torch.int64):
        for min_splits in (1, 3):
            tk.decode_num_splits(
                torch.tensor(lens, dtype=dtype, device=SMALL), out, 8, policy, min_splits
            )
            want = [
                min(max(math.ceil(n / 128), min_splits), max(math.ceil(n / 32), 1), 8) for n in lens
            ]
            assert out[: len(lens)].tolist() == want
            assert out[len(lens) :].tolist() == [-9, -9, -9]


# The wave rule (decode_wave / wave_cap): one wave of fewer splits where a little past a wave
# would double the launch.
WAVE_CASES = [
    # (lens, counts, wave, want): 32 x 8.2k tokens at 5 splits on 148 items per head (an H200's
    # 1,188 one-warp programs over 8 kv heads): two waves -> one of 4 splits
    ([8200] * 32, [5] * 32, 148, [4] * 32),
    ([8192] * 32, [4] * 32, 148, [4] * 32),  # one wave already
    ([8200] * 64, [5] * 64, 198, [3] * 64),  # 2 waves of 5 -> 1 of 3 (2731 < 2 x 1640)
    ([8192] * 128, [4] * 128, 198, [4] * 128),  # 1 split of 8192 is longer than 3 waves of 2048
    ([8200] * 16 + [500] * 16, [5] * 16 + [2] * 16, 148, [5] * 16 + [2] * 16),  # fits
    ([8200] * 32, [5] * 32, 0, [5] * 32),  # off
    ([8200] * 32, [5] * 32, 31, [5] * 32),  # a wave below the batch: no cap of 1 split
    ([9000] * 30 + [20000] * 2, [5] * 30 + [10] * 2, 148, [5] * 30 + [10] * 2),  # 2 x 10 long
]


@pytest.mark.parametrize("case", range(len(WAVE_CASES)))
def test_wave_cap_cuts_splits_only_where_one_wave_is_faster(case: int) -> None:
    lens, counts, wave, want = WAVE_CASES[case]
    assert tk.indices.wave_cap(lens, counts, wave) == want


def test_decode_num_splits_and_metadata_follow_the_wave_rule() -> None:
    """The torch split counts, the one-launch metadata kernel's counts and its work list all
    apply wave_cap's rule to the policy's counts, over random batches (ragged and uniform)."""
    gen = torch.Generator().manual_seed(11)
    policy = tk.SplitPolicy(min_split_len=16, target_split_len=64)
    max_splits = 8
    fired = 0
    for trial in range(16):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        if trial % 2:
            lens = [int(torch.randint(1, 600, (1,), generator=gen))] * batch
        else:
            lens = torch.randint(1, 600, (batch,), generator=gen).tolist()
        wave = int(torch.randint(0, 4 * batch, (1,), generator=gen))
        plain = torch.empty(batch, dtype=torch.int32, device=SMALL)
        seq = torch.tensor(lens, dtype=torch.int64, device=SMALL)
        tk.decode_num_splits(seq, plain, max_splits, policy, 1)
        want = tk.indices.wave_cap(lens, plain.tolist(), wave)
        fired += want != plain.tolist()
        got = torch.empty(batch, dtype=torch.int32, device=SMALL)
        tk.decode_num_splits(seq, got, max_splits, policy, 1, wave=wave)
        assert got.tolist() == want, (lens, wave)
        cache = make_cache(lens, 1, 16, 16, torch.float32, SMALL, gen)
        indptr = torch.empty(batch + 1, dtype=torch.int32, device=SMALL)
        indices = torch.empty(sum(lens), dtype=torch.int32, device=SMALL)
        splits = torch.empty(batch, dtype=torch.int32, device=SMALL)
        work = torch.empty(tk.work_size(batch, max_splits), dtype=torch.int32, device=SMALL)
        tk.decode_metadata(
            cache.req_to_token, cache.rows, seq, indptr, indices, splits, max_splits, policy,
            1, work, wave=wave,
        )  # fmt: skip
        assert splits.tolist() == want, (lens, wave)
        ref = _work_reference(want, max_splits, lens)
        assert work[: len(ref)].tolist() == ref, (lens, wave)
    assert fired >= 3  # the rule cut some batches (so the comparisons above can fail)


def test_the_wave_rule_rejects_a_bad_wave() -> None:
    lens = torch.ones(4, dtype=torch.int32, device=SMALL)
    out = torch.zeros(4, dtype=torch.int32, device=SMALL)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="wave .* unsupported"):
            tk.decode_num_splits(lens, out, 4, tk.SplitPolicy(), wave=bad)  # type: ignore[arg-type]


def test_decode_wave_is_off_for_the_triton_kernels() -> None:
    """A model-dtype cache, and an fp8 one on the words kernel (or where the mma kernel cannot
    run: this CPU), leave the split counts to the policy."""
    q = torch.zeros(32, 8, 64, dtype=torch.float16, device=SMALL)
    k = torch.zeros(64, 2, 64, dtype=torch.float16, device=SMALL)
    assert tk.decode_wave(q, k, k) == 0
    k8 = k.to(torch.float8_e4m3fn)
    assert tk.decode_wave(q, k8, k8, fp8_kernel="words") == 0
    if not CUDA:
        assert tk.decode_wave(q, k8, k8) == 0


def test_decode_num_splits_rejects_bad_input() -> None:
    lens = torch.ones(4, dtype=torch.int32, device=SMALL)
    policy = tk.SplitPolicy()
    with pytest.raises(ValueError, match="num_splits_out dtype"):
        tk.decode_num_splits(lens, torch.zeros(4, dtype=torch.int64, device=SMALL), 4, policy)
    with pytest.raises(ValueError, match="num_splits_out has 2 entries"):
        tk.decode_num_splits(lens, torch.zeros(2, dtype=torch.int32, device=SMALL), 4, policy)
    with pytest.raises(ValueError, match="max_splits 0"):
        tk.decode_num_splits(lens, torch.zeros(4, dtype=torch.int32, device=SMALL), 0, policy)
    with pytest.raises(ValueError, match="split policy"):
        tk.SplitPolicy(min_split_len=512, target_split_len=256)


def test_default_split_policy_matches_the_h200_measurements() -> None:
    # docs/kernels.md: ~2k-token splits, shortened (to >= 128 tokens) until an H200 (132 SMs)
    # holds 2 programs/SM.
    policy = tk.SplitPolicy()
    want = {
        (1, 512): 4,
        (32, 512): 2,
        (128, 512): 1,
        (1, 4096): 32,
        (1, 32768): 33,
        (16, 4096): 3,
        (64, 4096): 2,
        (256, 2048): 1,
        (64, 16384): 8,
    }
    got = {shape: policy.max_splits(*shape, 8, 132) for shape in want}
    assert got == want


def test_split_policy_properties() -> None:
    policy = tk.SplitPolicy(min_split_len=256, target_split_len=1024, cap=64, programs_per_sm=1)
    for bs in (0, 1, 2, 8, 64, 256):
        for ctx in (0, 1, 100, 4096, 32768):
            for hkv in (1, 8):
                n = policy.max_splits(bs, ctx, hkv, 132)
                assert 1 <= n <= 64
                assert n <= max(1, math.ceil(ctx / 256)), "split shorter than min_split_len"
    long_one = policy.max_splits(1, 32768, 8, 132)
    long_many = policy.max_splits(64, 32768, 8, 132)
    assert long_one == 32 and long_many == 32  # ~1k-token splits while the GPU is filled
    # One short request wants a program per SM (17 splits) but splits stay >= 256 tokens.
    assert policy.max_splits(1, 4096, 8, 132) == 16
    assert policy.max_splits(256, 2048, 8, 132) == 2
    assert tk.SplitPolicy(cap=16).max_splits(1, 32768, 1, 132) == 16
    assert policy.min_splits(64, 8, 132) == 1 and policy.min_splits(1, 8, 132) == 17


# ----------------------------------------------------------------------------------------------
# decode_attention on the interpreter
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS_CPU)
def test_decode_single_request(dtype: torch.dtype) -> None:
    o, ref = run_decode([77], dtype=dtype, seed=10)
    assert_close(o, ref, SMALL_TOL[dtype])


@pytest.mark.parametrize("dtype", FLOATS_CPU)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)])
def test_decode_ragged_batch_gqa(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int) -> None:
    o, ref = run_decode(
        [1, 7, 33, 200],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        seed=20 + num_q_heads + num_kv_heads,
    )
    assert_close(o, ref, SMALL_TOL[dtype])


@pytest.mark.parametrize("dtype", FLOATS_CPU)
def test_decode_context_of_one(dtype: torch.dtype) -> None:
    o, ref = run_decode([1, 1, 1], dtype=dtype, max_splits=3, num_splits=[1, 2, 3], seed=30)
    assert_close(o, ref, SMALL_TOL[dtype])


@pytest.mark.parametrize("dtype", FLOATS_CPU)
def test_decode_long_context_many_splits(dtype: torch.dtype) -> None:
    # 517 tokens over 9 splits of 64 (block_n 16); 300 over 3 splits; 65 tokens asked to use 8
    # splits, so splits 5..7 are empty and must be skipped by the merge.
    o, ref = run_decode(
        [517, 300, 65, 20],
        max_splits=9,
        num_splits=[9, 3, 8, 1],
        dtype=dtype,
        seed=40,
    )
    assert_close(o, ref, SMALL_TOL[dtype])


def test_decode_splits_from_policy_with_static_buffers() -> None:
    # Splits chosen by decode_num_splits (1..10 per request); every index and scratch buffer is
    # longer than the batch, as when the launch replays a CUDA graph captured for more requests.
    o, ref = run_decode([600, 5, 129, 250], max_splits=10, min_split_len=64, spare=3, seed=50)
    assert_close(o, ref, SMALL_TOL[torch.float32])


@pytest.mark.parametrize("dtype", FLOATS_CPU)
@pytest.mark.parametrize(("head_dim", "head_dim_v"), [(96, 96), (64, 32)])
def test_decode_other_head_dims(dtype: torch.dtype, head_dim: int, head_dim_v: int) -> None:
    o, ref = run_decode(
        [3, 90], head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype, seed=60 + head_dim_v
    )
    assert_close(o, ref, SMALL_TOL[dtype])


def test_decode_clamps_out_of_range_split_counts() -> None:
    # 0 acts as 1 and 50 as max_splits: the whole context is still covered, nothing is read
    # past the split dimension of the scratch buffers.
    o, ref = run_decode([90, 130], max_splits=4, num_splits=[0, 50], seed=75)
    assert_close(o, ref, SMALL_TOL[torch.float32])


def test_decode_large_group() -> None:
    # 32 query heads per kv head: the head tile grows past 16 rows.
    o, ref = run_decode([40, 9], num_q_heads=32, num_kv_heads=1, seed=70)
    assert_close(o, ref, SMALL_TOL[torch.float32])


def test_decode_empty_context_writes_zeros() -> None:
    o, ref = run_decode([0, 25, 0], max_splits=2, seed=80)
    assert_close(o, ref, SMALL_TOL[torch.float32])
    assert torch.all(o[0] == 0) and torch.all(o[2] == 0)


def test_decode_empty_batch_is_noop() -> None:
    o, ref = run_decode([])
    assert o.numel() == 0 and ref.numel() == 0


#: Cases for the merge inside stage 1 (``arrivals``): one split per request (written directly),
#: many and empty splits, clamped counts, padded buffers, wide groups, Dv != D, empty contexts
#: and an fp8 cache.
FUSED_CASES = {
    "one-split": dict(seq_lens=[77], max_splits=1, seed=10),
    "ragged-gqa": dict(seq_lens=[1, 7, 33, 200], num_q_heads=8, num_kv_heads=2, seed=30),
    "splits-1-2-3": dict(seq_lens=[1, 1, 1], max_splits=3, num_splits=[1, 2, 3], seed=30),
    "empty-splits": dict(seq_lens=[517, 300, 65, 20], max_splits=9, num_splits=[9, 3, 8, 1]),
    "padded": dict(seq_lens=[600, 5, 129, 250], max_splits=10, min_split_len=64, spare=3),
    "clamped": dict(seq_lens=[90, 130], max_splits=4, num_splits=[0, 50], seed=75),
    "group-32": dict(seq_lens=[40, 9], num_q_heads=32, num_kv_heads=1, max_splits=3),
    "dv-32": dict(seq_lens=[3, 90], head_dim=64, head_dim_v=32, num_splits=[1, 4]),
    "empty-context": dict(seq_lens=[0, 25, 0], max_splits=2, num_splits=[2, 2, 1], seed=80),
}


@pytest.mark.parametrize("case", list(FUSED_CASES), ids=str)
def test_fused_merge_matches_the_oracle_and_the_separate_merge(case: str) -> None:
    kwargs: dict = dict(FUSED_CASES[case])
    kwargs.setdefault("seed", 90)
    fused, ref = run_decode(**kwargs, fused=True)
    separate, _ = run_decode(**kwargs)
    assert_close(fused, ref, SMALL_TOL[torch.float32])
    # The same partials and the same weights; only the denominator's reduction may round
    # differently (a row of heads at once instead of one head).
    torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6)
    empty = [b for b, n in enumerate(kwargs["seq_lens"]) if n == 0]
    assert all(torch.all(fused[b] == 0) for b in empty)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_every_one_pass_merge_chunk_gives_the_same_bits(fused: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``EXECRT_DECODE_MERGE_CHUNK``: the one-pass merge loads that many splits at once but
    still sums them one by one, so every chunk gives the bits of a split at a time (1), over
    requests of fewer splits than a chunk, more (several chunks and a partial one), empty
    splits and an empty request, with the scratch past them NaN (``run_decode``); and it
    agrees with the two-pass merge (0) to rounding. Unset, it is 8 (``DEFAULT_MERGE_CHUNK``)."""
    kwargs: dict = dict(
        seq_lens=[1, 40, 77, 0, 130, 9], max_splits=11, num_splits=[1, 5, 11, 3, 11, 9]
    )
    outs = {}
    for chunk in (0, 1, 2, 8, 16):
        monkeypatch.setenv("EXECRT_DECODE_MERGE_CHUNK", str(chunk))
        outs[chunk], ref = run_decode(**kwargs, fused=fused, seed=7)
        assert_close(outs[chunk], ref, SMALL_TOL[torch.float32])
    for chunk in (2, 8, 16):
        assert torch.equal(outs[chunk], outs[1]), f"chunk {chunk}"
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    assert torch.all(outs[1][3] == 0), "an empty request's output is 0"
    monkeypatch.delenv("EXECRT_DECODE_MERGE_CHUNK")
    assert torch.equal(run_decode(**kwargs, fused=fused, seed=7)[0], outs[8]), "the default"
    monkeypatch.setenv("EXECRT_DECODE_MERGE_CHUNK", "3")
    with pytest.raises(ConfigError, match=r"EXECRT_DECODE_MERGE_CHUNK='3' unsupported"):
        run_decode(**kwargs, fused=fused)


def test_fused_merge_rejects_bad_counters() -> None:
    with pytest.raises(ValueError, match="arrivals has 3 entries, need at least 4"):
        run_decode([5, 9], num_kv_heads=2, fused=True, arrivals_len=3)
    with pytest.raises(ValueError, match="arrivals dtype torch.int64 unsupported"):
        run_decode([5, 9], fused=True, arrivals_dtype=torch.int64)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.25, 4.0), (3.0, 0.4)])
def test_decode_reads_an_fp8_cache_times_its_scales(
    kv_dtype: torch.dtype, kv_scales: tuple[float, float]
) -> None:
    # fp32 q: fp8 K/V convert to fp32 exactly and the probabilities stay fp32, so the output
    # is as close to the reference over the read-back values as an fp32 cache's would be
    # (rounding p to fp8 for the PV dot would cost percent).
    o, ref = run_decode([1, 40, 130], max_splits=3, kv_dtype=kv_dtype, kv_scales=kv_scales, seed=85)
    assert_close(o, ref, SMALL_TOL[torch.float32])


# 16-bit q over fp8 K/V: the dots run in fp16 (q times its scale rounded to fp16, p in fp16).
FP8_Q_TOL = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 6e-2)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.25, 4.0)])
def test_decode_fp8_cache_with_16bit_q_against_the_dequantized_oracle(
    dtype: torch.dtype, kv_dtype: torch.dtype, kv_scales: tuple[float, float]
) -> None:
    # The oracle: float64 attention of the unrounded q over what the cache holds times its
    # scales, gathered in order. fp16 keeps p to 11 bits, bf16 output rounding dominates.
    o, ref = run_decode(
        [1, 40, 130, 300], num_q_heads=8, num_kv_heads=2, max_splits=3, dtype=dtype,
        kv_dtype=kv_dtype, kv_scales=kv_scales, seed=86,
    )  # fmt: skip
    assert_close(o, ref, FP8_Q_TOL[dtype])


WORDS_CASES = {  # (kv dtype, head dim, v head dim, q dtype)
    "e4m3-d64-fp16": (torch.float8_e4m3fn, 64, 64, torch.float16),
    "e4m3-d64-bf16": (torch.float8_e4m3fn, 64, 64, torch.bfloat16),
    "e5m2-d64-bf16": (torch.float8_e5m2, 64, 64, torch.bfloat16),
    "e4m3-d32-dv96-bf16": (torch.float8_e4m3fn, 32, 96, torch.bfloat16),
    "e4m3-d36-fp16": (torch.float8_e4m3fn, 36, 36, torch.float16),  # padded words masked
}


@pytest.mark.parametrize("case", list(WORDS_CASES))
def test_fp8_words_give_the_element_paths_output(case: str) -> None:
    # The int32-word read unpacks the same fp16 values the element path converts; under the
    # interpreter (PTX emulated by shifts) the tiles and so the outputs are the same bits, a
    # byte taken from the wrong place in a word or a join in the wrong order is not. Compiled,
    # the mma fragments may sum in another order: the fp64 oracle's tolerance holds both.
    kv_dtype, head_dim, head_dim_v, dtype = WORDS_CASES[case]
    run = functools.partial(
        run_decode, [1, 40, 130, 300], num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
        head_dim_v=head_dim_v, max_splits=3, dtype=dtype, kv_dtype=kv_dtype,
        kv_scales=(0.25, 4.0), seed=89,
    )  # fmt: skip
    words, ref = run(fp8_words=True)
    elements, _ = run(fp8_words=False)
    assert_close(words, ref, FP8_Q_TOL[dtype] if not CUDA else GPU_TOL[dtype])
    if not CUDA and kv_dtype == torch.float8_e4m3fn:
        assert torch.equal(words, elements)
    elif not CUDA:
        # The interpreter's own fp8 cast (the element path) flushes e5m2's subnormal codes
        # 1-3 towards 0 (triton 3.9; the unpack test above holds the words to torch's exact
        # values), so the outputs differ in the last bits where those codes occur.
        torch.testing.assert_close(words, elements, rtol=0, atol=1e-4)
    else:
        assert_close(words, elements.double(), GPU_TOL[dtype])


@triton.jit
def _unpack_kernel(words_ptr, out_ptr, N: tl.constexpr, E5M2: tl.constexpr, ASM: tl.constexpr):
    words = tl.load(words_ptr + tl.arange(0, N))
    quads = tk.decode._unpack_fp8_words(words, E5M2, ASM)  # [N, 2, 2]
    tl.store(out_ptr + tl.arange(0, 4 * N), tl.reshape(quads, (4 * N,)))


@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_words_unpack_every_code_as_torch_converts_it(kv_dtype: torch.dtype) -> None:
    # All 256 codes, four to a word, through the PTX conversion (compiled) or the
    # interpreter's stand-in for it (shifts and a bitcast), against torch's fp8 -> fp16 (NaN
    # codes excepted: stores clamp, so a cache never holds them). Byte order included.
    codes = torch.arange(256, dtype=torch.uint8, device=SMALL)
    want = codes.view(kv_dtype).to(torch.float16)
    got = torch.empty(256, dtype=torch.float16, device=SMALL)
    _unpack_kernel[(1,)](
        codes.view(torch.int32), got, N=64, E5M2=kv_dtype == torch.float8_e5m2, ASM=CUDA
    )
    codes_read = ~want.isnan()  # e4m3 has 2 NaN codes, e5m2 6 (its infinities are compared)
    assert codes_read.sum() >= 250
    assert torch.equal(got[codes_read], want[codes_read])


def test_fp8_words_refusals() -> None:
    dev = SMALL
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=dev)
    fp8 = torch.zeros(8, 2, 64, dtype=torch.float8_e4m3fn, device=dev)
    assert tk.decode.fp8_words_supported(q, fp8, fp8)
    why = tk.decode.fp8_words_unsupported
    assert "is not fp8" in why(q, fp8.to(torch.bfloat16), fp8.to(torch.bfloat16))
    assert "fp32 q keeps fp32 dots" in why(q.float(), fp8, fp8)
    odd = torch.zeros(8, 2, 66, dtype=torch.float8_e4m3fn, device=dev)
    assert "rows not in whole words" in why(q, odd, odd)
    shifted = torch.zeros(8 * 2 * 64 + 2, dtype=torch.float8_e4m3fn, device=dev)[2:].view(8, 2, 64)
    assert "not in whole 4-byte words" in why(q, shifted, shifted)
    with pytest.raises(ValueError, match="fp8_words=True unsupported here: .*is not fp8"):
        run_decode([5], fp8_words=True)


def _fp8_decode(
    q: torch.Tensor, cache: Cache, scales: list[float], block_n: int = 16
) -> torch.Tensor:
    """decode_attention over an fp8 ``cache`` with the scale row ``scales`` (k, v, 1/k, 1/v)."""
    indptr, indices = flat_indices(cache)
    batch, num_q_heads, _ = q.shape
    splits = torch.full((batch,), 2, dtype=torch.int32, device=q.device)
    o = torch.empty(batch, num_q_heads, cache.v.shape[2], dtype=q.dtype, device=q.device)
    po = torch.empty(batch, num_q_heads, 2, cache.v.shape[2], device=q.device)
    pl = torch.empty(batch, num_q_heads, 2, device=q.device)
    kv_scales = torch.tensor(scales, dtype=torch.float32, device=q.device)
    tk.decode_attention(
        q, cache.k, cache.v, o, indptr, indices, splits, po, pl, cache.k.shape[2] ** -0.5, 2,
        kv_scales=kv_scales, block_n=block_n,
    )  # fmt: skip
    return o


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_fp8_scales_fold_into_q_and_the_output_exactly(dtype: torch.dtype) -> None:
    # The same stored bytes read with k_scale 2 and v_scale 1/2 by q / 2 give the same scores
    # (q/2 * 2 K) and half the output. Powers of two: every rounding step is the same, so the
    # kernel, which applies k_scale to q once and v_scale to each split's output, must agree
    # bit for bit (but for outputs that halve into fp16 subnormals: 2**-24 apart at most);
    # an error in either fold (a scale applied twice, or to the wrong tensor) cannot.
    gen = torch.Generator().manual_seed(87)
    base = make_cache([37, 90], 2, 64, 64, torch.float32, SMALL, gen)
    cache = base.quantized(torch.float8_e4m3fn, 1.0, 1.0)
    q = torch.randn(2, 8, 64, generator=gen).to(dtype).to(SMALL)
    plain = _fp8_decode(q, cache, [1.0, 1.0, 1.0, 1.0])
    folded = _fp8_decode(q / 2, cache, [2.0, 0.5, 0.5, 2.0])
    assert not torch.isnan(plain).any()
    torch.testing.assert_close(folded.double(), plain.double() * 0.5, rtol=0, atol=2**-24)
    # A scale that is not a power of two goes through the same path (no exact equality).
    thrice = _fp8_decode(q, cache, [1.0, 3.0, 1.0, 1 / 3])
    torch.testing.assert_close(thrice, plain * 3, rtol=1e-2, atol=1e-2)


def test_decode_fp8_clamps_the_scaled_q_to_the_fp16_range() -> None:
    # |q| * sm_scale * log2(e) * k_scale past 65504 would be inf in fp16 and the scores NaN;
    # the kernel clamps it, as the oracle below does, and the output stays finite.
    gen = torch.Generator().manual_seed(88)
    base = make_cache([9, 23], 1, 64, 64, torch.float32, SMALL, gen)
    cache = base.quantized(torch.float8_e4m3fn, 1.0, 1.0)
    q = (torch.randn(2, 4, 64, generator=gen) * 3e6).to(torch.bfloat16).to(SMALL)
    o = _fp8_decode(q, cache, [1.0, 1.0, 1.0, 1.0])
    assert torch.isfinite(o).all()
    scale = 64**-0.5 * math.log2(math.e)
    for b in range(2):
        k, v = (x.double() for x in cache.context(b))  # [L, 1, 64]
        qs = (q[b].double() * scale).clamp(-65504, 65504)  # [4, 64]
        p = torch.softmax((qs @ k[:, 0].T) * math.log(2), dim=-1)  # base-2 scores
        torch.testing.assert_close(o[b].double(), p @ v[:, 0], rtol=1e-2, atol=5e-2)


def test_decode_rejects_bad_input() -> None:
    # On the device the kernels run on (CUDA, or CPU under the interpreter): CPU tensors on a
    # GPU machine are refused for their device before any shape or dtype is looked at.
    def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=SMALL)

    q, k, o = zeros(2, 4, 64), zeros(10, 2, 64), zeros(2, 4, 64)
    indptr, indices = zeros(3, dtype=torch.int32), zeros(4, dtype=torch.int32)
    splits = torch.ones(2, dtype=torch.int32, device=SMALL)
    po, pl = zeros(2, 4, 2, 64), zeros(2, 4, 2)

    def call(**over: object) -> None:
        args = dict(
            q=q, k_buffer=k, v_buffer=k, o=o, kv_indptr=indptr, kv_indices=indices,
            num_splits=splits, partial_o=po, partial_lse=pl, sm_scale=0.1, max_splits=2,
        )  # fmt: skip
        args.update(over)
        tk.decode_attention(**args)  # type: ignore[arg-type]

    big = zeros(2, 4, 300)
    with pytest.raises(ValueError, match=r"triton attention: head_dim 300 unsupported"):
        call(q=big, k_buffer=zeros(10, 2, 300), v_buffer=k)
    with pytest.raises(ValueError, match="4 query heads unsupported with 3 kv heads"):
        call(k_buffer=zeros(10, 3, 64), v_buffer=zeros(10, 3, 64))
    with pytest.raises(ValueError, match="k_buffer dtype torch.float16 differs"):
        call(k_buffer=k.half())
    with pytest.raises(ValueError, match="q dtype torch.float64 unsupported"):
        call(q=q.double())
    with pytest.raises(ValueError, match="num_splits dtype torch.int64 unsupported"):
        call(num_splits=splits.long())
    with pytest.raises(ValueError, match="partial_o shape"):
        call(partial_o=zeros(2, 4, 1, 64))
    with pytest.raises(ValueError, match="block_n 24 unsupported"):
        call(block_n=24)
    with pytest.raises(ValueError, match="max_splits 0 unsupported"):
        call(max_splits=0)
    fp8 = k.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="a torch.float8_e4m3fn cache needs kv_scales"):
        call(k_buffer=fp8, v_buffer=fp8)
    with pytest.raises(ValueError, match="v_buffer dtype torch.float32 differs from k_buffer's"):
        call(k_buffer=fp8, kv_scales=zeros(4))
    with pytest.raises(ValueError, match=r"kv_scales \(1,\) torch.float32 unsupported"):
        call(k_buffer=fp8, v_buffer=fp8, kv_scales=zeros(1))


# ----------------------------------------------------------------------------------------------
# GPU (compiled) cases at real sizes
# ----------------------------------------------------------------------------------------------

GPU_FLOATS = [torch.bfloat16, torch.float16]


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_FLOATS)
@pytest.mark.parametrize(
    "seq_lens",
    [[8192], [1, 7, 33, 200, 4096, 8191], "random64"],
    ids=["bs1-8k", "ragged", "bs64-random"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_decode(dtype: torch.dtype, seq_lens: list[int] | str, fused: bool) -> None:
    if seq_lens == "random64":
        gen = torch.Generator().manual_seed(7)
        seq_lens = torch.randint(1, 8193, (64,), generator=gen).tolist()
    assert isinstance(seq_lens, list)
    max_splits = tk.SplitPolicy().max_splits(len(seq_lens), max(seq_lens), 8, _num_sms())
    o, ref = run_decode(
        seq_lens,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        device=torch.device("cuda"),
        max_splits=max_splits,
        min_split_len=tk.DEFAULT_MIN_SPLIT_LEN,
        block_n=64,
        seed=200,
        fused=fused,
    )
    assert_close(o, ref, GPU_TOL[dtype])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"), [(32, 8, 64), (32, 32, 128), (16, 1, 256)]
)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_decode_shapes(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, fused: bool
) -> None:
    o, ref = run_decode(
        [3000, 17, 1, 1200],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cuda"),
        max_splits=16,
        num_splits=[16, 1, 5, 7],
        block_n=64,
        seed=210,
        fused=fused,
    )
    assert_close(o, ref, GPU_TOL[dtype])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_decode_fp8_cache(dtype: torch.dtype, kv_dtype: torch.dtype, fused: bool) -> None:
    # Compiled: the fp8 loads, their conversion and the scale folding at the shape.
    _gpu_decode_fp8(dtype, kv_dtype, fused)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
def test_gpu_decode_fp8_words_with_the_identity(
    kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # EXECRT_FP8_WORDS_OPAQUE=1 (the A/B's other arm: the joins hidden, 2-value fragments on
    # triton 3.6) computes the same attention.
    from execrt.core import envs

    monkeypatch.setenv(envs.FP8_WORDS_OPAQUE, "1")
    _gpu_decode_fp8(torch.bfloat16, kv_dtype, False)


def _gpu_decode_fp8(dtype: torch.dtype, kv_dtype: torch.dtype, fused: bool) -> None:
    seq_lens = [8192, 1, 700, 4096]
    max_splits = tk.SplitPolicy().max_splits(len(seq_lens), max(seq_lens), 8, _num_sms())
    o, ref = run_decode(
        seq_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype,
        device=torch.device("cuda"), max_splits=max_splits,
        min_split_len=tk.DEFAULT_MIN_SPLIT_LEN, block_n=64, seed=220, kv_dtype=kv_dtype,
        kv_scales=(4.0, 0.25),  # v x 0.25: outputs stay in the bf16 max-abs bound
        fused=fused,
    )  # fmt: skip
    assert_close(o, ref, GPU_TOL[dtype])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [*FP8, torch.bfloat16])
@pytest.mark.parametrize(
    "tiles", [(64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3)], ids=str
)
def test_gpu_decode_tiles_the_tuner_sweeps(
    kv_dtype: torch.dtype, tiles: tuple[int, int, int]
) -> None:
    # Compiled with the tiles of benchmarks/tune_triton_decode.py (and the defaults): deeper
    # pipelines and the fp8 layout paths (K^T gathers, V transposed as fp16) at the 8B shape.
    block_n, warps, stages = tiles
    seq_lens = [1, 700, 4096, 513]
    max_splits = tk.SplitPolicy().max_splits(len(seq_lens), max(seq_lens), 8, _num_sms())
    fp8 = kv_dtype in FP8
    o, ref = run_decode(
        seq_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
        device=torch.device("cuda"), max_splits=max_splits,
        min_split_len=tk.DEFAULT_MIN_SPLIT_LEN, block_n=block_n, num_warps=warps,
        num_stages=stages, seed=221, kv_dtype=kv_dtype if fp8 else None,
        kv_scales=(0.5, 2.0) if fp8 else (1.0, 1.0),
    )  # fmt: skip
    assert_close(o, ref, GPU_TOL[torch.bfloat16])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_decode_cuda_graph_replays_new_lengths(fused: bool) -> None:
    """kv_indices + decode_num_splits + decode_attention captured once, replayed twice."""
    device = torch.device("cuda")
    dtype, hq, hkv, d, batch, max_ctx = torch.bfloat16, 32, 8, 128, 4, 4096
    gen = torch.Generator().manual_seed(300)
    cache = make_cache([max_ctx] * batch, hkv, d, d, dtype, device, gen)
    policy = tk.SplitPolicy()
    max_splits = policy.max_splits(batch, max_ctx, hkv, _num_sms())
    fill = policy.min_splits(batch, hkv, _num_sms())
    seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    indices = torch.zeros(batch * max_ctx, dtype=torch.int32, device=device)
    splits = torch.zeros(batch, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, generator=gen).to(dtype).to(device)
    o = torch.empty(batch, hq, d, dtype=dtype, device=device)
    partial_o = torch.empty(batch, hq, max_splits, d, device=device)
    partial_lse = torch.empty(batch, hq, max_splits, device=device)
    arrivals = torch.zeros(batch * hkv, dtype=torch.int32, device=device) if fused else None

    def step() -> None:
        torch.cumsum(seq_lens, 0, dtype=torch.int32, out=indptr[1:])
        fill_kv_index(cache.req_to_token, cache.rows, seq_lens, indptr, indices, fill_indptr=False)
        tk.decode_num_splits(seq_lens, splits, max_splits, policy, fill)
        tk.decode_attention(
            q, cache.k, cache.v, o, indptr, indices, splits, partial_o, partial_lse,
            d**-0.5, max_splits, arrivals=arrivals,
        )  # fmt: skip

    seq_lens.fill_(1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([1, 4096, 300, 2000], [4000, 2, 64, 1025]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.zeros_like(o, dtype=torch.float64)
        for b, length in enumerate(lens):
            k_ctx, v_ctx = cache.context(b)
            last = torch.tensor([length - 1])
            ref[b] = ref_attention(q[b : b + 1], k_ctx[:length], v_ctx[:length], last, d**-0.5)[0]
        assert_close(o, ref, GPU_TOL[dtype])
        assert arrivals is None or arrivals.eq(0).all()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_fused_merge_is_the_separate_merge_in_every_one_of_many_launches(
    kv_dtype: torch.dtype,
) -> None:
    """The merge inside stage 1 hands partials between programs through a GPU-scope atomic: a
    missing release or acquire shows as a stale partial in some launch, not in every one. 300
    back-to-back launches (the same scratch reused, as by consecutive layers), each against
    the separate merge's output of the same inputs."""
    device = torch.device("cuda")
    seq_lens = [4096, 1, 3000, 517, 8192, 64, 2000, 1500] * 4
    gen = torch.Generator().manual_seed(230)
    hq, hkv, d, batch = 32, 8, 128, len(seq_lens)
    cache = make_cache(seq_lens, hkv, d, d, torch.bfloat16, device, gen)
    cache, _, scales = fp8_cache(
        cache, None if kv_dtype == torch.bfloat16 else kv_dtype, (1.0, 1.0)
    )
    policy = tk.SplitPolicy()
    max_splits = max(8, policy.max_splits(batch, max(seq_lens), hkv, _num_sms()))
    splits = torch.tensor(
        [max(1, min(max_splits, n // 256)) for n in seq_lens], dtype=torch.int32, device=device
    )
    indptr, indices = flat_indices(cache)
    q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16).to(device)
    partial_o = torch.empty(batch, hq, max_splits, d, device=device)
    partial_lse = torch.empty(batch, hq, max_splits, device=device)
    arrivals = torch.zeros(batch * hkv, dtype=torch.int32, device=device)

    def run(out: torch.Tensor, counters: torch.Tensor | None) -> None:
        tk.decode_attention(
            q, cache.k, cache.v, out, indptr, indices, splits, partial_o, partial_lse,
            d**-0.5, max_splits, kv_scales=scales, arrivals=counters,
        )  # fmt: skip

    want = torch.empty(batch, hq, d, dtype=torch.bfloat16, device=device)
    run(want, None)
    outs = torch.empty(300, batch, hq, d, dtype=torch.bfloat16, device=device)
    for i in range(outs.shape[0]):
        partial_o.fill_(float("nan"))  # a stale read would be NaN, not a near miss
        run(outs[i], arrivals)
    torch.cuda.synchronize()
    assert arrivals.eq(0).all()
    bad = [i for i in range(outs.shape[0]) if not torch.allclose(outs[i], want, 0, 1e-2)]
    assert not bad, f"{len(bad)} of 300 launches differ from the separate merge, first {bad[:5]}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "kv_dtype, fp8_kernel",
    [(None, None), (torch.float8_e4m3fn, "words"), (torch.float8_e4m3fn, "mma")],
    ids=["bf16", "e4m3", "e4m3-mma"],
)
def test_gpu_the_kv_prefetch_changes_no_bit_even_over_a_stale_work_list(
    monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype | None, fp8_kernel: str | None
) -> None:
    """With PDL the split kernel reads its first work item and slot ids before it waits for
    the grid ahead, to prefetch their K/V. Here the kernel just ahead rebuilds the work list
    over garbage, so those early reads may see anything: they must neither fault nor change a
    bit of the output. The same for the fp8 mma kernel (decode_mma.py)."""
    if fp8_kernel == "mma":
        from execrt.kernels.attention.decode_mma import mma_unsupported

        probe = torch.empty(1, 32, 128, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(1, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
        if (why := mma_unsupported(probe, kv, kv, prologue=False)) is not None:
            pytest.skip(why)
    from execrt.core import envs

    gen = torch.Generator().manual_seed(230)
    dev = torch.device("cuda")
    seq_lens = [3000, 17, 1, 1200, 511, 4096]
    batch, hq, hkv, d = len(seq_lens), 32, 8, 128
    cache = make_cache(seq_lens, hkv, d, d, torch.bfloat16, dev, gen)
    cache, read, scales = fp8_cache(cache, kv_dtype, (2.0, 0.5))
    indptr, indices = flat_indices(cache)
    q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16).to(dev)
    max_splits = 8
    splits = torch.empty(batch, dtype=torch.int32, device=dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    tk.decode_num_splits(lens, splits, max_splits, tk.SplitPolicy(64, 64))
    work = torch.empty(tk.work_size(batch, max_splits), dtype=torch.int32, device=dev)
    partial_o = torch.empty(batch, hq, max_splits, d, dtype=torch.float32, device=dev)
    partial_lse = torch.empty(batch, hq, max_splits, dtype=torch.float32, device=dev)

    def launches(prefetch: str) -> list[torch.Tensor]:
        monkeypatch.setenv(envs.PDL_PREFETCH, prefetch)
        outs = []
        for garbage in (2**31 - 1, -(2**31), 123456789, 0):
            work.fill_(garbage)
            tk.decode_work(splits, max_splits, work)  # the grid just ahead
            o = torch.empty(batch, hq, d, dtype=torch.bfloat16, device=dev)
            tk.decode_attention(
                q, cache.k, cache.v, o, indptr, indices, splits, partial_o, partial_lse,
                d**-0.5, max_splits, kv_scales=scales, work=work, fp8_kernel=fp8_kernel,
            )  # fmt: skip
            outs.append(o)
        torch.cuda.synchronize()
        return outs

    off, on = launches("0"), launches("decode")
    assert all(torch.equal(a, b) for a, b in zip(off, on, strict=True))
    assert_close(on[0], decode_reference(q, read, seq_lens, d**-0.5), GPU_TOL[torch.bfloat16])


def test_fill_kv_index_writes_indptr_and_indices_into_static_buffers() -> None:
    gen = torch.Generator().manual_seed(4)
    seq_lens = [3, 40, 1]
    cache = make_cache(seq_lens, 1, 16, 16, torch.float32, SMALL, gen)
    want_indptr, want = flat_indices(cache)
    indptr = torch.full((8,), 99, dtype=torch.int32, device=SMALL)  # stale, longer than B+1
    indices = torch.full((want.numel() + 5,), -7, dtype=torch.int32, device=SMALL)
    lens = torch.tensor(seq_lens, device=SMALL)
    fill_kv_index(cache.req_to_token, cache.rows, lens, indptr, indices, mode="on")
    assert indptr[:4].tolist() == want_indptr.tolist() and indptr[4:].tolist() == [99] * 4
    assert torch.equal(indices[: want.numel()], want) and indices[want.numel() :].eq(-7).all()
    assert host_indptr([3, 40, 1]).tolist() == [0, 3, 43, 44]
    assert host_indptr([]).tolist() == [0]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("min_splits", [1, 5])
def test_decode_metadata_equals_the_separate_builds(
    index_dtype: torch.dtype, min_splits: int
) -> None:
    """One launch writes exactly what fill_kv_index + decode_num_splits write, and nothing else."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = [1, 7, 600, 33, 0, 1030, 129, 2]
    cache = make_cache(seq_lens, 1, 16, 16, torch.float32, SMALL, gen)
    lens = torch.tensor(seq_lens, dtype=index_dtype, device=SMALL)
    rows = cache.rows.to(index_dtype)
    policy = tk.SplitPolicy(min_split_len=32, target_split_len=256)
    n, tail = sum(seq_lens), 5
    want_indptr = torch.full((len(seq_lens) + 4,), 99, dtype=torch.int32, device=SMALL)
    want_indices = torch.full((n + tail,), -7, dtype=torch.int32, device=SMALL)
    want_splits = torch.full((len(seq_lens) + 2,), -9, dtype=torch.int32, device=SMALL)
    got = [want_indptr.clone(), want_indices.clone(), want_splits.clone()]
    fill_kv_index(cache.req_to_token, rows, lens, want_indptr, want_indices)
    tk.decode_num_splits(lens, want_splits, 16, policy, min_splits)
    tk.decode_metadata(cache.req_to_token, rows, lens, *got, 16, policy, min_splits)
    want = (want_indptr, want_indices, want_splits)
    for name, a, b in zip(("kv_indptr", "kv_indices", "num_splits"), got, want, strict=True):
        assert torch.equal(a, b), name
    assert got[0][len(seq_lens) + 1 :].eq(99).all() and got[2][len(seq_lens) :].eq(-9).all()


def _work_reference(counts: list[int], max_splits: int, lens: list[int] | None = None) -> list[int]:
    """The work list: request after request, or with ``lens`` the requests sorted by tokens
    per split, longest first, ties by index (a request's splits stay together)."""
    clamped = [min(max(n, 1), max_splits) for n in counts]
    order = list(range(len(counts)))
    if lens is not None:
        per_split = [-(-n // c) for n, c in zip(lens, clamped, strict=True)]
        order.sort(key=lambda b: (-per_split[b], b))
    items = [b * max_splits + s for b in order for s in range(clamped[b])]
    return [len(items), *items]


def test_decode_work_lists_every_split_request_after_request() -> None:
    counts = [3, 0, 1, 9, 2, -4]  # out of range counts are clamped into [1, 4] as decode reads
    splits = torch.tensor(counts, dtype=torch.int32, device=SMALL)
    work = torch.full((tk.work_size(6, 4) + 3,), -1, dtype=torch.int32, device=SMALL)
    tk.decode_work(splits, 4, work)
    want = _work_reference(counts, 4)
    assert work[: len(want)].tolist() == want and work[len(want) :].eq(-1).all()
    empty = torch.zeros(0, dtype=torch.int32, device=SMALL)
    tk.decode_work(empty, 4, work)
    assert work[0].item() == 0


def test_decode_work_given_lengths_lists_the_longest_splits_first() -> None:
    counts = [3, 0, 1, 9, 2, -4, 1]
    lens = [900, 40, 700, 5000, 700, 12, 700]  # per split: 300, 40, 700, 1250, 350, 12, 700
    splits = torch.tensor(counts, dtype=torch.int32, device=SMALL)
    seq = torch.tensor(lens, dtype=torch.int64, device=SMALL)
    work = torch.full((tk.work_size(7, 4) + 2,), -1, dtype=torch.int32, device=SMALL)
    tk.decode_work(splits, 4, work, seq)
    want = _work_reference(counts, 4, lens)
    # request 3 (4 splits of 1250) first; 2 and 6 tie at 700 (index order); 5 (12) last
    assert want[1:6] == [12, 13, 14, 15, 8] and want[-1] == 20
    assert work[: len(want)].tolist() == want and work[len(want) :].eq(-1).all()
    with pytest.raises(ValueError, match="seq_lens has 6 entries, need at least 7"):
        tk.decode_work(splits, 4, work, seq[:6])


def test_decode_work_rejects_bad_input() -> None:
    splits = torch.ones(3, dtype=torch.int32, device=SMALL)
    with pytest.raises(ValueError, match="work has 12 entries, need at least 13"):
        tk.decode_work(splits, 4, torch.zeros(12, dtype=torch.int32, device=SMALL))
    with pytest.raises(ValueError, match="work dtype"):
        tk.decode_work(splits, 4, torch.zeros(13, dtype=torch.int64, device=SMALL))
    with pytest.raises(ValueError, match="max_splits 0"):
        tk.decode_work(splits, 0, torch.zeros(13, dtype=torch.int32, device=SMALL))


@pytest.mark.parametrize("min_splits", [1, 5])
def test_decode_metadata_writes_the_work_list_of_its_split_counts(min_splits: int) -> None:
    gen = torch.Generator().manual_seed(6)
    seq_lens = [1, 7, 600, 33, 0, 1030, 129, 2]
    cache = make_cache(seq_lens, 1, 16, 16, torch.float32, SMALL, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=SMALL)
    policy = tk.SplitPolicy(min_split_len=32, target_split_len=256)
    indptr = torch.empty(len(seq_lens) + 1, dtype=torch.int32, device=SMALL)
    indices = torch.empty(sum(seq_lens), dtype=torch.int32, device=SMALL)
    splits = torch.empty(len(seq_lens), dtype=torch.int32, device=SMALL)
    work = torch.full((tk.work_size(len(seq_lens), 16),), -1, dtype=torch.int32, device=SMALL)
    for longest_first in (True, False):
        work.fill_(-1)
        tk.decode_metadata(
            cache.req_to_token, cache.rows, lens, indptr, indices, splits, 16, policy,
            min_splits, work, longest_first=longest_first,
        )  # fmt: skip
        want = _work_reference(splits.tolist(), 16, seq_lens if longest_first else None)
        assert work[: len(want)].tolist() == want
    assert want[0] > len(seq_lens)  # the case has requests of several splits
    assert want != _work_reference(splits.tolist(), 16, seq_lens)  # and the orders differ


def test_decode_programs_follow_the_batch_not_the_context_limit() -> None:
    # 256 requests, 8 kv heads, a context limit worth 20 splits, 132 SMs: a program per
    # request (the grid used to launch 20 per request, 19 of them to find no split).
    assert tk.decode_programs(256, 8, 20, 132) == 256
    # Few requests: up to 8 programs per SM over the heads, never more than the items.
    assert tk.decode_programs(8, 8, 20, 132) == 132
    assert tk.decode_programs(1, 8, 33, 132) == 33
    assert tk.decode_programs(1, 1, 1, 132) == 1


def test_one_wave_of_programs_shares_the_items_out_evenly() -> None:
    # "sm": two programs per SM over the heads, the items there can be shared out evenly.
    assert tk.decode_programs(128, 8, 1, 132, "sm") == 32  # 4 one-split requests each
    assert tk.decode_programs(256, 8, 1, 132, "sm") == 32  # 8 each
    assert tk.decode_programs(100, 8, 1, 132, "sm") == 25  # 33 would leave some with 3
    assert tk.decode_programs(8, 8, 4, 132, "sm") == 32  # fewer items than the wave: one each
    assert tk.decode_programs(1, 1, 1, 132, "sm") == 1
    assert tk.decode_programs(2, 8, 4, 1, "sm") == 1
    with pytest.raises(ValueError, match=r"programs 'wave' unsupported \(supported: request, sm\)"):
        tk.decode_programs(8, 8, 4, 132, "wave")


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_decode_with_one_wave_of_programs_matches_the_oracle(fused: bool) -> None:
    out, ref = run_decode(
        [200, 90, 5, 140, 33, 64], num_q_heads=8, num_kv_heads=4, num_splits=[4, 3, 1, 2, 1, 2],
        programs="sm", fused=fused,
    )  # fmt: skip
    assert_close(out, ref, SMALL_TOL[torch.float32])
    with pytest.raises(ValueError, match=r"programs 'wave' unsupported"):
        run_decode([20], programs="wave")


def test_decode_with_fewer_programs_than_splits_visits_every_split(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # As on one SM: two requests of 4 and 3 splits get 2 programs per kv head, each taking
    # several (request, split) items round robin, across request boundaries.
    from execrt.kernels.attention import decode

    monkeypatch.setattr(decode, "sm_count", lambda device: 1)
    assert tk.decode_programs(2, 8, 4, 1) == 2
    out, ref = run_decode([200, 90], num_q_heads=8, num_kv_heads=8, num_splits=[4, 3])
    assert_close(out, ref, SMALL_TOL[torch.float32])


def test_decode_metadata_rejects_bad_input() -> None:
    table = torch.zeros(3, 8, dtype=torch.int32, device=SMALL)
    one = torch.ones(1, dtype=torch.int32, device=SMALL)
    splits = torch.zeros(1, dtype=torch.int32, device=SMALL)
    policy = tk.SplitPolicy()
    with pytest.raises(ValueError, match="kv_indptr has 1 entries, need at least 2"):
        tk.decode_metadata(table, one, one, one, one, splits, 4, policy)
    with pytest.raises(ValueError, match="num_splits_out dtype"):
        tk.decode_metadata(table, one, one, one.repeat(2), one, splits.long(), 4, policy)
    with pytest.raises(ValueError, match="max_splits 0"):
        tk.decode_metadata(table, one, one, one.repeat(2), one, splits, 0, policy)
    with pytest.raises(ValueError, match="req_to_token must be a 2-D"):
        tk.decode_metadata(table.float(), one, one, one.repeat(2), one, splits, 4, policy)
    empty = torch.zeros(0, dtype=torch.int32, device=SMALL)
    indptr = torch.full((1,), 5, dtype=torch.int32, device=SMALL)
    tk.decode_metadata(table, empty, empty, indptr, one, empty, 4, policy)
    assert indptr.tolist() == [0]


# ----------------------------------------------------------------------------------------------
# Stage-1 tile table
# ----------------------------------------------------------------------------------------------


def test_decode_tiles_default_by_kv_dtype_and_on_the_interpreter() -> None:
    # No tuned table for this device name: the defaults by element size. fp8 gathers two
    # 128-token blocks ahead (3 stages) where 16-bit gathers one.
    from execrt.kernels.attention.decode import _decode_tiles

    fp8 = tk.DecodeTiles(128, 4, 3)
    assert _decode_tiles("No Tuned GPU", torch.float8_e4m3fn, 128, 1) == fp8
    assert _decode_tiles("No Tuned GPU", torch.float8_e5m2, 128, 64) == fp8
    assert _decode_tiles("No Tuned GPU", torch.bfloat16, 128, 1) == tk.DecodeTiles(128, 4, 2)
    assert tk.decode_tiles(torch.float8_e4m3fn, 128, 8, torch.device("cpu")).num_stages == 1


def test_decode_tile_table_round_trip_and_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from execrt.kernels._triton import tuned_table_name
    from execrt.kernels.attention import decode

    a, b, c = tk.DecodeTiles(64, 4, 4), tk.DecodeTiles(128, 4, 3), tk.DecodeTiles(256, 8, 2)
    data = tk.tile_table_json({128: {1: a, 32: b, 128: c}}, device_name="Table Test GPU")
    name = tuned_table_name("Table Test GPU", torch.float8_e4m3fn)
    assert name == "device_name=Table_Test_GPU,dtype=float8_e4m3fn.json"
    path = tmp_path / name
    path.write_text(json.dumps(data))
    assert tk.load_tile_table(str(path)) == {128: {1: a, 32: b, 128: c}}
    monkeypatch.setattr(decode, "CONFIG_DIR", str(tmp_path))
    pick = functools.partial(decode._decode_tiles, "Table Test GPU", torch.float8_e4m3fn)
    # The smallest tuned batch size >= the batch, else the largest; head dims padded.
    assert [pick(128, bs) for bs in (1, 2, 32, 33, 128, 512)] == [a, b, b, c, c, c]
    assert pick(100, 1) == a
    assert pick(64, 1) == tk.DecodeTiles(128, 4, 3)  # no entry for D 64: the default
    other = decode._decode_tiles("Table Test GPU", torch.bfloat16, 128, 1)
    assert other == tk.DecodeTiles(128, 4, 2)  # the table is per KV dtype


def test_decode_tile_table_rejects_bad_files_and_tiles(tmp_path: Path) -> None:
    assert tk.load_tile_table(str(tmp_path / "absent.json")) is None
    for i, text in enumerate(['{"tiles": {"128": {"1": {"block_n": 128}}}}', "{", "[]"]):
        path = tmp_path / f"bad{i}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"decode tile table .*bad{i}.json unreadable"):
            tk.load_tile_table(str(path))
    with pytest.raises(ValueError, match="block_n 24 unsupported"):
        tk.DecodeTiles(24, 4, 2)
    with pytest.raises(ValueError, match="num_warps 1/2/4/8/16"):
        tk.DecodeTiles(64, 3, 2)
    with pytest.raises(ValueError, match=r"min_split_len -1 unsupported \(a token count"):
        tk.DecodeTiles(64, 4, 2, min_split_len=-1)
    with pytest.raises(ValueError, match=r"merge 'last' unsupported \(supported: '', 'fused'"):
        tk.DecodeTiles(64, 4, 2, merge="last")
    path = tmp_path / "bad_merge.json"
    path.write_text('{"tiles": {"128": {"8": {"block_n": 128, "num_warps": 4, "num_stages": 3, '
                    '"merge": "both"}}}}')  # fmt: skip
    with pytest.raises(ValueError, match="bad_merge.json unreadable"):
        tk.load_tile_table(str(path))


def test_a_tile_entry_carries_its_split_and_merge(tmp_path: Path) -> None:
    # An entry may tune its batch size's shortest split and merge; older entries leave both
    # to the backend (0 and "").
    tuned = tk.DecodeTiles(128, 4, 3, min_split_len=1024, merge="fused")
    data = tk.tile_table_json({128: {1: tk.DecodeTiles(128, 4, 2), 8: tuned}})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    table = tk.load_tile_table(str(path))
    assert table == {128: {1: tk.DecodeTiles(128, 4, 2), 8: tuned}}
    assert (table[128][1].min_split_len, table[128][1].merge) == (0, "")


def test_shipped_decode_tile_tables_load() -> None:
    # Every table in the package parses into valid tiles keyed by a KV dtype's name.
    import glob
    import os

    from execrt.kernels._triton import DTYPE_NAMES
    from execrt.kernels.attention import decode

    for path in glob.glob(os.path.join(decode.CONFIG_DIR, "*.json")):
        table = tk.load_tile_table(path)
        assert table, path
        assert any(f"dtype={n}.json" in path for n in DTYPE_NAMES.values()), path


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["model-dtype", "fp8"])
def test_int64_slot_offsets_give_the_same_output(kv_dtype, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # int32 offsets wherever the cache allows (every test cache does); the int64 path of a
    # cache of 2^31 elements or more computes the same values.
    run = functools.partial(
        run_decode, [1, 40, 300], num_q_heads=8, num_kv_heads=2, max_splits=3, seed=93,
        kv_dtype=kv_dtype, kv_scales=(0.25, 4.0) if kv_dtype is not None else (1.0, 1.0),
    )  # fmt: skip
    narrow, ref = run()
    monkeypatch.setattr(tk.decode, "int32_slot_offsets", lambda *buffers: False)
    wide, _ = run()
    assert torch.equal(narrow, wide)
