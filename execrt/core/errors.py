"""Exception classes, one per failure domain."""

from __future__ import annotations

from collections.abc import Sequence


class ExecrtError(Exception):
    """Base class of every error execrt raises on purpose."""


class ConfigError(ExecrtError, ValueError):
    """A configuration value is invalid; the message names key, value and what is accepted."""


class BackendUnavailableError(ExecrtError):
    """A configured backend cannot be used here.

    Attributes:
        kind: backend kind (``attention``, ``moe_dispatch``, ``graph``).
        name: backend name as requested.
        reasons: why it cannot be used, one short sentence each.
    """

    def __init__(self, kind: str, name: str, reasons: Sequence[str]) -> None:
        self.kind = kind
        self.name = name
        self.reasons = list(reasons)
        super().__init__(f"{kind} backend {name!r} unavailable: " + "; ".join(self.reasons))


class PluginError(ExecrtError):
    """A plugin misbehaved: failed to import, raised in a hook, or clashed with another plugin."""

    def __init__(self, plugin: str, message: str) -> None:
        self.plugin = plugin
        super().__init__(f"plugin {plugin!r}: {message}")


class KVOwnershipError(ExecrtError):
    """A KV slot or request row was freed twice, freed by one that does not hold it, or handed
    to two holders at once: a bug in the code that drives KVMemory, never a user mistake."""


class ResourceError(ExecrtError):
    """A runtime resource was misused: borrowed twice, closed while borrowed, unknown name."""


class ModelLoadError(ExecrtError):
    """A checkpoint cannot be loaded: missing or mis-shaped tensor, unsupported format."""


class RequestError(ExecrtError, ValueError):
    """One request is invalid; the engine reports it for that request and serves the others."""
