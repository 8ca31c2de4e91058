"""nccl_ep availability: the probe's reasons, lazy registration, and the double's API surface."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from enum import IntEnum
from typing import Any

import pytest
import torch

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
from execrt.testing import nccl_ep_double

GPU_BOX = NcclEpEnvironment(  # the H200 machine: torch 2.11 pins NCCL 2.28.9, no nccl.ep
    ep_installed=False, cuda_available=True, compute_capability=(9, 0), torch_nccl=(2, 28, 9)
)
READY = NcclEpEnvironment(True, True, (9, 0), (2, 30, 7), core_nccl=(2, 30, 7))


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
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nccl_ep_probe, "probe_environment", lambda: GPU_BOX)
    with pytest.raises(BackendUnavailableError, match=r"NCCL 2\.28\.9 loaded by torch"):
        nccl_ep_native.load_nccl_api()
    assert "nccl.ep" not in sys.modules


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
    assert modules == []
    if not torch.cuda.is_available():
        assert not usable and reasons == ["needs cuda; this machine has cpu"]


def test_auto_never_picks_nccl_ep_and_naming_it_here_explains() -> None:
    registry = PluginHost(autoload=False).registry
    req = MoERequirements("cpu", torch.bfloat16, 1, "none", 8, 2, 64)
    assert resolve_backend(registry, "moe_dispatch", "auto", req).chosen != "nccl_ep"
    with pytest.raises(BackendUnavailableError, match="device cpu unsupported"):
        resolve_backend(registry, "moe_dispatch", "nccl_ep", req)


# ---------------------------------------------------------------------------------------------
# The double against the real package
# ---------------------------------------------------------------------------------------------
def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _fields(cls: type) -> list[tuple[str, Any]]:
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        default = "<factory>" if f.default is dataclasses.MISSING else f.default
        out.append((f.name, int(default) if isinstance(default, IntEnum) else default))
    return out


def test_the_double_matches_the_real_api() -> None:
    try:  # loading nccl.ep needs CUDA bindings and a recent NCCL; absent here, skip with why
        import nccl.core as real_core
        import nccl.ep as real_ep
    except Exception as exc:  # any import failure: "not comparable here"
        pytest.skip(f"the real nccl.ep is not importable here ({type(exc).__name__}: {exc})")
    fake = nccl_ep_double.FakeNccl()
    ep, core = fake.ep, fake.core
    for name in real_ep.__all__:
        assert hasattr(ep, name), f"double lacks nccl.ep.{name}"
    problems = []
    enums = ("Algorithm", "Layout", "PassDir", "OverflowPolicy", "ZeroCopyMode", "ExpertIdKind")
    for name in (*enums, "DispatchQuantizationRecipe", "CombineQuantizationRecipe"):
        real = {m.name: int(m) for m in getattr(real_ep, name)}
        if {m.name: int(m) for m in getattr(ep, name)} != real:
            problems.append(f"enum {name}")
    records = ("GroupConfig", "HandleConfig", "DispatchConfig", "CombineConfig", "LayoutInfo")
    bundles = ("DispatchInputs", "DispatchOutputs", "CombineInputs", "CombineOutputs")
    for name in (*records, *bundles, "AllocConfig"):
        if _fields(getattr(ep, name)) != _fields(getattr(real_ep, name)):
            problems.append(f"dataclass {name}")
    for cls, methods in (
        ("Group", ("__init__", "create", "create_handle", "destroy")),
        ("Handle", ("__init__", "update", "dispatch", "combine", "complete", "destroy")),
        ("Tensor", ("__init__",)),
    ):
        for method in methods:
            fake_fn, real_fn = (
                getattr(getattr(ep, cls), method),
                getattr(getattr(real_ep, cls), method),
            )
            if _params(fake_fn) != _params(real_fn):
                problems.append(f"{cls}.{method}: {_params(fake_fn)} != {_params(real_fn)}")
    for prop in ("ptr", "ndim", "sizes", "datatype", "data", "buffer"):
        if not isinstance(getattr(real_ep.Tensor, prop), property):
            problems.append(f"Tensor.{prop} is no longer a property")
    for method in ("__init__", "init"):
        if _params(getattr(core.Communicator, method)) != _params(
            getattr(real_core.Communicator, method)
        ):
            problems.append(f"Communicator.{method}")
    for fn in ("get_unique_id", "get_version"):
        if _params(getattr(core, fn)) != _params(getattr(real_core, fn)):
            problems.append(f"nccl.core.{fn}")
    for prop in ("ptr", "nranks", "rank", "device_api_support"):
        if not hasattr(real_core.Communicator, prop):
            problems.append(f"Communicator.{prop} is gone")
    assert not problems, "the double drifted from the real API:\n" + "\n".join(problems)
