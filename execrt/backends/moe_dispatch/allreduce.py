"""allreduce MoE dispatch: no traffic at dispatch, an all-reduce of partial outputs at combine."""

from __future__ import annotations

import torch

from execrt.backends.moe_dispatch._common import check_routing, check_sharding
from execrt.core.interfaces import (
    DispatchOutput,
    MoEDispatcher,
    MoEDispatcherInit,
    StandardDispatchOutput,
)


class AllReduceDispatcher(MoEDispatcher):
    """Every rank sees every token and computes its own experts' share; combine sums the shares.

    Suits decode with few tokens and EP groups on one host: one all-reduce of ``[T, H]`` per
    layer, nothing else. At world size 1 combine is the identity.
    """

    def __init__(self, init: MoEDispatcherInit) -> None:
        super().__init__(init)
        # An uneven split would leave the last experts on no rank: their tokens would vanish.
        check_sharding("allreduce dispatcher", init)
        self.first = init.first_local_expert
        self.num_local = init.num_local_experts

    def dispatch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchOutput:
        check_routing("allreduce dispatcher", hidden_states, topk_ids, topk_weights, self.init)
        if self.num_local == self.init.num_experts:  # one EP rank: every id is already local
            return StandardDispatchOutput(hidden_states, topk_ids, topk_weights)
        local = topk_ids - self.first  # [T, K]
        on_rank = (topk_ids >= 0) & (local >= 0) & (local < self.num_local)
        local_ids = torch.where(on_rank, local, torch.full_like(local, -1))
        return StandardDispatchOutput(hidden_states, local_ids, topk_weights)

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        if not isinstance(dispatch_output, StandardDispatchOutput):
            raise TypeError(
                "allreduce dispatcher: combine needs the StandardDispatchOutput it made"
            )
        parallel = self.init.parallel
        return parallel.all_reduce(expert_output, parallel.ep_group)
