"""PluginHost: loads the built-in plugin and entry-point plugins into one BackendRegistry.

This is the edge of the plugin system: the core defines the hookspecs and the registry; the
host discovers plugins, records what failed, and is the process's only singleton.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import pluggy

from execrt._version import __version__
from execrt.core import envs
from execrt.core.errors import PluginError
from execrt.core.plugins import PROJECT, BackendRegistry, Hookspecs

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "execrt"
BUILTIN_PLUGIN = "execrt.builtin"


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    error: str


@dataclass
class PluginInfo:
    name: str
    version: str
    source: str  # "builtin", "entry point <dist>", "direct"


class PluginHost:
    """One pluggy PluginManager, the registry it fills, and what failed while loading."""

    def __init__(
        self,
        *,
        autoload: bool | None = None,
        environ: Mapping[str, str] | None = None,
        builtin: bool = True,
    ) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(Hookspecs)
        self.registry = BackendRegistry()
        self.failures: list[PluginFailure] = []
        self.plugins: list[PluginInfo] = []
        self._environ = environ
        if autoload is None:
            autoload = not envs.flag(envs.DISABLE_PLUGIN_AUTOLOAD, environ)
        if builtin:
            from execrt.plugins import builtin as builtin_plugin

            self.add_plugin(builtin_plugin, BUILTIN_PLUGIN, version=__version__, source="builtin")
        if autoload:
            self.load_entry_points()

    def add_plugin(
        self, plugin: object, name: str, *, version: str = "", source: str = "direct"
    ) -> bool:
        """Register a plugin object and collect its backends. False if it failed (reported)."""
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:
            self._fail(name, f"rejected by the plugin manager: {exc}")
            return False
        self.plugins.append(PluginInfo(name, version, source))
        return self._collect(name, version)

    def load_entry_points(self) -> None:
        """Load the ``execrt`` entry-point group, honouring EXECRT_PLUGINS."""
        allow = envs.plugin_allow_list(self._environ)
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if allow is not None:
            # A misspelt name would otherwise leave its backends silently unregistered.
            installed = sorted({ep.name for ep in entry_points})
            for name in sorted(allow - set(installed) - {BUILTIN_PLUGIN}):
                self._fail(
                    name,
                    f"named in {envs.PLUGINS}, but no installed entry point of group "
                    f"{ENTRY_POINT_GROUP!r} has that name "
                    f"(installed: {', '.join(installed) or 'none'})",
                )
        for ep in entry_points:
            if allow is not None and ep.name not in allow:
                continue
            dist = getattr(ep, "dist", None)
            version = getattr(dist, "version", "") or ""
            source = f"entry point ({getattr(dist, 'name', '?')})"
            try:
                plugin = ep.load()
            except Exception as exc:
                self._fail(ep.name, f"failed to import {ep.value}: {exc!r}")
                continue
            self.add_plugin(plugin, ep.name, version=version, source=source)

    def _collect(self, name: str, version: str) -> bool:
        impls = [
            i
            for i in self.pm.hook.execrt_register_backends.get_hookimpls()
            if i.plugin_name == name
        ]
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=name)
            self._fail(name, f"implements an unknown hook: {exc}")
            return False
        if not impls:  # e.g. the hook written without @hookimpl: nothing would say why
            self._fail(
                name,
                "registers nothing: it has no execrt_register_backends marked @hookimpl "
                "(pluggy.HookimplMarker('execrt'))",
            )
            return False
        for impl in impls:
            kwargs = {"registry": self.registry} if "registry" in impl.argnames else {}
            with self.registry.attributed_to(name, version):
                raised: Exception | None = None
                try:
                    impl.function(**kwargs)
                except Exception as exc:
                    raised = exc
            # A hook that caught the PluginError of a refused registration is rejected all the
            # same, with that first refusal.
            error = self.registry.refusal(name) or raised
            if error is not None:
                # Rejected whole: nothing it registered stays, and built-ins are untouched.
                self.registry.remove_plugin(name)
                self._fail(name, _failure_message(name, error))
                return False
        return True

    def _fail(self, plugin: str, message: str) -> None:
        self.failures.append(PluginFailure(plugin, message))
        self.registry.note_skipped(plugin, message)  # a lookup that misses names it
        logger.warning("plugin %r skipped: %s", plugin, message)


def _failure_message(plugin: str, exc: Exception) -> str:
    """What went wrong, without the ``plugin 'x':`` prefix the report adds itself."""
    if isinstance(exc, PluginError):
        return str(exc).removeprefix(f"plugin {plugin!r}: ")
    return f"execrt_register_backends raised {exc!r}"


_HOST: PluginHost | None = None


def get_plugin_host() -> PluginHost:
    """The process-wide plugin host (execrt's only singleton), created on first use."""
    global _HOST
    if _HOST is None:
        _HOST = PluginHost()
    return _HOST
