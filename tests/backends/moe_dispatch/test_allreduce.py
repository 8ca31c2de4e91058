"""allreduce: experts that do not split over the EP ranks are refused, never dropped."""

from __future__ import annotations

import pytest
import torch

from execrt.backends.moe_dispatch.allreduce import AllReduceDispatcher
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import MoEDispatcherInit
from execrt.core.parallel import ParallelState
from execrt.plugins.builtin import ALLREDUCE_DISPATCH


@pytest.mark.parametrize("num_experts", [7, 1])
def test_num_experts_must_split_over_ranks(num_experts: int) -> None:
    # 7 experts over 2 ranks: blocks of 3 would leave expert 6 on neither rank.
    parallel = ParallelState(world_size=2, rank=1, backend="gloo")
    init = MoEDispatcherInit(
        ALLREDUCE_DISPATCH, num_experts, 1, 16, torch.float32, torch.device("cpu"), 8,
        parallel, RuntimeContext(parallel),
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"num_experts {num_experts} unsupported"):
        AllReduceDispatcher(init)
