"""The import layers of DESIGN section 2, checked in fresh interpreters."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import execrt.core

CORE_MODULES = sorted(f"execrt.core.{m.name}" for m in pkgutil.iter_modules(execrt.core.__path__))
ABOVE_CORE = (
    "execrt.models",
    "execrt.engine",
    "execrt.plugins",
    "execrt.backends",
    "execrt.kernels",
)


def loaded_after(statement: str) -> list[str]:
    """The execrt and kernel-library modules a fresh interpreter holds after ``statement``."""
    code = (
        f"import sys, json; {statement}; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith(('execrt', 'triton', 'flashinfer')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def test_core_modules_are_found() -> None:
    assert "execrt.core.batch" in CORE_MODULES and len(CORE_MODULES) >= 15


def test_core_imports_nothing_above_it() -> None:
    # Whatever one core module loads, importing all of them loads too: one interpreter proves
    # the rule for every module, and a failure is then traced to the culprit module by module.
    loaded = loaded_after("; ".join(f"import {m}" for m in CORE_MODULES))
    upward = [m for m in loaded if m.startswith(ABOVE_CORE + ("triton", "flashinfer"))]
    if upward:
        culprits = {
            m: bad
            for m in CORE_MODULES
            if (bad := [x for x in loaded_after(f"import {m}") if x.startswith(ABOVE_CORE)])
        }
        pytest.fail(f"execrt.core imports layers above it: {culprits or upward}")


def test_a_plugin_importing_hookimpl_loads_only_the_contract() -> None:
    loaded = loaded_after("from execrt import hookimpl, BackendRegistry")
    heavy = [
        m for m in loaded if m.startswith(("execrt.engine", "execrt.models", "execrt.backends"))
    ]
    assert not heavy, f"'from execrt import hookimpl' loads {heavy}"


def test_flashinfer_backend_does_not_need_triton() -> None:
    loaded = loaded_after("import execrt.backends.attention.flashinfer")
    assert not [m for m in loaded if m.startswith("triton")]


def test_kernel_modules_do_not_import_triton_eagerly() -> None:
    loaded = loaded_after("import execrt.kernels; import execrt.backends.attention.kv_indices")
    assert not [m for m in loaded if m.startswith("triton")]


def test_models_never_import_backends_and_backends_never_import_models() -> None:
    for statement, forbidden in (
        ("import execrt.models", ("execrt.backends", "execrt.engine", "execrt.plugins")),
        (
            "import execrt.backends.attention.torch_native, execrt.backends.attention.triton, "
            "execrt.backends.moe_dispatch.allreduce, execrt.backends.graph.reexec",
            ("execrt.models", "execrt.engine"),
        ),
    ):
        bad = [m for m in loaded_after(statement) if m.startswith(forbidden)]
        assert not bad, f"{statement} loads {bad}"
