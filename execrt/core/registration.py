"""Type checks of a backend registration: every field, its element types, the kind's interface.

pluggy's rule: a plugin is validated whole when it registers, so a mistake is one refusal
naming the plugin, the field and the value, never a crash later in ``execrt backends`` or
"auto" for everyone who has the plugin installed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

from execrt.core.interfaces import AttentionBackend, Capabilities, GraphBackend, MoEDispatcher
from execrt.core.prefix_cache import PrefixCache

#: kind -> the interface what a factory builds must implement
INTERFACES: dict[str, type] = {
    "attention": AttentionBackend,
    "moe_dispatch": MoEDispatcher,
    "graph": GraphBackend,
    "prefix_cache": PrefixCache,
}


def option_problems(
    factory: object,
    requires: object,
    install_hint: object,
    priority: object,
    auto_devices: object,
    description: object,
    check: object,
) -> list[str]:
    """What is wrong with the options of ``BackendRegistry.register`` (empty: nothing)."""
    out: list[str] = []
    if not (isinstance(factory, str) or callable(factory)):
        out.append(f"factory must be 'module:attr' or a callable, got {factory!r}")
    elif isinstance(factory, str) and ":" not in factory:
        out.append(f"factory {factory!r} must look like 'module:attr'")
    if isinstance(requires, str) or not (
        isinstance(requires, list | tuple) and all(isinstance(m, str) for m in requires)
    ):
        out.append(f"requires must be a tuple of module names (str), got {requires!r}")
    if not _conforms(priority, int):
        out.append(f"priority must be an int, got {priority!r}")
    if not _conforms(auto_devices, frozenset[str] | None):
        out.append(f"auto_devices must be a frozenset of str or None, got {auto_devices!r}")
    for label, value in (("install_hint", install_hint), ("description", description)):
        if not isinstance(value, str):
            out.append(f"{label} must be a str, got {value!r}")
    if check is not None and not callable(check):
        out.append(f"check must be a callable or None, got {check!r}")
    return out


def capability_problems(capabilities: Capabilities) -> list[str]:
    """Fields of a capability record whose value does not have the declared type, element
    types included (``head_dims={"64"}``, ``devices="cuda"``), or is an empty set (a backend
    that supports nothing; ``None`` is the way to say "any")."""
    try:
        hints = typing.get_type_hints(type(capabilities))
    except Exception:  # a plugin's own subclass with annotations that do not resolve
        hints = {}
    out: list[str] = []
    for f in dataclasses.fields(capabilities):  # type: ignore[arg-type]
        value = getattr(capabilities, f.name)
        declared = hints.get(f.name)
        if declared is None:
            continue
        if not _conforms(value, declared):
            out.append(f"capabilities.{f.name} must be {_describe(declared)}, got {value!r}")
        elif isinstance(value, frozenset) and not value:
            out.append(f"capabilities.{f.name} is empty (use None for 'any')")
        else:
            out += _value_problems(f.name, value)
    return out


def _value_problems(field: str, value: object) -> list[str]:
    """Values of the right type that no backend can mean: a device type torch does not
    know (``"gpu"``: the backend would be refused everywhere), a dtype that is not a
    floating-point one (models and caches are), a size or ratio below 1."""
    members = value if isinstance(value, frozenset) else (value,)
    bad: list[str] = []
    for member in members:
        if isinstance(member, str) and field == "devices":
            try:
                torch.device(member)
            except (RuntimeError, ValueError):
                bad.append(repr(member))
        elif isinstance(member, torch.dtype) and not member.is_floating_point:
            bad.append(str(member))
        elif isinstance(member, int) and not isinstance(member, bool) and member < 1:
            bad.append(repr(member))
    if not bad:
        return []
    accepted = {
        "devices": "device types such as 'cpu' and 'cuda'",
        "dtypes": "floating-point dtypes",
        "kv_dtypes": "floating-point dtypes",
    }.get(field, "integers >= 1")
    return [f"capabilities.{field} holds {', '.join(sorted(bad))} (accepted: {accepted})"]


def interface_problem(kind: str, factory: object) -> str | None:
    """A factory that is a class but not a subclass of the kind's interface, or one that
    leaves some of its abstract methods unwritten (None: fine, or not knowable before it is
    called)."""
    interface = INTERFACES.get(kind)
    if interface is None or not isinstance(factory, type):
        return None
    if not issubclass(factory, interface):
        return f"{_name(factory)} does not implement {interface.__name__} (subclass it)"
    missing = sorted(getattr(factory, "__abstractmethods__", ()))
    if missing:
        return (
            f"{_name(factory)} does not implement {interface.__name__}'s "
            f"{', '.join(missing)} (abstract: it cannot be built)"
        )
    return None


def built_problem(kind: str, built: object) -> str | None:
    """What a factory returned, when it does not implement the kind's interface or breaks
    a promise the engine relies on only later (a graph claim without the graph methods, a
    padding fill value a graph cannot use): named now, once, not as a traceback mid-run."""
    interface = INTERFACES.get(kind)
    if interface is None:
        return None
    if not isinstance(built, interface):
        return (
            f"factory built {type(built).__name__}, which does not implement {interface.__name__}"
        )
    if isinstance(built, AttentionBackend):
        return _attention_contract_problem(built)
    return None


def _attention_contract_problem(backend: AttentionBackend) -> str | None:
    name = type(backend).__name__
    fill = backend.graph_seq_len_fill_value
    if not isinstance(fill, int) or isinstance(fill, bool) or fill < 1:
        return (
            f"{name}.graph_seq_len_fill_value must be an int >= 1 (the context length of a "
            f"padded graph row, which reads slot 0), got {fill!r}"
        )
    return graph_claim_problem(type(backend), getattr(backend, "capabilities", None), name)


def graph_claim_problem(cls: type, capabilities: object, name: str | None = None) -> str | None:
    """An attention backend class whose ``capabilities`` claim ``graph`` without the two graph
    methods: refused before it is built (its registered capabilities) and when built (its
    own)."""
    if not (issubclass(cls, AttentionBackend) and getattr(capabilities, "graph", False)):
        return None
    missing = [
        method
        for method in ("init_graph_state", "plan_graph")
        if getattr(cls, method) is getattr(AttentionBackend, method)
    ]
    if not missing:
        return None
    return (
        f"{name or _name(cls)} declares capabilities.graph = True but does not implement "
        f"{' and '.join(missing)} (implement them, or declare graph = False)"
    )


def check_result_problem(result: object) -> str | None:
    """A ``check`` must return a list (or tuple) of reasons, each a str."""
    if isinstance(result, list | tuple) and all(isinstance(r, str) for r in result):
        return None
    return f"check returned {result!r}, not a list of str"


def _conforms(value: object, declared: Any) -> bool:
    origin = typing.get_origin(declared)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arm) for arm in typing.get_args(declared))
    if declared is type(None):
        return value is None
    if origin in (frozenset, set, tuple, list):
        args = typing.get_args(declared)
        element = args[0] if args else Any
        return isinstance(value, origin) and all(_conforms(v, element) for v in value)
    if declared is bool:
        return isinstance(value, bool)
    if declared is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if declared is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(declared, type):
        return isinstance(value, declared)
    return True  # Any, ClassVar, a TypeVar: nothing to check


def _describe(declared: Any) -> str:
    if isinstance(declared, type) and typing.get_origin(declared) is None:
        return declared.__name__
    return str(declared).replace("typing.", "").replace("NoneType", "None")


def _name(obj: Callable[..., Any] | type) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"
