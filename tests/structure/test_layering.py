"""The import layers of DESIGN section 2, checked in fresh interpreters.

One subprocess imports torch and pluggy (the core's only third-party packages), then forks a
copy of itself per check: each check starts from that fresh state without paying for torch's
import again. A failing group is traced to its culprit module by module.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pkgutil
import re
import subprocess
import sys
from typing import Any

import pytest

import execrt

ROOT = os.path.dirname(execrt.__file__)


def modules_under(package: str) -> list[str]:
    """Every module of ``package`` (subpackages too), found on disk without importing any."""
    path = os.path.join(ROOT, *package.split(".")[1:])
    found = [package]
    for info in pkgutil.iter_modules([path]):
        name = f"{package}.{info.name}"
        found += modules_under(name) if info.ispkg else [name]
    return found


CORE_MODULES = [m for m in modules_under("execrt.core") if m != "execrt.core"]
BACKEND_MODULES = modules_under("execrt.backends")
KERNEL_MODULES = modules_under("execrt.kernels")
MODEL_MODULES = modules_under("execrt.models")
EDGE = ("execrt.engine", "execrt.plugins", "execrt.testing", "execrt.bench", "execrt.cli")
EDGE += ("execrt.inventory",)
ABOVE_CORE = ("execrt.models", "execrt.backends", "execrt.kernels", *EDGE)
KERNEL_LIBRARIES = ("triton", "flashinfer")
CORE_THIRD_PARTY = ("torch", "pluggy")

PROBE = r"""
import json, os, sys
import torch, pluggy  # the core's two third-party packages, with whatever they load
base = set(sys.modules)

def load(names):
    errors = {}
    for name in names:  # "module" or "module:attribute"
        module, _, attribute = name.partition(":")
        try:
            loaded = __import__(module, fromlist=["_"])
            if attribute:
                getattr(loaded, attribute)
        except ImportError as exc:  # reported; the other modules still load
            errors[name] = [f"{type(exc).__name__}: {exc}", exc.name]
    return {"loaded": sorted(set(sys.modules) - base), "errors": errors}

results = {}
for check, names in json.loads(sys.argv[1]).items():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            report = load(names)
        except BaseException as exc:
            report = {"crash": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(write, "w") as out:
            json.dump(report, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as inp:
        text = inp.read()
    os.waitpid(pid, 0)
    results[check] = json.loads(text) if text else {"crash": "the check died without a report"}
print(json.dumps(results))
"""


def probe(checks: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Per check: the modules a fresh interpreter (torch and pluggy imported) holds after
    importing the check's names, beyond torch's and pluggy's; and the names that failed."""
    if not hasattr(os, "fork"):
        pytest.skip("the layering probe forks (POSIX only)")
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(checks)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results: dict[str, dict[str, Any]] = json.loads(done.stdout.splitlines()[-1])
    crashed = {check: r["crash"] for check, r in results.items() if "crash" in r}
    assert not crashed, crashed
    return results


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict[str, Any]]:
    return probe(
        {
            "contract": ["execrt:hookimpl", "execrt:BackendRegistry"],
            "core": CORE_MODULES,
            "flashinfer": ["execrt.backends.attention.flashinfer"],
            "kernels": ["execrt.kernels", "execrt.kernels.kv_indices"],
            "all kernels": KERNEL_MODULES,
            "backends": BACKEND_MODULES,
            "models": MODEL_MODULES,
        }
    )


def culprits(modules: list[str], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """Module by module, in fresh interpreters again: which one loads what."""
    results = probe({m: [m] for m in modules})
    bad = {m: [x for x in r["loaded"] if within(x, forbidden)] for m, r in results.items()}
    return {m: b for m, b in bad.items() if b}


def test_modules_are_found() -> None:
    assert "execrt.core.batch" in CORE_MODULES and len(CORE_MODULES) >= 15
    for name in (
        "execrt.backends.attention.triton",
        "execrt.backends.graph.full_cuda_graph",
        "execrt.backends.moe_dispatch.allreduce",
    ):
        assert name in BACKEND_MODULES, BACKEND_MODULES
    for name in ("execrt.kernels.kv_indices", "execrt.kernels.attention.decode"):
        assert name in KERNEL_MODULES, KERNEL_MODULES  # the second: a module of a subpackage
    assert {"execrt.models", "execrt.models.decoder", "execrt.models.layers"} <= set(MODEL_MODULES)


def test_every_module_imports_or_names_the_missing_library(loaded) -> None:  # type: ignore[no-untyped-def]
    # Only an optional third-party library that is absent here may stop a module importing.
    for check, report in loaded.items():
        broken = {
            name: message
            for name, (message, missing) in report["errors"].items()
            if not missing or missing.split(".")[0] == "execrt"
        }
        assert not broken, f"{check}: {broken}"
    assert not loaded["core"]["errors"] and not loaded["contract"]["errors"]


def test_core_imports_nothing_above_it(loaded) -> None:  # type: ignore[no-untyped-def]
    forbidden = ABOVE_CORE + KERNEL_LIBRARIES
    upward = [m for m in loaded["core"]["loaded"] if within(m, forbidden)]
    if upward:
        pytest.fail(f"execrt.core imports layers above it: {culprits(CORE_MODULES, forbidden)}")


def test_core_imports_no_third_party_package_but_torch_and_pluggy(loaded) -> None:  # type: ignore[no-untyped-def]
    # What torch and pluggy load is in the probe's baseline; what the core adds must be the
    # standard library, execrt, or a declared dependency of torch or pluggy loaded late.
    added = {m.split(".")[0] for m in loaded["core"]["loaded"]}
    foreign = added - set(sys.stdlib_module_names) - {"execrt"}
    if foreign:
        foreign -= dependency_modules(*CORE_THIRD_PARTY)
    assert not foreign, f"execrt.core imports third-party packages {sorted(foreign)}"
    assert "execrt.core.plugins" in loaded["core"]["loaded"]  # the check saw the core load


def dependency_modules(*distributions: str) -> set[str]:
    """Top-level module names of ``distributions`` and of everything they require (extras
    excluded), as installed here."""

    def key(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    names: set[str] = set()
    todo = list(distributions)
    while todo:
        name = todo.pop()
        if key(name) in names:
            continue
        names.add(key(name))
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requirements:
            match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
            if match and "extra ==" not in requirement:
                todo.append(match.group())
    return {
        top
        for top, owners in importlib.metadata.packages_distributions().items()
        if any(key(owner) in names for owner in owners)
    }


def test_a_plugin_importing_hookimpl_loads_only_the_contract(loaded) -> None:  # type: ignore[no-untyped-def]
    heavy = [m for m in loaded["contract"]["loaded"] if within(m, ABOVE_CORE)]
    assert not heavy, f"'from execrt import hookimpl' loads {heavy}"
    assert "execrt.core.plugins" in loaded["contract"]["loaded"]


def test_flashinfer_backend_does_not_need_triton(loaded) -> None:  # type: ignore[no-untyped-def]
    report = loaded["flashinfer"]
    assert "execrt.backends.attention.flashinfer" in report["loaded"], report["errors"]
    assert not [m for m in report["loaded"] if within(m, ("triton",))]


def test_kernel_modules_do_not_import_triton_eagerly(loaded) -> None:  # type: ignore[no-untyped-def]
    report = loaded["kernels"]
    assert "execrt.kernels.kv_indices" in report["loaded"], report["errors"]
    assert not [m for m in report["loaded"] if within(m, ("triton",))]


@pytest.mark.parametrize(
    ("group", "forbidden"),
    [
        # Models build on the core and the kernels; they never reach for a backend.
        ("models", ("execrt.backends", *EDGE)),
        # Backends import only the core's public names and the kernels.
        ("backends", ("execrt.models", *EDGE)),
        # Kernels sit under models and backends alike: they import neither.
        ("all kernels", ("execrt.models", "execrt.backends", *EDGE)),
    ],
)
def test_models_never_import_backends_and_backends_never_import_models(
    loaded: dict[str, dict[str, Any]], group: str, forbidden: tuple[str, ...]
) -> None:
    modules = {
        "models": MODEL_MODULES,
        "backends": BACKEND_MODULES,
        "all kernels": KERNEL_MODULES,
    }[group]
    report = loaded[group]
    imported = [m for m in modules if m not in report["errors"]]
    assert set(imported) <= set(report["loaded"]), report["errors"]
    if [m for m in report["loaded"] if within(m, forbidden)]:
        pytest.fail(f"execrt.{group} imports {forbidden}: {culprits(imported, forbidden)}")
