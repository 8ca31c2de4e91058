"""Graph-lifetime resources through reexec on CPU: the lifecycle every graph backend shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from execrt.backends.graph.reexec import ReexecGraphBackend
from execrt.core.context import RuntimeContext
from execrt.core.errors import ResourceError
from execrt.core.interfaces import GraphBackendInit, ShapeKey
from execrt.plugins.builtin import REEXEC_GRAPH

NAME = "test_graph_resources"


class Provider:
    """Records every call, in one log shared with the captured functions."""

    resource_name = NAME

    def __init__(self, log: list[tuple[Any, ...]], fail_create: bool = False) -> None:
        self.log = log
        self.fail_create = fail_create
        self.created: list[dict[str, int]] = []
        self.closed: list[dict[str, int]] = []

    def create_graph_resources(self, capacity: int, context: RuntimeContext) -> dict[str, int]:
        if self.fail_create:
            raise RuntimeError("no buffers today")
        resources = {"capacity": capacity, "generation": len(self.created)}
        self.created.append(resources)
        self.log.append(("create", capacity))
        return resources

    def warm_up_graph_resources(self, resources: dict[str, int], num_tokens: int) -> None:
        assert resources in self.created and resources not in self.closed
        self.log.append(("warm", resources["generation"], num_tokens))

    def close_graph_resources(self, resources: dict[str, int]) -> None:
        self.log.append(("close", resources["generation"]))
        self.closed.append(resources)


def make(
    context: RuntimeContext, fail_create: bool = False
) -> tuple[ReexecGraphBackend, Provider, list[tuple[Any, ...]]]:
    log: list[tuple[Any, ...]] = []
    provider = Provider(log, fail_create)
    init = GraphBackendInit(REEXEC_GRAPH, torch.device("cpu"), context, provider)
    return ReexecGraphBackend(init), provider, log


def step(log: list[tuple[Any, ...]], bs: int) -> Callable[[], torch.Tensor]:
    def fn() -> torch.Tensor:
        log.append(("fn", bs))
        return torch.full((bs, 2), float(bs))

    return fn


def capture(backend: ReexecGraphBackend, log: list[tuple[Any, ...]], *sizes: int) -> None:
    with backend.capture_session():
        for bs in sizes:
            backend.capture(ShapeKey(bs), step(log, bs))


def test_created_once_sized_by_the_first_key_and_warmed_before_each_capture() -> None:
    with RuntimeContext() as context:
        backend, provider, log = make(context)
        capture(backend, log, 8, 4)
        capture(backend, log, 2)  # a second session of the same generation reuses them
        assert log == [
            ("create", 8),
            ("warm", 0, 8),
            ("fn", 8),
            ("warm", 0, 4),
            ("fn", 4),
            ("warm", 0, 2),
            ("fn", 2),
        ]
        assert context.get(NAME) is provider.created[0]
        assert context.owner_of(NAME) == "reexec graph backend"


def test_each_replay_warms_its_key_up_again_before_re_running_it() -> None:
    # A real graph's kernels carry their key's bucket; a re-run forward must find the
    # provider back on that bucket, whichever key was warmed (or replayed) last.
    with RuntimeContext() as context:
        backend, provider, log = make(context)
        capture(backend, log, 8, 4)
        log.clear()
        for bs in (8, 4, 8, 4):
            out = backend.replay(ShapeKey(bs))
            assert bool((out == float(bs)).all())
        assert log == [("warm", 0, 8), ("fn", 8), ("warm", 0, 4), ("fn", 4)] * 2
        assert len(provider.created) == 1 and provider.closed == []


def test_cleanup_closes_once_after_the_graphs_and_recapture_makes_a_new_generation() -> None:
    with RuntimeContext() as context:
        backend, provider, log = make(context)
        capture(backend, log, 4, 1)
        log.clear()
        backend.cleanup()
        backend.cleanup()
        assert log == [("close", 0)] and provider.closed == [provider.created[0]]
        assert not context.has(NAME) and not backend.has(ShapeKey(4))
        capture(backend, log, 16)  # a larger first key: the new generation is sized by it
        assert provider.created[1] == {"capacity": 16, "generation": 1}
        assert context.get(NAME) is provider.created[1]
        out = backend.replay(ShapeKey(16))
        assert out.shape == (16, 2) and bool((out == 16.0).all())


def test_a_key_beyond_the_capacity_is_refused_before_anything_runs() -> None:
    with RuntimeContext() as context:
        backend, provider, log = make(context)
        capture(backend, log, 4)
        log.clear()
        with pytest.raises(ValueError, match=r"8 tokens exceeds the graph resources' capacity 4"):
            capture(backend, log, 8)
        assert log == [] and not backend.has(ShapeKey(8)) and backend.has(ShapeKey(4))
        assert len(provider.created) == 1


def test_context_closing_first_still_resets_graphs_before_closing_resources() -> None:
    context = RuntimeContext()
    backend, provider, log = make(context)
    seen: list[bool] = []
    provider.close_graph_resources = lambda r: seen.append(backend.has(ShapeKey(2)))  # type: ignore[method-assign]
    capture(backend, log, 2)
    assert context.close() == []
    assert seen == [False], "resources closed while a graph still referenced them"
    backend.cleanup()  # the backend's own cleanup afterwards closes nothing twice
    assert seen == [False]


def test_close_is_refused_while_borrowed_and_retried_later() -> None:
    with RuntimeContext() as context:
        backend, provider, log = make(context)
        capture(backend, log, 2)
        context.borrow(NAME, "dispatcher")
        with pytest.raises(ResourceError, match="borrowed by dispatcher"):
            backend.cleanup()
        assert provider.closed == [] and not backend.has(ShapeKey(2))
        context.release(NAME, "dispatcher")
        backend.cleanup()
        assert provider.closed == provider.created and not context.has(NAME)


def test_a_failed_creation_registers_nothing() -> None:
    with RuntimeContext() as context:
        backend, _, log = make(context, fail_create=True)
        with pytest.raises(RuntimeError, match="no buffers today"):
            capture(backend, log, 2)
        assert not context.has(NAME) and not backend.has(ShapeKey(2)) and log == []
        backend.cleanup()


def test_a_name_taken_by_another_owner_is_refused_and_our_resources_closed() -> None:
    with RuntimeContext() as context:
        context.register(NAME, object(), owner="someone else")
        backend, provider, log = make(context)
        with pytest.raises(ResourceError, match="already registered by someone else"):
            capture(backend, log, 2)
        assert provider.closed == provider.created and len(provider.created) == 1
        assert context.owner_of(NAME) == "someone else"


def test_without_a_provider_nothing_is_registered() -> None:
    with RuntimeContext() as context:
        init = GraphBackendInit(REEXEC_GRAPH, torch.device("cpu"), context)
        backend = ReexecGraphBackend(init)
        capture(backend, [], 2)
        backend.cleanup()
        assert context.open_resources() == []
