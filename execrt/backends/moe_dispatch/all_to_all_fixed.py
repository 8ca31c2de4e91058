"""all_to_all_fixed MoE dispatch: the token exchange in fixed-capacity buffers, graph-capturable.

The same exchange as ``all_to_all`` (counts, then rows grouped by destination rank and local
expert, weights applied at the source in combine), but every shape is fixed when the dispatcher
is built, so no step waits for the host and a CUDA graph can capture dispatch and combine
(under NCCL, whose ``all_to_all_single`` with equal splits is capturable; at world size 1 there
is no communication at all).

Capacities, from ``C = max_tokens_per_rank``, ``K = top_k`` and ``P`` ranks:

- each source sends each rank one block of ``R = C * min(K, E_local)`` rows; the exchange moves
  ``[P * R, H]`` per rank whatever the routing (padding rows are zero);
- each local expert receives at most ``C`` rows per source, so the expert-major output is
  ``[E_local, P * C, H]`` with ``expert_counts``: the NCCL EP contract, shared expert compute.

With ``T <= C`` tokens (checked) and distinct experts within each token's top-k, nothing can
exceed these capacities. A token naming one expert twice can push an expert past ``C`` rows
from one source; such rows, and ids outside ``[-1, E)``, are dropped *and counted*: the counts
exchange tells every rank every rank's drops, so in eager mode all ranks raise ValueError
together. Under capture nothing may wait for the host, so drops accumulate in a device counter
that ``check_dropped()`` reads (raising if any) and ``close()`` reports; never silently.

Memory per rank: send and receive blocks ``2 * P * R * H`` plus the expert-major buffer
``E_local * P * C * H`` elements, for every call: size ``max_tokens_per_rank`` to the largest
graph batch, not to prefill. Hence "auto" never picks this dispatcher; name it explicitly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from execrt.backends.moe_dispatch._common import (
    check_expert_output,
    check_routing,
    check_sharding,
    exchange,
)
from execrt.core.interfaces import (
    DispatchOutput,
    ExpertMajorDispatchOutput,
    MoEDispatcher,
    MoEDispatcherInit,
)

logger = logging.getLogger(__name__)
COMPONENT = "all_to_all_fixed dispatcher"


@dataclass(frozen=True)
class _FixedRoute:
    """What combine needs (ExpertMajorDispatchOutput.state); every tensor has a fixed shape."""

    token_of_row: torch.Tensor  # [T*K] int64: source token of each (t, k), in send order
    weight_of_row: torch.Tensor  # [T*K] fp32: its weight, 0 where nothing was sent
    send_index: torch.Tensor  # [T*K] int64: its row in the send block, P*R = not sent
    slot_of_row: torch.Tensor  # [P*R] int64: expert-major slot of each received row
    num_tokens: int
    dtype: torch.dtype


class FixedCapacityAllToAllDispatcher(MoEDispatcher):
    """all_to_all with static shapes: capturable, at the price of fixed, padded buffers."""

    def __init__(self, init: MoEDispatcherInit) -> None:
        super().__init__(init)
        check_sharding(COMPONENT, init)
        if init.max_tokens_per_rank < 1:
            raise ValueError(
                f"{COMPONENT}: max_tokens_per_rank {init.max_tokens_per_rank} unsupported "
                "(supported: >= 1)"
            )
        self.parallel = init.parallel
        self.num_local = init.num_local_experts
        self.capacity = init.max_tokens_per_rank  # C tokens per rank
        self.pair_rows = self.capacity * min(init.top_k, self.num_local)  # R rows per rank pair
        self.expert_rows = init.parallel.ep_size * self.capacity  # P*C slots per local expert
        # Rows dropped under capture, counted on the device (allocated now, outside capture).
        self._dropped = torch.zeros((), dtype=torch.int64, device=init.device)

    def dispatch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchOutput:
        check_routing(COMPONENT, hidden_states, topk_ids, topk_weights, self.init)
        num_tokens, top_k = topk_ids.shape
        if num_tokens > self.capacity:
            raise ValueError(
                f"{COMPONENT}: {num_tokens} tokens unsupported (supported: <= "
                f"max_tokens_per_rank {self.capacity})"
            )
        if top_k > self.init.top_k:
            raise ValueError(
                f"{COMPONENT}: top_k {top_k} unsupported (supported: <= {self.init.top_k})"
            )
        world, e_local, num_experts = self.parallel.ep_size, self.num_local, self.init.num_experts
        cap, pair_rows, device = self.capacity, self.pair_rows, hidden_states.device
        flat = topk_ids.reshape(-1).long()  # [n = T*K]
        n = flat.numel()
        # Bucket 0 = masked (-1), 1..E = expert id + 1, E + 1 = invalid; sorted, rows come in
        # (destination rank, local expert) order, each expert's rows in token order.
        invalid = (flat < -1) | (flat >= num_experts)
        bucket = torch.where(invalid, num_experts + 1, flat + 1)  # [n]
        order = torch.argsort(bucket, stable=True)  # [n]
        in_order = bucket[order]
        tally = torch.zeros(num_experts + 2, dtype=torch.int64, device=device)
        tally.index_add_(0, bucket, torch.ones_like(bucket))  # [E + 2]
        first_of_bucket = torch.cumsum(tally, 0) - tally  # [E + 2] in sorted order
        rank_in_expert = torch.arange(n, device=device) - first_of_bucket[in_order]  # [n]
        expert = (in_order - 1).clamp(0, num_experts - 1)  # [n], meaningful where routed
        keep = (in_order >= 1) & (in_order <= num_experts) & (rank_in_expert < cap)
        sent = tally[1 : num_experts + 1].clamp(max=cap).view(world, e_local)  # [P, E_local]
        earlier = (torch.cumsum(sent, 1) - sent).reshape(-1)  # [E] rows before e's in its block
        send_index = torch.where(
            keep,
            (expert // e_local) * pair_rows + earlier[expert] + rank_in_expert,
            world * pair_rows,
        )  # [n]; the extra last row of the send block collects what is not sent
        send = hidden_states.new_zeros(world * pair_rows + 1, hidden_states.shape[1])
        send.index_copy_(0, send_index, hidden_states[order // top_k])

        counts = torch.empty(world, e_local + 2, dtype=torch.int64, device=device)
        counts[:, :e_local] = sent
        counts[:, e_local] = tally[num_experts + 1]  # invalid ids, told to every rank
        counts[:, e_local + 1] = (tally[1 : num_experts + 1] - cap).clamp(min=0).sum()
        recv = exchange(self.parallel, counts)  # [P, E_local + 2] by source rank
        self._report_drops(recv[:, e_local:])
        received = exchange(self.parallel, send[: world * pair_rows])  # [P*R, H]

        slot_of_row = self._slots(recv[:, :e_local])  # [P*R]
        tokens = hidden_states.new_zeros(e_local * self.expert_rows + 1, hidden_states.shape[1])
        tokens.index_copy_(0, slot_of_row, received)
        weight_of_row = torch.where(keep, topk_weights.reshape(-1)[order].float(), 0.0)
        route = _FixedRoute(
            order // top_k, weight_of_row, send_index, slot_of_row, num_tokens, hidden_states.dtype
        )
        return ExpertMajorDispatchOutput(
            hidden_states=tokens[:-1].view(e_local, self.expert_rows, -1),  # [E_local, P*C, H]
            expert_counts=recv[:, :e_local].sum(0).to(torch.int32),  # [E_local]
            num_tokens=num_tokens,
            state=route,
        )

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        route = check_expert_output(COMPONENT, expert_output, dispatch_output, _FixedRoute)
        hidden = expert_output.shape[-1]
        zero = expert_output.new_zeros(1, hidden)
        back = torch.cat([expert_output.reshape(-1, hidden), zero])[route.slot_of_row]  # [P*R, H]
        home = torch.cat([exchange(self.parallel, back), zero])  # [P*R + 1, H]
        rows = home[route.send_index].float() * route.weight_of_row[:, None]  # [T*K, H]
        out = torch.zeros(route.num_tokens, hidden, dtype=torch.float32, device=rows.device)
        out.index_add_(0, route.token_of_row, rows)
        return out.to(route.dtype)  # [T, H]

    def check_dropped(self) -> None:
        """Raise ValueError if rows were dropped under capture since the last check (syncs)."""
        dropped = int(self._dropped.item())
        if dropped:
            self._dropped.zero_()
            raise ValueError(
                f"{COMPONENT}: {dropped} (token, expert) rows dropped under graph replay: ids "
                f"outside [-1, {self.init.num_experts}) or over {self.capacity} rows per expert "
                "per source (a token naming one expert twice)"
            )

    def close(self) -> None:
        dropped = int(self._dropped.item())
        if dropped:
            logger.error("%s: %d rows were dropped under graph replay", COMPONENT, dropped)

    def _report_drops(self, drops: torch.Tensor) -> None:
        """``drops [P, 2]``: invalid ids and over-capacity rows of each source rank."""
        if drops.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._dropped += drops.sum()
            return
        per_rank = drops.tolist()
        if any(a or b for a, b in per_rank):
            where = "; ".join(
                f"rank {r}: {a} invalid ids, {b} over capacity"
                for r, (a, b) in enumerate(per_rank)
                if a or b
            )
            raise ValueError(
                f"{COMPONENT}: rows dropped ({where}); ids must lie in [-1, "
                f"{self.init.num_experts}) and an expert takes at most {self.capacity} rows per "
                "source (a token naming one expert twice can exceed it); every rank raises"
            )

    def _slots(self, per_source: torch.Tensor) -> torch.Tensor:
        """Expert-major slot ``e * P*C + i`` of every row of the ``[P, R]`` received blocks.

        Block ``r`` holds ``per_source[r].sum()`` rows grouped by local expert, then padding
        (sent to the discarded last slot); within expert ``e``, rank ``r``'s rows follow those
        of ranks ``< r``.
        """
        world, e_local = per_source.shape
        ends = torch.cumsum(per_source, 1)  # [P, E_local] end of each expert's run in a block
        row = torch.arange(self.pair_rows, device=per_source.device).expand(world, -1).contiguous()
        expert = torch.searchsorted(ends, row, right=True)  # [P, R]; e_local = padding
        valid = expert < e_local
        expert = expert.clamp(max=e_local - 1)
        run_start = (ends - per_source).gather(1, expert)  # [P, R]
        from_lower_ranks = (torch.cumsum(per_source, 0) - per_source).gather(1, expert)
        slot = expert * self.expert_rows + from_lower_ranks + row - run_start
        return torch.where(valid, slot, e_local * self.expert_rows).reshape(-1)  # [P*R]
