"""Triton extend (causal prefill) kernel checked against a float64 oracle, and at real sizes."""

from __future__ import annotations

import functools
import json

import pytest
import torch

pytest.importorskip("triton")

from execrt.kernels import attention as tk
from execrt.kernels.attention import extend as ext
from tests.kernels.attention.test_decode import (
    CUDA,
    FP8,
    FP8_Q_TOL,
    GPU_TOL,
    SMALL,
    SMALL_TOL,
    Cache,
    assert_close,
    flat_indices,
    fp8_cache,
    make_cache,
    ref_attention,
)

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (compiled Triton kernels)")
FLOATS_CPU = [torch.float32, torch.float16]
F32 = SMALL_TOL[torch.float32]


def run_extend(
    prefix_lens: list[int],
    extend_lens: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device = SMALL,
    extra_grid: int = 0,
    pad_rows: int = 0,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    fresh: bool = False,
    tma: bool | None = None,
    **tiles: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run extend_attention on a fresh random case; return (output, float64 reference).

    ``extra_grid`` over-sizes max_extend_len so that whole query tiles have nothing to do;
    ``pad_rows`` adds rows to q / o past the last request (they must stay NaN). ``tiles``
    go to extend_attention; block_m / block_n default to 16 (many tiles per request).
    ``kv_dtype`` (fp8): the cache is stored in it with ``kv_scales``.

    ``fresh``: the fresh kernel, handed the new tokens' K/V as views of one fused
    ``[T, Hq + 2 Hkv, D]``-like buffer (strided rows, as a model's qkv projection gives them;
    pad rows NaN); the cache's copies of those rows are then overwritten with NaN, so a read
    of them shows. ``tma`` goes to the kernel.
    """
    gen = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    cache = make_cache(seq_lens, num_kv_heads, head_dim, head_dim_v, dtype, device, gen)
    cache, read, scales = fp8_cache(cache, kv_dtype, kv_scales)
    total = sum(extend_lens)
    q = torch.randn(total + pad_rows, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    qo_indptr = torch.zeros(len(extend_lens) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor(extend_lens), 0)
    kv_indptr, kv_indices = flat_indices(cache)
    o = torch.full(
        (total + pad_rows, num_q_heads, head_dim_v), float("nan"), dtype=dtype, device=device
    )
    sm_scale = head_dim**-0.5
    refs = []
    for b, (prefix, n) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        refs.append(ref_attention(q[rows], *read.context(b), prefix + torch.arange(n), sm_scale))
    new: dict[str, object] = {}
    if fresh:
        new = fresh_kv(cache, prefix_lens, pad_rows, num_q_heads) | {"kernel": "fresh", "tma": tma}
    tk.extend_attention(
        q, cache.k, cache.v, o, qo_indptr.to(device), kv_indptr, kv_indices,
        torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        max(extend_lens) + extra_grid, sm_scale, max_kv_len=max(seq_lens), kv_scales=scales,
        **({"block_m": 16, "block_n": 16} | tiles | new),  # type: ignore[arg-type]
    )  # fmt: skip
    assert torch.isnan(o[total:]).all(), "wrote rows past the last request"
    return o[:total], torch.cat(refs) if refs else torch.zeros_like(o[:total], dtype=torch.float64)


def fresh_kv(
    cache: Cache, prefix_lens: list[int], pad_rows: int, num_q_heads: int
) -> dict[str, torch.Tensor]:
    """``k_new`` / ``v_new``: every request's new-token K/V rows, request after request, as
    strided views of one fused buffer (q heads first, as a qkv projection lays them out), then
    NaN over the cache's copies so that a kernel reading them there fails."""
    ks, vs, slots = [], [], []
    for b, prefix in enumerate(prefix_lens):
        k, v = cache.context(b)
        ks.append(k[prefix:])
        vs.append(v[prefix:])
        row = cache.req_to_token[int(cache.rows[b])]
        slots.append(row[prefix : cache.seq_lens[b]].long())
    k_rows, v_rows = torch.cat(ks), torch.cat(vs)  # [T, Hkv, D], [T, Hkv, Dv]
    t, hkv, d = k_rows.shape
    dv = v_rows.shape[2]
    fused = torch.full(
        (t + pad_rows, num_q_heads * d + hkv * d + hkv * dv), float("nan"),
        dtype=k_rows.dtype, device=k_rows.device,
    )  # fmt: skip
    k_new = fused[:, num_q_heads * d : (num_q_heads + hkv) * d].view(t + pad_rows, hkv, d)
    v_new = fused[:, (num_q_heads + hkv) * d :].view(t + pad_rows, hkv, dv)
    k_new[:t] = k_rows
    v_new[:t] = v_rows
    gone = torch.cat(slots)
    cache.k[gone] = float("nan")
    cache.v[gone] = float("nan")
    return {"k_new": k_new, "v_new": v_new}


# ----------------------------------------------------------------------------------------------
# Host-side choices
# ----------------------------------------------------------------------------------------------


def test_gpu_tile_table_fits_shared_memory_and_dot_shapes() -> None:
    # Every compiled tile must launch on sm90 (227 KB of shared memory per block) and feed
    # tl.dot with power-of-two sides >= 16; the estimate matched triton's own figure within
    # 3% on the table's tiles (AOT-compiled for sm90).
    for (elem, block_d), t in ext._GPU_TILES.items():
        assert ext.shared_memory_estimate(t, elem, block_d, block_d) <= 200 << 10, (elem, t)
        for side in (t.block_m, t.block_n):
            assert side >= 16 and side & (side - 1) == 0
        assert t.num_stages >= 2 and t.num_warps in (4, 8)
    cpu = ext.default_extend_tiles(torch.bfloat16, 128, torch.device("cpu"))
    assert cpu.block_m <= 32, "the interpreter needs small tiles"
    # A 96-dim head takes the padded 128's tiles (the tuned table's where the GPU has one).
    cuda = torch.device("cuda")
    assert ext.default_extend_tiles(torch.bfloat16, 96, cuda) == ext.default_extend_tiles(
        torch.bfloat16, 128, cuda
    )


def test_schedule_chunks_and_head_packing() -> None:
    # 1 x 8k at Hkv 8, D 128, bf16: 4 MiB of K/V per kv head, 8 of them fit half of 60 MB.
    assert ext._pairs_per_chunk(8, 8192, 512, 60 << 20) == 7
    assert ext._pairs_per_chunk(8, 8192, 512, 80 << 20) == 8
    assert ext._pairs_per_chunk(512, 1152, 512, 60 << 20) == 53
    assert ext._pairs_per_chunk(3, 1 << 20, 512, 60 << 20) == 1
    assert ext._default_heads_per_tile(4, 128) == 4
    assert ext._default_heads_per_tile(32, 16) == 16
    assert ext._default_heads_per_tile(6, 4) == 3
    assert ext._default_heads_per_tile(1, 16) == 1


# ----------------------------------------------------------------------------------------------
# extend_attention on the interpreter
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS_CPU)
def test_extend_without_prefix(dtype: torch.dtype) -> None:
    o, ref = run_extend([0, 0, 0], [17, 40, 1], dtype=dtype, seed=100)
    assert_close(o, ref, SMALL_TOL[dtype])


@pytest.mark.parametrize("dtype", FLOATS_CPU)
def test_extend_with_mixed_prefixes(dtype: torch.dtype) -> None:
    o, ref = run_extend([0, 5, 40], [23, 1, 37], dtype=dtype, extra_grid=20, pad_rows=3, seed=110)
    assert_close(o, ref, SMALL_TOL[dtype])


def test_extend_single_token_each() -> None:
    o, ref = run_extend([30, 0, 7, 64], [1, 1, 1, 1], seed=120)
    assert_close(o, ref, F32)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(8, 1), (8, 8), (8, 2), (6, 2)])
def test_extend_gqa_groups(num_q_heads: int, num_kv_heads: int) -> None:
    # Groups 8, 1, 4 and 3: with block_m 16 a group of 3 leaves one padding row per tile.
    o, ref = run_extend(
        [19, 0], [20, 9], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, seed=130
    )
    assert_close(o, ref, F32)


@pytest.mark.parametrize("heads_per_tile", [1, 2])
def test_extend_partial_head_packing(heads_per_tile: int) -> None:
    # Group 4 split over tiles of 1 or 2 heads (16 or 8 tokens per tile).
    o, ref = run_extend(
        [9, 0], [30, 17], num_q_heads=8, num_kv_heads=2, heads_per_tile=heads_per_tile, seed=135
    )
    assert_close(o, ref, F32)


def test_extend_group_larger_than_tile() -> None:
    # 32 heads per kv head and 16-row tiles: two head blocks share each kv head.
    o, ref = run_extend([5], [7], num_q_heads=32, num_kv_heads=1, seed=138)
    assert_close(o, ref, F32)


def test_extend_diagonal_on_block_boundaries() -> None:
    # block_n 16, tiles of 8 tokens (group 2): prefixes 15, 16, 31 put the first query of a
    # tile right at the end / start of a context block, so a diagonal block can be invisible
    # to some rows (they must keep their running max); with 14 and 6 the block after the
    # first query's position ends on a boundary (a full-block limit one too far shows).
    o, ref = run_extend([15, 16, 31, 14, 6], [17, 16, 9, 3, 25], seed=150)
    assert_close(o, ref, F32)


def test_extend_long_prefix_and_wide_tiles() -> None:
    # A long prefix over many unmasked blocks, 32 x 32 tiles; block_m 32 with group 2 gives
    # 16-token tiles, so block_n > tokens per tile.
    o, ref = run_extend([300, 0, 129], [40, 33, 1], block_m=32, block_n=32, seed=160)
    assert_close(o, ref, F32)


@pytest.mark.parametrize(("head_dim", "head_dim_v"), [(128, 128), (256, 256), (96, 96), (64, 32)])
def test_extend_head_dims(head_dim: int, head_dim_v: int) -> None:
    # 96 pads to 128 with masked loads; 64 / 32 has a narrower value head.
    o, ref = run_extend(
        [20, 0], [12, 21], head_dim=head_dim, head_dim_v=head_dim_v, seed=170 + head_dim_v
    )
    assert_close(o, ref, F32)


@pytest.mark.parametrize("dtype", FLOATS_CPU)
def test_extend_default_tiles(dtype: torch.dtype) -> None:
    # Tiles from the kernel's table for this device (the interpreter's on CPU), head dim 96.
    o, ref = run_extend(
        [3, 70], [50, 21], head_dim=96, dtype=dtype, block_m=None, block_n=None, seed=140
    )
    assert_close(o, ref, SMALL_TOL[dtype])


@pytest.mark.parametrize("key", sorted(ext._GPU_TILES), ids=lambda k: f"{8 * k[0]}bit-d{k[1]}")
def test_extend_gpu_table_tiles(key: tuple[int, int]) -> None:
    # Every tile of the GPU table: 32 query heads over 8 KV heads pack 4 heads per tile, a
    # prefix spans several unmasked K/V blocks, one request is a single token. On a GPU it
    # runs compiled at the table's dtype size, warps and stages (what a launch there uses); on
    # CPU the interpreter runs the same block shapes in fp32 (warps and stages only shape
    # compiled code, and fp32 is exact there).
    elem, d = key
    t = ext._GPU_TILES[key]
    dtype = {2: torch.float16, 4: torch.float32}[elem] if CUDA else torch.float32
    compiled = {"num_warps": t.num_warps, "num_stages": t.num_stages} if CUDA else {}
    o, ref = run_extend(
        [70, 0, 5], [2 * t.block_m // 4 + 3, 1, 9], num_q_heads=32, num_kv_heads=8, head_dim=d,
        dtype=dtype, block_m=t.block_m, block_n=t.block_n, seed=250 + d, **compiled,
    )  # fmt: skip
    assert_close(o, ref, SMALL_TOL[dtype])


@pytest.mark.parametrize("pairs_per_chunk", [1, 3, 1000])
def test_extend_schedule_chunk_sizes(pairs_per_chunk: int) -> None:
    # 5 requests x 2 head blocks = 10 pairs: chunks of 1 (pair after pair), 3 (the last
    # chunk ragged) or all; each must still run every query tile exactly once.
    o, ref = run_extend(
        [0, 33, 4, 0, 18],
        [21, 2, 30, 1, 16],
        pairs_per_chunk=pairs_per_chunk,
        extra_grid=5,
        seed=180,
    )
    assert_close(o, ref, F32)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.25, 4.0)])
def test_extend_reads_an_fp8_cache_times_its_scales(
    kv_dtype: torch.dtype, kv_scales: tuple[float, float]
) -> None:
    # Full and diagonal blocks both read fp8; fp32 q keeps the reference's precision.
    o, ref = run_extend([0, 37, 5], [20, 9, 40], kv_dtype=kv_dtype, kv_scales=kv_scales, seed=190)
    assert_close(o, ref, F32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", FP8)
def test_extend_fp8_cache_with_16bit_q_against_the_dequantized_oracle(
    dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    # 16-bit q over an fp8 cache: the dots run in fp16 with the softmax and k scales in q
    # (clamped to fp16's range), p in fp16, v_scale on the output. Prefix and diagonal blocks.
    o, ref = run_extend(
        [0, 37, 5], [20, 9, 40], num_q_heads=8, num_kv_heads=2, dtype=dtype, kv_dtype=kv_dtype,
        kv_scales=(0.25, 4.0), seed=191,
    )  # fmt: skip
    assert_close(o, ref, FP8_Q_TOL[dtype] if not CUDA else GPU_TOL[dtype])


def test_extend_rejects_bad_input() -> None:
    # On the device the kernels run on (CUDA, or CPU under the interpreter): CPU tensors on a
    # GPU machine are refused for their device before any shape is looked at.
    q = torch.zeros(3, 4, 64, device=SMALL)
    k = torch.zeros(10, 2, 64, device=SMALL)
    i32 = torch.zeros(2, dtype=torch.int32, device=SMALL)

    def call(**over: object) -> None:
        tk.extend_attention(q, k, k, q.clone(), i32, i32, i32, i32[:1], 3, 0.1, **over)  # type: ignore[arg-type]

    o32 = torch.zeros(3, 4, 32, device=SMALL)
    with pytest.raises(ValueError, match=r"o shape \(3, 4, 32\) unsupported"):
        tk.extend_attention(q, k, k, o32, i32, i32, i32, i32[:1], 3, 0.1)
    with pytest.raises(ValueError, match="block_m 8 unsupported"):
        call(block_m=8)
    with pytest.raises(ValueError, match="heads_per_tile 3 unsupported .* group size 2"):
        call(heads_per_tile=3)
    with pytest.raises(ValueError, match="pairs_per_chunk 0 unsupported"):
        call(pairs_per_chunk=0)
    with pytest.raises(ValueError, match="max_extend_len -1 unsupported"):
        tk.extend_attention(q, k, k, q.clone(), i32, i32, i32, i32[:1], -1, 0.1)


# ----------------------------------------------------------------------------------------------
# The fresh kernel (new tokens' K/V from their own rows) on the interpreter: ``ptr`` loads them
# with strided pointer loads, ``tma`` through tensor descriptors (the interpreter emulates
# them; on sm90 they are TMA copies). The cache's copies of the new rows are NaN (fresh_kv).
# ----------------------------------------------------------------------------------------------

TMA_IDS = {"ids": ["ptr", "tma"], "argvalues": [False, True], "argnames": "tma"}


@pytest.mark.parametrize(**TMA_IDS)
@pytest.mark.parametrize("dtype", FLOATS_CPU)
def test_fresh_without_prefix(tma: bool, dtype: torch.dtype) -> None:
    o, ref = run_extend([0, 0, 0], [17, 40, 1], dtype=dtype, seed=100, fresh=True, tma=tma)
    assert_close(o, ref, SMALL_TOL[dtype])


@pytest.mark.parametrize(**TMA_IDS)
def test_fresh_with_mixed_prefixes_pads_and_idle_tiles(tma: bool) -> None:
    # pad_rows: k_new / v_new rows past the last request are NaN, and the last request's
    # diagonal block reaches into them (TMA reads them unmasked; the kernel zeroes them).
    o, ref = run_extend(
        [0, 5, 40], [23, 1, 37], extra_grid=20, pad_rows=3, seed=110, fresh=True, tma=tma
    )
    assert_close(o, ref, F32)


@pytest.mark.parametrize("kernel", ["gather", "fresh"])
def test_requests_without_new_tokens(kernel: str) -> None:
    # Requests with a prefix and no new tokens (and one with neither) own no rows: nothing
    # is written for them and their neighbours are unaffected.
    o, ref = run_extend(
        [5, 0, 3, 0, 17], [0, 20, 0, 0, 9], pad_rows=2, seed=115, fresh=kernel == "fresh"
    )
    assert_close(o, ref, F32)


@pytest.mark.parametrize(**TMA_IDS)
def test_fresh_single_token_each(tma: bool) -> None:
    o, ref = run_extend([30, 0, 7, 64], [1, 1, 1, 1], seed=120, fresh=True, tma=tma)
    assert_close(o, ref, F32)


@pytest.mark.parametrize(**TMA_IDS)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(8, 1), (8, 8), (8, 2), (6, 2)])
def test_fresh_gqa_groups(tma: bool, num_q_heads: int, num_kv_heads: int) -> None:
    # Groups 8, 1, 4 and 3 (a padding row per 16-row tile).
    o, ref = run_extend(
        [19, 0], [20, 9], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, seed=130,
        fresh=True, tma=tma,
    )  # fmt: skip
    assert_close(o, ref, F32)


@pytest.mark.parametrize(**TMA_IDS)
@pytest.mark.parametrize(("head_dim", "head_dim_v"), [(64, 64), (128, 128), (256, 256), (64, 32)])
def test_fresh_head_dims(tma: bool, head_dim: int, head_dim_v: int) -> None:
    o, ref = run_extend(
        [20, 0], [12, 21], head_dim=head_dim, head_dim_v=head_dim_v, seed=170 + head_dim_v,
        fresh=True, tma=tma,
    )  # fmt: skip
    assert_close(o, ref, F32)


def test_fresh_padded_head_dim_loads_without_tma() -> None:
    # 96 pads to 128: a TMA box would read the next head's columns, so TMA is refused when
    # asked for and not used when left to the kernel (masked pointer loads instead).
    with pytest.raises(ValueError, match="tma unsupported here: k_new head dim 96"):
        run_extend([20, 0], [12, 21], head_dim=96, seed=175, fresh=True, tma=True)
    o, ref = run_extend([20, 0], [12, 21], head_dim=96, seed=175, fresh=True, tma=None)
    assert_close(o, ref, F32)


@pytest.mark.parametrize(**TMA_IDS)
def test_fresh_diagonal_and_prefix_on_block_boundaries(tma: bool) -> None:
    # block_n 16, 8-token tiles (group 2): prefixes 15, 16, 31, 14, 6 end the gathered part
    # one short of, on, or inside a block (the ragged last prefix block); new lengths 17,
    # 16, 9, 3, 25 end the diagonal on and off block boundaries.
    o, ref = run_extend([15, 16, 31, 14, 6], [17, 16, 9, 3, 25], seed=150, fresh=True, tma=tma)
    assert_close(o, ref, F32)
    # Group 3 packs 5 tokens per 16-row tile: tiles start at every residue of block_n, so the
    # last whole block below a tile's first token is off by one if the bound is.
    o, ref = run_extend(
        [0, 7], [50, 41], num_q_heads=6, num_kv_heads=2, seed=151, fresh=True, tma=tma
    )
    assert_close(o, ref, F32)


@pytest.mark.parametrize(**TMA_IDS)
def test_fresh_long_prefix_and_wide_tiles(tma: bool) -> None:
    # Many whole prefix blocks, 32 x 32 tiles (16 tokens per tile: block_n > tokens per tile,
    # so some tiles start mid-block) and 64-token K/V steps.
    o, ref = run_extend(
        [300, 0, 129], [40, 33, 1], block_m=32, block_n=32, seed=160, fresh=True, tma=tma
    )
    assert_close(o, ref, F32)
    o, ref = run_extend(
        [300, 0, 129], [70, 33, 1], block_m=32, block_n=64, seed=161, fresh=True, tma=tma
    )
    assert_close(o, ref, F32)


@pytest.mark.parametrize(**TMA_IDS)
@pytest.mark.parametrize(("heads_per_tile", "pairs_per_chunk"), [(1, None), (2, 3), (None, 1)])
def test_fresh_head_packing_and_schedule(
    tma: bool, heads_per_tile: int | None, pairs_per_chunk: int | None
) -> None:
    o, ref = run_extend(
        [0, 33, 4, 0, 18], [21, 2, 30, 1, 16], num_q_heads=8, num_kv_heads=2,
        heads_per_tile=heads_per_tile, pairs_per_chunk=pairs_per_chunk, extra_grid=5, seed=180,
        fresh=True, tma=tma,
    )  # fmt: skip
    assert_close(o, ref, F32)


@pytest.mark.parametrize("key", [(2, 64), (2, 128), (2, 256)], ids=lambda k: f"d{k[1]}")
def test_fresh_gpu_table_tiles(key: tuple[int, int]) -> None:
    # The tiles the fresh kernel launches with by default on a GPU (the gather table's
    # until a tuned table says otherwise), compiled on a GPU, interpreted on CPU in fp32.
    elem, d = key
    t = ext._GPU_TILES[key]
    dtype = torch.float16 if CUDA else torch.float32
    compiled = {"num_warps": t.num_warps, "num_stages": t.num_stages} if CUDA else {}
    o, ref = run_extend(
        [70, 0, 5], [2 * t.block_m // 4 + 3, 1, 9], num_q_heads=32, num_kv_heads=8, head_dim=d,
        dtype=dtype, block_m=t.block_m, block_n=t.block_n, seed=260 + d, fresh=True,
        tma=True if CUDA else None, **compiled,
    )  # fmt: skip
    assert_close(o, ref, SMALL_TOL[dtype])


def test_kernel_choice_and_refusals() -> None:
    q = torch.zeros(3, 4, 64, device=SMALL)
    k = torch.zeros(10, 2, 64, device=SMALL)
    new = torch.zeros(3, 2, 64, device=SMALL)
    i32 = torch.zeros(2, dtype=torch.int32, device=SMALL)
    scales = torch.ones(2, device=SMALL)
    assert ext.choose_kernel(q, k, None, None, 64) == "gather"
    # A GPU takes the fresh kernel only from its tuned table (none ships yet).
    assert ext.choose_kernel(q, k, new, None, 64) == ("fresh" if not CUDA else "gather")
    assert ext.choose_kernel(q, k.to(torch.float16), new, None, 64) == "gather"
    assert ext.choose_kernel(q, k, new, scales, 64) == "gather"

    def call(**over: object) -> None:
        tk.extend_attention(q, k, k, q.clone(), i32, i32, i32, i32[:1], 3, 0.1, **over)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="kernel 'fresh' cannot run this call: no k_new"):
        call(kernel="fresh")
    with pytest.raises(ValueError, match="kernel 'flash' unsupported"):
        call(kernel="flash")
    with pytest.raises(ValueError, match="k_new and v_new go together"):
        call(k_new=new)
    with pytest.raises(ValueError, match=r"v_new shape \(3, 2, 32\) unsupported"):
        call(k_new=new, v_new=new[..., :32])
    with pytest.raises(ValueError, match="k_new dtype torch.float16 differs"):
        call(k_new=new.half(), v_new=new)
    with pytest.raises(ValueError, match="k_new must be contiguous in its last dim"):
        call(k_new=new.transpose(1, 2).contiguous().transpose(1, 2), v_new=new)


def _sm90() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


def test_tuned_table_round_trip_and_choice(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A table as the tuning sweep writes it: every field read back; "use" picks the kernel,
    # each kernel's entry its launch; other keys (TFLOP/s, shapes, provenance) are ignored.
    fresh = ext.ExtendChoice(ext.ExtendTiles(128, 128, 8, 2), 2, 7, False)
    gather = ext.ExtendChoice(ext.ExtendTiles(64, 64, 4, 3))
    entry = {"fresh": fresh.to_json() | {"tflops": [1.0]}, "gather": gather.to_json(),
             "use": "gather", "shapes": ["1x8+0"], "tuned": {"gpu": "x"}}  # fmt: skip
    path = tmp_path / "GPU.json"
    path.write_text(json.dumps({"entries": {"bfloat16,128": entry}}))
    table = ext.load_table(str(path))
    assert table["bfloat16,128"] == ext.TableEntry("gather", {"fresh": fresh, "gather": gather})
    assert ext.table_key(torch.bfloat16, 96) == "bfloat16,128"
    assert ext.table_file_name("NVIDIA H200 (x) 141GB") == "NVIDIA_H200__x__141GB.json"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": {"k": {"use": "fresh", "gather": gather.to_json()}}}))
    with pytest.raises(ValueError, match="uses 'fresh' but tunes only"):
        ext.load_table(str(bad))
    # Where a GPU has a table, its entry wins over the built-in tiles and picks the kernel.
    monkeypatch.setattr(ext, "table_entry", lambda *a: table["bfloat16,128"])
    cuda = torch.device("cuda")
    assert ext.extend_choice(torch.bfloat16, 128, cuda, "fresh") == fresh
    assert ext.default_extend_tiles(torch.bfloat16, 128, cuda) == gather.tiles
    q = torch.zeros(3, 4, 64, device=SMALL)
    k = torch.zeros(10, 2, 64, device=SMALL)
    assert ext.choose_kernel(q, k, k[:3], None, 64) in ("gather",)


# ----------------------------------------------------------------------------------------------
# GPU (compiled) cases at real sizes
# ----------------------------------------------------------------------------------------------

# The issue's benchmark rows: (requests, new tokens each, cached prefix each).
ISSUE_SHAPES = [(1, 8192, 0), (4, 2048, 0), (16, 512, 2048), (64, 128, 1024), (8, 1024, 8192)]


def ref_extend_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, sm_scale: float
) -> torch.Tensor:
    """fp32 causal attention of q [n, Hq, D] at positions prefix.. over k/v [L, Hkv, D],
    in chunks of queries so the score matrix stays ~1 GB."""
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vv = v.float().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], device=q.device)
    pos = torch.arange(k.shape[0], device=q.device)
    for lo in range(0, q.shape[0], 1024):
        qc = q[lo : lo + 1024].float()  # [c, Hq, D]
        s = torch.einsum("nhd,lhd->hnl", qc, kk) * sm_scale  # [Hq, c, L]
        rows = prefix + lo + torch.arange(qc.shape[0], device=q.device)
        s.masked_fill_(pos[None, None, :] > rows[None, :, None], float("-inf"))
        out[lo : lo + 1024] = torch.einsum("hnl,lhd->nhd", s.softmax(-1), vv)
    return out


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("bs", "new", "prefix"), ISSUE_SHAPES)
def test_gpu_extend_issue_shapes_bf16(bs: int, new: int, prefix: int) -> None:
    """bf16, 32 / 8 heads, D 128, default tiles, random slots vs fp32 on gathered K/V."""
    check_issue_shape(bs, new, prefix, 300 + bs)


def check_issue_shape(bs: int, new: int, prefix: int, seed: int, **launch: object) -> None:
    """One of the issue's rows on the GPU (bf16, 32 / 8 heads, D 128, random slots), each
    request within 1% (norm) of fp32 attention over its gathered K/V; ``launch`` goes to
    ``extend_attention`` (a kernel, its knobs)."""
    device, dtype, hq, hkv, d = torch.device("cuda"), torch.bfloat16, 32, 8, 128
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache([prefix + new] * bs, hkv, d, d, dtype, device, gen)
    kv_indptr, kv_indices = flat_indices(cache)
    q = torch.randn(bs * new, hq, d, generator=gen).to(dtype).to(device)
    o = torch.full_like(q, float("nan"))
    qo_indptr = torch.arange(0, bs * new + 1, new, dtype=torch.int32, device=device)
    prefix_lens = torch.full((bs,), prefix, dtype=torch.int32, device=device)
    tk.extend_attention(
        q, cache.k, cache.v, o, qo_indptr, kv_indptr, kv_indices, prefix_lens, new, d**-0.5,
        max_kv_len=prefix + new, **launch,  # type: ignore[arg-type]
    )  # fmt: skip
    for b in range(bs):
        rows = slice(b * new, (b + 1) * new)
        ref = ref_extend_fp32(q[rows], *cache.context(b), prefix, d**-0.5)
        assert not torch.isnan(o[rows]).any(), f"request {b}: unwritten rows"
        rel = float((o[rows].float() - ref).norm() / ref.norm())
        assert rel <= 1e-2, f"request {b}: relative error {rel:.3g}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens"),
    [([0, 0], [1000, 333]), ([0, 5, 2000, 4000], [700, 1, 1024, 77]), ([100] * 8, [1] * 8)],
    ids=["no-prefix", "mixed-prefix", "single-token"],
)
def test_gpu_extend(dtype: torch.dtype, prefix_lens: list[int], extend_lens: list[int]) -> None:
    o, ref = run_extend(
        prefix_lens, extend_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype,
        device=torch.device("cuda"), block_m=None, block_n=None, pad_rows=5, seed=220,
    )  # fmt: skip
    assert_close(o, ref, GPU_TOL[dtype])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
def test_gpu_extend_fp8_cache(kv_dtype: torch.dtype) -> None:
    # Compiled, the default tiles: fp8 K/V converted in the loops, scales folded.
    o, ref = run_extend(
        [0, 5, 2000], [700, 1, 1024], num_q_heads=32, num_kv_heads=8, head_dim=128,
        dtype=torch.bfloat16, device=torch.device("cuda"), block_m=None, block_n=None,
        seed=230, kv_dtype=kv_dtype, kv_scales=(4.0, 0.25),  # v x 0.25: small outputs
    )  # fmt: skip
    assert_close(o, ref, GPU_TOL[torch.bfloat16])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(32, 8, 64), (32, 32, 96), (16, 1, 256), (24, 8, 128)],
)
def test_gpu_extend_shapes(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # The table's tiles for every head dim, groups 4, 1, 16 and 3, ragged requests.
    o, ref = run_extend(
        [0, 300, 1], [500, 129, 64], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, device=torch.device("cuda"), block_m=None,
        block_n=None, seed=230,
    )  # fmt: skip
    assert_close(o, ref, GPU_TOL[dtype])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "tiles",
    [
        {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 4},
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "heads_per_tile": 1},
        {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3, "pairs_per_chunk": 1},
    ],
    ids=["64x64w4s3", "128x32w8s4", "128x64w8s2-h1", "64x128w4s3-c1"],
)
def test_gpu_extend_tuning_candidates(tiles: dict[str, int]) -> None:
    # Other tiles the tuning sweep may pick must be correct too.
    o, ref = run_extend(
        [0, 700, 33], [900, 200, 1], num_q_heads=32, num_kv_heads=8, head_dim=128,
        dtype=torch.bfloat16, device=torch.device("cuda"), seed=240, **tiles,
    )  # fmt: skip
    assert_close(o, ref, GPU_TOL[torch.bfloat16])


def test_slot_offsets_are_int32_below_two_to_the_31_elements() -> None:
    from execrt.kernels.attention.common import int32_slot_offsets

    meta = functools.partial(torch.empty, dtype=torch.bfloat16, device="meta")
    assert int32_slot_offsets(meta(2**20, 8, 128), meta(2**20, 8, 128))
    assert not int32_slot_offsets(meta(2**21, 8, 128), meta(2**20, 8, 128))  # K at 2^31
    assert not int32_slot_offsets(meta(2**20, 8, 128), meta(2**22, 8, 128))


@pytest.mark.parametrize("kernel", ["gather", "fresh"])
def test_int64_slot_offsets_give_the_same_output(kernel: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The kernels take int32 offsets wherever the cache allows (every test cache does); the
    # int64 path a cache of 2^31 elements would take gives the same values.
    run = functools.partial(run_extend, [0, 37, 5], [9, 20, 33], seed=331, fresh=kernel == "fresh")
    narrow, ref = run()
    monkeypatch.setattr(ext, "int32_slot_offsets", lambda *buffers: False)
    wide, _ = run()
    assert torch.equal(narrow, wide)
    assert_close(wide, ref, SMALL_TOL[torch.float32])
