"""Plugin contract: pluggy hookspecs, BackendSpec and the validated BackendRegistry.

Loading plugins (entry points, the built-in plugin) is the edge's job: ``execrt.plugins.host``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import pluggy

from execrt.core.errors import BackendUnavailableError, PluginError
from execrt.core.interfaces import (
    AttentionCapabilities,
    Capabilities,
    GraphCapabilities,
    MoEDispatcherCapabilities,
)
from execrt.core.prefix_cache import PrefixCacheCapabilities
from execrt.core.registration import (
    built_problem,
    capability_problems,
    check_result_problem,
    graph_claim_problem,
    interface_problem,
    option_problems,
)

logger = logging.getLogger(__name__)

PROJECT = "execrt"
NO_GRAPH = "none"  # graph_backend (and prefix_cache) value: no backend of that kind at all

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: kind -> the capability record type a backend of that kind must declare
KINDS: dict[str, type[Capabilities]] = {
    "attention": AttentionCapabilities,
    "moe_dispatch": MoEDispatcherCapabilities,
    "graph": GraphCapabilities,
    "prefix_cache": PrefixCacheCapabilities,
}


class Hookspecs:
    """The hooks an execrt plugin may implement. Hooks are called by keyword."""

    @hookspec
    def execrt_register_backends(self, registry: BackendRegistry) -> None:
        """Register backend factories with ``registry.register(...)``.

        Must be cheap: register factories as ``"module:attr"`` strings so that loading the
        plugin imports no kernel library. Called once per plugin host.
        """


C = TypeVar("C", bound=Capabilities)
N = TypeVar("N", bound=Capabilities)


@dataclass(frozen=True)
class BackendSpec(Generic[C]):
    """A registered backend: what it claims (its kind's capability record ``C``) and how to
    build it (lazily).

    ``factory`` is ``"module:attr"`` (imported on first use) or a callable taking the kind's
    init record. ``requires`` lists modules that must be importable. ``check`` adds refusals
    that depend on the environment (called with the requirements; must not import kernels).
    ``priority`` orders "auto" (higher first); ``auto_devices`` limits where "auto" may pick it
    (default: every device in its capabilities). What the factory builds must implement the
    kind's interface (``AttentionBackend``, ``MoEDispatcher``, ``GraphBackend``, ...).
    """

    kind: str
    name: str
    factory: str | Callable[[Any], Any]
    capabilities: C
    plugin: str
    version: str
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    priority: int = 0
    auto_devices: frozenset[str] | None = None
    description: str = ""
    check: Callable[[Any], list[str]] | None = None

    def narrowed(self, capabilities_type: type[N]) -> BackendSpec[N]:
        """This spec, typed by its kind's capability record (TypeError if it is not one)."""
        if not isinstance(self.capabilities, capabilities_type):
            raise TypeError(
                f"{self.kind} backend {self.name!r}: capabilities are "
                f"{type(self.capabilities).__name__}, not {capabilities_type.__name__}"
            )
        return cast("BackendSpec[N]", self)

    def refusals(self, requirements: Any) -> list[str]:
        """Why this backend cannot serve ``requirements`` here (empty: usable)."""
        return self.assess(requirements)[0]

    def assess(self, requirements: Any) -> tuple[list[str], str | None]:
        """``refusals``, and what is wrong with the plugin's ``check`` itself where it ran:
        it raised, or answered something other than a list of reasons (None: it answered,
        or did not run). Selection takes that as a refusal, never a crash of `execrt
        backends` or of "auto"; the conformance suite fails on it, since otherwise every case
        would be skipped as "refused here" and the suite pass."""
        out = [self._missing(m) for m in self.requires if not _importable(m)]
        out += self.capabilities.refusals(requirements)
        if self.check is None or out:
            return out, None
        try:
            result = self.check(requirements)
        except Exception as exc:
            problem = f"plugin {self.plugin!r}: check raised {exc!r}"
        else:
            answer = check_result_problem(result)
            if answer is None:
                return list(result), None
            problem = f"plugin {self.plugin!r}: {answer}"
        return [problem], problem

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
        """The factory, imported if it is a string; a class that is not a subclass of the
        kind's interface is refused (BackendUnavailableError) before anything is built."""
        if callable(self.factory):
            loaded = self.factory
        else:
            module_name, _, attr = self.factory.partition(":")
            try:
                module = importlib.import_module(module_name)
                loaded = getattr(module, attr)
            except Exception as exc:
                hint = f" ({self.install_hint})" if self.install_hint else ""
                raise BackendUnavailableError(
                    self.kind,
                    self.name,
                    [f"plugin {self.plugin!r}: cannot load {self.factory}: {exc!r}{hint}"],
                ) from exc
        problem = interface_problem(self.kind, loaded)
        if problem is None and isinstance(loaded, type):
            problem = graph_claim_problem(loaded, self.capabilities)
        if problem is None and not callable(loaded):
            problem = f"factory {self.factory} is {loaded!r}, not a callable"
        if problem is not None:
            raise BackendUnavailableError(
                self.kind, self.name, [f"plugin {self.plugin!r}: {problem}"]
            )
        return loaded

    def problems(self, requirements: Any) -> list[str]:
        """Why this backend cannot be picked for ``requirements``: its refusals, else why its
        factory cannot be loaded (empty: usable, as far as can be told without building it)."""
        return self.refusals(requirements) or self.factory_problems()

    def factory_problems(self) -> list[str]:
        """Why the factory cannot be loaded (imports its module, builds nothing)."""
        try:
            self.load_factory()
        except BackendUnavailableError as exc:
            return list(exc.reasons)
        return []

    def create(self, init: Any) -> Any:
        """Build the backend from the kind's init record.

        Any failure (import or constructor) becomes a BackendUnavailableError of one line
        naming the plugin, so a broken third-party backend never surfaces as a traceback.
        """
        factory = self.load_factory()
        try:
            built = factory(init)
        except BackendUnavailableError:
            raise
        except Exception as exc:
            raise BackendUnavailableError(
                self.kind, self.name, [f"plugin {self.plugin!r}: constructor raised {exc!r}"]
            ) from exc
        problem = built_problem(self.kind, built)
        if problem is not None:
            # Not a backend: refused here, so "auto" falls through to the next candidate
            # instead of handing the runner an object that fails at its first call.
            raise BackendUnavailableError(
                self.kind, self.name, [f"plugin {self.plugin!r}: {problem}"]
            )
        return built

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
    """Backends by (kind, name). Registration is validated; a clash names both plugins and the
    first registrant keeps the name."""

    def __init__(self) -> None:
        self._specs: dict[tuple[str, str], BackendSpec[Capabilities]] = {}
        # A name claimed twice stays with its first registrant; the newcomer is refused whole.
        self._conflicts: dict[tuple[str, str], tuple[str, str]] = {}
        # plugin -> its first refused registration, kept even if its hook caught the error
        self._refused: dict[str, PluginError] = {}
        # plugin -> why it was skipped whole (``note_skipped``): told with a name not found
        self._skipped: dict[str, str] = {}
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
    ) -> BackendSpec[Capabilities]:
        """Register a backend factory. Raises PluginError for an invalid or clashing entry;
        the first one per plugin is also recorded (``refusal``), so a hook that catches it
        cannot keep the rest of its backends. Every argument is checked here, element types
        too (pluggy's rule: a plugin is validated whole when it registers)."""
        options = dict(
            requires=requires,
            install_hint=install_hint,
            priority=priority,
            auto_devices=auto_devices,
            description=description,
            check=check,
        )
        try:
            self._validate(kind, name, factory, capabilities, options)
        except PluginError as exc:
            self._refused.setdefault(self._plugin, exc)
            raise
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
        self._specs[(kind, name)] = spec
        return spec

    def _validate(
        self,
        kind: object,
        name: object,
        factory: object,
        capabilities: object,
        options: dict[str, Any],
    ) -> None:
        """Raise PluginError (attributed to the current plugin) for an invalid or taken name,
        or any argument of the wrong type."""
        if not isinstance(kind, str) or kind not in KINDS:
            raise PluginError(
                self._plugin, f"unknown backend kind {kind!r} (kinds: {', '.join(KINDS)})"
            )
        if (
            not isinstance(name, str)
            or not name
            or name in {"auto", NO_GRAPH}
            or not name.replace("_", "").replace("-", "").replace(".", "").isalnum()
        ):
            raise PluginError(
                self._plugin,
                f"invalid backend name {name!r} (use letters, digits, '_', '-' and '.'; "
                f"{'auto'!r} and {NO_GRAPH!r} are reserved)",
            )
        if not isinstance(capabilities, KINDS[kind]):
            raise PluginError(
                self._plugin,
                f"{kind} backend {name!r} must declare {KINDS[kind].__name__}, "
                f"got {type(capabilities).__name__}",
            )
        problems = option_problems(factory, **options) + capability_problems(capabilities)
        if problems:
            raise PluginError(self._plugin, f"{kind} backend {name!r}: " + "; ".join(problems))
        key = (kind, name)
        if key in self._specs:
            first = self._specs[key].plugin
            if first == self._plugin:  # the plugin is refused whole: nobody keeps the name
                raise PluginError(
                    self._plugin, f"{kind} backend {name!r} is registered twice by this plugin"
                )
            self._conflicts.setdefault(key, (first, self._plugin))
            raise PluginError(
                self._plugin,
                f"{kind} backend {name!r} is already registered by plugin {first!r}, "
                "which keeps it",
            )

    def remove_plugin(self, plugin: str) -> None:
        """Forget everything ``plugin`` registered (after its hook failed half-way), and its
        recorded refusal."""
        self._refused.pop(plugin, None)
        for key in [k for k, s in self._specs.items() if s.plugin == plugin]:
            del self._specs[key]

    def refusal(self, plugin: str) -> PluginError | None:
        """The first registration of ``plugin`` that was refused, None if none was."""
        return self._refused.get(plugin)

    def note_skipped(self, plugin: str, reason: str) -> None:
        """Record that ``plugin`` registered nothing, and why (its host failed to load it, or
        refused it whole): a lookup of a name that is not registered says so, since the name
        may well be that plugin's."""
        self._skipped.setdefault(plugin, reason)

    def get(
        self, kind: str, name: str, keywords: tuple[str, ...] = ()
    ) -> BackendSpec[Capabilities]:
        """The spec registered as ``name``; else BackendUnavailableError listing the
        registered names and the ``keywords`` the caller also accepts (e.g. "auto")."""
        try:
            return self._specs[(kind, name)]
        except KeyError:
            known = ", ".join(self.names(kind)) or "none"
            also = f"; or {', '.join(keywords)}" if keywords else ""
            reasons = [f"not registered (registered: {known}{also})"]
            reasons += [f"plugin {p!r} was skipped: {why}" for p, why in self._skipped.items()]
            raise BackendUnavailableError(kind, name, reasons) from None

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, name in self._specs if k == kind)

    def specs(self, kind: str | None = None) -> list[BackendSpec[Capabilities]]:
        """Specs of one kind (or all), highest priority first, then by name."""
        found = [s for (k, _), s in self._specs.items() if kind is None or k == kind]
        return sorted(found, key=lambda s: (list(KINDS).index(s.kind), -s.priority, s.name))

    def conflicts(self) -> dict[tuple[str, str], tuple[str, str]]:
        """(kind, name) -> (the plugin that keeps it, the first plugin refused it)."""
        return dict(self._conflicts)
