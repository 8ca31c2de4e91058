"""GenerationBatchResult.token_ids: from the in-flight host copy when there is one."""

from __future__ import annotations

import torch

from execrt.core.batch import LogitsOutput
from execrt.core.staging import DeviceToHost, HostCopy
from execrt.core.worker import GenerationBatchResult


def result(next_ids: list[int], host_copy: HostCopy | None = None) -> GenerationBatchResult:
    ids = torch.tensor(next_ids, dtype=torch.int64)
    return GenerationBatchResult(LogitsOutput(torch.zeros(len(next_ids), 4)), ids, False, host_copy)


def test_token_ids_without_a_host_copy_read_the_device_tensor() -> None:
    ids = result([3, 0, 9]).token_ids()
    assert ids == [3, 0, 9] and all(type(i) is int for i in ids)
    assert result([]).token_ids() == []


def test_token_ids_come_from_the_host_copy_when_there_is_one() -> None:
    # Different values in the copy prove which one is read.
    res = result([1, 2], HostCopy(torch.tensor([7, 8]), None))
    assert res.token_ids() == [7, 8]


def test_token_ids_through_a_device_to_host_copy() -> None:
    ids = torch.tensor([11, 12, 13], dtype=torch.int64)
    copy = DeviceToHost(torch.device("cpu"), torch.int64).start(ids)
    res = GenerationBatchResult(LogitsOutput(torch.zeros(3, 4)), ids, True, copy)
    assert res.token_ids() == [11, 12, 13] and res.can_run_graph
