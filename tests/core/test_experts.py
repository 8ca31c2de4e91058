"""The capturable torch expert compute against the naive float64 MoE loop; no host sync."""

from __future__ import annotations

import pytest
import torch

from execrt.core.experts import grouped_mm_usable, run_experts, standard_experts
from execrt.core.interfaces import ExpertMajorDispatchOutput, StandardDispatchOutput
from execrt.testing.oracles import compare, moe_oracle
from tests.conftest import requires_cuda
from tests.kernels.moe_cases import ROUTINGS, expert_weights, routing

METHODS = ("grouped_mm", "dense")
H, I = 24, 16  # noqa: E741 - the intermediate size is I throughout the MoE code


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize(("t", "e", "k"), [(9, 5, 2), (1, 12, 3), (16, 3, 3)])
def test_standard_matches_oracle(method: str, name: str, t: int, e: int, k: int) -> None:
    ids, w = routing(name, t, e, k)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(t))
    w13, w2 = expert_weights(e, H, I, torch.float32)
    out = standard_experts(x, ids, w, w13, w2, method=method)  # type: ignore[arg-type]
    assert out.shape == (t, H) and out.dtype == x.dtype
    ref = moe_oracle(x, ids, w, w13, w2)
    if name == "all_nonlocal":
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert compare(out, ref).ok(1e-5), compare(out, ref)


@pytest.mark.parametrize("method", METHODS)
def test_standard_half_precision_and_zero_tokens(method: str) -> None:
    ids, w = routing("some_nonlocal", 11, 6, 2)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(3))
    w13, w2 = expert_weights(6, H, I, torch.float32)
    ref = moe_oracle(x, ids, w, w13, w2)
    for dtype in (torch.float16, torch.bfloat16):
        out = standard_experts(x.to(dtype), ids, w, w13.to(dtype), w2.to(dtype), method=method)  # type: ignore[arg-type]
        assert out.dtype == dtype and compare(out, ref).ok(2e-2), (dtype, compare(out, ref))
    empty = standard_experts(x[:0], ids[:0], w[:0], w13, w2, method=method)  # type: ignore[arg-type]
    assert empty.shape == (0, H)


def test_auto_uses_grouped_mm_on_cpu() -> None:
    x = torch.zeros(1, H)
    w13, w2 = expert_weights(2, H, I, torch.float32)
    assert grouped_mm_usable(x, w13, w2)
    assert not grouped_mm_usable(x.double(), w13.double(), w2.double())


@pytest.mark.parametrize(("h", "i", "dtype"), [(24, 30, torch.float32), (20, 16, torch.bfloat16)])
def test_auto_takes_the_dense_loop_where_rows_are_not_16_byte_multiples(
    h: int, i: int, dtype: torch.dtype
) -> None:
    # torch's grouped GEMM refuses such strides ("strides should be multiple of 16 bytes"):
    # an fp32 expert width of 30 loaded, then failed at the first prefill.
    ids, w = routing("some_nonlocal", 7, 4, 2)
    x = torch.randn(7, h, generator=torch.Generator().manual_seed(5))
    w13, w2 = expert_weights(4, h, i, torch.float32)
    assert not grouped_mm_usable(x.to(dtype), w13.to(dtype), w2.to(dtype))
    out = standard_experts(x.to(dtype), ids, w, w13.to(dtype), w2.to(dtype))
    ref = moe_oracle(x, ids, w, w13, w2)
    assert compare(out, ref).ok(1e-5 if dtype == torch.float32 else 2e-2), compare(out, ref)


def test_expert_major_counted_rows_ignore_poison() -> None:
    e, rows = 4, 5
    counts = torch.tensor([0, 5, 2, 1], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(e, rows, H, generator=gen)
    for expert in range(e):
        x[expert, int(counts[expert]) :] = 1e4  # rows past the count must not leak
    w13, w2 = expert_weights(e, H, I, torch.float32)
    out = run_experts(ExpertMajorDispatchOutput(x, counts, num_tokens=8), w13, w2)
    assert out.shape == x.shape
    for expert in range(e):
        c = int(counts[expert])
        ids = torch.full((c, 1), expert, dtype=torch.int64)
        ref = moe_oracle(x[expert, :c], ids, torch.ones(c, 1), w13, w2)
        assert compare(out[expert, :c], ref).ok(1e-5), expert


@pytest.mark.parametrize("method", METHODS)
def test_standard_path_never_reads_device_values_on_host(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, w = routing("some_nonlocal", 7, 5, 2)
    x = torch.randn(7, H)
    w13, w2 = expert_weights(5, H, I, torch.float32)
    ref = moe_oracle(x, ids, w, w13, w2)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("host read of a device value")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = standard_experts(x, ids, w, w13, w2, method=method)  # type: ignore[arg-type]
    monkeypatch.undo()
    assert compare(out, ref).ok(1e-5)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["auto", "dense"])
def test_standard_path_captures_without_sync_on_gpu(method: str) -> None:
    ids, w = routing("some_nonlocal", 40, 16, 4)
    dev = "cuda"
    ids, w = ids.to(dev), w.to(dev)
    x = torch.randn(40, 256, device=dev, dtype=torch.bfloat16)
    w13, w2 = (t.to(dev) for t in expert_weights(16, 256, 128, torch.bfloat16))
    d = StandardDispatchOutput(x, ids, w)

    def call() -> torch.Tensor:
        if method == "auto":
            return run_experts(d, w13, w2)
        return standard_experts(x, ids, w, w13, w2, method="dense")

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit device-to-host wait raises
    try:
        eager = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert compare(out, moe_oracle(x, ids, w, w13, w2)).ok(2e-2)
