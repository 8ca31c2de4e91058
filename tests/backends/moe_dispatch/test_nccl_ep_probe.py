"""nccl_ep availability: what the probe finds, its reasons, and lazy registration."""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from packaging.version import Version

from execrt.backends.moe_dispatch import nccl_ep_native, nccl_ep_probe
from execrt.backends.moe_dispatch.nccl_ep_probe import (
    NcclEpEnvironment,
    environment_problems,
    requirement_problems,
)
from execrt.core.errors import BackendUnavailableError
from execrt.core.interfaces import MoERequirements
from execrt.core.selection import resolve_backend
from execrt.plugins.host import PluginHost

GPU_BOX = NcclEpEnvironment(  # the H200 machine: torch 2.11 pins NCCL 2.28.9, no nccl.ep
    ep_installed=False, cuda_available=True, compute_capability=(9, 0), torch_nccl=(2, 28, 9)
)
READY = NcclEpEnvironment(True, True, (9, 0), (2, 30, 7), core_nccl=(2, 30, 7))


class NcclModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for the installed ``nccl`` packages: a module is present (``install``),
    present but failing on import (``broken``), or absent; the real ones stay hidden."""

    def __init__(self) -> None:
        self.present: dict[str, Callable[[ModuleType], None]] = {"nccl": lambda m: None}
        self.broken: dict[str, Exception] = {}
        self.imported: list[str] = []

    def install(self, *names: str, fill: Callable[[ModuleType], None] = lambda m: None) -> None:
        for name in names:
            self.present[name] = fill

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.present and fullname not in self.broken:
            return None  # below our empty `nccl` package nothing else is found
        package = fullname == "nccl" or any(n.startswith(f"{fullname}.") for n in self.present)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=package)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        name = module.__name__
        if name in self.broken:
            raise self.broken[name]
        if name != "nccl":
            self.imported.append(name)
        self.present[name](module)


@pytest.fixture
def nccl_modules() -> Iterator[NcclModules]:
    """Fake ``nccl`` packages for one test; the real ones (if imported) come back after it."""
    saved = {n: m for n, m in sys.modules.items() if n == "nccl" or n.startswith("nccl.")}
    for name in saved:
        del sys.modules[name]
    finder = NcclModules()
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "nccl" or n.startswith("nccl.")]:
            del sys.modules[name]
        sys.modules.update(saved)


@dataclass
class Machine:
    """What torch reports: CUDA, the device's compute capability, torch's NCCL."""

    cuda: bool = True
    capability: tuple[int, int] = (9, 0)
    nccl: tuple[int, int, int] | None = (2, 30, 7)

    def apply(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def version() -> tuple[int, int, int]:
            if self.nccl is None:  # a CPU build of torch has no torch._C._nccl_version
                raise AttributeError("module 'torch._C' has no attribute '_nccl_version'")
            return self.nccl

        capability = self.capability
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda.nccl, "version", version)


def core_reporting(version: str | None) -> Callable[[ModuleType], None]:
    """An nccl.core whose get_version() reports ``version`` for libnccl (None: none loaded)."""

    def fill(module: ModuleType) -> None:
        lib = None if version is None else SimpleNamespace(version=Version(version))
        module.get_version = lambda: SimpleNamespace(libnccl=lib)  # type: ignore[attr-defined]

    return fill


def probed(monkeypatch: pytest.MonkeyPatch, machine: Machine) -> NcclEpEnvironment:
    machine.apply(monkeypatch)
    return nccl_ep_probe.probe_environment()


def test_probe_a_ready_machine(monkeypatch: pytest.MonkeyPatch, nccl_modules: NcclModules) -> None:
    nccl_modules.install("nccl.ep")
    nccl_modules.install("nccl.core", fill=core_reporting("2.30.7"))
    env = probed(monkeypatch, Machine())
    assert env == READY
    assert environment_problems(env) == []
    assert nccl_modules.imported == ["nccl.core", "nccl.ep"]  # ep only once the NCCLs agree


def test_probe_an_old_nccl_never_imports_the_nccl_modules(
    monkeypatch: pytest.MonkeyPatch, nccl_modules: NcclModules
) -> None:
    nccl_modules.install("nccl.ep")
    nccl_modules.install("nccl.core", fill=core_reporting("2.28.9"))
    env = probed(monkeypatch, Machine(nccl=(2, 28, 9)))
    assert env == dataclasses.replace(GPU_BOX, ep_installed=True)
    assert nccl_modules.imported == []
    (problem,) = environment_problems(env)
    assert problem.startswith("NCCL 2.28.9 loaded by torch; NCCL EP needs >= 2.29")


def test_probe_two_nccls_in_one_process(
    monkeypatch: pytest.MonkeyPatch, nccl_modules: NcclModules
) -> None:
    nccl_modules.install("nccl.ep")
    nccl_modules.install("nccl.core", fill=core_reporting("2.29.7"))
    env = probed(monkeypatch, Machine())
    assert (env.torch_nccl, env.core_nccl, env.core_error) == ((2, 30, 7), (2, 29, 7), None)
    assert nccl_modules.imported == ["nccl.core"], "nccl.ep is not imported over a mismatch"
    assert environment_problems(env) == [
        "NCCL 2.30.7 loaded by torch but 2.29.7 by nccl.core; NCCL EP needs one NCCL in the "
        "process (LD_PRELOAD the newer libnccl.so.2)"
    ]


@pytest.mark.parametrize(
    ("core", "reason"),
    [
        (ImportError("libcudart.so.13: cannot open shared object file"), "ImportError: libcud"),
        (None, "module 'nccl.core' not installed (pip install execrt[nccl-ep])"),
        ("no libnccl", "no libnccl loaded"),
    ],
    ids=["findable-not-importable", "missing", "no-libnccl"],
)
def test_probe_an_nccl_core_that_cannot_report(
    monkeypatch: pytest.MonkeyPatch, nccl_modules: NcclModules, core: Any, reason: str
) -> None:
    nccl_modules.install("nccl.ep")
    if isinstance(core, Exception):
        nccl_modules.broken["nccl.core"] = core
    elif core == "no libnccl":
        nccl_modules.install("nccl.core", fill=core_reporting(None))
    env = probed(monkeypatch, Machine())
    assert env.core_nccl is None and env.core_error is not None
    assert "nccl.ep" not in nccl_modules.imported
    (problem,) = environment_problems(env)
    assert problem.startswith(f"nccl.core cannot report its NCCL: {reason}"), problem


def test_probe_an_nccl_ep_that_fails_to_import(
    monkeypatch: pytest.MonkeyPatch, nccl_modules: NcclModules
) -> None:
    # What `pip install nccl-extensions nccl4py` gives without cuda-bindings.
    nccl_modules.broken["nccl.ep"] = ImportError("cannot import name 'bindings' from 'cuda'")
    nccl_modules.install("nccl.core", fill=core_reporting("2.30.7"))
    env = probed(monkeypatch, Machine())
    assert env.ep_installed and env.ep_error is not None
    assert environment_problems(env) == [
        "module 'nccl.ep' cannot be imported: ImportError: cannot import name 'bindings' from "
        "'cuda' (pip install execrt[nccl-ep])"
    ]


def test_probe_a_machine_without_cuda_nccl_or_packages(
    monkeypatch: pytest.MonkeyPatch, nccl_modules: NcclModules
) -> None:
    env = probed(monkeypatch, Machine(cuda=False, nccl=None))
    assert env == NcclEpEnvironment(False, False, None, None)
    assert environment_problems(env) == [
        "module 'nccl.ep' not installed (pip install execrt[nccl-ep])",
        "no CUDA device visible",
        "torch was built without NCCL; NCCL EP needs >= 2.29",
    ]
    assert nccl_modules.imported == []


def test_probe_an_ampere_device(monkeypatch: pytest.MonkeyPatch, nccl_modules: NcclModules) -> None:
    nccl_modules.install("nccl.ep")
    nccl_modules.install("nccl.core", fill=core_reporting("2.30.7"))
    env = probed(monkeypatch, Machine(capability=(8, 0)))
    assert env.compute_capability == (8, 0)
    assert environment_problems(env) == ["compute capability 8.0 unsupported (supported: >= 9.0)"]


def test_the_gpu_machine_gets_both_reasons() -> None:
    problems = environment_problems(GPU_BOX)
    assert problems[0] == "module 'nccl.ep' not installed (pip install execrt[nccl-ep])"
    assert problems[1].startswith("NCCL 2.28.9 loaded by torch; NCCL EP needs >= 2.29 (")
    assert "LD_PRELOAD" in problems[1] and len(problems) == 2


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (READY, []),
        (dataclasses.replace(READY, cuda_available=False), ["no CUDA device visible"]),
        (
            dataclasses.replace(READY, compute_capability=(8, 0)),
            ["compute capability 8.0 unsupported (supported: >= 9.0)"],
        ),
        (
            dataclasses.replace(READY, torch_nccl=None),
            ["torch was built without NCCL; NCCL EP needs >= 2.29"],
        ),
        (
            dataclasses.replace(READY, core_nccl=(2, 29, 7)),
            ["NCCL 2.30.7 loaded by torch but 2.29.7 by nccl.core; NCCL EP needs one NCCL"],
        ),
        (
            dataclasses.replace(READY, core_nccl=None, core_error="ImportError: no cuda"),
            ["nccl.core cannot report its NCCL: ImportError: no cuda"],
        ),
    ],
    ids=["ready", "no-cuda", "sm80", "no-nccl", "two-nccls", "core-broken"],
)
def test_environment_problems(env: NcclEpEnvironment, expected: list[str]) -> None:
    problems = environment_problems(env)
    assert len(problems) == len(expected)
    for got, want in zip(problems, expected, strict=True):
        assert got.startswith(want), (got, want)


def test_shape_limits() -> None:
    assert requirement_problems(2048, 8) == []
    assert requirement_problems(100, 8) == [
        "hidden size 100 unsupported (supported: multiples of 8, so that a bf16 row is a "
        "multiple of 16 bytes)"
    ]
    assert requirement_problems(64, 33) == ["top_k 33 unsupported (supported: 1..32)"]


def test_loading_refuses_an_old_nccl_before_importing_nccl_ep(
    monkeypatch: pytest.MonkeyPatch, nccl_modules: NcclModules
) -> None:
    nccl_modules.install("nccl.ep", "nccl.core", "nccl.ep.interop.torch")
    monkeypatch.setattr(nccl_ep_probe, "probe_environment", lambda: GPU_BOX)
    with pytest.raises(BackendUnavailableError, match=r"NCCL 2\.28\.9 loaded by torch"):
        nccl_ep_native.load_nccl_api()
    assert nccl_modules.imported == []


def test_loading_turns_a_broken_install_into_a_reason(
    monkeypatch: pytest.MonkeyPatch, nccl_modules: NcclModules
) -> None:
    nccl_modules.install("nccl.core")
    nccl_modules.broken["nccl.ep"] = ImportError("cannot import name 'bindings' from 'cuda'")
    monkeypatch.setattr(nccl_ep_probe, "probe_environment", lambda: READY)
    with pytest.raises(BackendUnavailableError, match=r"nccl\.ep cannot be imported \(ImportError"):
        nccl_ep_native.load_nccl_api()


def test_the_check_adds_requirement_and_environment_reasons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = PluginHost(autoload=False).registry.get("moe_dispatch", "nccl_ep")
    monkeypatch.setattr(nccl_ep_probe, "probe_environment", lambda: GPU_BOX)
    req = MoERequirements("cuda", torch.bfloat16, 1, "none", 8, 2, 100)
    reasons = spec.refusals(req)
    assert reasons[0].startswith("hidden size 100 unsupported")
    assert reasons[1].startswith("module 'nccl.ep' not installed")
    assert reasons[2].startswith("NCCL 2.28.9 loaded by torch")
    fp16 = dataclasses.replace(req, dtype=torch.float16, world_size=3, process_group_backend="gloo")
    assert {r.split(" ")[0] for r in spec.refusals(fp16)} >= {"dtype", "world", "process"}


def test_registration_imports_nothing_heavy_and_reports_here() -> None:
    # Listing may import execrt's own nccl_ep module (to prove the factory loads) on a CUDA
    # machine, never the nccl package itself.
    code = (
        "import sys, json; from execrt.plugins.host import PluginHost; "
        "from execrt.inventory import usability; "
        "spec = PluginHost(autoload=False).registry.get('moe_dispatch', 'nccl_ep'); "
        "usable, reasons = usability(spec); "
        "mods = [m for m in sys.modules if m.split('.')[0] == 'nccl']; "
        "print(json.dumps([usable, reasons, mods]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    usable, reasons, modules = json.loads(out.stdout)
    # Only the probe of a machine whose torch has NCCL >= 2.29 imports nccl.core (and nccl.ep);
    # elsewhere at most the namespace package `nccl` (no code) is touched by a module lookup.
    torch_nccl = nccl_ep_probe.torch_nccl_version()
    if not torch.cuda.is_available() or torch_nccl is None or torch_nccl[:2] < (2, 29):
        assert [m for m in modules if m != "nccl"] == []
    if not torch.cuda.is_available():
        assert not usable and reasons == ["needs cuda; this machine has cpu"]


def test_auto_never_picks_nccl_ep_and_naming_it_here_explains() -> None:
    registry = PluginHost(autoload=False).registry
    req = MoERequirements("cpu", torch.bfloat16, 1, "none", 8, 2, 64)
    assert resolve_backend(registry, "moe_dispatch", "auto", req).chosen != "nccl_ep"
    with pytest.raises(BackendUnavailableError, match="device cpu unsupported"):
        resolve_backend(registry, "moe_dispatch", "nccl_ep", req)
