"""nccl_ep MoE dispatch: NCCL EP low-latency all-to-all into expert-major buffers."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from execrt.backends.moe_dispatch import nccl_ep_native as native
from execrt.backends.moe_dispatch.nccl_ep_native import COMPONENT, NcclApi, load_nccl_api
from execrt.backends.moe_dispatch.nccl_ep_probe import MAX_LOCAL_EXPERTS, requirement_problems
from execrt.backends.moe_dispatch.nccl_ep_resources import (
    GRAPH_RESOURCE_NAME,
    EpLayout,
    NcclEpGraphResources,
)
from execrt.core.context import RuntimeContext
from execrt.core.errors import ResourceError
from execrt.core.interfaces import (
    DispatchOutput,
    ExpertMajorDispatchOutput,
    GraphResourceProvider,
    MoEDispatcher,
    MoEDispatcherInit,
)

logger = logging.getLogger(__name__)


@dataclass
class _EagerLease:
    """One eager forward's handle and what combine needs; the routing descriptor stays alive."""

    handle: Any
    routing: Any
    topk_weights: torch.Tensor  # [rows, K] fp32
    num_tokens: int  # T as the caller sent it
    rows: int  # rows dispatched: T, or 1 (routed nowhere) when T == 0


@dataclass
class _GraphLease:
    resources: NcclEpGraphResources
    borrower: str
    num_tokens: int


class NcclEpDispatcher(MoEDispatcher):
    """Tokens travel to their experts' ranks through NCCL EP's low-latency (LL) kernels and
    land expert-major: ``[E_local, P*C, H]`` with ``expert_counts``; combine sends the expert
    outputs back and applies the routing weights itself (never pre-multiply them).

    Eager: one EP group over the ranks' NCCL communicator, created at the first forward; a
    handle per forward, destroyed after combine. Graphs: the dispatcher is its own
    GraphResourceProvider; the graph backend's NcclEpGraphResources (context name
    ``nccl_ep_graph_resources``) serve every forward of the warmed-up bucket, one layer at a
    time. ``api`` is the seam to NCCL EP; tests pass ``tests.doubles.nccl_ep``'s.
    """

    def __init__(self, init: MoEDispatcherInit, api: NcclApi | None = None) -> None:
        super().__init__(init)
        self.resource_name = GRAPH_RESOURCE_NAME  # GraphResourceProvider: the context name
        problems = requirement_problems(init.hidden_size, init.top_k)
        if init.dtype != torch.bfloat16:
            problems.append(f"dtype {init.dtype} unsupported (supported: bfloat16)")
        if init.num_experts % init.parallel.ep_size:
            problems.append(f"num_experts {init.num_experts} not divisible by the EP size")
        elif init.num_experts // init.parallel.ep_size > MAX_LOCAL_EXPERTS:
            problems.append(
                f"{init.num_experts // init.parallel.ep_size} local experts per rank "
                f"({init.num_experts} over EP size {init.parallel.ep_size}) unsupported "
                f"(supported: up to {MAX_LOCAL_EXPERTS}, NCCL EP's limit)"
            )
        if init.max_tokens_per_rank < 1:
            problems.append(f"max_tokens_per_rank {init.max_tokens_per_rank} must be >= 1")
        if problems:
            raise ValueError(f"{COMPONENT}: " + "; ".join(problems))
        self.api = api if api is not None else load_nccl_api()
        self.device = _resolve(init.device)
        self.layout = EpLayout(
            init.num_experts, init.parallel.ep_size, init.hidden_size, init.top_k, self.device
        )
        self.capacity = init.max_tokens_per_rank  # C of the eager group
        self._comm: native.Communicator | None = None
        self._group: Any = None
        self._recv: torch.Tensor | None = None  # [E_local, P*C, H]
        self._counters: torch.Tensor | None = None  # [E_local]
        self._inflight: _EagerLease | None = None
        self._graph: NcclEpGraphResources | None = None  # the open generation, if any
        self._generations = 0
        self._calls = 0
        self.closed = False

    # -- MoEDispatcher ------------------------------------------------------------------------
    def dispatch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchOutput:
        if self.closed:
            raise ResourceError(f"{COMPONENT}: dispatch after close()")
        num_tokens = self._check_inputs(hidden_states, topk_ids, topk_weights)
        resources = self._graph_resources_for(num_tokens)
        if resources is not None:
            return self._dispatch_graph(resources, hidden_states, topk_ids, topk_weights)
        return self._dispatch_eager(hidden_states, topk_ids, topk_weights)

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        state = getattr(dispatch_output, "state", None)
        if isinstance(state, _GraphLease):
            return self._combine_graph(state, expert_output)
        if isinstance(state, _EagerLease) and state is self._inflight:
            return self._combine_eager(state, expert_output)
        raise ValueError(
            f"{COMPONENT}: combine needs the latest ExpertMajorDispatchOutput this dispatcher "
            f"returned, got {type(dispatch_output).__name__} with state {type(state).__name__}"
        )

    def graph_resource_provider(self) -> GraphResourceProvider:
        return self

    def close(self) -> None:
        """Destroy the open graph generation (if the graph backend left one), the eager handle
        and group, then our own communicator. Refuses while graph resources are borrowed."""
        if self.closed:
            return
        if self._graph is not None and not self._graph.closed:
            logger.warning("%s: closing %r its graph backend left open", COMPONENT, self._graph)
            self._graph.close()
        if self._inflight is not None:
            self._inflight.handle.destroy()
            self._inflight = None
        if self._group is not None:
            self._group.destroy()
            self._group = None
        if self._comm is not None:
            self._comm.close()
            self._comm = None
        self.closed = True

    # -- GraphResourceProvider ----------------------------------------------------------------
    def create_graph_resources(
        self, capacity: int, context: RuntimeContext
    ) -> NcclEpGraphResources:
        """An empty generation; nothing native happens until the first warm-up."""
        if context is not self.init.context:
            raise ResourceError(
                f"{COMPONENT}: graph resources must live in the dispatcher's RuntimeContext, "
                "where its forwards look them up"
            )
        if self._graph is not None and not self._graph.closed:
            raise ResourceError(
                f"{COMPONENT}: {self._graph!r} is still open; close it before a recapture"
            )
        self._generations += 1
        self._graph = NcclEpGraphResources(
            capacity=capacity,
            generation=self._generations,
            layout=self.layout,
            api=self.api,
            communicator=self._communicator,
            provider=self,
        )
        return self._graph

    def warm_up_graph_resources(self, resources: Any, num_tokens: int) -> None:
        self._own(resources).warm_up(num_tokens)

    def close_graph_resources(self, resources: Any) -> None:
        self._own(resources).close()

    def _own(self, resources: Any) -> NcclEpGraphResources:
        if not isinstance(resources, NcclEpGraphResources) or resources.provider is not self:
            raise ResourceError(f"{COMPONENT}: {resources!r} was not created by this dispatcher")
        return resources

    # -- eager path ---------------------------------------------------------------------------
    def _communicator(self) -> Any:
        if self._comm is None:
            self._comm = native.open_communicator(self.api, self.init.parallel, self.device)
        return self._comm.comm

    def _dispatch_eager(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> ExpertMajorDispatchOutput:
        num_tokens = x.shape[0]
        if num_tokens > self.capacity:
            raise ValueError(
                f"{COMPONENT}: {num_tokens} tokens exceed max_tokens_per_rank {self.capacity} "
                "(the EP group's max_dispatch_tokens_per_rank)"
            )
        if num_tokens == 0:
            # A rank without tokens still joins the collective: one row routed nowhere.
            x = x.new_zeros(1, x.shape[1])
            ids = ids.new_full((1, ids.shape[1]), -1)
            weights = weights.new_zeros(1, weights.shape[1])
        if self._group is None:
            lay = self.layout
            self._group = native.create_group(
                self.api,
                self._communicator(),
                num_experts=lay.num_experts,
                max_tokens=self.capacity,
                hidden=lay.hidden,
                top_k=lay.top_k,
            )
            rows = lay.world_size * self.capacity
            self._recv = torch.empty(
                lay.num_local, rows, lay.hidden, dtype=torch.bfloat16, device=self.device
            )
            self._counters = torch.zeros(lay.num_local, dtype=torch.int32, device=self.device)
        assert self._recv is not None and self._counters is not None
        if self._inflight is not None:  # an earlier layer raised between dispatch and combine
            logger.warning("%s: dropping a dispatch that was never combined", COMPONENT)
            self._inflight.handle.destroy()
            self._inflight = None
        stream = native.stream_of(self.device)
        routing = self.api.ep.Tensor(ids)
        handle = native.create_handle(self.api, self._group, routing, stream)
        try:
            native.dispatch(
                self.api,
                handle,
                x,
                self._recv,
                self._counters,
                num_tokens=x.shape[0],
                stream=stream,
            )
        except BaseException:
            handle.destroy()
            raise
        self._inflight = _EagerLease(handle, routing, weights, num_tokens, x.shape[0])
        return ExpertMajorDispatchOutput(self._recv, self._counters, num_tokens, self._inflight)

    def _combine_eager(self, lease: _EagerLease, expert_output: torch.Tensor) -> torch.Tensor:
        assert self._recv is not None
        out = torch.empty(lease.rows, self.layout.hidden, dtype=torch.bfloat16, device=self.device)
        try:
            native.combine(
                self.api,
                lease.handle,
                expert_output,
                out,
                lease.topk_weights,
                recv_shape=tuple(self._recv.shape),  # type: ignore[arg-type]
                num_tokens=lease.rows,
                top_k=self.layout.top_k,
                stream=native.stream_of(self.device),
            )
        finally:
            lease.handle.destroy()
            self._inflight = None
        return out[: lease.num_tokens]

    # -- graph path ---------------------------------------------------------------------------
    def _graph_resources_for(self, num_tokens: int) -> NcclEpGraphResources | None:
        """The graph generation serving a forward of ``num_tokens``, or None (eager).

        Graph mode is on for bucket T from ``warm_up_graph_resources(resources, T)`` until the
        next warm-up or close. Under capture there is no eager fallback: a forward that the
        warm-up did not prepare is refused, since creating anything native there is illegal.
        """
        context = self.init.context
        resources = context.get(self.resource_name) if context.has(self.resource_name) else None
        if resources is not None and getattr(resources, "provider", None) is not self:
            raise ResourceError(
                f"{COMPONENT}: {self.resource_name!r} in the context was not created by this "
                f"dispatcher ({resources!r})"
            )
        if resources is not None and not resources.closed and resources.bucket == num_tokens:
            return resources
        if self.api.is_capturing():
            why = (
                f"none registered as {self.resource_name!r}"
                if resources is None
                else f"{resources!r} is not warmed up for it"
            )
            raise ResourceError(
                f"{COMPONENT}: dispatch of {num_tokens} tokens under CUDA-graph capture needs "
                f"graph resources warmed up for that bucket ({why}); call "
                f"warm_up_graph_resources(resources, {num_tokens}) outside capture first"
            )
        return None

    def _dispatch_graph(
        self,
        resources: NcclEpGraphResources,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> ExpertMajorDispatchOutput:
        num_tokens = x.shape[0]
        self._calls += 1
        borrower = f"{COMPONENT} forward call {self._calls}"
        context = self.init.context
        context.borrow(self.resource_name, borrower)  # refuses a second borrower
        try:
            res = resources.borrow(borrower, num_tokens)
            assert res.send_tokens is not None and res.topk_ids is not None
            assert res.topk_weights is not None and res.recv_tokens is not None
            assert res.expert_counters is not None
            res.send_tokens[:num_tokens].copy_(x)
            res.topk_ids[:num_tokens].copy_(ids)
            res.topk_weights[:num_tokens].copy_(weights)
            native.dispatch(
                self.api,
                res.handle,
                res.send_tokens[:num_tokens],
                res.recv_tokens,
                res.expert_counters,
                num_tokens=num_tokens,
                stream=native.stream_of(self.device),
            )
        except BaseException:
            if resources.borrower == borrower:
                resources.release(borrower)
            context.release(self.resource_name, borrower)
            raise
        lease = _GraphLease(resources, borrower, num_tokens)
        return ExpertMajorDispatchOutput(res.recv_tokens, res.expert_counters, num_tokens, lease)

    def _combine_graph(self, lease: _GraphLease, expert_output: torch.Tensor) -> torch.Tensor:
        res, t = lease.resources, lease.num_tokens
        if res.borrower != lease.borrower:
            raise ResourceError(
                f"{COMPONENT}: combine of {lease.borrower}, but the graph resources are held by "
                f"{res.borrower or 'nobody'}"
            )
        assert res.combined is not None and res.topk_weights is not None
        assert res.recv_tokens is not None
        try:
            native.combine(
                self.api,
                res.handle,
                expert_output,
                res.combined[:t],
                res.topk_weights[:t],
                recv_shape=tuple(res.recv_tokens.shape),  # type: ignore[arg-type]
                num_tokens=t,
                top_k=self.layout.top_k,
                stream=native.stream_of(self.device),
            )
            # Every layer of the generation combines into the same scratch: hand out a copy.
            out = res.combined[:t].clone()
        finally:
            res.release(lease.borrower)
            self.init.context.release(self.resource_name, lease.borrower)
        return out

    # -- validation ---------------------------------------------------------------------------
    def _check_inputs(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> int:
        """Validate the public inputs (NCCL EP would abort on most of these); returns T."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{COMPONENT}: hidden_states must be [T, H], got {shape}")
        t, k = x.shape[0], self.layout.top_k
        native.check_tensor(
            "hidden_states", x, (t, self.layout.hidden), torch.bfloat16, self.device
        )
        native.check_tensor("topk_ids", ids, (t, k), torch.int64, self.device)
        native.check_tensor("topk_weights", weights, (t, k), torch.float32, self.device)
        if t and not self.api.is_capturing():
            # One host sync per layer. Under capture it would break the capture, and a replay
            # runs no Python: the recorded graph trusts the router's ids.
            native.check_expert_ids(ids, self.layout.num_experts)
        return t


def _resolve(device: torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
