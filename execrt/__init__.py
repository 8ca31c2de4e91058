"""execrt: a pluggable LLM execution runtime.

Pick attention, MoE-dispatch and graph backends by name; write new ones as pluggy plugins;
hold every backend to the conformance suites in ``execrt.testing``.

Attributes resolve on first use, so ``from execrt import hookimpl`` (what a plugin does)
loads the plugin contract only, never the engine, the scheduler or the models.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from execrt._version import __version__

if TYPE_CHECKING:
    from execrt.core.config import RuntimeConfig
    from execrt.core.context import RuntimeContext
    from execrt.core.errors import (
        BackendUnavailableError,
        ConfigError,
        ExecrtError,
        ModelLoadError,
        PluginError,
        RequestError,
        ResourceError,
    )
    from execrt.core.interfaces import AttentionBackend, GraphBackend, MoEDispatcher
    from execrt.core.plugins import BackendRegistry, hookimpl
    from execrt.core.sampling_params import SamplingParams
    from execrt.engine import Engine, GenerationResult

_EXPORTS = {
    "AttentionBackend": "execrt.core.interfaces",
    "BackendRegistry": "execrt.core.plugins",
    "BackendUnavailableError": "execrt.core.errors",
    "ConfigError": "execrt.core.errors",
    "Engine": "execrt.engine",
    "ExecrtError": "execrt.core.errors",
    "GenerationResult": "execrt.engine",
    "GraphBackend": "execrt.core.interfaces",
    "ModelLoadError": "execrt.core.errors",
    "MoEDispatcher": "execrt.core.interfaces",
    "PluginError": "execrt.core.errors",
    "RequestError": "execrt.core.errors",
    "ResourceError": "execrt.core.errors",
    "RuntimeConfig": "execrt.core.config",
    "RuntimeContext": "execrt.core.context",
    "SamplingParams": "execrt.core.sampling_params",
    "hookimpl": "execrt.core.plugins",
}

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
    "PluginError",
    "RequestError",
    "ResourceError",
    "RuntimeConfig",
    "RuntimeContext",
    "SamplingParams",
    "__version__",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'execrt' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
