"""Correct fake backends pass the suites: graph metadata, per-rank tokens, expert-major, ..."""

from __future__ import annotations

from execrt.testing.attention import AttentionBackendSuite
from execrt.testing.graph import GraphBackendSuite
from execrt.testing.moe import MoEDispatcherSuite
from tests.testing import fake_backends as fakes

HERE = "tests.testing.fake_backends"


class TestStaticGraphAttention(AttentionBackendSuite):
    """A graph-claiming backend that is right: the graph tests must pass, not only skip."""

    factory = f"{HERE}:StaticGraphAttention"
    capabilities = fakes.GRAPH_CAPS
    devices = ("cpu",)


class TestStoringAttention(AttentionBackendSuite):
    """A backend that stores K/V itself (``stores_kv``) passes the same suite: it is handed
    this step's K/V, and the harness stores none for it."""

    factory = f"{HERE}:StoringAttention"
    capabilities = fakes.STORES_CAPS
    devices = ("cpu",)


class TestAllGatherDispatch(MoEDispatcherSuite):
    """Per-rank (non-replicated) tokens at world size 1 and 2."""

    factory = f"{HERE}:AllGatherDispatcher"
    capabilities = fakes.ALLGATHER_CAPS
    devices = ("cpu",)


class TestExpertMajorDispatch(MoEDispatcherSuite):
    factory = f"{HERE}:ExpertMajorDispatcher"
    capabilities = fakes.EXPERT_MAJOR_CAPS
    devices = ("cpu",)


class TestResourceGraph(GraphBackendSuite):
    factory = f"{HERE}:ResourceReexecGraph"
    capabilities = fakes.RESOURCE_CAPS
    devices = ("cpu",)
