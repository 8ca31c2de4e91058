"""A toy MoE stack over static buffers and a driver playing the graph runner around reexec."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from execrt.backends.graph.reexec import ReexecGraphBackend
from execrt.backends.moe_dispatch.nccl_ep import NcclEpDispatcher
from execrt.backends.moe_dispatch.nccl_ep_native import NcclApi
from execrt.core.context import RuntimeContext
from execrt.core.experts import run_experts
from execrt.core.interfaces import GraphBackendInit, MoEDispatcherInit, ShapeKey
from execrt.core.parallel import ParallelState
from execrt.plugins.builtin import NCCL_EP_DISPATCH, REEXEC_GRAPH
from execrt.testing.moe_harness import expert_weights
from tests.doubles.nccl_ep import FakeNccl

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 32
CAPACITY = 8  # largest graph bucket
EAGER_MAX_TOKENS = 16
BUCKETS = (8, 4, 2, 1)
LAYERS = 2


def make_dispatcher(
    fake: FakeNccl, context: RuntimeContext, max_tokens: int = EAGER_MAX_TOKENS
) -> NcclEpDispatcher:
    init = MoEDispatcherInit(
        capabilities=NCCL_EP_DISPATCH,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        max_tokens_per_rank=max_tokens,
        parallel=ParallelState.single(),
        context=context,
    )
    return NcclEpDispatcher(init, NcclApi(fake.ep, fake.core, fake.is_capturing))


@dataclass
class StepOutput:
    inputs: list[torch.Tensor]  # each layer's MoE input [T, H]
    moe: list[torch.Tensor]  # each layer's MoE output [T, H]


@dataclass
class ToyMoE:
    """``LAYERS`` MoE layers over static buffers sized for the largest bucket; rows past the
    real batch are padding: zero hidden states, routed nowhere (-1)."""

    dispatcher: NcclEpDispatcher
    context: RuntimeContext
    seed: int = 0
    mid_layer: list[str | None] = field(default_factory=list)  # borrower between dispatch/combine
    after_combine: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)
        self.weights = [
            expert_weights(NUM_EXPERTS, HIDDEN, INTER, torch.bfloat16, self.seed + layer)
            for layer in range(LAYERS)
        ]
        self.x = torch.zeros(CAPACITY, HIDDEN, dtype=torch.bfloat16)  # [C, H]
        self.ids = [torch.full((CAPACITY, TOP_K), -1, dtype=torch.int64) for _ in range(LAYERS)]
        self.w = [torch.zeros(CAPACITY, TOP_K) for _ in range(LAYERS)]
        self.refill(CAPACITY)

    def refill(self, num_real: int) -> None:
        """New values in place (addresses never change); ``num_real`` real rows, padding after."""
        g = self.gen
        self.x.zero_()
        self.x[:num_real] = torch.randn(num_real, HIDDEN, generator=g).to(torch.bfloat16)
        for ids, w in zip(self.ids, self.w, strict=True):
            ids.fill_(-1)
            w.zero_()
            for row in range(num_real):
                ids[row] = torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K]
            masked = torch.rand(num_real, TOP_K, generator=g) < 0.25
            ids[:num_real][masked] = -1
            w[:num_real] = torch.softmax(torch.randn(num_real, TOP_K, generator=g), -1)

    def forward_fn(self, num_tokens: int) -> Callable[[], StepOutput]:
        name = self.dispatcher.resource_name

        def step() -> StepOutput:
            h = self.x[:num_tokens]
            out = StepOutput([], [])
            for layer, (w13, w2) in enumerate(self.weights):
                out.inputs.append(h.clone())
                d = self.dispatcher.dispatch(
                    h, self.ids[layer][:num_tokens], self.w[layer][:num_tokens]
                )
                self.mid_layer.append(self._borrower(name))
                y = self.dispatcher.combine(run_experts(d, w13, w2), d)
                self.after_combine.append(self._borrower(name))
                out.moe.append(y)
                h = h + y
            return out

        return step

    def _borrower(self, name: str) -> str | None:
        return self.context.borrower_of(name) if self.context.has(name) else None


class GraphDriver:
    """The graph runner's side: buckets largest first, an optional eager run before each
    capture (what FullCudaGraphBackend's warm-up runs do before it warms the resources up),
    replays, cleanup. ReexecGraphBackend holds the dispatcher's resources through
    GraphResourceOwner exactly as a real graph backend does (create on the first key,
    register, warm up per key outside capture, close after the graphs at cleanup); the first
    call of each captured function runs with the double's capture flag on: the recording."""

    def __init__(
        self, fake: FakeNccl, context: RuntimeContext, model: ToyMoE, *, eager_run_first: bool
    ) -> None:
        self.fake, self.context, self.model = fake, context, model
        self.provider = model.dispatcher.graph_resource_provider()
        self.backend = ReexecGraphBackend(
            GraphBackendInit(REEXEC_GRAPH, torch.device("cpu"), context, self.provider)
        )
        self.eager_run_first = eager_run_first
        self.outputs: dict[int, StepOutput] = {}

    @property
    def resources(self) -> Any:
        name = self.provider.resource_name
        return self.context.get(name) if self.context.has(name) else None

    def capture_all(self, buckets: tuple[int, ...] = BUCKETS) -> None:
        with self.backend.capture_session():
            for t in sorted(buckets, reverse=True):
                fn = self.model.forward_fn(t)
                if self.eager_run_first:
                    fn()
                self.outputs[t] = self.backend.capture(ShapeKey(t), self._recorded(fn))

    def _recorded(self, fn: Callable[[], StepOutput]) -> Callable[[], StepOutput]:
        calls = 0

        def run() -> StepOutput:
            nonlocal calls
            calls += 1
            if calls > 1:  # a replay
                return fn()
            with self.fake.capture():
                return fn()

        return run

    def replay(self, num_tokens: int) -> StepOutput:
        out: StepOutput = self.backend.replay(ShapeKey(num_tokens))
        return out

    def cleanup(self) -> None:
        self.backend.cleanup()
