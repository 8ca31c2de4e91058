"""The skinny GEMM's layer-level variants: SwiGLU on gate/up's output (with and without the norm
in front), the per-variant tuned table (format 2, format 1 still loading), and the kernels a
dense decode layer launches as the table decides."""

from __future__ import annotations

import functools
import json
import types

import pytest
import torch

pytest.importorskip("triton")

from execrt.kernels import linear as linear_mod
from execrt.kernels.linear import linear, norm_linear
from tests.kernels.helpers import DEVICE, max_rel, needs_cuda, replay_matches_eager

# 0.6B and 8B Qwen3 shapes: hidden, q width (heads x head_dim), k/v width, intermediate.
SHAPE_06B = dict(hidden=1024, q=2048, kv=1024, inter=3072)
SHAPE_8B = dict(hidden=4096, q=4096, kv=1024, inter=12288)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape: tuple[int, ...], seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype).to(DEVICE)


def act_oracle(
    x: torch.Tensor,
    w13: torch.Tensor,
    b: torch.Tensor | None,
    norm_w: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``silu(gate) * up`` of ``norm(x + residual) @ w13^T + b`` with the reference's
    roundings to the dtype: the residual sum and the norm's two (``*_torch``), gate and up
    (the product's output), and the product (``silu_and_mul``'s). Returns (act, new residual)."""
    from execrt.kernels.norm import fused_add_rmsnorm_torch, rmsnorm_torch

    dtype = x.dtype
    new_res = x
    if norm_w is not None:
        if residual is None:
            x = rmsnorm_torch(x, norm_w, eps)
        else:
            x, new_res = fused_add_rmsnorm_torch(x, residual, norm_w, eps)
    gu = x.double() @ w13.double().T
    if b is not None:
        gu = gu + b.double()
    i = w13.shape[0] // 2
    gate, up = gu[:, :i].to(dtype).double(), gu[:, i:].to(dtype).double()
    return gate / (1.0 + torch.exp(-gate)) * up, new_res


def bound(dtype: torch.dtype) -> float:
    # fp32: summation order; 16-bit: a gate/up rounding that may flip by one ulp, then one more.
    return 2e-5 if dtype == torch.float32 else 8e-3


TILES = [
    dict(block_n=4, block_k=32),  # CUDA cores
    dict(block_n=16, block_k=64),
    dict(block_n=16, block_k=32, use_dot=True),  # tensor cores, rows padded to 16
    dict(block_n=32, block_k=64, use_dot=True),
]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: "-".join(map(str, t.values())))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("norm", ["none", "norm", "add"])
def test_swiglu_out_matches_the_oracle(tile: dict, dtype: torch.dtype, m: int, norm: str) -> None:
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch

    i, k = 37, 200  # I not a multiple of any block_n, K not of any block_k
    x = rand((m, k), m, dtype)
    w13 = rand((2 * i, k), m + 1, dtype, k**-0.5)
    b = rand((2 * i,), m + 2, dtype)
    norm_w = (torch.rand(k, generator=gen(3)) + 0.5).to(dtype).to(DEVICE)
    residual = rand((m, k), m + 4, dtype, 4.0) if norm == "add" else None
    new_res = torch.full_like(x, float("nan")) if norm == "add" else None
    nin = NormIn(norm_w, 1e-6, residual, new_res) if norm != "none" else None
    out = launch(x, w13, b, SkinnyTile(**tile), swiglu_out=True, norm=nin)
    expected, expected_res = act_oracle(x, w13, b, norm_w if nin else None, residual)
    assert out.shape == (m, i) and out.dtype == dtype
    assert max_rel(out, expected) <= bound(dtype)
    if new_res is not None:
        assert torch.equal(new_res, expected_res)


@pytest.mark.parametrize(("m", "dtype"), [(3, torch.float16), (8, torch.float32)])
def test_swiglu_out_with_split_k_matches_the_oracle(m: int, dtype: torch.dtype) -> None:
    # Gate and up partials per slice; the last slice sums both and applies SwiGLU. The norm
    # prologue with the residual add rides along.
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch

    i, k = 37, 200
    x = rand((m, k), m, dtype)
    w13 = rand((2 * i, k), m + 1, dtype, k**-0.5)
    b = rand((2 * i,), m + 2, dtype)
    norm_w = (torch.rand(k, generator=gen(3)) + 0.5).to(dtype).to(DEVICE)
    residual = rand((m, k), m + 4, dtype, 4.0)
    new_res = torch.full_like(x, float("nan"))
    tile = SkinnyTile(block_n=16, block_k=64, split_k=2)
    out = launch(x, w13, b, tile, swiglu_out=True, norm=NormIn(norm_w, 1e-6, residual, new_res))
    expected, expected_res = act_oracle(x, w13, b, norm_w, residual)
    assert max_rel(out, expected) <= bound(dtype)
    assert torch.equal(new_res, expected_res)


def test_swiglu_out_equals_the_unfused_kernels_bitwise_in_fp16() -> None:
    """Same tile, same accumulation: SwiGLU in the epilogue rounds exactly as gate/up's output
    followed by ``silu_and_mul`` does (every element, not just within a bound)."""
    from execrt.kernels.activation import silu_and_mul
    from execrt.kernels.triton_linear import SkinnyTile, launch

    x = rand((5, 96), 1, torch.float16)
    w13 = rand((2 * 48, 96), 2, torch.float16, 96**-0.5)
    tile = SkinnyTile(16, 32, use_dot=False)
    fused = launch(x, w13, None, tile, swiglu_out=True)
    apart = silu_and_mul(launch(x, w13, None, tile), use_triton=True)
    assert torch.equal(fused, apart)


def test_swiglu_out_checks_its_arguments() -> None:
    from execrt.kernels.triton_linear import SkinnyTile, launch

    x = rand((2, 16), 1, torch.float32)
    with pytest.raises(ValueError, match=r"swiglu_out weight \(5, 16\) needs an even row count"):
        launch(x, rand((5, 16), 2, torch.float32), None, SkinnyTile(16, 16), swiglu_out=True)
    with pytest.raises(ValueError, match="swiglu .* and swiglu_out .* are exclusive"):
        launch(x, rand((4, 8), 2, torch.float32), None, SkinnyTile(16, 16), swiglu=True,
               swiglu_out=True)  # fmt: skip


# -- the model shapes: norm + gate/up (SwiGLU out) then down, every row count ------------------


def mlp_chain(shape: dict, m: int, dtype: torch.dtype, tile: dict, seed: int) -> None:
    """post-attention norm (with the residual add) + gate/up + SwiGLU in one kernel, then down
    plain on the activations: both against fp64 (the down oracle takes the kernel's act)."""
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch

    h, inter = shape["hidden"], shape["inter"]
    delta, residual = rand((m, h), seed, dtype), rand((m, h), seed + 1, dtype, 4.0)
    w13 = rand((2 * inter, h), seed + 2, dtype, h**-0.5)
    w2 = rand((h, inter), seed + 3, dtype, inter**-0.5)
    norm_w = (torch.rand(h, generator=gen(seed)) + 0.5).to(dtype).to(DEVICE)
    new_res = torch.empty_like(delta)
    t = SkinnyTile(**tile)
    act = launch(delta, w13, None, t, swiglu_out=True, norm=NormIn(norm_w, 1e-6, residual, new_res))
    expected, expected_res = act_oracle(delta, w13, None, norm_w, residual)
    assert act.shape == (m, inter) and max_rel(act, expected) <= bound(dtype)
    assert torch.equal(new_res, expected_res)
    out = launch(act, w2, None, t)
    assert max_rel(out, act.double() @ w2.double().T) <= bound(dtype)


# late_norm: 1 / rms scales the product, the squares summed in the main loop (no prologue).
LATE_CASES = [  # (tile, dtype, m, residual added, SwiGLU on the output)
    (dict(block_n=4, block_k=32), torch.float16, 1, True, False),
    (dict(block_n=4, block_k=32), torch.float32, 3, False, True),
    (dict(block_n=16, block_k=32, use_dot=True), torch.float16, 5, True, True),
    (dict(block_n=32, block_k=64, use_dot=True), torch.float16, 16, False, False),
    (dict(block_n=32, block_k=64, use_dot=True), torch.float32, 8, True, False),
]


@pytest.mark.parametrize(("tile", "dtype", "m", "add", "swiglu_out"), LATE_CASES)
def test_late_norm_matches_the_oracle(
    tile: dict, dtype: torch.dtype, m: int, add: bool, swiglu_out: bool
) -> None:
    from execrt.kernels.norm import fused_add_rmsnorm_torch, rmsnorm_torch
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch

    n, k = 37, 200  # N not a multiple of any block_n, K not of any block_k
    x = rand((m, k), m, dtype)
    w = rand(((2 if swiglu_out else 1) * n, k), m + 1, dtype, k**-0.5)
    norm_w = (torch.rand(k, generator=gen(3)) + 0.5).to(dtype).to(DEVICE)
    residual = rand((m, k), m + 4, dtype, 4.0) if add else None
    new_res = torch.full_like(x, float("nan")) if add else None
    nin = NormIn(norm_w, 1e-6, residual, new_res)
    out = launch(x, w, None, SkinnyTile(**tile, late_norm=True), swiglu_out=swiglu_out, norm=nin)
    if swiglu_out:
        expected, expected_res = act_oracle(x, w, None, norm_w, residual)
    else:
        if add:
            normed, expected_res = fused_add_rmsnorm_torch(x, residual, norm_w, 1e-6)
        else:
            normed, expected_res = rmsnorm_torch(x, norm_w, 1e-6), x
        expected = normed.double() @ w.double().T
    assert out.shape == (m, n) and max_rel(out, expected) <= bound(dtype)
    if new_res is not None:
        assert torch.equal(new_res, expected_res)  # x + r, rounded as the norm kernel rounds it


def test_late_norm_needs_whole_rows() -> None:
    from execrt.kernels.triton_linear import SkinnyTile

    with pytest.raises(ValueError, match=r"late_norm needs split_k 1"):
        SkinnyTile(block_n=16, block_k=64, use_dot=True, split_k=2, late_norm=True)


# Wide tensor-core tiles keep the interpreter's program count low (the CUDA-core tiles and
# fp16 are covered on small shapes above); fp32 keeps numpy's dots on BLAS. On a GPU that tile
# needs 305 KiB of fp32 shared memory (an H200 has 227), so the GPU runs a 64 x 128 tensor-core
# tile that fits.
WIDE = (
    dict(block_n=128, block_k=256, use_dot=True)
    if DEVICE.type == "cpu"
    else dict(block_n=64, block_k=128, use_dot=True)
)


# Every row count on a GPU; on CPU (2-3 s each under the interpreter) one, a few, an odd one
# past a power of two, and the most a skinny tile takes.
@pytest.mark.parametrize("m", range(1, 17) if DEVICE.type == "cuda" else (1, 3, 9, 16))
def test_mlp_chain_at_the_06b_shape(m: int) -> None:
    mlp_chain(SHAPE_06B, m, torch.float32, WIDE, seed=m)


# On CPU the interpreter takes 40-60 s per 8B chain; the 0.6B chains above run the same code
# (K loops of several blocks, both norms, SwiGLU in and out), so the 8B shape is the GPU's.
@pytest.mark.skipif(DEVICE.type == "cpu", reason="8B shape: GPU only (0.6B covers it on CPU)")
@pytest.mark.parametrize("m", [3, 16])
def test_mlp_chain_at_the_8b_shape(m: int) -> None:
    mlp_chain(SHAPE_8B, m, torch.float32, WIDE, seed=m)


# The 8B shape once on CPU (12-16 s each under the interpreter), every row count on a GPU.
QKV_CASES = [(m, "0.6b") for m in (1, 5, 16)] + [
    (m, "8b") for m in ((1, 5, 16) if DEVICE.type == "cuda" else (5,))
]


@pytest.mark.parametrize(("m", "shape_name"), QKV_CASES)
def test_qkv_norm_prologue_with_tensor_core_tiles_at_the_model_shapes(
    m: int, shape_name: str
) -> None:
    """The norm in front of q/k/v (the residual added) on a ``use_dot`` tile, rows padded."""
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch

    shape = {"0.6b": SHAPE_06B, "8b": SHAPE_8B}[shape_name]
    h, n = shape["hidden"], shape["q"] + 2 * shape["kv"]
    delta, residual = rand((m, h), m, torch.float16), rand((m, h), m + 1, torch.float16, 4.0)
    w = rand((n, h), m + 2, torch.float16, h**-0.5)
    norm_w = (torch.rand(h, generator=gen(m)) + 0.5).to(torch.float16).to(DEVICE)
    new_res = torch.empty_like(delta)
    out = launch(delta, w, None, SkinnyTile(**WIDE), norm=NormIn(norm_w, 1e-6, residual, new_res))
    from execrt.kernels.norm import fused_add_rmsnorm_torch

    normed, expected_res = fused_add_rmsnorm_torch(delta, residual, norm_w, 1e-6)
    assert max_rel(out, normed.double() @ w.double().T) <= 4e-3
    assert torch.equal(new_res, expected_res)


# -- norm_linear(swiglu_out=) and MLP.down through the table's choices -------------------------


def install(monkeypatch: pytest.MonkeyPatch, shapes: dict, fmt: int = 2) -> None:
    """Run the dispatch against a table of ``shapes`` on any device."""
    from execrt.kernels import triton_linear as tl_mod

    table = parse(shapes, fmt)

    def pick(m, n, k, dtype, device, v=""):  # type: ignore[no-untyped-def]
        return tl_mod.choose(table, m, n, k, v)

    monkeypatch.setattr(tl_mod, "pick_tile", pick)


def parse(shapes: dict, fmt: int = 2):  # type: ignore[no-untyped-def]
    import os
    import tempfile

    from execrt.kernels import triton_linear as tl_mod

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(({"format": fmt} if fmt != 1 else {}) | {"shapes": shapes}, fh)
    try:
        return tl_mod.load_table(fh.name)
    finally:
        os.unlink(fh.name)


TILE = {"block_n": 16, "block_k": 32, "use_dot": True, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("where", ["inside", "norm_apart", "no_epilogue"])
@pytest.mark.parametrize("m", [2, 9])
def test_norm_linear_swiglu_out_and_down(
    monkeypatch: pytest.MonkeyPatch, where: str, m: int
) -> None:
    from execrt.models.layers import MLP

    h, inter = 40, 24
    epi = {"inside": TILE, "norm_apart": TILE | {"fuse_norm": False}, "no_epilogue": "apart"}
    install(
        monkeypatch,
        {
            f"{2 * inter},{h},swiglu_out": {"16": epi[where]},
            f"{2 * inter},{h},norm": {"16": TILE},
            f"{h},{inter}": {"16": TILE},
        },
    )
    mlp = MLP(h, inter).to(DEVICE).to(torch.float16).requires_grad_(False)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen(p.numel())) * p.shape[1] ** -0.5)
    delta, residual = rand((m, h), 1, torch.float16), rand((m, h), 2, torch.float16, 4.0)
    norm_w = (torch.rand(h, generator=gen(5)) + 0.5).to(torch.float16).to(DEVICE)
    out, new_res = norm_linear(
        delta, mlp.gate_up_proj.weight, None, norm_w, 1e-6, residual=residual, swiglu_out=True,
        use_triton=True,
    )  # fmt: skip
    expected, expected_res = act_oracle(delta, mlp.gate_up_proj.weight, None, norm_w, residual)
    assert torch.equal(new_res, expected_res)
    if where == "no_epilogue":
        assert out.shape == (m, 2 * inter)
    else:
        assert out.shape == (m, inter) and max_rel(out, expected) <= bound(torch.float16)
    mlp.down_proj.fused = True
    y = mlp.down(out)  # takes either form
    ref = expected.to(torch.float16).double() @ mlp.down_proj.weight.double().T
    assert y.shape == (m, h) and max_rel(y, ref) <= 1e-2


def test_swiglu_out_off_without_use_triton_or_past_the_skinny_rows() -> None:
    h, inter = 16, 8
    w13 = rand((2 * inter, h), 1, torch.float32)
    norm_w = torch.ones(h, device=DEVICE)
    for m, use in ((2, False), (linear_mod.MAX_SKINNY_ROWS + 1, True)):
        out, _ = norm_linear(rand((m, h), 2, torch.float32), w13, None, norm_w, 1e-6,
                             swiglu_out=True, use_triton=use)  # fmt: skip
        assert out.shape == (m, 2 * inter)


# -- the table: format 2, format 1, errors ------------------------------------------------------


def test_format_2_entries_and_format_1_fallbacks() -> None:
    from execrt.kernels import triton_linear as tl_mod
    from execrt.kernels.triton_linear import NORM, PLAIN, SWIGLU_IN, SWIGLU_OUT, SkinnyTile, choose

    t = SkinnyTile(**TILE)
    v2 = parse(
        {
            "64,32": {"8": "cublas", "16": TILE},
            "64,32,norm": {"8": TILE | {"fuse_norm": False}, "16": "apart"},
            "64,32,swiglu_out": {"16": TILE | {"fuse_norm": False}},
            "32,64,swiglu_in": {"16": "cublas"},
            "32,64": {"16": TILE},
        }
    )
    assert choose(v2, 8, 64, 32, PLAIN) is None  # cuBLAS
    assert choose(v2, 8, 64, 32, NORM) == t  # a norm entry's tile runs the norm inside
    assert choose(v2, 9, 64, 32, NORM) is None  # "apart"
    assert choose(v2, 3, 64, 32, SWIGLU_OUT) == SkinnyTile(**TILE | {"fuse_norm": False})
    assert choose(v2, 17, 64, 32, SWIGLU_OUT) is None  # past the largest tuned M
    assert choose(v2, 4, 32, 64, SWIGLU_IN) is None and choose(v2, 4, 32, 64, PLAIN) == t
    assert choose(v2, 4, 32, 64, SWIGLU_OUT) is None  # tuned shape, no entry: no epilogue
    # Format 1: the plain tile's fuse_norm places the norm; SwiGLU in on the plain tile.
    v1 = parse({"64,32": {"1": TILE, "8": TILE | {"fuse_norm": False}, "16": "cublas"}}, fmt=1)
    assert choose(v1, 1, 64, 32, NORM) == t and choose(v1, 5, 64, 32, NORM) is None
    assert choose(v1, 1, 64, 32, SWIGLU_IN) == t and choose(v1, 9, 64, 32, SWIGLU_IN) is None
    assert choose(v1, 1, 64, 32, SWIGLU_OUT) is None
    assert tl_mod.tile_to_json(None, NORM) == "apart" and tl_mod.tile_to_json(None) == "cublas"
    with pytest.raises(ValueError, match="call variant 'gelu' unsupported"):
        choose(v1, 1, 64, 32, "gelu")


@pytest.mark.parametrize(
    "data,match",
    [
        ({"format": 3, "shapes": {}}, "format 3 unsupported"),
        ({"shapes": {"64,32,norm": {"1": "apart"}}}, r"key '64,32,norm' unsupported \(format 1"),
        ({"format": 2, "shapes": {"64,32,gelu": {"1": "apart"}}}, "key '64,32,gelu' unsupported"),
        ({"format": 2, "shapes": {"64,32": {"1": "fast"}}}, "'fast' is not a tile"),
    ],
)
def test_bad_tables_are_refused_clearly(tmp_path, data: dict, match: str) -> None:  # type: ignore[no-untyped-def]
    from execrt.kernels import triton_linear as tl_mod

    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        tl_mod.load_table(str(path))


# -- kernels per dense layer ------------------------------------------------------------------


def layer_kernels_0p6b(table, m: int) -> list[str]:  # type: ignore[no-untyped-def]
    from execrt.kernels.linear import dense_layer_kernels
    from execrt.kernels.triton_linear import choose

    s = SHAPE_06B
    return dense_layer_kernels(
        lambda mm, n, k, v: choose(table, mm, n, k, v),
        m,
        hidden=s["hidden"],
        qkv_out=s["q"] + 2 * s["kv"],
        attn_out=s["q"],
        intermediate=s["inter"],
    )


# The entries of the 2026-12-01 H200 table (format 1) for the 0.6B shape at M = 1 and 8.
SHIPPED_06B = {
    "4096,1024": {"1": TILE | {"block_n": 4, "use_dot": False}, "8": TILE | {"fuse_norm": False}},
    "1024,2048": {"1": TILE | {"block_n": 4, "use_dot": False}, "8": TILE},
    "6144,1024": {
        "1": TILE | {"block_n": 4, "use_dot": False, "fuse_norm": False},
        "8": TILE | {"fuse_norm": False},
    },
    "1024,3072": {"1": TILE | {"block_n": 4, "use_dot": False}, "8": "cublas"},
}


def test_layer_kernels_reproduce_the_measured_profile_of_the_format_1_table() -> None:
    """``decode-step-20261202-164753.json``: per 0.6B layer at bs 1, 4 skinny GEMMs and one
    norm; at bs 8, 3 skinny GEMMs, 2 norms, ``silu_and_mul`` and cuBLAS for down."""
    table = parse(SHIPPED_06B, fmt=1)
    assert layer_kernels_0p6b(table, 1) == [
        "skinny[norm](qkv)", "skinny(o)", "norm", "skinny(gate_up)", "skinny[swiglu_in](down)",
    ]  # fmt: skip
    assert layer_kernels_0p6b(table, 8) == [
        "norm", "skinny(qkv)", "skinny(o)", "norm", "skinny(gate_up)", "silu_and_mul",
        "cublas(down)",
    ]  # fmt: skip


@pytest.mark.parametrize("m", range(1, 17))
def test_at_most_four_gemm_side_kernels_per_layer_when_the_fused_variants_win(m: int) -> None:
    """A format 2 table whose fused variants won: norm + q/k/v, o, norm + gate/up + SwiGLU,
    down; the layer is these 4 + q/k norm-RoPE + attention (2 kernels with Triton's split
    decode) = 7 (docs/kernels.md)."""
    s = SHAPE_06B
    qkv, gu = f"{s['q'] + 2 * s['kv']},{s['hidden']}", f"{2 * s['inter']},{s['hidden']}"
    every = {str(mm): TILE for mm in (1, 2, 4, 8, 16)}
    table = parse(
        {
            f"{qkv},norm": every,
            f"{s['hidden']},{s['q']}": every,
            f"{gu},swiglu_out": every,
            f"{s['hidden']},{s['inter']}": every,
        }
    )
    kernels = layer_kernels_0p6b(table, m)
    assert kernels == [
        "skinny[norm](qkv)", "skinny(o)", "skinny[norm+swiglu_out](gate_up)", "skinny(down)",
    ]  # fmt: skip
    assert len(kernels) + 1 + 2 <= 7


@pytest.mark.parametrize("m", [1, 8])
def test_layer_kernels_match_what_the_dispatch_launches(
    monkeypatch: pytest.MonkeyPatch, m: int
) -> None:
    """``dense_layer_kernels`` against the kernels ``norm_linear`` / ``linear`` / ``MLP.down``
    really launch (spied), for the format 1 table and a format 2 one, on a small layer."""
    from execrt.kernels import triton_linear as tl_mod
    from execrt.kernels.linear import dense_layer_kernels
    from execrt.models.layers import MLP

    h, q, kv, inter = 32, 64, 16, 48
    launched: list[str] = []
    real_launch, real_f = tl_mod.launch, linear_mod.F

    def spy_launch(x, w, b, tile, *, swiglu=False, swiglu_out=False, norm=None, out=None):  # type: ignore[no-untyped-def]
        tag = "+".join(n for n, on in (("norm", norm), ("swiglu_in", swiglu),
                                       ("swiglu_out", swiglu_out)) if on)  # fmt: skip
        launched.append(f"skinny[{tag}]" if tag else "skinny")
        return real_launch(x, w, b, tile, swiglu=swiglu, swiglu_out=swiglu_out, norm=norm, out=out)

    def spy(name, fn):  # type: ignore[no-untyped-def]
        def wrapped(*a, **kw):  # type: ignore[no-untyped-def]
            launched.append(name)
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(tl_mod, "launch", spy_launch)
    monkeypatch.setattr(linear_mod, "F", types.SimpleNamespace(linear=spy("cublas", real_f.linear)))
    for name in ("silu_and_mul", "rmsnorm", "fused_add_rmsnorm"):
        monkeypatch.setattr(
            linear_mod, name, spy("silu_and_mul" if name == "silu_and_mul" else "norm",
                                  getattr(linear_mod, name))
        )  # fmt: skip
    v1 = {
        f"{q + 2 * kv},{h}": {"8": TILE | {"fuse_norm": False}, "1": TILE},
        f"{h},{q}": {"16": TILE},
        f"{2 * inter},{h}": {"1": TILE | {"fuse_norm": False}, "8": TILE},
        f"{h},{inter}": {"1": TILE, "8": "cublas"},
    }
    v2 = {
        f"{q + 2 * kv},{h},norm": {"16": TILE},
        f"{h},{q}": {"16": "cublas"},
        f"{2 * inter},{h},swiglu_out": {"1": TILE | {"fuse_norm": False}, "16": TILE},
        f"{h},{inter}": {"16": TILE},
    }
    for shapes, fmt in ((v1, 1), (v2, 2)):
        install(monkeypatch, shapes, fmt)
        pick = functools.partial(tl_mod.pick_tile, dtype=None, device=None)
        expected = [
            name.split("(")[0]
            for name in dense_layer_kernels(
                lambda mm, n, k, v, pick=pick: pick(mm, n, k, v=v),
                m,
                hidden=h,
                qkv_out=q + 2 * kv,
                attn_out=q,
                intermediate=inter,
            )  # fmt: skip
        ]
        launched.clear()
        f16 = torch.float16
        wqkv, wo = rand((q + 2 * kv, h), 1, f16, h**-0.5), rand((h, q), 2, f16, q**-0.5)
        mlp = MLP(h, inter).to(DEVICE).to(f16)
        mlp.down_proj.fused = True
        norm_w = torch.ones(h, dtype=f16, device=DEVICE)
        res, delta = rand((m, h), 3, f16), rand((m, h), 4, f16)
        with torch.no_grad():
            _, res = norm_linear(delta, wqkv, None, norm_w, 1e-6, residual=res, use_triton=True)
            a = linear(rand((m, q), 5, f16), wo, use_triton=True)
            gu, res = norm_linear(a, mlp.gate_up_proj.weight, None, norm_w, 1e-6, residual=res,
                                  swiglu_out=True, use_triton=True)  # fmt: skip
            mlp.down(gu)
        assert launched == expected, (fmt, m)


@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 16])
def test_swiglu_out_bf16_on_gpu_and_graph_replay_is_bitwise(m: int) -> None:
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch

    h, inter = SHAPE_06B["hidden"], SHAPE_06B["inter"]
    delta, residual = rand((m, h), 1, torch.bfloat16), rand((m, h), 2, torch.bfloat16)
    w13 = rand((2 * inter, h), 3, torch.bfloat16, h**-0.5)
    norm_w = (torch.rand(h, generator=gen(4)) + 0.5).to(torch.bfloat16).to(DEVICE)
    new_res = torch.empty_like(delta)
    tile = SkinnyTile(4, 1024) if m == 1 else SkinnyTile(64, 128, use_dot=True)

    def run() -> list[torch.Tensor]:
        nin = NormIn(norm_w, 1e-6, residual, new_res)
        return [launch(delta, w13, None, tile, swiglu_out=True, norm=nin), new_res]

    act = run()[0]
    assert max_rel(act, act_oracle(delta, w13, None, norm_w, residual)[0]) <= 1.6e-2
    replay_matches_eager(
        run, [delta, residual], [torch.randn_like(delta), torch.randn_like(residual)]
    )


# -- wide decode batches: every row of a large batch in one tensor-core program ----------------

WIDE_DTYPE = torch.float16 if DEVICE.type == "cpu" else torch.bfloat16  # interpreter: no bf16 dot
WIDE_ROWS = [17, 40, 130]  # BLOCK_M 32, 64, 256: padded rows never stored


@pytest.mark.parametrize("m", WIDE_ROWS)
@pytest.mark.parametrize(
    "case", ["plain", "swiglu_in", "norm", "norm_late", "swiglu_out", "split", "split_norm"]
)
def test_wide_batches_match_the_oracle_in_every_variant(m: int, case: str) -> None:
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, block_m_for, launch

    assert block_m_for(m, True) in (32, 64, 256)
    n, k, dtype = 37, 200, WIDE_DTYPE  # N and K not multiples of any block
    split = 3 if case.startswith("split") else 1
    tile = SkinnyTile(32, 32, use_dot=True, split_k=split, late_norm=case == "norm_late")
    x = rand((m, 2 * k if case == "swiglu_in" else k), m, dtype)
    w = rand(((2 if case == "swiglu_out" else 1) * n, k), m + 1, dtype, k**-0.5)
    b = rand((w.shape[0],), m + 2, dtype)
    if case in ("plain", "split", "swiglu_in"):
        out = launch(x, w, b, tile, swiglu=case == "swiglu_in")
        xin = x
        if case == "swiglu_in":
            gate, up = x[:, :k].double(), x[:, k:].double()
            xin = (gate / (1.0 + torch.exp(-gate)) * up).to(dtype)
        expected = xin.double() @ w.double().T + b.double()
        assert out.shape == (m, n) and max_rel(out, expected) <= bound(dtype)
        return
    residual = rand((m, k), m + 3, dtype, 4.0)
    norm_w = (torch.rand(k, generator=gen(m)) + 0.5).to(dtype).to(DEVICE)
    new_res = torch.full_like(x, float("nan"))
    nin = NormIn(norm_w, 1e-6, residual, new_res)
    out = launch(x, w, b, tile, swiglu_out=case == "swiglu_out", norm=nin)
    if case == "swiglu_out":
        expected, expected_res = act_oracle(x, w, b, norm_w, residual)
    else:
        from execrt.kernels.norm import fused_add_rmsnorm_torch

        normed, expected_res = fused_add_rmsnorm_torch(x, residual, norm_w, 1e-6)
        expected = normed.double() @ w.double().T + b.double()
    assert out.shape == (m, n) and max_rel(out, expected) <= bound(dtype)
    assert torch.equal(new_res, expected_res)


def test_wide_batches_take_tensor_core_tiles_from_a_table_only() -> None:
    from execrt.kernels.triton_linear import (
        CUDA_CORE_ROWS,
        SkinnyTile,
        choose,
        default_tile,
        launch,
    )

    m = CUDA_CORE_ROWS + 1
    x, w = rand((m, 64), 1, WIDE_DTYPE), rand((32, 64), 2, WIDE_DTYPE)
    with pytest.raises(ValueError, match=r"uses the CUDA cores: at most 16 rows, got 17"):
        launch(x, w, None, SkinnyTile(block_n=4, block_k=32))
    # untuned (and under the interpreter): cuBLAS past the CUDA-core rows; the kernel at one
    # row (on a GPU untuned shapes take it at one row only)
    assert default_tile(m, 32, 64) is None and default_tile(1, 32, 64) is not None
    wide = SkinnyTile(32, 64, use_dot=True, num_warps=8)
    table = {(32, 64, ""): {16: SkinnyTile(4, 64), 128: wide}}
    assert choose(table, 100, 32, 64) == wide and choose(table, 129, 32, 64) is None
    torch.testing.assert_close(linear(x, w, use_triton=True), x @ w.T)  # F.linear's answer


@needs_cuda
@pytest.mark.parametrize("m", [64, 256])
def test_wide_batches_on_gpu_at_the_06b_shape_and_graph_replay_is_bitwise(m: int) -> None:
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch

    h, inter = SHAPE_06B["hidden"], SHAPE_06B["inter"]
    x, residual = rand((m, h), 1, torch.bfloat16), rand((m, h), 2, torch.bfloat16, 4.0)
    w13 = rand((2 * inter, h), 3, torch.bfloat16, h**-0.5)
    w2 = rand((h, inter), 4, torch.bfloat16, inter**-0.5)
    norm_w = (torch.rand(h, generator=gen(5)) + 0.5).to(torch.bfloat16).to(DEVICE)
    new_res = torch.empty_like(x)
    up_tile = SkinnyTile(64, 64, use_dot=True, num_warps=8, num_stages=3, late_norm=True)
    down_tile = SkinnyTile(32, 64, use_dot=True, num_warps=8, num_stages=3, split_k=4)

    def chain() -> list[torch.Tensor]:
        nin = NormIn(norm_w, 1e-6, residual, new_res)
        act = launch(x, w13, None, up_tile, swiglu_out=True, norm=nin)
        return [act, launch(act, w2, None, down_tile)]

    act, out = chain()
    expected, expected_res = act_oracle(x, w13, None, norm_w, residual)
    assert max_rel(act, expected) <= 1.6e-2 and torch.equal(new_res, expected_res)
    assert max_rel(out, act.double() @ w2.double().T) <= 8e-3
    fresh = [torch.randn_like(x), torch.randn_like(residual)]
    replay_matches_eager(chain, [x, residual], fresh)
