"""open_communicator's branches with a fake torch process group and the nccl.core double."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from execrt.backends.moe_dispatch import nccl_ep_native as native
from execrt.backends.moe_dispatch.nccl_ep_native import NcclApi, open_communicator
from execrt.core.errors import BackendUnavailableError, ResourceError
from execrt.core.parallel import ParallelState
from tests.doubles.nccl_ep import FakeNccl

CPU = torch.device("cpu")
TORCH_COMM = 0xBEEF00  # the ncclComm_t torch's ProcessGroupNCCL would hand out


class FakeProcessGroup:
    """A torch ProcessGroup as open_communicator sees one: ``_get_backend(device)`` gives the
    NCCL backend, whose ``_comm_ptr()`` is 0 until the first collective (``collective()``)."""

    def __init__(
        self, size: int = 2, rank: int = 0, *, exposes_ptr: bool = True, lazy: bool = True
    ) -> None:
        self._size, self._rank = size, rank
        self.backend = _Backend(exposes_ptr, 0 if lazy else TORCH_COMM)
        self.devices: list[torch.device] = []

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def _get_backend(self, device: torch.device) -> Any:
        self.devices.append(device)
        return self.backend

    def collective(self) -> None:
        if self.backend.ptr == 0:
            self.backend.ptr = TORCH_COMM


class _Backend:
    def __init__(self, exposes_ptr: bool, ptr: int) -> None:
        self.ptr = ptr
        if exposes_ptr:
            self._comm_ptr = lambda: self.ptr


@pytest.fixture
def all_reduces(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, Any]]:
    """torch.distributed.all_reduce replaced: records (tensor, group) and runs the group's
    first collective, which is what makes ProcessGroupNCCL create its communicator."""
    calls: list[tuple[torch.Tensor, Any]] = []

    def all_reduce(tensor: torch.Tensor, group: Any = None) -> None:
        calls.append((tensor, group))
        if isinstance(group, FakeProcessGroup):
            group.collective()

    monkeypatch.setattr(native.dist, "all_reduce", all_reduce)
    return calls


def nccl_world(group: FakeProcessGroup) -> ParallelState:
    return ParallelState(world_size=group.size(), rank=group.rank(), backend="nccl", group=group)


def api(fake: FakeNccl, *, fallback: bool = True) -> NcclApi:
    comm_from_group = fake.interop.get_nccl_comm_from_group if fallback else None
    return NcclApi(fake.ep, fake.core, fake.is_capturing, comm_from_group)


def test_a_single_process_opens_and_owns_a_one_rank_communicator() -> None:
    fake = FakeNccl()
    comm = open_communicator(api(fake), ParallelState.single(), CPU)
    assert comm.owned and comm.comm.nranks == 1 and comm.comm.ptr != 0
    assert fake.communicators == [comm.comm]
    ptr = comm.comm.ptr
    comm.close()
    comm.close()  # idempotent
    assert [(e.op, e.target) for e in fake.events] == [("destroy_comm", f"comm#{ptr:x}")]


def test_tensor_parallel_only_keeps_the_experts_here_on_an_own_communicator(
    all_reduces: list[Any],
) -> None:
    fake = FakeNccl()
    group = FakeProcessGroup(size=2, rank=1)
    parallel = ParallelState(2, 1, "nccl", group, tp_size=2, ep_size=1)
    comm = open_communicator(api(fake), parallel, CPU)
    assert comm.owned and comm.comm.nranks == 1
    assert group.devices == [] and all_reduces == [], "the world group is not involved"
    comm.close()


def test_torch_s_communicator_is_borrowed_after_the_first_collective_creates_it(
    all_reduces: list[Any],
) -> None:
    fake = FakeNccl()
    group = FakeProcessGroup(lazy=True)
    comm = open_communicator(api(fake), nccl_world(group), CPU)
    assert not comm.owned and comm.comm.ptr == TORCH_COMM
    assert len(all_reduces) == 1 and all_reduces[0][1] is group
    assert all_reduces[0][0].device == CPU
    assert group.devices == [CPU], "the backend of the dispatcher's device"
    comm.close()
    assert not fake.ops("destroy_comm"), "torch's communicator is torch's to destroy"


def test_an_existing_torch_communicator_needs_no_collective(all_reduces: list[Any]) -> None:
    comm = open_communicator(api(FakeNccl()), nccl_world(FakeProcessGroup(lazy=False)), CPU)
    assert comm.comm.ptr == TORCH_COMM and not comm.owned and all_reduces == []


@pytest.mark.parametrize("exposes_ptr", [False, True], ids=["no-_comm_ptr", "ptr-stays-0"])
def test_without_torch_s_pointer_a_fresh_communicator_over_the_group(
    monkeypatch: pytest.MonkeyPatch, all_reduces: list[Any], exposes_ptr: bool
) -> None:
    fake = FakeNccl()
    group = FakeProcessGroup(exposes_ptr=exposes_ptr)
    monkeypatch.setattr(group, "collective", lambda: None)  # a torch that never sets it
    asked: list[Any] = []

    def comm_from_group(handle: Any) -> Any:
        asked.append(handle)
        return fake.core.Communicator.init(1, 0, fake.core.get_unique_id())

    the_api = NcclApi(fake.ep, fake.core, fake.is_capturing, comm_from_group)
    comm = open_communicator(the_api, nccl_world(group), CPU)
    assert asked == [group] and comm.owned and comm.comm.ptr not in (0, TORCH_COMM)
    assert len(all_reduces) == (1 if exposes_ptr else 0)
    comm.close()
    assert len(fake.ops("destroy_comm")) == 1, "a communicator we made is ours to destroy"
    with pytest.raises(BackendUnavailableError, match="torch does not expose its NCCL comm"):
        open_communicator(api(fake, fallback=False), nccl_world(group), CPU)


def test_the_double_s_comm_from_group_mirrors_the_group() -> None:
    fake = FakeNccl()
    comm = fake.interop.get_nccl_comm_from_group(FakeProcessGroup(size=1))
    assert comm.nranks == 1 and comm.ptr and fake.ops("comm_from_group")
    with pytest.raises(NotImplementedError, match="world size 1 only"):
        fake.interop.get_nccl_comm_from_group(FakeProcessGroup(size=2))
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="not initialized"):
            fake.interop.get_nccl_comm_from_group()


def test_gloo_and_process_less_expert_parallelism_are_refused() -> None:
    fake = FakeNccl()
    gloo = ParallelState(world_size=2, rank=0, backend="gloo", group=FakeProcessGroup())
    with pytest.raises(ValueError, match=r"process group backend 'gloo' unsupported \(supported"):
        open_communicator(api(fake), gloo, CPU)
    with pytest.raises(ValueError, match="EP size 2 needs NCCL"):
        open_communicator(api(fake), ParallelState(world_size=2, backend="none"), CPU)
    assert fake.communicators == []


def test_no_communicator_opens_under_capture() -> None:
    fake = FakeNccl()
    with fake.capture(), pytest.raises(ResourceError, match="inside CUDA-graph capture"):
        open_communicator(api(fake), ParallelState.single(), CPU)
    assert fake.communicators == []


@pytest.mark.parametrize("torch_owned", [False, True], ids=["own", "torch's"])
def test_a_communicator_without_the_device_api_is_refused(
    all_reduces: list[Any], torch_owned: bool
) -> None:
    fake = FakeNccl(device_api=False)
    parallel = nccl_world(FakeProcessGroup()) if torch_owned else ParallelState.single()
    with pytest.raises(BackendUnavailableError, match="has no Device API support"):
        open_communicator(api(fake), parallel, CPU)
    assert len(fake.ops("destroy_comm")) == (0 if torch_owned else 1)
