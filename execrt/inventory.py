"""What ``execrt backends`` shows: every registered backend and whether it is usable here."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from execrt.core import envs
from execrt.core.interfaces import (
    AttentionCapabilities,
    AttentionRequirements,
    Capabilities,
    GraphCapabilities,
    GraphRequirements,
    MoEDispatcherCapabilities,
    MoERequirements,
)
from execrt.core.plugins import BackendSpec
from execrt.core.prefix_cache import PrefixCacheCapabilities, PrefixCacheRequirements
from execrt.plugins.host import PluginHost, get_plugin_host


def local_devices() -> list[str]:
    return ["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"]


def probe_requirements(caps: Capabilities, device: str) -> Any:
    """A typical workload this backend claims, used to ask "usable here?" without a model."""
    if isinstance(caps, AttentionCapabilities):
        preferred = torch.bfloat16 if device == "cuda" else torch.float32
        dtype = preferred if preferred in caps.dtypes else sorted(caps.dtypes, key=str)[0]
        head_dim = 128 if caps.head_dims is None or 128 in caps.head_dims else min(caps.head_dims)
        ratio = 1 if caps.gqa_ratios is None or 1 in caps.gqa_ratios else min(caps.gqa_ratios)
        return AttentionRequirements(device, dtype, head_dim, 8 * ratio, 8)
    if isinstance(caps, MoEDispatcherCapabilities):
        world = 1 if caps.world_sizes is None or 1 in caps.world_sizes else min(caps.world_sizes)
        backend = "none" if world == 1 else ("nccl" if device == "cuda" else "gloo")
        hidden = 128 if caps.hidden_sizes is None else min(caps.hidden_sizes)
        top_k = min(2, caps.max_top_k or 2)
        dtype = torch.bfloat16 if torch.bfloat16 in caps.dtypes else sorted(caps.dtypes, key=str)[0]
        return MoERequirements(device, dtype, world, backend, 8 * world, top_k, hidden)
    if isinstance(caps, PrefixCacheCapabilities):
        return PrefixCacheRequirements(device, 1 if 1 in caps.page_sizes else min(caps.page_sizes))
    assert isinstance(caps, GraphCapabilities)
    return GraphRequirements(device)


def usability(spec: BackendSpec) -> tuple[bool, list[str]]:
    """(usable on some local device, reasons for the best candidate device when not)."""
    devices = [d for d in local_devices() if d in getattr(spec.capabilities, "devices", ())]
    if not devices:
        claimed = ", ".join(sorted(getattr(spec.capabilities, "devices", ())))
        return False, spec.unusable_here() + [
            f"needs {claimed}; this machine has {', '.join(local_devices())}"
        ]
    # Importing the factory's module builds nothing but proves the backend can load at all.
    broken = spec.factory_problems() if not spec.unusable_here() else []
    if broken:
        return False, broken
    first_reasons: list[str] = []
    for device in devices:
        reasons = spec.refusals(probe_requirements(spec.capabilities, device))
        if not reasons:
            return True, []
        first_reasons = first_reasons or [f"{device}: {r}" for r in reasons]
    return False, first_reasons


def conformance_report_path(kind: str, name: str) -> str:
    return os.path.join(envs.cache_dir(), "conformance", f"{kind}-{name}.json")


def last_conformance(kind: str, name: str) -> dict[str, Any] | None:
    path = conformance_report_path(kind, name)
    try:
        with open(path) as fh:
            report = json.load(fh)
    except (OSError, ValueError):
        return None
    return {k: report.get(k) for k in ("date", "passed", "failed", "skipped", "xfailed", "summary")}


def backend_inventory(kind: str | None = None, host: PluginHost | None = None) -> dict[str, Any]:
    host = host or get_plugin_host()
    rows = []
    for spec in host.registry.specs(kind):
        usable, reasons = usability(spec)
        rows.append(
            spec.as_dict()
            | {
                "usable": usable,
                "reasons": reasons,
                "last_conformance": last_conformance(spec.kind, spec.name),
            }
        )
    conflicts = [
        {"kind": k, "name": n, "plugins": list(p)}
        for (k, n), p in host.registry.conflicts().items()
    ]
    return {
        "backends": rows,
        "plugin_failures": [{"plugin": f.plugin, "error": f.error} for f in host.failures],
        "conflicts": conflicts,
        "plugins": [
            {"name": p.name, "version": p.version, "source": p.source} for p in host.plugins
        ],
    }


def format_inventory(inv: dict[str, Any]) -> str:
    # Column widths come from the content, so a long backend or plugin name cannot push a
    # row out of line; the capabilities and conformance lines start under PLUGIN.
    header = ("KIND", "NAME", "PLUGIN", "VERSION")
    cells = [
        (str(r["kind"]), str(r["name"]), str(r["plugin"]), str(r["version"]))
        for r in inv["backends"]
    ]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(header)]
    indent = " " * (widths[0] + widths[1] + 4)

    def row(values: tuple[str, ...], last: str) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + "  " + last

    lines = [row(header, "USABLE")]
    for r, values in zip(inv["backends"], cells, strict=True):
        status = "yes" if r["usable"] else "no: " + "; ".join(r["reasons"])
        lines.append(row(values, status))
        caps = ", ".join(f"{k}={_short(v)}" for k, v in r["capabilities"].items())
        lines.append(indent + caps)
        if r["last_conformance"]:
            lines.append(f"{indent}last conformance: {r['last_conformance'].get('summary')}")
    for c in inv["conflicts"]:
        keeper, refused = c["plugins"]
        lines.append(
            f"conflict: {c['kind']} backend {c['name']!r} claimed by {keeper!r} and {refused!r}; "
            f"{keeper!r} keeps it"
        )
    for f in inv["plugin_failures"]:
        lines.append(f"plugin {f['plugin']!r} skipped: {f['error']}")
    return "\n".join(lines)


def _short(value: Any) -> str:
    if value is None:
        return "any"
    if isinstance(value, list):
        return "/".join(map(str, value))
    return str(value)
