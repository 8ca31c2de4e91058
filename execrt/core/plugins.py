"""Plugins and selection: pluggy hookspecs, the backend registry, plugin loading, "auto"."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pluggy

from execrt.core import envs
from execrt.core.errors import BackendUnavailableError, PluginError
from execrt.core.interfaces import (
    AttentionCapabilities,
    Capabilities,
    GraphCapabilities,
    MoEDispatcherCapabilities,
)

logger = logging.getLogger(__name__)

PROJECT = "execrt"
ENTRY_POINT_GROUP = "execrt"
BUILTIN_PLUGIN = "execrt.builtin"
NO_GRAPH = "none"  # graph_backend value that disables graphs

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: kind -> the capability record type a backend of that kind must declare
KINDS: dict[str, type[Capabilities]] = {
    "attention": AttentionCapabilities,
    "moe_dispatch": MoEDispatcherCapabilities,
    "graph": GraphCapabilities,
}


class Hookspecs:
    """The hooks an execrt plugin may implement. Hooks are called by keyword."""

    @hookspec
    def execrt_register_backends(self, registry: BackendRegistry) -> None:
        """Register backend factories with ``registry.register(...)``.

        Must be cheap: register factories as ``"module:attr"`` strings so that loading the
        plugin imports no kernel library. Called once per plugin host.
        """


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend: what it claims and how to build it (lazily).

    ``factory`` is ``"module:attr"`` (imported on first use) or a callable taking the kind's
    init record. ``requires`` lists modules that must be importable. ``check`` adds refusals
    that depend on the environment (called with the requirements; must not import kernels).
    ``priority`` orders "auto" (higher first); ``auto_devices`` limits where "auto" may pick it
    (default: every device in its capabilities).
    """

    kind: str
    name: str
    factory: str | Callable[[Any], Any]
    capabilities: Capabilities
    plugin: str
    version: str
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    priority: int = 0
    auto_devices: frozenset[str] | None = None
    description: str = ""
    check: Callable[[Any], list[str]] | None = None

    def refusals(self, requirements: Any) -> list[str]:
        """Why this backend cannot serve ``requirements`` here (empty: usable)."""
        out = [self._missing(m) for m in self.requires if not _importable(m)]
        out += self.capabilities.refusals(requirements)  # type: ignore[attr-defined]
        if self.check is not None and not out:
            out += self.check(requirements)
        return out

    def unusable_here(self) -> list[str]:
        """Requirement-independent refusals: missing modules (used by ``execrt backends``)."""
        return [self._missing(m) for m in self.requires if not _importable(m)]

    def _missing(self, module: str) -> str:
        hint = f" ({self.install_hint})" if self.install_hint else ""
        return f"module {module!r} not installed{hint}"

    def claims_for_auto(self, device: str) -> bool:
        devices = self.auto_devices
        if devices is None:
            devices = getattr(self.capabilities, "devices", None) or frozenset()
        return device in devices

    def load_factory(self) -> Callable[[Any], Any]:
        if callable(self.factory):
            return self.factory
        module_name, _, attr = self.factory.partition(":")
        try:
            module = importlib.import_module(module_name)
            return getattr(module, attr)  # type: ignore[no-any-return]
        except (ImportError, AttributeError) as exc:
            hint = f" ({self.install_hint})" if self.install_hint else ""
            raise BackendUnavailableError(
                self.kind, self.name, [f"cannot load {self.factory}: {exc}{hint}"]
            ) from exc

    def create(self, init: Any) -> Any:
        """Build the backend from the kind's init record."""
        return self.load_factory()(init)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "plugin": self.plugin,
            "version": self.version,
            "priority": self.priority,
            "requires": list(self.requires),
            "install_hint": self.install_hint,
            "description": self.description,
            "capabilities": self.capabilities.as_dict(),
        }


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class BackendRegistry:
    """Backends by (kind, name). Registration is validated; clashes name both plugins."""

    def __init__(self) -> None:
        self._specs: dict[tuple[str, str], BackendSpec] = {}
        self._conflicts: dict[tuple[str, str], tuple[str, str]] = {}
        self._plugin = "<direct>"
        self._version = ""

    @contextmanager
    def attributed_to(self, plugin: str, version: str) -> Iterator[BackendRegistry]:
        """Registrations inside the block are attributed to ``plugin``."""
        previous = (self._plugin, self._version)
        self._plugin, self._version = plugin, version
        try:
            yield self
        finally:
            self._plugin, self._version = previous

    def register(
        self,
        kind: str,
        name: str,
        factory: str | Callable[[Any], Any],
        capabilities: Capabilities,
        *,
        requires: tuple[str, ...] = (),
        install_hint: str = "",
        priority: int = 0,
        auto_devices: frozenset[str] | None = None,
        description: str = "",
        check: Callable[[Any], list[str]] | None = None,
    ) -> BackendSpec:
        """Register a backend factory. Raises PluginError for an invalid or clashing entry."""
        if kind not in KINDS:
            raise PluginError(
                self._plugin, f"unknown backend kind {kind!r} (kinds: {', '.join(KINDS)})"
            )
        if not isinstance(capabilities, KINDS[kind]):
            raise PluginError(
                self._plugin,
                f"{kind} backend {name!r} must declare {KINDS[kind].__name__}, "
                f"got {type(capabilities).__name__}",
            )
        if (
            not name
            or name in {"auto", NO_GRAPH}
            or not name.replace("_", "").replace("-", "").replace(".", "").isalnum()
        ):
            raise PluginError(self._plugin, f"invalid backend name {name!r}")
        if isinstance(factory, str) and ":" not in factory:
            raise PluginError(self._plugin, f"factory {factory!r} must look like 'module:attr'")
        key = (kind, name)
        if key in self._conflicts:
            first, _ = self._conflicts[key]
            self._conflicts[key] = (first, self._plugin)
            raise PluginError(
                self._plugin, f"{kind} backend {name!r} is also registered by plugin {first!r}"
            )
        if key in self._specs:
            other = self._specs.pop(key).plugin
            self._conflicts[key] = (other, self._plugin)
            raise PluginError(
                self._plugin, f"{kind} backend {name!r} is also registered by plugin {other!r}"
            )
        spec = BackendSpec(
            kind=kind,
            name=name,
            factory=factory,
            capabilities=capabilities,
            plugin=self._plugin,
            version=self._version,
            requires=tuple(requires),
            install_hint=install_hint,
            priority=priority,
            auto_devices=auto_devices,
            description=description,
            check=check,
        )
        self._specs[key] = spec
        return spec

    def remove_plugin(self, plugin: str) -> None:
        """Forget everything ``plugin`` registered (after its hook failed half-way)."""
        for key in [k for k, s in self._specs.items() if s.plugin == plugin]:
            del self._specs[key]

    def get(self, kind: str, name: str) -> BackendSpec:
        key = (kind, name)
        if key in self._conflicts:
            a, b = self._conflicts[key]
            raise PluginError(
                a, f"{kind} backend {name!r} is claimed by both plugin {a!r} and plugin {b!r}"
            )
        try:
            return self._specs[key]
        except KeyError:
            known = ", ".join(self.names(kind)) or "none"
            raise BackendUnavailableError(
                kind, name, [f"not registered (registered: {known})"]
            ) from None

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, name in self._specs if k == kind)

    def specs(self, kind: str | None = None) -> list[BackendSpec]:
        """Specs of one kind (or all), highest priority first, then by name."""
        found = [s for (k, _), s in self._specs.items() if kind is None or k == kind]
        return sorted(found, key=lambda s: (list(KINDS).index(s.kind), -s.priority, s.name))

    def conflicts(self) -> dict[tuple[str, str], tuple[str, str]]:
        return dict(self._conflicts)


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
        self._collected: set[str] = set()
        if autoload is None:
            autoload = not envs.flag(envs.DISABLE_PLUGIN_AUTOLOAD, environ)
        if builtin:
            from execrt.plugins import builtin as builtin_plugin

            self.add_plugin(
                builtin_plugin, BUILTIN_PLUGIN, version=_execrt_version(), source="builtin"
            )
        if autoload:
            self.load_entry_points()

    def add_plugin(
        self, plugin: object, name: str, *, version: str = "", source: str = "direct"
    ) -> bool:
        """Register a plugin object and collect its backends. False if it failed (reported)."""
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001 - pluggy validation errors of any type
            self._fail(name, f"rejected by the plugin manager: {exc}")
            return False
        self.plugins.append(PluginInfo(name, version, source))
        return self._collect(name, version)

    def load_entry_points(self) -> None:
        """Load the ``execrt`` entry-point group, honouring EXECRT_PLUGINS."""
        allow = envs.plugin_allow_list(self._environ)
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allow is not None and ep.name not in allow:
                continue
            dist = getattr(ep, "dist", None)
            version = getattr(dist, "version", "") or ""
            source = f"entry point ({getattr(dist, 'name', '?')})"
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import-time failure is reported
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
        ok = True
        for impl in impls:
            kwargs = {"registry": self.registry} if "registry" in impl.argnames else {}
            with self.registry.attributed_to(name, version):
                try:
                    impl.function(**kwargs)
                except PluginError as exc:
                    self.registry.remove_plugin(name)
                    self._fail(name, str(exc))
                    ok = False
                except Exception as exc:  # noqa: BLE001 - a broken plugin must not stop others
                    self.registry.remove_plugin(name)
                    self._fail(name, f"execrt_register_backends raised {exc!r}")
                    ok = False
        return ok

    def _fail(self, plugin: str, message: str) -> None:
        self.failures.append(PluginFailure(plugin, message))
        logger.warning("plugin %r skipped: %s", plugin, message)


def _execrt_version() -> str:
    from execrt import __version__

    return __version__


_HOST: PluginHost | None = None


def get_plugin_host() -> PluginHost:
    """The process-wide plugin host (execrt's only singleton), created on first use."""
    global _HOST
    if _HOST is None:
        _HOST = PluginHost()
    return _HOST
