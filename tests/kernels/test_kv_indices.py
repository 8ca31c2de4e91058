"""kv_indices: the torch path (mode "off", or "auto" off CUDA or without triton) and the Triton
kernel build the same CSR slot list as a plain per-request concatenation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from execrt.kernels import _triton, kv_indices, use_triton
from execrt.kernels.kv_indices import fill_kv_index

SENTINEL = -7  # what kv_indices holds before the call; entries past the total must keep it
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
DTYPES = [torch.int32, torch.int64]


def expected(rtt: torch.Tensor, rows: list[int], lens: list[int]) -> torch.Tensor:
    """The independent construction: each request's first ``len`` slots, request after request."""
    parts = [rtt[r, :n].cpu().long() for r, n in zip(rows, lens, strict=True)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def run(
    rtt: torch.Tensor,
    rows: list[int],
    lens: list[int],
    *,
    mode: str,
    dtype: torch.dtype = torch.int32,
    spare: int = 5,
    fill: bool = False,
) -> torch.Tensor:
    """``kv_indices`` (``spare`` entries longer than needed) after one build; on the host."""
    device = rtt.device
    req_pool_indices = torch.tensor(rows, dtype=dtype, device=device)  # [B]
    seq_lens = torch.tensor(lens, dtype=dtype, device=device)  # [B]
    out = torch.full((sum(lens) + spare,), SENTINEL, dtype=dtype, device=device)  # [N]
    if fill:  # the device computes kv_indptr too; give it a longer, stale buffer
        indptr = torch.full((len(lens) + 3,), 99, dtype=dtype, device=device)
        fill_kv_index(rtt, req_pool_indices, seq_lens, indptr, out, mode=mode)
        want = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)
        assert indptr[: len(lens) + 1].cpu().long().tolist() == want.tolist()
        assert (indptr[len(lens) + 1 :] == 99).all(), "kv_indptr past B+1 was written"
    else:
        indptr = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(device, dtype)
        fill_kv_index(rtt, req_pool_indices, seq_lens, indptr, out, mode=mode, fill_indptr=False)
    return out.cpu().long()


def slot_table(rows: int, width: int, device: str, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    """``req_to_token [rows, width]`` of distinct random slot ids (a wrong gather shows)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(rows * width, generator=g).view(rows, width).to(device, dtype) + 1


# (row of each request, its context length): ragged, empty rows, rows out of order, repeats.
BATCHES = {
    "ragged": ([3, 0, 5, 1, 7], [5, 0, 64, 1, 17]),
    "permuted": ([7, 6, 5, 4, 3, 2, 1, 0], [9, 33, 2, 64, 1, 40, 13, 8]),
    "empty-rows": ([2, 4, 6], [0, 0, 0]),
    "empty-first-and-last": ([1, 2, 3, 4], [0, 31, 30, 0]),
    "one-full-row": ([5], [64]),
    "row-repeated": ([4, 4, 0], [10, 3, 64]),
}


def triton_or_skip(device: str) -> None:
    if not _triton.triton_importable() or not _triton.runs_on(torch.device(device)):
        pytest.skip(f"the Triton kernel does not serve {device} here (no triton / interpreter)")


@pytest.mark.parametrize("fill", [False, True], ids=["build", "fill"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_torch_path_matches_the_concatenation(batch, device, dtype, fill) -> None:  # type: ignore[no-untyped-def]
    rows, lens = BATCHES[batch]
    rtt = slot_table(8, 64, device, dtype)
    got = run(rtt, rows, lens, mode="off", dtype=dtype, fill=fill)
    want = expected(rtt, rows, lens)
    assert torch.equal(got[: want.numel()], want)
    assert (got[want.numel() :] == SENTINEL).all(), "entries past the total were written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_triton_kernel_matches_the_torch_path(batch, device) -> None:  # type: ignore[no-untyped-def]
    triton_or_skip(device)
    rows, lens = BATCHES[batch]
    rtt = slot_table(8, 64, device, torch.int32, seed=1)
    want = run(rtt, rows, lens, mode="off")
    assert torch.equal(run(rtt, rows, lens, mode="on"), want)
    assert torch.equal(run(rtt, rows, lens, mode="auto"), want)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 48), min_size=1, max_size=12),
    width=st.integers(48, 80),
    spare=st.integers(0, 9),
    seed=st.integers(0, 2**16),
    int64=st.booleans(),
)
def test_torch_path_on_random_ragged_batches(lens, width, spare, seed, int64) -> None:  # type: ignore[no-untyped-def]
    dtype = torch.int64 if int64 else torch.int32
    g = torch.Generator().manual_seed(seed)
    rtt = slot_table(len(lens) + 2, width, "cpu", dtype, seed)
    rows = torch.randint(0, len(lens) + 2, (len(lens),), generator=g).tolist()  # any order
    got = run(rtt, rows, lens, mode="off", dtype=dtype, spare=spare)
    want = expected(rtt, rows, lens)
    assert torch.equal(got[: want.numel()], want)
    assert (got[want.numel() :] == SENTINEL).all()


def test_auto_takes_the_torch_path_where_triton_is_absent(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Without triton even CUDA falls back to the torch path.
    monkeypatch.setattr(_triton, "triton_importable", lambda: False)
    assert not use_triton("cpu", "auto") and not use_triton("cuda", "auto")
    with pytest.raises(ImportError, match="mode 'on' needs triton"):
        use_triton("cpu", "on")
    calls: list[int] = []
    torch_path = kv_indices._build_kv_indices_torch

    def spy(*args):  # type: ignore[no-untyped-def]
        calls.append(args[1].shape[0])
        return torch_path(*args)

    monkeypatch.setattr(kv_indices, "_build_kv_indices_torch", spy)
    rows, lens = BATCHES["ragged"]
    rtt = slot_table(8, 64, "cpu", torch.int32)
    for fill in (False, True):
        got = run(rtt, rows, lens, mode="auto", fill=fill)
        want = expected(rtt, rows, lens)
        assert torch.equal(got[: want.numel()], want)
    assert calls == [len(rows), len(rows)]


def test_auto_takes_the_torch_path_on_cpu_even_under_the_interpreter(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The one switch: "auto" never picks the interpreter (it is for "on").
    monkeypatch.setattr(_triton, "interpreter_enabled", lambda: True)
    assert not use_triton("cpu", "auto")
    rows, lens = BATCHES["permuted"]
    rtt = slot_table(8, 64, "cpu", torch.int64)
    got = run(rtt, rows, lens, mode="auto", dtype=torch.int64)
    assert torch.equal(got[: sum(lens)], expected(rtt, rows, lens))


def test_an_empty_batch_writes_nothing_and_a_bad_mode_is_refused() -> None:
    rtt = slot_table(4, 16, "cpu", torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    out = torch.full((4,), SENTINEL, dtype=torch.int32)
    indptr = torch.full((2,), 9, dtype=torch.int32)
    fill_kv_index(rtt, empty, empty, indptr, out, mode="off")
    assert (out == SENTINEL).all() and indptr.tolist() == [0, 9]
    lens = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"mode 'cuda' unsupported \(supported: auto, on, off"):
        fill_kv_index(rtt, lens, lens, torch.tensor([0, 2], dtype=torch.int32), out, mode="cuda")


@requires_cuda
def test_torch_path_is_capturable_and_replays_new_lengths() -> None:
    # The fallback must serve graph metadata: no host sync, fixed buffers, new values per replay.
    device = torch.device("cuda")
    rtt = slot_table(8, 64, "cuda", torch.int32)
    rows = torch.tensor([3, 0, 5, 1], dtype=torch.int32, device=device)
    lens = torch.tensor([1, 1, 1, 1], dtype=torch.int32, device=device)
    indptr = torch.zeros(5, dtype=torch.int32, device=device)
    out = torch.full((4 * 64,), SENTINEL, dtype=torch.int32, device=device)

    def step() -> None:
        fill_kv_index(rtt, rows, lens, indptr, out, mode="off")

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        torch.cuda.set_sync_debug_mode("error")  # a host sync would also break the capture
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for new_rows, new_lens in (([7, 6, 5, 4], [9, 0, 64, 2]), ([0, 0, 1, 2], [0, 0, 0, 5])):
        rows.copy_(torch.tensor(new_rows))
        lens.copy_(torch.tensor(new_lens))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        want = expected(rtt, new_rows, new_lens)
        assert torch.equal(out[: want.numel()].cpu().long(), want)
        assert (out[want.numel() :] == SENTINEL).all()
