"""HostToDevice, DeviceToHost and HostCopy: exact values, dtypes, and the CUDA slot discipline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pytest
import torch

from execrt.core.staging import (
    ALIGN_BYTES,
    DeviceToHost,
    HostCopy,
    HostToDevice,
    stage_floats,
    stage_ints,
)

CPU = torch.device("cpu")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# -- CPU ------------------------------------------------------------------------------------------
def test_ints_arrive_as_int64_with_exact_values() -> None:
    values = [0, -1, 7, 2**53 + 1, -(2**62) - 1]  # not exact in fp64: no float detour
    out = HostToDevice(CPU)(values)
    assert out.dtype == torch.int64 and out.device == CPU and out.shape == (5,)
    assert out.tolist() == values


def test_floats_arrive_as_float32() -> None:
    values = [0.5, -1.25, 3.0, 1e-3]
    out = HostToDevice(CPU).floats(values)
    assert out.dtype == torch.float32 and out.shape == (4,)
    assert out[:3].tolist() == [0.5, -1.25, 3.0]  # exactly representable
    assert out[3].item() == pytest.approx(1e-3, rel=1e-7) and out[3].item() != 1e-3  # rounded


def test_empty_lists_give_empty_tensors_of_the_right_dtype() -> None:
    stager = HostToDevice(CPU)
    ints, floats = stager([]), stager.floats([])
    assert ints.shape == (0,) and ints.dtype == torch.int64
    assert floats.shape == (0,) and floats.dtype == torch.float32


def test_long_lists_and_repeated_calls_keep_every_result() -> None:
    stager = HostToDevice(CPU, slots=2)
    big = list(range(5000))  # far beyond a CUDA slot's initial 1024 entries
    results = [stager([i] * 3) for i in range(7)] + [stager(big)]
    # Earlier results are never overwritten by later calls through the same slots.
    assert [r.tolist() for r in results[:7]] == [[i] * 3 for i in range(7)]
    assert results[7].tolist() == big


class CountingStager(HostToDevice):
    def __init__(self) -> None:
        super().__init__(CPU)
        self.copies: list[list[Any]] = []

    def __call__(self, values: Sequence[int]) -> torch.Tensor:
        self.copies.append(list(values))
        return super().__call__(values)

    def floats(self, values: Sequence[float]) -> torch.Tensor:
        self.copies.append(list(values))
        return super().floats(values)


@pytest.mark.parametrize("lens", [(1, 3, 2), (0, 5, 0, 1), (7,), (), (2, 2, 2, 2)])
def test_stage_packs_segments_aligned_in_one_copy(lens: tuple[int, ...]) -> None:
    stager = CountingStager()
    ints = [[10 * i + j for j in range(n)] for i, n in enumerate(lens)]
    floats = [[float(v) + 0.5 for v in seg] for seg in ints]
    for stage, segs, dtype in (
        (stage_ints, ints, torch.int64),
        (stage_floats, floats, torch.float32),
    ):
        out = stage(stager, segs)
        assert [t.tolist() for t in out] == segs and all(t.dtype == dtype for t in out)
        # Every segment starts 16-byte aligned (a Triton kernel variant per alignment).
        assert all(t.data_ptr() % ALIGN_BYTES == 0 for t in out)
    assert len(stager.copies) == 2  # one copy each for the ints and the floats
    unit = ALIGN_BYTES // 8
    assert len(stager.copies[0]) == sum(-(-n // unit) * unit for n in lens)  # padding only


def test_device_to_host_on_cpu_needs_no_copy_and_is_done_at_once() -> None:
    d2h = DeviceToHost(CPU, torch.int64)
    copy = d2h.start(torch.tensor([3, 1, 4], dtype=torch.int64))
    assert copy.done()
    ids = copy.tolist()
    assert ids == [3, 1, 4] and all(type(i) is int for i in ids)
    assert d2h.start(torch.zeros(0, dtype=torch.int64)).tolist() == []


class FakeEvent:
    """Stands in for a CUDA event: records synchronize() and answers query()."""

    def __init__(self, finished: bool) -> None:
        self.finished = finished
        self.synchronized = 0

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.synchronized += 1
        self.finished = True


def test_host_copy_done_asks_its_event_and_tolist_waits_for_it() -> None:
    event = FakeEvent(finished=False)
    copy = HostCopy(torch.tensor([9, 8]), cast(Any, event))
    assert not copy.done() and event.synchronized == 0  # done() never blocks
    assert copy.tolist() == [9, 8] and event.synchronized == 1
    assert copy.done()


def test_host_copy_without_event_reads_the_host_tensor() -> None:
    copy = HostCopy(torch.tensor([5, 6, 7]), None)
    assert copy.done() and copy.tolist() == [5, 6, 7]


# -- CUDA -----------------------------------------------------------------------------------------
# ``torch.cuda._sleep`` keeps the stream busy so that the copies issued after it are still in
# flight when the host goes on: what the host does next must not corrupt them.
BUSY_CYCLES = 100_000_000  # ~50 ms on a ~2 GHz GPU


@requires_cuda
def test_cuda_staging_uses_pinned_slots_and_non_blocking_copies() -> None:
    cuda = torch.device("cuda")
    stager = HostToDevice(cuda, slots=2)
    torch.cuda._sleep(BUSY_CYCLES)
    out = stager([1, 2, 3])
    slot = stager._ints.slots[0]
    assert slot.host.is_pinned() and slot.event is not None
    assert not slot.event.query(), "the copy should queue behind the busy stream"
    assert out.device.type == "cuda" and out.tolist() == [1, 2, 3]  # tolist syncs
    assert stager.floats([0.5]).tolist() == [0.5] and stager._floats.slots[0].host.is_pinned()


@requires_cuda
def test_cuda_slot_reuse_waits_for_the_copy_that_used_it() -> None:
    stager = HostToDevice(torch.device("cuda"), slots=2)
    torch.cuda._sleep(BUSY_CYCLES)
    # 8 copies through 2 slots while the first ones still wait behind the sleep: a slot
    # rewritten before its copy ran would show a later call's values in an earlier result.
    outs = [stager([i] * 2000) for i in range(8)]  # 2000 > 1024: the slots grow too
    torch.cuda.synchronize()
    assert [o.unique().tolist() for o in outs] == [[i] for i in range(8)]
    grown = stager._ints.slots[0].host
    assert grown.numel() == 2048 and grown.is_pinned()  # max(n, twice the old capacity)


@requires_cuda
def test_cuda_device_to_host_snapshots_the_values_at_start() -> None:
    d2h = DeviceToHost(torch.device("cuda"), torch.int64, slots=2)
    src = torch.arange(6, device="cuda").reshape(2, 3)
    torch.cuda._sleep(BUSY_CYCLES)
    copy = d2h.start(src)
    assert not copy.done()  # the copy waits behind the sleep; start() did not block
    src.fill_(-1)  # stream-ordered after the copy: must not show in it
    assert copy.tolist() == [0, 1, 2, 3, 4, 5]  # flattened
    assert copy.done()


@requires_cuda
def test_cuda_device_to_host_copies_stay_valid_until_their_slot_comes_round() -> None:
    d2h = DeviceToHost(torch.device("cuda"), torch.int64, slots=3)
    copies = [d2h.start(torch.full((4,), i, device="cuda")) for i in range(3)]
    assert [c.tolist() for c in copies] == [[i] * 4 for i in range(3)]
