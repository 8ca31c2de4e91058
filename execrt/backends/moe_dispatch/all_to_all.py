"""all_to_all MoE dispatch: tokens travel to their experts' ranks and back over torch.distributed.

The reference expert-parallel path; it runs on gloo (CPU tensors) and NCCL (CUDA tensors) alike,
using only ``all_to_all_single`` (verified on gloo in torch 2.13 for float32/float16/bfloat16/
int64 rows, uneven and zero split sizes, and empty tensors).

One dispatch is two exchanges:

1. **Counts.** Each rank sends every rank a row of ``E_local + 1`` int64 counts: how many
   (token, k) rows it routes to each of that rank's experts, plus how many invalid expert ids it
   saw. Every rank thus learns the same "some rank has bad ids" fact from the same collective and
   all of them raise together, instead of one raising and the rest hanging in the next exchange.
2. **Rows.** The sender orders its rows by global expert id. Experts are sharded in contiguous
   blocks, so that is (destination rank, local expert) order, and ``all_to_all_single`` with the
   per-rank row counts as split sizes delivers each source's block already grouped by local
   expert. The receiver knows the ``[P, E_local]`` count matrix, so it derives every row's
   expert and slot from the counts alone: no expert id travels with a row.

Format: EXPERT_MAJOR ``[E_local, C, H]`` with ``expert_counts``, the NCCL EP contract, so expert
compute is the same batched matmul (and the same future fused kernel) as for ``nccl_ep``, and it
returns unweighted outputs: the routing weights stay on the source rank and are applied there
in combine, in fp32, never before. The slot dimension ``C`` is the largest count among this
rank's experts in this step (host-known after the counts exchange), the tightest capacity that
holds every row; the fixed ``P * max_tokens`` bound is for graphs (``all_to_all_fixed``).
Rows of expert ``e`` sit source-rank-major, each source's rows in its token order, which makes
the layout deterministic. Padding rows are zero and combine never reads them. The alternative,
a STANDARD-like list of received rows with local ids, would apply the weights in expert compute
(against the STANDARD contract's meaning of ``[T, H]`` in token order) and use the per-expert
gather loop instead of one batched matmul; with a hot expert, EXPERT_MAJOR pays in padding rows
(at most ``E_local * C``), which the reference path accepts.

Combine runs the exchange backwards (same split sizes, reversed) and each source rank sums
``w[t, k] * y`` into its tokens. Sizes are data-dependent (host synchronisation, varying shapes),
so this dispatcher is not graph-capturable. Every rank must call dispatch and combine, also with
zero tokens. Each rank brings its own tokens (``replicated_tokens=False``); replicated tokens
work too, at the cost of every rank shipping every token.
"""

from __future__ import annotations

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

COMPONENT = "all_to_all dispatcher"


@dataclass(frozen=True)
class _Counts:
    """The counts exchange's outcome, on the host: who sends whom how many rows."""

    send_splits: list[int]  # [P] rows this rank sends to each rank
    recv_splits: list[int]  # [P] rows each rank sends here
    per_source: torch.Tensor  # [P, E_local] on device: rows from rank r for local expert e
    capacity: int  # the largest row count among this rank's experts


@dataclass(frozen=True)
class _Route:
    """What combine needs to bring expert outputs home (ExpertMajorDispatchOutput.state)."""

    token_of_row: torch.Tensor  # [N_send] int64: the source token of each row sent
    weight_of_row: torch.Tensor  # [N_send] fp32: its routing weight, applied in combine
    send_splits: list[int]  # [P] rows sent to each rank
    recv_splits: list[int]  # [P] rows received from each rank
    slot_of_row: torch.Tensor  # [N_recv] int64: e * C + slot of each row received, in order
    num_tokens: int  # T on this rank
    dtype: torch.dtype  # the tokens' dtype; combine returns it


class AllToAllDispatcher(MoEDispatcher):
    """Sends each (token, k) row to the rank owning its expert; combine brings results back."""

    def __init__(self, init: MoEDispatcherInit) -> None:
        super().__init__(init)
        check_sharding(COMPONENT, init)
        self.parallel = init.parallel
        self.num_local = init.num_local_experts

    def dispatch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchOutput:
        check_routing(COMPONENT, hidden_states, topk_ids, topk_weights, self.init)
        num_experts, top_k = self.init.num_experts, topk_ids.shape[1]
        flat = topk_ids.reshape(-1).long()  # [T*K]
        # Bucket 0 = masked (-1), 1..E = expert id + 1, E + 1 = invalid.
        invalid = (flat < -1) | (flat >= num_experts)
        bucket = torch.where(invalid, num_experts + 1, flat + 1)  # [T*K]
        counts = self._exchange_counts(bucket)

        # Global expert order is (destination rank, local expert) order; masked rows sort first.
        num_masked = flat.numel() - sum(counts.send_splits)
        order = torch.argsort(bucket, stable=True)[num_masked:]  # [N_send] flat (t, k)
        token_of_row = order // top_k
        weight_of_row = topk_weights.reshape(-1)[order].float()  # [N_send]
        rows = hidden_states[token_of_row]  # [N_send, H]
        par = self.parallel
        received = exchange(par, rows, counts.recv_splits, counts.send_splits)  # [N_recv, H]

        e_local, hidden = self.num_local, hidden_states.shape[1]
        slot_of_row = _slots(counts.per_source, counts.capacity, received.shape[0])  # [N_recv]
        tokens = hidden_states.new_zeros(e_local * counts.capacity, hidden)
        tokens.index_copy_(0, slot_of_row, received)
        route = _Route(
            token_of_row,
            weight_of_row,
            counts.send_splits,
            counts.recv_splits,
            slot_of_row,
            hidden_states.shape[0],
            hidden_states.dtype,
        )
        return ExpertMajorDispatchOutput(
            hidden_states=tokens.view(e_local, counts.capacity, hidden),  # [E_local, C, H]
            expert_counts=counts.per_source.sum(0).to(torch.int32),  # [E_local]
            num_tokens=hidden_states.shape[0],
            state=route,
        )

    def _exchange_counts(self, bucket: torch.Tensor) -> _Counts:
        """Tell every rank how many rows it gets per local expert, and how many bad ids we saw.

        The one host synchronisation of dispatch. Raises ValueError on every rank when any
        rank saw an id outside ``[-1, E)``.
        """
        world, e_local, num_experts = self.parallel.ep_size, self.num_local, self.init.num_experts
        # A scatter counts every bucket without a device round trip (bincount would wait to
        # size its output).
        tally = torch.zeros(num_experts + 2, dtype=torch.int64, device=bucket.device)
        tally.index_add_(0, bucket, torch.ones_like(bucket))
        send = torch.empty(world, e_local + 1, dtype=torch.int64, device=bucket.device)
        send[:, :e_local] = tally[1 : num_experts + 1].view(world, e_local)
        send[:, e_local] = tally[num_experts + 1]  # every rank hears of our invalid ids
        recv = exchange(self.parallel, send)  # [P, E_local + 1] by source rank
        per_source = recv[:, :e_local]  # [P, E_local]
        host = torch.cat(
            [
                send[:, :e_local].sum(1),
                per_source.sum(1),
                recv[:, e_local],
                per_source.sum(0).max().view(1),
            ]
        ).tolist()
        bad = host[2 * world : 3 * world]
        if any(bad):
            where = "; ".join(f"rank {r}: {n} invalid ids" for r, n in enumerate(bad) if n)
            raise ValueError(
                f"{COMPONENT}: topk_ids outside [-1, {num_experts}) ({where}); every rank raises"
            )
        return _Counts(host[:world], host[world : 2 * world], per_source, host[-1])

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        route = check_expert_output(COMPONENT, expert_output, dispatch_output, _Route)
        hidden = expert_output.shape[-1]
        back = expert_output.reshape(-1, hidden)[route.slot_of_row]  # [N_recv, H] arrival order
        home = exchange(self.parallel, back, route.send_splits, route.recv_splits)  # [N_send, H]
        out = torch.zeros(route.num_tokens, hidden, dtype=torch.float32, device=home.device)
        out.index_add_(0, route.token_of_row, home.float() * route.weight_of_row[:, None])
        return out.to(route.dtype)  # [T, H]


def _slots(per_source: torch.Tensor, capacity: int, num_rows: int) -> torch.Tensor:
    """Flat slot ``e * capacity + i`` of every received row, from the ``[P, E_local]`` counts.

    Rows arrive source by source, each source's grouped by local expert; within expert ``e``,
    source ``r``'s rows start after those of sources ``< r``.
    """
    world, e_local = per_source.shape
    device = per_source.device
    before = torch.cumsum(per_source, 0) - per_source  # [P, E_local] rows of e from ranks < r
    expert = torch.arange(e_local, device=device).expand(world, e_local)
    first_slot = (expert * capacity + before).reshape(-1)  # [P*E_local] per (source, expert)
    sizes = per_source.reshape(-1)  # [P*E_local] arrival order: source-major
    group_start = torch.cumsum(sizes, 0) - sizes  # where each (source, expert) run begins
    group = torch.repeat_interleave(
        torch.arange(sizes.numel(), device=device), sizes, output_size=num_rows
    )  # [N_recv]
    return first_slot[group] + torch.arange(num_rows, device=device) - group_start[group]
