"""Conformance suites for backend authors: subclass one, name your backend, run pytest."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from execrt.testing.attention import AttentionBackendSuite
    from execrt.testing.graph import GraphBackendSuite
    from execrt.testing.moe import MoEDispatcherSuite
    from execrt.testing.prefix_cache import PrefixCacheSuite
    from execrt.testing.report import run_conformance
    from execrt.testing.suite import Case, ConformanceSuite

# The suites import pytest; resolve them on first use so that importing this package (or the
# oracles) never needs the test dependencies.
_EXPORTS = {
    "AttentionBackendSuite": "execrt.testing.attention",
    "MoEDispatcherSuite": "execrt.testing.moe",
    "GraphBackendSuite": "execrt.testing.graph",
    "PrefixCacheSuite": "execrt.testing.prefix_cache",
    "ConformanceSuite": "execrt.testing.suite",
    "Case": "execrt.testing.suite",
    "run_conformance": "execrt.testing.report",
}

__all__ = [
    "AttentionBackendSuite",
    "Case",
    "ConformanceSuite",
    "GraphBackendSuite",
    "MoEDispatcherSuite",
    "PrefixCacheSuite",
    "run_conformance",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'execrt.testing' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
