"""execrt: a pluggable LLM execution runtime.

Pick attention, MoE-dispatch and graph backends by name; write new ones as pluggy plugins;
hold every backend to the conformance suites in ``execrt.testing``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.errors import (
    BackendUnavailableError,
    ConfigError,
    ExecrtError,
    ModelLoadError,
    OutOfKVCacheError,
    PluginError,
    RequestError,
    ResourceError,
)
from execrt.core.interfaces import AttentionBackend, GraphBackend, MoEDispatcher
from execrt.core.plugins import BackendRegistry, hookimpl
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine, GenerationResult

__all__ = [
    "AttentionBackend",
    "BackendRegistry",
    "BackendUnavailableError",
    "ConfigError",
    "Engine",
    "ExecrtError",
    "GenerationResult",
    "GraphBackend",
    "ModelLoadError",
    "MoEDispatcher",
    "OutOfKVCacheError",
    "PluginError",
    "RequestError",
    "ResourceError",
    "RuntimeConfig",
    "RuntimeContext",
    "SamplingParams",
    "hookimpl",
    "__version__",
]
