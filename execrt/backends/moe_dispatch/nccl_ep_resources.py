"""NcclEpGraphResources: the graph-lifetime NCCL EP group, persistent handle and fixed buffers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from execrt.backends.moe_dispatch import nccl_ep_native as native
from execrt.backends.moe_dispatch.nccl_ep_native import COMPONENT, NcclApi
from execrt.core.errors import ResourceError

GRAPH_RESOURCE_NAME = "nccl_ep_graph_resources"


@dataclass(frozen=True)
class EpLayout:
    """The shapes one dispatcher fixes for every layer."""

    num_experts: int
    world_size: int
    hidden: int
    top_k: int
    device: torch.device

    @property
    def num_local(self) -> int:
        return self.num_experts // self.world_size


class NcclEpGraphResources:
    """One capture generation of NCCL EP state, lent to the dispatcher one layer at a time.

    Created empty (``create_graph_resources``) and registered in the RuntimeContext by the
    graph backend, which owns it. The first ``warm_up(T)`` (outside capture) builds a
    graph-dedicated EP group, the fixed buffers and one persistent handle over
    ``topk_ids[:T]``; a later ``warm_up(T')`` rebinds that handle to ``topk_ids[:T']``, the
    same base pointer, so captured kernels keep reading the routing they were recorded with.
    ``bucket`` is the last warmed T: forwards of exactly ``bucket`` tokens use this state.
    The first warm-up of a bucket also runs it once (kernels loaded before capture); warming
    an already-run bucket up again, as a re-executing graph backend does before each replay,
    only rebinds the handle.

    Buffers (C = capacity): ``send_tokens`` bf16 [C, H]; ``topk_ids`` int64 [C, K], rows past
    the bucket hold -1; ``topk_weights`` fp32 [C, K]; ``recv_tokens`` bf16 [E_local, P*C, H];
    ``expert_counters`` int32 [E_local]; ``combined`` bf16 [C, H], shared by every layer.

    ``close()`` (after the graph backend synchronised and reset every graph) destroys the
    handle, then the group; it refuses while borrowed and is idempotent. A recapture builds a
    new generation: a new object.
    """

    def __init__(
        self,
        *,
        capacity: int,
        generation: int,
        layout: EpLayout,
        api: NcclApi,
        communicator: Callable[[], Any],
        provider: Any,
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"{COMPONENT}: graph capacity {capacity!r} unsupported (>= 1)")
        self.capacity = capacity
        self.generation = generation
        self.layout = layout
        self.provider = provider  # the dispatcher that made it; only it may borrow
        self._api = api
        self._communicator = communicator
        self.bucket: int | None = None
        self._run_buckets: set[int] = set()  # buckets whose kernels ran once (this generation)
        self.borrower: str | None = None
        self.closed = False
        self.group: Any = None
        self.handle: Any = None
        self._routing: Any = None  # the ep.Tensor the handle is bound to; kept alive
        self.send_tokens: torch.Tensor | None = None
        self.topk_ids: torch.Tensor | None = None
        self.topk_weights: torch.Tensor | None = None
        self.recv_tokens: torch.Tensor | None = None
        self.expert_counters: torch.Tensor | None = None
        self.combined: torch.Tensor | None = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("built" if self.built else "empty")
        held = f", borrowed by {self.borrower}" if self.borrower else ""
        return (
            f"NcclEpGraphResources(generation {self.generation}, capacity {self.capacity}, "
            f"bucket {self.bucket}, {state}{held})"
        )

    @property
    def built(self) -> bool:
        return self.handle is not None

    # -- warm-up, outside capture ---------------------------------------------------------------
    def warm_up(self, num_tokens: int) -> None:
        """Graph mode on for bucket ``num_tokens``: build on first use, rebind the routing
        (an update outside capture) when the handle is bound to another bucket, and on the
        bucket's first warm-up run one dispatch + combine so every kernel is loaded before
        capture. Nothing is created after the build."""
        self._refuse_if_closed("warm up")
        if self._api.is_capturing():
            raise ResourceError(
                f"{COMPONENT}: warm_up_graph_resources({num_tokens}) inside CUDA-graph capture; "
                "warm each bucket up before capturing it"
            )
        if self.borrower is not None:
            raise ResourceError(f"{COMPONENT}: cannot warm up while borrowed by {self.borrower}")
        if not isinstance(num_tokens, int) or not 1 <= num_tokens <= self.capacity:
            raise ValueError(
                f"{COMPONENT}: graph bucket {num_tokens!r} unsupported "
                f"(supported: 1..{self.capacity}, the graph capacity)"
            )
        stream = native.stream_of(self.layout.device)
        if not self.built:
            self._build(num_tokens, stream)
        elif self.bucket != num_tokens:
            assert self.topk_ids is not None
            self.topk_ids[num_tokens:].fill_(-1)
            routing = self._api.ep.Tensor(self.topk_ids[:num_tokens])
            native.update_handle(self._api, self.handle, routing, stream)
            self._routing = routing
        self.bucket = num_tokens
        if num_tokens not in self._run_buckets:
            self._prime(num_tokens, stream)
            self._run_buckets.add(num_tokens)

    def _build(self, num_tokens: int, stream: int) -> None:
        lay, cap = self.layout, self.capacity
        dev, bf16 = lay.device, torch.bfloat16
        self.send_tokens = torch.zeros(cap, lay.hidden, dtype=bf16, device=dev)
        self.topk_ids = torch.full((cap, lay.top_k), -1, dtype=torch.int64, device=dev)
        self.topk_weights = torch.zeros(cap, lay.top_k, dtype=torch.float32, device=dev)
        rows = lay.world_size * cap
        self.recv_tokens = torch.zeros(lay.num_local, rows, lay.hidden, dtype=bf16, device=dev)
        self.expert_counters = torch.zeros(lay.num_local, dtype=torch.int32, device=dev)
        self.combined = torch.zeros(cap, lay.hidden, dtype=bf16, device=dev)
        self.group = native.create_group(
            self._api,
            self._communicator(),
            num_experts=lay.num_experts,
            max_tokens=cap,
            hidden=lay.hidden,
            top_k=lay.top_k,
        )
        routing = self._api.ep.Tensor(self.topk_ids[:num_tokens])
        try:
            self.handle = native.create_handle(self._api, self.group, routing, stream)
        except BaseException:
            self.group.destroy()
            self.group = None
            raise
        self._routing = routing

    def _prime(self, num_tokens: int, stream: int) -> None:
        # Whatever the buffers hold is valid routing (ids in [-1, E)); the results are unused.
        assert self.recv_tokens is not None and self.combined is not None
        assert self.send_tokens is not None and self.topk_weights is not None
        assert self.expert_counters is not None
        native.dispatch(
            self._api,
            self.handle,
            self.send_tokens[:num_tokens],
            self.recv_tokens,
            self.expert_counters,
            num_tokens=num_tokens,
            stream=stream,
        )
        native.combine(
            self._api,
            self.handle,
            self.recv_tokens,
            self.combined[:num_tokens],
            self.topk_weights[:num_tokens],
            recv_shape=tuple(self.recv_tokens.shape),  # type: ignore[arg-type]
            num_tokens=num_tokens,
            top_k=self.layout.top_k,
            stream=stream,
        )

    # -- lending, one layer at a time -----------------------------------------------------------
    def borrow(self, borrower: str, num_tokens: int) -> NcclEpGraphResources:
        """Lend the state for one layer's dispatch..combine; refuses a second borrower."""
        self._refuse_if_closed(f"lend to {borrower}")
        if self.borrower is not None:
            raise ResourceError(
                f"{COMPONENT}: graph resources are borrowed by {self.borrower}; {borrower} must "
                "wait for its combine"
            )
        if not self.built or self.bucket != num_tokens:
            raise ResourceError(
                f"{COMPONENT}: graph resources warmed up for bucket {self.bucket}, not {num_tokens}"
            )
        self.borrower = borrower
        return self

    def release(self, borrower: str) -> None:
        if self.borrower != borrower:
            raise ResourceError(
                f"{COMPONENT}: {borrower} released graph resources held by "
                f"{self.borrower or 'nobody'}"
            )
        self.borrower = None

    # -- closing --------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the handle, then the group. Refuses while borrowed; idempotent."""
        if self.borrower is not None:
            raise ResourceError(
                f"{COMPONENT}: cannot close graph resources (generation {self.generation}) "
                f"while borrowed by {self.borrower}"
            )
        if self.closed:
            return
        if self._api.is_capturing():
            raise ResourceError(f"{COMPONENT}: cannot close graph resources inside capture")
        if self.layout.device.type == "cuda":
            torch.cuda.synchronize(self.layout.device)  # in-flight replays may still read them
        try:
            if self.handle is not None:
                self.handle.destroy()
            if self.group is not None:
                self.group.destroy()
        finally:
            self.closed = True
            self.handle = self.group = self._routing = None
            self.send_tokens = self.topk_ids = self.topk_weights = None
            self.recv_tokens = self.expert_counters = self.combined = None

    def _refuse_if_closed(self, what: str) -> None:
        if self.closed:
            raise ResourceError(
                f"{COMPONENT}: cannot {what}: graph resources generation {self.generation} are "
                "closed; a recapture creates a new generation"
            )
