"""Skinny GEMM (decode-size linear, optional SwiGLU prologue): Triton vs an fp64 oracle."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from execrt.kernels import linear as linear_mod
from execrt.kernels.linear import MAX_SKINNY_ROWS, linear, linear_torch, skinny_eligible
from tests.kernels.helpers import DEVICE, max_rel, needs_cuda, replay_matches_eager

# Every accumulation path of the kernel: CUDA-core lanes for one row (2-D accumulator) and for
# several rows (3-D), tensor cores; narrow and wide weight tiles; K steps that do and do not
# divide K.
TILES = [
    dict(block_n=4, block_k=32),
    dict(block_n=16, block_k=64),
    dict(block_n=16, block_k=32, use_dot=True),
    dict(block_n=32, block_k=64, use_dot=True),
]
# split-K: 3 slices of 3 K steps (7 in all: the last slice short and ragged)
SPLIT_TILE = dict(block_n=16, block_k=32, use_dot=True, split_k=3)


def oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, swiglu: bool) -> torch.Tensor:
    """fp64 math; with swiglu the activations are rounded to the dtype first, as the kernel
    (and silu_and_mul) round them."""
    if swiglu:
        k = w.shape[1]
        gate, up = x[:, :k].double(), x[:, k:].double()
        x = (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype)
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


def make(m: int, n: int, k: int, dtype: torch.dtype, swiglu: bool, bias: bool, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k if swiglu else k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, w, b


def every_tile_dtype_and_rows(test):  # type: ignore[no-untyped-def]
    for name, values in (("m", [1, 3, 16]), ("dtype", [torch.float32, torch.float16])):
        test = pytest.mark.parametrize(name, values)(test)
    ids = lambda t: "-".join(f"{v}" for v in t.values())  # noqa: E731
    return pytest.mark.parametrize("tile", TILES, ids=ids)(test)


def bound(dtype: torch.dtype) -> float:
    # fp32: summation order only; 16-bit: one rounding of the output (and of the SwiGLU input).
    return 1e-5 if dtype == torch.float32 else 4e-3


@every_tile_dtype_and_rows
@pytest.mark.parametrize("swiglu", [False, True])
def test_every_tile_matches_the_oracle(
    tile: dict, dtype: torch.dtype, m: int, swiglu: bool
) -> None:
    from execrt.kernels.triton_linear import SkinnyTile, launch

    n, k = 37, 200  # N not a multiple of any block_n, K not of any block_k
    x, w, b = make(m, n, k, dtype, swiglu, bias=True, seed=m * 10 + len(tile))
    out = launch(x, w, b, SkinnyTile(**tile), swiglu=swiglu)
    assert out.shape == (m, n) and out.dtype == dtype
    assert max_rel(out, oracle(x, w, b, swiglu)) <= bound(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (2, 50, 72), (5, 130, 64), (16, 16, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_picks_the_kernel_and_matches(
    dtype: torch.dtype, m: int, n: int, k: int, bias: bool
) -> None:
    x, w, b = make(m, n, k, dtype, False, bias, seed=n + k)
    assert skinny_eligible(x, w)
    out = linear(x, w, b, use_triton=True)
    assert max_rel(out, oracle(x, w, b, False)) <= bound(dtype)
    assert max_rel(out, linear_torch(x, w, b)) <= bound(dtype)


def test_leading_dims_and_swiglu_through_linear() -> None:
    x, w, b = make(3, 24, 40, torch.float32, True, True, seed=5)
    out = linear(x.view(3, 1, 80), w, b, swiglu=True, use_triton=True)
    assert out.shape == (3, 1, 24)
    assert max_rel(out.view(3, 24), oracle(x, w, b, True)) <= 1e-5


def test_calls_the_kernel_does_not_take_run_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    from execrt.kernels import triton_linear

    calls: list[tuple[int, ...]] = []
    real = triton_linear.skinny_linear

    def spy(x, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(tuple(x.shape))
        return real(x, *a, **kw)

    monkeypatch.setattr(triton_linear, "skinny_linear", spy)
    big, w, _ = make(MAX_SKINNY_ROWS + 1, 16, 32, torch.float32, False, False, seed=1)
    assert not skinny_eligible(big, w)
    torch.testing.assert_close(linear(big, w, use_triton=True), linear_torch(big, w))
    strided_w = torch.randn(32, 16, device=DEVICE).T  # [16, 32], not contiguous
    small = big[:2]
    assert not skinny_eligible(small, strided_w)
    linear(small, strided_w, use_triton=True)
    assert calls == []
    linear(small, w, use_triton=True)
    assert calls == [(2, 32)]
    # Off, nothing reaches the kernel module either (and SwiGLU is the reference).
    gate_up, w2, _ = make(2, 8, 16, torch.float32, True, False, seed=2)
    torch.testing.assert_close(
        linear(gate_up, w2, swiglu=True), linear_torch(gate_up, w2, swiglu=True)
    )
    assert calls == [(2, 32)]


def test_swiglu_width_is_checked() -> None:
    w = torch.ones(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"linear: swiglu input \(2, 8\) must be \[\.\.\., 2K\]"):
        linear(torch.ones(2, 8, device=DEVICE), w, swiglu=True, use_triton=True)


def test_tile_records_refuse_bad_values() -> None:
    from execrt.kernels.triton_linear import SkinnyTile

    with pytest.raises(ValueError, match="block_n 12 unsupported"):
        SkinnyTile(block_n=12, block_k=64)
    with pytest.raises(ValueError, match="needs block_n and block_k >= 16"):
        SkinnyTile(block_n=8, block_k=64, use_dot=True)
    with pytest.raises(ValueError, match="num_warps"):
        SkinnyTile(block_n=8, block_k=64, num_warps=3)


def test_untuned_shapes_take_the_kernel_at_one_row_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from execrt.kernels import triton_linear as tl_mod

    monkeypatch.setattr(tl_mod, "interpreter_enabled", lambda: False)
    for n, k in ((1024, 2048), (151936, 4096), (7, 24), (960, 576)):
        tile = tl_mod.default_tile(1, n, k)
        assert tile is not None and not tile.use_dot and tile.block_n == 4
        assert tile.block_k >= min(k, 64) and tile.block_k <= 1024
        for m in (2, 4, 16):
            assert tl_mod.default_tile(m, n, k) is None  # cuBLAS unless tuned


def test_tuned_table_lookup(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from execrt.kernels import triton_linear as tl_mod

    table = {
        "shapes": {
            "1024,2048": {
                "1": {
                    "block_n": 8,
                    "block_k": 512,
                    "use_dot": False,
                    "num_warps": 4,
                    "num_stages": 3,
                },
                "8": "cublas",
            }
        }
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    loaded = tl_mod.load_table(str(path))
    assert loaded is not None
    by_m = loaded[(1024, 2048, tl_mod.PLAIN)]
    assert by_m[1] == tl_mod.SkinnyTile(8, 512, False, 4, 3) and by_m[8] is None
    # The smallest tuned M at or above the call's: 1 -> 1, 2..8 -> 8 (cuBLAS), past 8: cuBLAS.
    assert tl_mod.lookup(by_m, 1) == by_m[1]
    assert tl_mod.lookup(by_m, 2) is None and tl_mod.lookup(by_m, 9) is None
    by_m = {1: by_m[1], 4: tl_mod.SkinnyTile(4, 1024), 16: tl_mod.SkinnyTile(32, 128, True)}
    assert tl_mod.lookup(by_m, 3) == by_m[4] and tl_mod.lookup(by_m, 5) == by_m[16]
    assert tl_mod.load_table(str(tmp_path / "absent.json")) is None
    assert tl_mod.tile_to_json(None) == "cublas"
    # No table on CPU: the default (interpreter) tile.
    assert tl_mod.pick_tile(1, 1024, 2048, torch.float32, torch.device("cpu")) is not None


def test_a_cublas_verdict_falls_back_to_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    from execrt.kernels import triton_linear as tl_mod

    monkeypatch.setattr(tl_mod, "pick_tile", lambda *a: None)
    x, w, b = make(1, 16, 32, torch.float32, True, True, seed=3)
    assert tl_mod.skinny_linear(x, w, b, swiglu=True) is None
    torch.testing.assert_close(
        linear(x, w, b, swiglu=True, use_triton=True), linear_torch(x, w, b, swiglu=True)
    )
    assert linear_mod.MAX_SKINNY_ROWS == MAX_SKINNY_ROWS


@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("swiglu", [False, True])
def test_bf16_on_gpu_and_graph_replay_is_bitwise(m: int, swiglu: bool) -> None:
    n, k = 1024, 3072  # a small model's down projection
    x, w, b = make(m, n, k, torch.bfloat16, swiglu, bias=True, seed=m)
    out = linear(x, w, b, swiglu=swiglu, use_triton=True)
    assert max_rel(out, oracle(x, w, b, swiglu)) <= 8e-3
    fresh = torch.randn_like(x)
    replay_matches_eager(lambda: [linear(x, w, b, swiglu=swiglu, use_triton=True)], [x], [fresh])


def test_shipped_tables_load_and_keep_cuda_core_tiles_to_few_rows() -> None:
    import glob
    import os

    from execrt.kernels import triton_linear as tl_mod

    paths = glob.glob(os.path.join(tl_mod.CONFIG_DIR, "*.json"))
    assert any("NVIDIA_H200" in p for p in paths)
    for path in paths:
        table = tl_mod.load_table(path)
        assert table
        for (n, k, variant), by_m in table.items():
            assert n > 0 and k > 0 and by_m and variant in tl_mod.VARIANTS
            for m, tile in by_m.items():
                if tile is None or tile.use_dot:
                    continue
                # A CUDA-core tile holds BLOCK_M x BLOCK_N x BLOCK_K fp32 accumulators per
                # program (two sets with SwiGLU on the output): at most 8 rows, 128 per lane.
                sets = 2 if variant == tl_mod.SWIGLU_OUT else 1
                lanes = 32 * tile.num_warps
                per_lane = sets * tl_mod.block_m_for(m, False) * tile.block_n * tile.block_k / lanes
                assert m <= 8 and per_lane <= 128, (path, n, k, variant, m, tile)


def norm_oracle(x, residual, norm_w, eps, w, b):  # type: ignore[no-untyped-def]
    """The reference roundings of ``fused_add_rmsnorm`` (exact), then an fp64 product."""
    from execrt.kernels.norm import fused_add_rmsnorm_torch, rmsnorm_torch

    if residual is None:
        normed, new_residual = rmsnorm_torch(x, norm_w, eps), x
    else:
        normed, new_residual = fused_add_rmsnorm_torch(x, residual, norm_w, eps)
    return oracle(normed, w, b, False), new_residual


@every_tile_dtype_and_rows
@pytest.mark.parametrize("add", [False, True])
def test_norm_prologue_matches_the_oracle(
    tile: dict, dtype: torch.dtype, m: int, add: bool
) -> None:
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch

    n, k = 37, 200
    x, w, b = make(m, n, k, dtype, False, bias=True, seed=m + 7 * len(tile))
    residual = (torch.randn(m, k) * 4).to(dtype).to(DEVICE) if add else None
    norm_w = (torch.rand(k) + 0.5).to(dtype).to(DEVICE)
    new_residual = torch.full_like(x, float("nan")) if add else None
    norm = NormIn(norm_w, 1e-6, residual, new_residual)
    out = launch(x, w, b, SkinnyTile(**tile), norm=norm)
    expected, expected_residual = norm_oracle(x, residual, norm_w, 1e-6, w, b)
    assert max_rel(out, expected) <= bound(dtype)
    if add:
        assert new_residual is not None and torch.equal(new_residual, expected_residual)


@pytest.mark.parametrize("m", [1, 5, MAX_SKINNY_ROWS + 3])  # the last one: separate kernels
@pytest.mark.parametrize("add", [False, True])
def test_norm_linear_returns_the_new_residual(m: int, add: bool) -> None:
    from execrt.kernels.linear import norm_linear

    x, w, b = make(m, 24, 40, torch.float16, False, bias=False, seed=m)
    residual = torch.randn(m, 40).to(torch.float16).to(DEVICE) if add else None
    norm_w = (torch.rand(40) + 0.5).to(torch.float16).to(DEVICE)
    out, new_residual = norm_linear(x, w, b, norm_w, 1e-5, residual=residual, use_triton=True)
    expected, expected_residual = norm_oracle(x, residual, norm_w, 1e-5, w, b)
    assert out.shape == (m, 24) and max_rel(out, expected) <= 4e-3
    assert torch.equal(new_residual, expected_residual)
    if not add:
        assert new_residual is x
    ref, ref_residual = norm_linear(x, w, b, norm_w, 1e-5, residual=residual)  # torch path
    assert max_rel(out, ref) <= 4e-3 and torch.equal(ref_residual, expected_residual)


@needs_cuda
@pytest.mark.parametrize("m", [1, 4])
def test_norm_prologue_bf16_on_gpu_and_graph_replay_is_bitwise(m: int) -> None:
    from execrt.kernels.linear import norm_linear

    x, w, b = make(m, 4096, 1024, torch.bfloat16, False, bias=False, seed=m)
    residual = torch.randn(m, 1024, device=DEVICE).to(torch.bfloat16)
    norm_w = (torch.rand(1024, device=DEVICE) + 0.5).to(torch.bfloat16)
    out, new_residual = norm_linear(x, w, None, norm_w, 1e-6, residual=residual, use_triton=True)
    expected, expected_residual = norm_oracle(x, residual, norm_w, 1e-6, w, None)
    assert max_rel(out, expected) <= 8e-3 and torch.equal(new_residual, expected_residual)
    fresh = [torch.randn_like(x), torch.randn_like(residual)]
    replay_matches_eager(
        lambda: list(norm_linear(x, w, None, norm_w, 1e-6, residual=residual, use_triton=True)),
        [x, residual],
        fresh,
    )


@pytest.mark.parametrize(
    ("m", "dtype", "swiglu", "norm"),
    [
        (3, torch.float16, False, "add"),
        (16, torch.float32, True, "none"),
        (1, torch.float16, False, "norm"),
    ],
)
def test_split_k_matches_the_oracle(m: int, dtype: torch.dtype, swiglu: bool, norm: str) -> None:
    # Plain, SwiGLU on the input, the norm prologue with and without the residual add: each
    # slice reads its part of K (and of the norm weight / residual), slice (0, 0) alone
    # writes the new residual.
    from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch

    n, k = 37, 200
    x, w, b = make(m, n, k, dtype, swiglu, bias=True, seed=m + 31)
    tile = SkinnyTile(**SPLIT_TILE)
    if norm == "none":
        out = launch(x, w, b, tile, swiglu=swiglu)
        assert max_rel(out, oracle(x, w, b, swiglu)) <= bound(dtype)
        return
    residual = (torch.randn(m, k) * 4).to(dtype).to(DEVICE) if norm == "add" else None
    norm_w = (torch.rand(k) + 0.5).to(dtype).to(DEVICE)
    new_residual = torch.full_like(x, float("nan")) if residual is not None else None
    out = launch(x, w, b, tile, norm=NormIn(norm_w, 1e-6, residual, new_residual))
    expected, expected_residual = norm_oracle(x, residual, norm_w, 1e-6, w, b)
    assert max_rel(out, expected) <= bound(dtype)
    if new_residual is not None:
        assert torch.equal(new_residual, expected_residual)


def test_split_k_is_deterministic_resets_its_counters_and_caps_its_slices() -> None:
    from execrt.kernels import triton_linear as tl_mod
    from execrt.kernels.triton_linear import SkinnyTile, launch

    x, w, b = make(8, 70, 96, torch.float16, False, bias=True, seed=5)
    # 96 = 3 K steps of 32: split_k 8 runs 3 slices, no empty one
    tile = SkinnyTile(16, 32, use_dot=True, split_k=8)
    first = launch(x, w, b, tile)
    assert max_rel(first, oracle(x, w, b, False)) <= 4e-3
    for _ in range(3):
        assert torch.equal(launch(x, w, b, tile), first)
    _, counts = tl_mod.split_workspace(x.device, 0, 0)  # the one this stream used
    assert counts.eq(0).all()
    # One slice: the unsplit kernel; the sums differ only in order.
    whole = launch(x, w, b, SkinnyTile(16, 32, use_dot=True))
    assert max_rel(whole, first) <= 4e-3


def test_split_workspace_grows_and_keeps_what_graphs_may_hold() -> None:
    from execrt.kernels import _triton
    from execrt.kernels import triton_linear as tl_mod

    dev = torch.device(DEVICE)
    part, counts = tl_mod.split_workspace(dev, 10, 10)
    assert tl_mod.split_workspace(dev, 10, 10)[0] is part
    bigger, more = tl_mod.split_workspace(dev, part.numel() + 1, counts.numel() + 1)
    assert bigger.numel() > part.numel() and more.numel() > counts.numel() and more.eq(0).all()
    assert any(p is part for p in _triton._OUTGROWN)


def test_split_k_bounds_are_checked() -> None:
    from execrt.kernels.triton_linear import MAX_SPLIT_K, SkinnyTile

    with pytest.raises(ValueError, match=f"split_k 1..{MAX_SPLIT_K}"):
        SkinnyTile(16, 32, use_dot=True, split_k=0)
    with pytest.raises(ValueError, match=f"split_k 1..{MAX_SPLIT_K}"):
        SkinnyTile(16, 32, use_dot=True, split_k=MAX_SPLIT_K + 1)


@needs_cuda
@pytest.mark.parametrize("swiglu", [False, True])
def test_split_k_on_gpu_in_many_launches_and_graph_replay_is_bitwise(swiglu: bool) -> None:
    # The last slice to arrive sums in slice order: whatever the arrival order of 500
    # launches, the same bits; and a captured graph replays them.
    from execrt.kernels.triton_linear import SkinnyTile, launch

    x, w, b = make(8, 1024, 2048, torch.bfloat16, swiglu, bias=True, seed=9)
    tile = SkinnyTile(16, 128, use_dot=True, num_stages=3, split_k=4)
    first = launch(x, w, b, tile, swiglu=swiglu)
    assert max_rel(first, oracle(x, w, b, swiglu)) <= 8e-3
    outs = [launch(x, w, b, tile, swiglu=swiglu) for _ in range(500)]
    assert all(torch.equal(o, first) for o in outs)
    fresh = torch.randn_like(x)
    replay_matches_eager(lambda: [launch(x, w, b, tile, swiglu=swiglu)], [x], [fresh])


def test_a_tile_that_keeps_the_norm_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    from execrt.kernels import triton_linear as tl_mod
    from execrt.kernels.linear import norm_linear

    launches: list[bool] = []
    real = tl_mod.launch

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        launches.append(kw.get("norm") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(tl_mod, "launch", spy)
    monkeypatch.setattr(tl_mod, "pick_tile", lambda *a: tl_mod.SkinnyTile(16, 64, fuse_norm=False))
    x, w, _ = make(2, 24, 40, torch.float32, False, False, seed=4)
    residual = torch.randn(2, 40, device=DEVICE)
    norm_w = torch.rand(40, device=DEVICE) + 0.5
    out, new_res = norm_linear(x, w, None, norm_w, 1e-6, residual=residual, use_triton=True)
    expected, expected_res = norm_oracle(x, residual, norm_w, 1e-6, w, None)
    assert launches == [False]  # the norm ran by itself, the product on the same tile
    assert max_rel(out, expected) <= 1e-5 and torch.equal(new_res, expected_res)


@needs_cuda
def test_every_entry_of_this_gpus_shipped_table_matches_the_oracle() -> None:
    """Each (N, K, variant, M) of the running GPU's own shipped table (the tuned tiles, split
    K, late norms, cuBLAS and "apart" choices alike) through the public dispatch at its M,
    against the fp64 oracle: a table entry that picks a broken tile fails here, on the GPU that
    reads it (the tuner checks its candidates too, but tables are also edited by hand)."""
    import os

    from execrt.kernels import triton_linear as tl_mod
    from execrt.kernels._triton import tuned_table_name
    from execrt.kernels.linear import norm_linear

    name = tuned_table_name(torch.cuda.get_device_name(), torch.bfloat16)
    path = os.path.join(tl_mod.CONFIG_DIR, name)
    if not os.path.exists(path):
        pytest.skip(f"no shipped skinny-GEMM table for this GPU ({name})")
    table = tl_mod.load_table(path)
    assert table
    dtype, eps, checked = torch.bfloat16, 1e-6, 0
    for (n, k, variant), by_m in sorted(table.items()):
        # One weight, one batch of the largest M and one fp64 oracle per shape (a 151936-row
        # LM head is 5 GB in fp64); the rows are independent, so each M takes the first M.
        rows, seed = max(by_m), n + k
        swiglu_in = variant == tl_mod.SWIGLU_IN
        x, w, _ = make(rows, n, k, dtype, swiglu_in, bias=False, seed=seed)
        if variant in (tl_mod.NORM, tl_mod.SWIGLU_OUT):
            residual = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 4
            residual = residual.to(dtype).to(DEVICE)
            norm_w = torch.rand(k, generator=torch.Generator().manual_seed(seed)) + 0.5
            norm_w = norm_w.to(dtype).to(DEVICE)
            expected, expected_res = norm_oracle(x, residual, norm_w, eps, w, None)
            if variant == tl_mod.SWIGLU_OUT:  # silu(gate) * up, [M, N / 2], where fused
                gate, up = expected[:, : n // 2], expected[:, n // 2 :]
                gate, up = gate.to(dtype).double(), up.to(dtype).double()
                swiglu = gate / (1.0 + torch.exp(-gate)) * up
        else:
            expected = oracle(x, w, None, swiglu_in)
        for m in sorted(by_m):
            if variant in (tl_mod.NORM, tl_mod.SWIGLU_OUT):
                out, new_res = norm_linear(x[:m], w, None, norm_w, eps, residual=residual[:m],
                                           swiglu_out=variant == tl_mod.SWIGLU_OUT,
                                           use_triton=True)  # fmt: skip
                assert torch.equal(new_res, expected_res[:m]), (n, k, variant, m)
                want = (swiglu if out.shape[-1] != n else expected)[:m]
            else:
                out, want = linear(x[:m], w, swiglu=swiglu_in, use_triton=True), expected[:m]
            # late_norm tiles round (x + r) * g where the norm kernel rounds (x + r) / rms
            # first (docs/kernels.md): a few bf16 ulps more than one rounding.
            assert max_rel(out, want) <= 2e-2, (n, k, variant, m, by_m[m])
            checked += 1
    assert checked >= len(table)
