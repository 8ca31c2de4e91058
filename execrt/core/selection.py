"""Selection: resolving "auto" or a name to a usable backend, and the resolution report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from execrt.core.errors import BackendUnavailableError
from execrt.core.interfaces import Capabilities
from execrt.core.plugins import NO_GRAPH, BackendRegistry, BackendSpec

#: Kinds the runtime can do without: "none" builds nothing and "auto" with no usable candidate
#: falls back to none (unless strict). Value: what the note calls them.
OPTIONAL_KINDS = {"graph": "graphs", "prefix_cache": "prefix cache"}


@dataclass(frozen=True)
class Resolution:
    """How one backend kind was resolved: requested, chosen, and every rejection with reasons."""

    kind: str
    requested: str
    chosen: str | None
    rejected: tuple[tuple[str, tuple[str, ...]], ...] = ()
    note: str = ""

    def describe(self) -> str:
        line = f"{self.kind}: requested {self.requested!r} -> {self.chosen or 'none'}"
        if self.note:
            line += f" ({self.note})"
        for name, reasons in self.rejected:
            line += f"\n  rejected {name}: " + "; ".join(reasons)
        return line

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "requested": self.requested,
            "chosen": self.chosen,
            "rejected": {name: list(reasons) for name, reasons in self.rejected},
            "note": self.note,
        }


@dataclass
class ResolutionReport:
    resolutions: list[Resolution] = field(default_factory=list)

    def describe(self) -> str:
        return "\n".join(r.describe() for r in self.resolutions)


def resolve_backend(
    registry: BackendRegistry,
    kind: str,
    requested: str,
    requirements: Any,
    *,
    strict: bool = False,
) -> Resolution:
    """Pick the backend of ``kind`` for ``requirements``. Builds nothing (it may import a
    candidate's factory module, to prove it loads).

    An explicit name must be usable, else BackendUnavailableError with its reasons. "auto"
    takes the highest-priority usable backend among those that claim the device for auto;
    with ``strict`` a refused higher-priority candidate is an error instead of a fallback.
    For an optional kind (graphs, the prefix cache), "none" disables it and "auto" falls back
    to none when nothing is usable.
    """
    resolution, _ = _walk(registry, kind, requested, requirements, strict, build=None)
    return resolution


def build_backend(
    registry: BackendRegistry,
    kind: str,
    requested: str,
    requirements: Any,
    make_init: Callable[[BackendSpec[Capabilities]], object],
    *,
    strict: bool = False,
) -> tuple[Any, Resolution]:
    """Resolve like ``resolve_backend`` and build the choice with ``spec.create(make_init(spec))``.

    Under "auto" (and not ``strict``) a candidate whose factory or constructor fails is
    skipped with the reason in the report and the next one is tried. Returns ``(None,
    resolution)`` only for an optional kind (``OPTIONAL_KINDS``) when none is chosen.
    """
    resolution, backend = _walk(registry, kind, requested, requirements, strict, build=make_init)
    return backend, resolution


def _walk(
    registry: BackendRegistry,
    kind: str,
    requested: str,
    requirements: Any,
    strict: bool,
    build: Callable[[BackendSpec[Capabilities]], object] | None,
) -> tuple[Resolution, Any]:
    def attempt(spec: BackendSpec[Capabilities]) -> tuple[list[str], Any]:
        reasons = spec.problems(requirements)
        if reasons or build is None:
            return reasons, None
        try:
            return [], spec.create(build(spec))
        except BackendUnavailableError as exc:
            return list(exc.reasons), None

    if kind in OPTIONAL_KINDS and requested == NO_GRAPH:
        return Resolution(kind, requested, None, note=f"{OPTIONAL_KINDS[kind]} disabled"), None
    if requested != "auto":
        words = ("auto", NO_GRAPH) if kind in OPTIONAL_KINDS else ("auto",)
        reasons, backend = attempt(registry.get(kind, requested, keywords=words))
        if reasons:
            raise BackendUnavailableError(kind, requested, reasons)
        return Resolution(kind, requested, requested), backend
    device = requirements.device
    rejected: list[tuple[str, tuple[str, ...]]] = []
    for spec in registry.specs(kind):
        if not spec.claims_for_auto(device):
            continue
        if strict and rejected:
            raise BackendUnavailableError(
                kind,
                "auto",
                [f"strict: preferred {n} unusable ({'; '.join(r)})" for n, r in rejected],
            )
        reasons, backend = attempt(spec)
        if not reasons:
            return Resolution(kind, requested, spec.name, tuple(rejected)), backend
        rejected.append((spec.name, tuple(reasons)))
    if kind in OPTIONAL_KINDS:
        if strict and rejected:
            raise BackendUnavailableError(
                kind, "auto", [f"{n}: {'; '.join(r)}" for n, r in rejected]
            )
        note = f"no {kind} backend for {device}"
        return Resolution(kind, requested, None, tuple(rejected), note=note), None
    raise BackendUnavailableError(
        kind,
        "auto",
        [f"{n}: {'; '.join(r)}" for n, r in rejected]
        or [f"no {kind} backend claims device {device}"],
    )
