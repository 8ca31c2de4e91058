"""Programmatic dependent launch: when it is asked for, and that it changes no result."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from execrt.core import envs
from execrt.core.errors import ConfigError
from execrt.kernels import _triton
from tests.kernels.helpers import DEVICE, needs_cuda


def test_never_on_cpu_or_under_the_interpreter() -> None:
    assert not _triton.use_pdl(torch.device("cpu"))
    assert _triton.pdl_kwargs(torch.device("cpu")) == {"PDL": False}
    assert not _triton.pdl_prefetch(torch.device("cpu"), "linear")


def test_the_switch_is_read_at_each_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_triton, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(_triton, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(_triton, "_cuda_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda = torch.device("cuda", 0)
    assert _triton.use_pdl(cuda)
    assert _triton.pdl_kwargs(cuda) == {"PDL": True, "launch_pdl": True}
    assert not _triton.pdl_prefetch(cuda, "linear")  # off unless asked for
    monkeypatch.setenv(envs.PDL_PREFETCH, "1")
    assert _triton.pdl_prefetch(cuda, "linear") and _triton.pdl_prefetch(cuda, "decode")
    monkeypatch.setenv(envs.PDL_PREFETCH, " Decode")  # one kernel, by name
    assert _triton.pdl_prefetch(cuda, "decode") and not _triton.pdl_prefetch(cuda, "linear")
    monkeypatch.setenv(envs.PDL_PREFETCH, "linear,decode")
    assert _triton.pdl_prefetch(cuda, "linear") and _triton.pdl_prefetch(cuda, "decode")
    with pytest.raises(ValueError, match="'lm_head' is not one of"):
        _triton.pdl_prefetch(cuda, "lm_head")
    monkeypatch.setenv(envs.PDL_PREFETCH, "linear,lienar")  # a typo is named, not ignored
    typo = r"EXECRT_PDL_PREFETCH='linear,lienar': \['lienar'\] unknown"
    with pytest.raises(ConfigError, match=typo):
        _triton.pdl_prefetch(cuda, "linear")
    monkeypatch.setenv(envs.PDL_PREFETCH, "linear,decode")
    monkeypatch.setenv(envs.PDL_PREFETCH_ROWS, "1")  # the bs-1 launches only
    assert _triton.pdl_prefetch(cuda, "linear", 1) and not _triton.pdl_prefetch(cuda, "linear", 2)
    assert not _triton.pdl_prefetch(cuda, "decode", 8)
    monkeypatch.setenv(envs.PDL_PREFETCH_ROWS, "8")
    assert _triton.pdl_prefetch(cuda, "decode", 8) and not _triton.pdl_prefetch(cuda, "decode", 9)
    for bad in ("0", "-1", "one", "1.5"):
        monkeypatch.setenv(envs.PDL_PREFETCH_ROWS, bad)
        with pytest.raises(ConfigError, match=f"EXECRT_PDL_PREFETCH_ROWS='{bad}' unsupported"):
            _triton.pdl_prefetch(cuda, "linear", 1)
    monkeypatch.delenv(envs.PDL_PREFETCH_ROWS)
    assert _triton.pdl_prefetch(cuda, "linear", 4096)  # unset: any
    monkeypatch.setenv(envs.DISABLE_PDL, "1")
    assert not _triton.use_pdl(cuda)
    assert not _triton.pdl_prefetch(cuda, "linear")  # the prefetch comes with PDL only
    monkeypatch.delenv(envs.DISABLE_PDL)
    monkeypatch.setattr(_triton, "_cuda_capability", lambda index: (8, 0))  # before Hopper
    assert not _triton.use_pdl(cuda)


def test_the_variables_are_not_config_keys() -> None:
    switches = {envs.DISABLE_PDL: "1", envs.PDL_PREFETCH: "1", envs.FP8_WORDS_OPAQUE: "0"}
    assert envs.config_overrides(switches) == {}
    assert envs.kernel_switches(switches) == switches  # what a benchmark record names


def test_the_fp8_words_identity_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _triton.fp8_words_opaque()
    for off in ("0", "false", " Off "):
        monkeypatch.setenv(envs.FP8_WORDS_OPAQUE, off)
        assert not _triton.fp8_words_opaque()
    for on in ("1", " Yes "):
        monkeypatch.setenv(envs.FP8_WORDS_OPAQUE, on)
        assert _triton.fp8_words_opaque()
    monkeypatch.setenv(envs.FP8_WORDS_OPAQUE, "sometimes")
    with pytest.raises(ConfigError, match=r"EXECRT_FP8_WORDS_OPAQUE='sometimes' unsupported"):
        _triton.fp8_words_opaque()


@needs_cuda
def test_a_decode_layer_chain_gives_the_same_bits_with_and_without_pdl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """norm + projection, SwiGLU + projection, back to back and graph-replayed: PDL only moves
    launches earlier, every kernel still waits for the one ahead before touching memory (the
    weight prefetch ahead of the wait reads what no kernel writes)."""
    from execrt.kernels.linear import linear, norm_linear

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    h = torch.randn(1, 1024, generator=gen, device=DEVICE).to(torch.bfloat16)
    norm_w = torch.rand(1024, generator=gen, device=DEVICE).to(torch.bfloat16) + 0.5
    w1 = (torch.randn(6144, 1024, generator=gen, device=DEVICE) * 0.03).to(torch.bfloat16)
    w2 = (torch.randn(1024, 3072, generator=gen, device=DEVICE) * 0.03).to(torch.bfloat16)

    def chain() -> torch.Tensor:
        x = h
        for _ in range(4):
            gate_up, res = norm_linear(x, w1, None, norm_w, 1e-6, residual=h, use_triton=True)
            x = linear(gate_up, w2, swiglu=True, use_triton=True) + res
        return x

    results = {}
    for disabled, prefetch in (("1", "0"), ("0", "0"), ("0", "1")):
        monkeypatch.setenv(envs.DISABLE_PDL, disabled)
        monkeypatch.setenv(envs.PDL_PREFETCH, prefetch)
        eager = chain()
        graph = torch.cuda.CUDAGraph()
        chain()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = chain()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        results[disabled + prefetch] = eager
    assert torch.equal(results["00"], results["10"])  # PDL
    assert torch.equal(results["01"], results["10"])  # PDL with the weight prefetch


def test_the_weight_prefetch_is_capped_per_program() -> None:
    """What a program prefetches covers its first DRAM round trip, not its slice: resident
    programs of a wide tile asking for whole slices would overflow L2 and evict their own
    lines (the LM head's 128-row tile holds 256 KB per 1024 columns)."""
    from execrt.kernels.triton_linear import PREFETCH_BYTES, SkinnyTile, prefetch_columns

    narrow = SkinnyTile(block_n=4, block_k=1024)  # the bs-1 tiles
    assert prefetch_columns(narrow, 2) == 4096  # the 8B shape's 4096-wide rows in full
    assert prefetch_columns(narrow, 2, swiglu_out=True) == 2048  # gate and up rows
    wide = SkinnyTile(block_n=128, block_k=256, use_dot=True)
    assert prefetch_columns(wide, 2) == 256  # one block_k step at least
    for tile in (narrow, wide, SkinnyTile(block_n=32, block_k=128, use_dot=True)):
        for size in (1, 2, 4):
            cols = prefetch_columns(tile, size)
            assert cols % tile.block_k == 0
            step = tile.block_n * tile.block_k * size
            assert tile.block_n * cols * size <= max(PREFETCH_BYTES, step)
