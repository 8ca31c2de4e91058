"""The skinny GEMM's preload (``EXECRT_PDL_PRELOAD``): the first weight tile loaded before the
PDL wait, its K step run from those registers. The arithmetic is the loop's own, so every
variant gives the same bits with it and without it (the new residual stream included), on the
interpreter and compiled; where it is read, a bad value is refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from execrt.core import envs
from execrt.core.errors import ConfigError
from execrt.kernels import _triton
from execrt.kernels.triton_linear import NormIn, SkinnyTile, launch
from tests.kernels.helpers import DEVICE, needs_cuda


def rand(shape: tuple[int, ...], seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# (id, tile, rows, K, variant): K 200 is not a multiple of any block_k (masked tiles); 256 is.
CASES = [
    ("cuda-cores", dict(block_n=4, block_k=64), 1, 256, "plain"),
    ("one-step", dict(block_n=4, block_k=256), 1, 256, "plain"),
    ("uneven-k-bias", dict(block_n=4, block_k=64), 3, 200, "bias"),
    ("swiglu-in", dict(block_n=4, block_k=32), 2, 128, "swiglu"),
    ("swiglu-out", dict(block_n=16, block_k=32, use_dot=True), 5, 200, "swiglu_out"),
    ("norm", dict(block_n=4, block_k=64), 1, 256, "norm"),
    ("norm-add", dict(block_n=16, block_k=64, use_dot=True), 8, 200, "add"),
    ("late-norm-add", dict(block_n=4, block_k=64, late_norm=True), 1, 256, "add"),
    ("late-norm-swiglu-out", dict(block_n=4, block_k=32, late_norm=True), 3, 200, "add_swiglu_out"),
    ("split-k", dict(block_n=16, block_k=32, use_dot=True, split_k=4), 8, 256, "plain"),
    (
        "split-k-swiglu-out",
        dict(block_n=16, block_k=32, use_dot=True, split_k=3),
        4,
        200,
        "swiglu_out",
    ),
]


def _run(tile: SkinnyTile, m: int, k: int, variant: str, dtype: torch.dtype, preload: bool):
    n = 37  # not a multiple of any block_n
    swiglu_out = variant in ("swiglu_out", "add_swiglu_out")
    swiglu = variant == "swiglu"
    x = rand((m, 2 * k if swiglu else k), 1, dtype)
    w = rand(((2 if swiglu_out else 1) * n, k), 2, dtype, k**-0.5)
    bias = rand(((2 if swiglu_out else 1) * n,), 3, dtype) if variant == "bias" else None
    norm, new_res = None, None
    if variant in ("norm", "add", "add_swiglu_out"):
        norm_w = (torch.rand(k, generator=torch.Generator().manual_seed(4)) + 0.5).to(dtype)
        residual = rand((m, k), 5, dtype, 4.0) if variant != "norm" else None
        new_res = torch.full_like(x, float("nan")) if residual is not None else None
        norm = NormIn(norm_w.to(DEVICE), 1e-6, residual, new_res)
    out = launch(x if not swiglu else x.view(m, 2 * k), w, bias, tile, swiglu=swiglu,
                 swiglu_out=swiglu_out, norm=norm, preload=preload)  # fmt: skip
    return out, new_res


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("tile", "m", "k", "variant"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_preload_gives_the_same_bits(
    tile: dict, m: int, k: int, variant: str, dtype: torch.dtype
) -> None:
    t = SkinnyTile(**tile)
    off, res_off = _run(t, m, k, variant, dtype, preload=False)
    on, res_on = _run(t, m, k, variant, dtype, preload=True)
    assert torch.isfinite(off.float()).all()
    assert torch.equal(on, off)
    if res_off is not None:
        assert torch.isfinite(res_off.float()).all() and torch.equal(res_on, res_off)


@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_preload_under_pdl_in_a_graph_equals_eager_without_it(m: int) -> None:
    """Compiled with PDL, replayed from a CUDA graph behind a kernel that writes the input:
    the preload must not read the activations early (same bits as eager without it)."""
    k, n = 1024, 3072
    tile = SkinnyTile(block_n=4, block_k=1024) if m == 1 else SkinnyTile(32, 256, use_dot=True)
    x = rand((m, k), 6, torch.bfloat16)
    w = rand((n, k), 7, torch.bfloat16, k**-0.5)
    src = rand((m, k), 8, torch.bfloat16)
    expected = launch(src, w, None, tile, preload=False)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    graph = torch.cuda.CUDAGraph()
    x.zero_()
    with torch.cuda.graph(graph):
        x.copy_(src)  # the grid ahead writes the activations
        launch(x, w, None, tile, out=out, preload=True)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_the_switch_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    monkeypatch.setattr(_triton, "use_pdl", lambda device: device.type == "cuda")
    monkeypatch.delenv(envs.PDL_PRELOAD, raising=False)
    assert _triton.pdl_preload(cuda, 1) is True  # unset: one-row launches only
    assert _triton.pdl_preload(cuda, 2) is False
    assert _triton.pdl_preload(torch.device("cpu"), 1) is False  # no PDL, nothing to overlap
    monkeypatch.setenv(envs.PDL_PRELOAD, "1")
    assert _triton.pdl_preload(cuda, 8) is True
    monkeypatch.setenv(envs.PDL_PRELOAD, "off")
    assert _triton.pdl_preload(cuda, 1) is False
    monkeypatch.setenv(envs.PDL_PRELOAD, "sometimes")
    with pytest.raises(ConfigError, match="EXECRT_PDL_PRELOAD='sometimes'"):
        _triton.check_kernel_switches()
    assert envs.PDL_PRELOAD in envs.KERNEL_SWITCHES and envs.PDL_PRELOAD in envs.NON_CONFIG
