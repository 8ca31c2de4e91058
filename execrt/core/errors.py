"""Exception classes, one per failure domain."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class ExecrtError(Exception):
    """Base class of every error execrt raises on purpose."""


class ConfigError(ExecrtError, ValueError):
    """A configuration value is invalid; the message names key, value and what is accepted.

    ``ConfigError(message)`` is the whole constructor a plugin needs; ``keys`` is optional.

    Attributes:
        keys: the RuntimeConfig keys whose values the error is about, e.g.
            ``("context_len",)``, when the message does not say which source gave them (TOML
            file, ``EXECRT_*`` variable, flag, keyword argument): most often a value that the
            model or this machine cannot run, found after the config loaded. Empty when the
            message names the source (``RuntimeConfig.load``'s errors) or the error is about
            no key. The CLI reads them to add ``(the environment sets
            EXECRT_CONTEXT_LEN=100000000)`` for a key that a variable set and no flag
            overrode.
    """

    def __init__(self, *args: object, keys: Iterable[str] = ()) -> None:
        super().__init__(*args)
        self.keys = tuple(keys)


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
