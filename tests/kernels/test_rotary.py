"""q/k norm + RoPE (+ K/V store): Triton kernel vs torch reference vs an fp64 oracle."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from execrt.core.kv_quant import K_INV_SCALE, V_INV_SCALE, KVScales, quantize
from execrt.kernels.rotary import KVStore, qk_norm_rope, qk_norm_rope_torch
from tests.kernels.helpers import (
    DEVICE,
    max_rel,
    needs_cuda,
    replay_matches_eager,
)

EPS = 1e-6
POSITIONS = 512  # table rows; high positions give large angles


def tables(head_dim: int, theta: float = 1e6) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin ``[P, D]`` laid out as the model's (frequencies repeated over both halves)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(POSITIONS, dtype=torch.float64), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float().to(DEVICE), emb.sin().float().to(DEVICE)


def oracle(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight: torch.Tensor | None,
) -> torch.Tensor:
    """Per-head RMSNorm then rotate-half RoPE in fp64, written out element by half."""
    xd = x.double()
    if weight is not None:
        xd = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    half = x.shape[-1] // 2
    c = cos.double()[positions][:, None, :]  # [T, 1, D]
    s = sin.double()[positions][:, None, :]
    x1, x2 = xd[..., :half], xd[..., half:]
    first = x1 * c[..., :half] - x2 * s[..., :half]
    second = x2 * c[..., half:] + x1 * s[..., half:]
    return torch.cat([first, second], dim=-1)


def fused_qkv(
    tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one ``[T, (Hq + 2 Hkv) D]`` projection output."""
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype).to(DEVICE)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    assert tokens == 1 or not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    return q, k, v


def random_positions(tokens: int, gen: torch.Generator) -> torch.Tensor:
    # Unsorted, with repeats and the last table row.
    pos = torch.randint(0, POSITIONS, (tokens,), generator=gen)
    pos[-1] = POSITIONS - 1
    return pos.to(DEVICE)


def norm_weight(d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(d, generator=gen) * 0.3 + 1.0).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_norm_rope_on_fused_qkv_views(dtype: torch.dtype, head_dim: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(head_dim * 100 + tokens)
    q, k, _ = fused_qkv(tokens, 8, 2, head_dim, dtype, gen)
    pos = random_positions(tokens, gen)
    cos, sin = tables(head_dim)
    qw, kw = norm_weight(head_dim, dtype, gen), norm_weight(head_dim, dtype, gen)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = qk_norm_rope(q, k, pos, cos, sin, qw, kw, EPS, use_triton=True)
    q_ref, k_ref = qk_norm_rope_torch(q, k, pos, cos, sin, qw, kw, EPS)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.is_contiguous() and k_out.is_contiguous() and q_out.dtype == dtype
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    for out, ref, x, w in ((q_out, q_ref, q, qw), (k_out, k_ref, k, kw)):
        exact = oracle(x, pos, cos, sin, w)
        if dtype == torch.float32:
            assert max_rel(out, ref) <= 1e-6
            assert max_rel(out, exact) <= 1e-6
        else:
            assert max_rel(out, ref) <= 1e-2
            assert max_rel(out, exact) <= 1e-2
            # One rounding of the rotation instead of three (and fp32 tables): never worse.
            assert max_rel(out, exact) <= max_rel(ref, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_without_norm_is_rounded_once(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    q = (torch.randn(7, 4, 128, generator=gen) * 2).to(dtype).to(DEVICE)
    k = (torch.randn(7, 2, 128, generator=gen) * 2).to(dtype).to(DEVICE)
    pos = random_positions(7, gen)
    cos, sin = tables(128)
    outs = qk_norm_rope(q, k, pos, cos, sin, None, None, EPS, use_triton=True)
    for out, x in zip(outs, (q, k), strict=True):
        exact = oracle(x, pos, cos, sin, None)
        # Half an ulp of the result from the final rounding, plus fp32 error of the products.
        half_ulp = 2.0 ** -(24 if dtype == torch.float32 else 11)
        bound = half_ulp * exact.abs() + 2.0**-22 * x.abs().max().double()
        assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("head_dim_v", [64, 96])
def test_kv_store_writes_exactly_the_given_slots(use_triton: bool, head_dim_v: int) -> None:
    gen = torch.Generator().manual_seed(head_dim_v)
    tokens, hq, hkv, d, slots = 7, 8, 2, 64, 40
    q = torch.randn(tokens, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(tokens, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(tokens, hkv, 2 * head_dim_v, generator=gen).to(DEVICE)[..., ::2]  # strided
    v = v.contiguous().view(tokens, hkv, head_dim_v)
    loc = torch.randperm(slots, generator=gen)[:tokens].to(DEVICE)  # unsorted, distinct
    pos = random_positions(tokens, gen)
    cos, sin = tables(d)
    kw = norm_weight(d, torch.float32, gen)
    # The cache is fp16 under fp32 activations, so the store must cast.
    k_cache = torch.full((slots, hkv, d), float("nan"), dtype=torch.float16, device=DEVICE)
    v_cache = torch.full((slots, hkv, head_dim_v), float("nan"), dtype=torch.float16, device=DEVICE)
    _, k_out = qk_norm_rope(
        q, k, pos, cos, sin, None, kw, EPS,
        v=v, k_cache=k_cache, v_cache=v_cache, out_cache_loc=loc, use_triton=use_triton,
    )  # fmt: skip
    written = torch.zeros(slots, dtype=torch.bool, device=DEVICE)
    written[loc] = True
    assert k_cache[~written].isnan().all() and v_cache[~written].isnan().all()
    assert torch.equal(v_cache[loc], v.half())
    assert torch.equal(k_cache[loc], k_out.half())
    assert max_rel(k_cache[loc], oracle(k, pos, cos, sin, kw)) <= 1e-3


@pytest.mark.parametrize("heads_per_block", [1, 4])
def test_head_tiles_that_do_not_divide_the_head_count(heads_per_block: int) -> None:
    from execrt.kernels.triton_rotary import qk_norm_rope_triton

    gen = torch.Generator().manual_seed(heads_per_block)
    tokens, hq, hkv, d = 3, 6, 3, 64
    q, k, v = fused_qkv(tokens, hq, hkv, d, torch.float32, gen)
    pos = random_positions(tokens, gen)
    loc = torch.tensor([5, 0, 2], device=DEVICE)
    cos, sin = tables(d)
    qw, kw = norm_weight(d, torch.float32, gen), norm_weight(d, torch.float32, gen)
    k_cache = torch.full((6, hkv, d), float("nan"), device=DEVICE)
    v_cache = torch.full((6, hkv, d), float("nan"), device=DEVICE)
    q_out, k_out = qk_norm_rope_triton(
        q, k, pos, cos, sin, qw, kw, EPS,
        store=KVStore(v, k_cache, v_cache, loc, None), heads_per_block=heads_per_block,
    )  # fmt: skip
    assert max_rel(q_out, oracle(q, pos, cos, sin, qw)) <= 1e-6
    assert max_rel(k_out, oracle(k, pos, cos, sin, kw)) <= 1e-6
    assert torch.equal(v_cache[loc], v) and torch.equal(k_cache[loc], k_out)
    assert v_cache[[1, 3, 4]].isnan().all() and k_cache[[1, 3, 4]].isnan().all()


def sylvester(d: int) -> torch.Tensor:
    """The Hadamard matrix of size ``d`` over sqrt(d) in fp64, built by Sylvester's doubling
    (independent of the butterflies under test)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d**0.5).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("tokens", "heads_per_block"), [(1, None), (7, 2), (33, 16)])
def test_hadamard_rotation_against_an_fp64_oracle_keeps_every_score(
    dtype: torch.dtype, head_dim: int, tokens: int, heads_per_block: int | None
) -> None:
    from execrt.kernels.triton_rotary import qk_norm_rope_triton

    gen = torch.Generator().manual_seed(head_dim + tokens)
    q, k, v = fused_qkv(tokens, 8, 2, head_dim, dtype, gen)
    pos = random_positions(tokens, gen)
    cos, sin = tables(head_dim)
    qw, kw = norm_weight(head_dim, dtype, gen), norm_weight(head_dim, dtype, gen)
    h = sylvester(head_dim)
    slots = tokens + 3
    caches = [torch.zeros(slots, 2, head_dim, dtype=dtype, device=DEVICE) for _ in range(2)]
    loc = torch.randperm(slots, generator=gen)[:tokens].to(DEVICE)
    store = KVStore(v, caches[0], caches[1], loc, None)
    outs = {
        "triton": qk_norm_rope_triton(
            q,
            k,
            pos,
            cos,
            sin,
            qw,
            kw,
            EPS,
            store=store,
            heads_per_block=heads_per_block,
            hadamard=True,
        ),  # fmt: skip
        "torch": qk_norm_rope_torch(q, k, pos, cos, sin, qw, kw, EPS, hadamard=True),
    }
    assert torch.equal(caches[0][loc], outs["triton"][1]), "the cache holds the rotated k"
    exact_q, exact_k = oracle(q, pos, cos, sin, qw) @ h, oracle(k, pos, cos, sin, kw) @ h
    bound = 2e-6 if dtype == torch.float32 else 2e-3
    for name, (q_out, k_out) in outs.items():
        assert max_rel(q_out, exact_q) <= bound, name
        assert max_rel(k_out, exact_k) <= bound, name
    # q.k of every query head with its kv head is the unrotated one.
    q_rot, k_rot = (x.double() for x in outs["triton"])
    q_plain, k_plain = oracle(q, pos, cos, sin, qw), oracle(k, pos, cos, sin, kw)
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("thd,thd->th", q_rot, k_rot.repeat_interleave(group, 1))
    plain = torch.einsum("thd,thd->th", q_plain, k_plain.repeat_interleave(group, 1))
    assert max_rel(scores, plain) <= 50 * bound


def test_hadamard_needs_a_power_of_two_head_dim() -> None:
    from execrt.kernels.rotary import hadamard_rotate

    q = torch.randn(2, 4, 96, device=DEVICE)
    cos, sin = tables(96)
    pos = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 96 unsupported .*power of two"):
        qk_norm_rope(q, q[:, :2], pos, cos, sin, None, None, EPS, hadamard=True, use_triton=True)
    with pytest.raises(ValueError, match="last dim 96 must be a power of two"):
        hadamard_rotate(q)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
#: Values whose fp8 rounding is easy to get wrong: ties (to even), a carry across an exponent
#: (125 -> 128 in e4m3), subnormals, signed zeros, and magnitudes past the finite range.
HARD_VALUES = [1.0625, 1.1875, 125.0, -125.0, 2.0**-8, -(2.0**-10), 0.0, -0.0, 470.0, -1e4]


def fp8_store(
    kv_dtype: torch.dtype,
    scales: tuple[float, float] | None,
    use_triton: bool,
    seed: int,
    hadamard: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """Rotate and store large K/V (plus ``HARD_VALUES`` in v) into an fp8 cache.

    Returns ``([k_cache, v_cache], [k_out, v], scale row)``: what was stored and what the
    store was given."""
    gen = torch.Generator().manual_seed(seed)
    tokens, hq, hkv, d, slots = 5, 4, 2, 64, 12
    q, k, v = fused_qkv(tokens, hq, hkv, d, torch.float32, gen)
    k, v = k * 150, (v * 150).contiguous()  # past 448 after rotation for many elements
    v.view(-1)[: len(HARD_VALUES)] = torch.tensor(HARD_VALUES)
    row = None if scales is None else KVScales((scales[0],), (scales[1],)).row(0)
    row_t = None if row is None else torch.tensor(row, dtype=torch.float32, device=DEVICE)
    loc = torch.randperm(slots, generator=gen)[:tokens].to(DEVICE)
    caches = [torch.zeros(slots, hkv, d, dtype=kv_dtype, device=DEVICE) for _ in range(2)]
    k_in, v_in = k.clone(), v.clone()
    _, k_out = qk_norm_rope(
        q, k, random_positions(tokens, gen), *tables(d), None, None, EPS, v=v,
        k_cache=caches[0], v_cache=caches[1], out_cache_loc=loc, cache_scales=row_t,
        hadamard=hadamard, use_triton=use_triton,
    )  # fmt: skip
    assert torch.equal(k, k_in) and torch.equal(v, v_in), "the store modified its inputs"
    return [c[loc] for c in caches], [k_out, v], row_t


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scales", [None, (0.25, 4.0), (0.37, 3.1)])
@pytest.mark.parametrize("hadamard", [False, True], ids=["rope", "rope+hadamard"])
def test_fp8_store_gives_the_bytes_of_kv_quant(
    use_triton: bool, kv_dtype: torch.dtype, scales: tuple[float, float] | None, hadamard: bool
) -> None:
    # The Triton store must give torch's bytes (kv_quant.quantize) for the same rotated k.
    stored, given, row = fp8_store(kv_dtype, scales, use_triton, seed=7, hadamard=hadamard)
    for cache, x, inv in zip(stored, given, (K_INV_SCALE, V_INV_SCALE), strict=True):
        want = quantize(x, kv_dtype, None if row is None else row[inv])
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
        assert torch.isfinite(cache.float()).all()


@needs_cuda
@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["rope", "rope+hadamard"])
def test_fp8_stores_on_the_gpu_give_no_nan_or_inf_and_the_same_bytes(
    kv_dtype: torch.dtype, hadamard: bool
) -> None:
    # torch's CUDA cast to e4m3 turns values >= 480 into NaN (CPU torch and Triton saturate):
    # only a GPU run sees whether every store path clamps first. Inputs up to |x| = 1e4.
    from execrt.core.memory import KVCache

    values = []
    for use_triton in (False, True):
        stored, given, _ = fp8_store(kv_dtype, None, use_triton, seed=8, hadamard=hadamard)
        assert max(float(x.abs().max()) for x in given) >= 1e4 - 1
        for cache, x in zip(stored, given, strict=True):  # rotated k (each path's own), v
            assert torch.isfinite(cache.float()).all()
            assert torch.equal(cache.view(torch.uint8), quantize(x, kv_dtype).view(torch.uint8))
        values.append(stored[1].view(torch.uint8))
    assert torch.equal(*values)  # v is stored unrotated: both paths give the same bytes
    cache = KVCache(8, 1, 2, 64, kv_dtype, "cuda")
    big = torch.linspace(-1e4, 1e4, 4 * 2 * 64, device="cuda").view(4, 2, 64)
    cache.set_kv(0, torch.tensor([1, 3, 5, 7], device="cuda"), big.bfloat16(), big)
    # 1e4 clamped to the format, then cast: 448 (e4m3), 10240 (e5m2). Not a bare cast: the
    # H200 image's torch gives NaN even on the CPU for e4m3 beyond its range.
    top = torch.tensor(min(1e4, torch.finfo(kv_dtype).max))
    largest = float(top.to(kv_dtype).float())
    for buf in (cache.k_buffers[0], cache.v_buffers[0]):
        assert torch.isfinite(buf.float()).all()
        assert float(buf.float().abs().max()) == largest


def _inputs(d: int = 64) -> dict[str, torch.Tensor]:
    cos, sin = tables(d)
    return {
        "q": torch.zeros(2, 4, d, device=DEVICE),
        "k": torch.zeros(2, 2, d, device=DEVICE),
        "positions": torch.zeros(2, dtype=torch.int64, device=DEVICE),
        "cos": cos,
        "sin": sin,
    }


@pytest.mark.parametrize(
    "change, match",
    [
        ({"k": torch.zeros(2, 2, 32)}, "does not match q"),
        ({"positions": torch.zeros(3, dtype=torch.int64)}, "positions"),
        ({"positions": torch.zeros(2)}, "positions"),
        ({"cos": torch.zeros(8, 64, dtype=torch.float64)}, "cos"),
        ({"q": torch.zeros(2, 4, 63), "k": torch.zeros(2, 2, 63)}, "head_dim 63 unsupported"),
    ],
)
def test_rejects_bad_inputs(change: dict[str, torch.Tensor], match: str) -> None:
    args = _inputs() | {name: t.to(DEVICE) for name, t in change.items()}
    with pytest.raises(ValueError, match=f"qk_norm_rope: .*{match}"):
        qk_norm_rope(
            args["q"], args["k"], args["positions"], args["cos"], args["sin"], None, None, EPS,
            use_triton=True,
        )  # fmt: skip


@pytest.mark.parametrize("use_triton", [True, False])
def test_store_needs_every_store_argument(use_triton: bool) -> None:
    args = _inputs()
    with pytest.raises(ValueError, match="qk_norm_rope: the K/V store needs all of"):
        qk_norm_rope(
            args["q"], args["k"], args["positions"], args["cos"], args["sin"], None, None, EPS,
            v=args["k"], use_triton=use_triton,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# GPU: bf16 at model sizes, CUDA-graph capture
# ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("heads", [(16, 8), (32, 8)])
@pytest.mark.parametrize("tokens", [1, 37, 256])
def test_bf16_model_sizes(heads: tuple[int, int], tokens: int) -> None:
    hq, hkv = heads
    gen = torch.Generator().manual_seed(tokens * hq)
    q, k, v = fused_qkv(tokens, hq, hkv, 128, torch.bfloat16, gen)
    pos = random_positions(tokens, gen)
    cos, sin = tables(128)
    qw, kw = norm_weight(128, torch.bfloat16, gen), norm_weight(128, torch.bfloat16, gen)
    slots = 4 * tokens
    loc = torch.randperm(slots, generator=gen)[:tokens].cuda()
    caches = [torch.zeros(slots, hkv, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    q_out, k_out = qk_norm_rope(
        q, k, pos, cos, sin, qw, kw, EPS,
        v=v, k_cache=caches[0], v_cache=caches[1], out_cache_loc=loc, use_triton=True,
    )  # fmt: skip
    q_ref, k_ref = qk_norm_rope_torch(
        q, k, pos, cos, sin, qw, kw, EPS,
        v=v, k_cache=caches[2], v_cache=caches[3], out_cache_loc=loc,
    )  # fmt: skip
    assert max_rel(q_out, q_ref) <= 1e-2 and max_rel(k_out, k_ref) <= 1e-2
    assert max_rel(caches[0], caches[2]) <= 1e-2 and torch.equal(caches[1], caches[3])


@needs_cuda
def test_capturable_in_a_cuda_graph() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = fused_qkv(4, 16, 8, 128, torch.bfloat16, gen)
    pos = random_positions(4, gen)
    loc = torch.tensor([3, 1, 7, 5], device="cuda")
    cos, sin = tables(128)
    qw, kw = norm_weight(128, torch.bfloat16, gen), norm_weight(128, torch.bfloat16, gen)
    k_cache = torch.zeros(8, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)

    def step() -> list[torch.Tensor]:
        q_out, k_out = qk_norm_rope(
            q, k, pos, cos, sin, qw, kw, EPS,
            v=v, k_cache=k_cache, v_cache=v_cache, out_cache_loc=loc, use_triton=True,
        )  # fmt: skip
        return [q_out, k_out, k_cache[loc], v_cache[loc]]

    fresh_pos = (pos + 17) % POSITIONS
    replay_matches_eager(
        step,
        [q, k, v, pos],
        [torch.randn_like(q), torch.randn_like(k), torch.randn_like(v), fresh_pos],
    )


def test_launch_shape_follows_the_h200_sweep() -> None:
    """Heads per program grow with the tokens while every SM keeps four programs; warps are
    one up to two heads, then one per head (``bench_layer_kernels.py --sweep``)."""
    from execrt.kernels.triton_rotary import heads_per_program, rope_warps

    assert [heads_per_program(t, 16, 8, 132) for t in (1, 8, 64, 128, 256)] == [1, 1, 2, 4, 8]
    assert [rope_warps(h) for h in (1, 2, 4, 8, 16)] == [1, 1, 4, 8, 8]
