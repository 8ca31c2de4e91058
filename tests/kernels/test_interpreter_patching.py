"""The test suite's Triton interpreter patching (``tests/interpreter_patching.py``): one patching
of ``triton.language`` per launch and per language module, the same results."""

from __future__ import annotations

from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from execrt.kernels._triton import interpreter_enabled  # noqa: E402
from tests.interpreter_patching import install  # noqa: E402

pytestmark = pytest.mark.skipif(
    not interpreter_enabled(), reason="patches the CPU interpreter (TRITON_INTERPRET=1) only"
)


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    y = _twice(_twice(x))  # this module's helper: sees tl, which the launch patched
    total = tl.sum(y, axis=0)  # triton.language.standard's: sees tl.core
    peak = tl.max(y, axis=0)
    tl.store(out_ptr + offs, y + total + peak + tl.zeros([BLOCK], tl.float32))


def _real_patchings(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Install, then count the calls that reach the interpreter's own ``_patch_lang``."""
    from triton.runtime import interpreter

    if not install():
        pytest.skip("this triton's interpreter has other internals: the tests run unpatched")
    wrapper = interpreter._patch_lang
    cell = next(
        c
        for c in wrapper.__closure__
        if getattr(c.cell_contents, "__name__", "") == "_patch_lang"
        and c.cell_contents is not wrapper
    )
    real, calls = cell.cell_contents, []

    def counting(fn: Any) -> Any:
        calls.append(fn.__name__)
        return real(fn)

    monkeypatch.setattr(cell, "cell_contents", counting)
    return calls


def test_a_launch_patches_once_per_language_module_and_computes_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _real_patchings(monkeypatch)
    x = torch.arange(64, dtype=torch.float32)
    out = torch.empty_like(x)
    for _ in range(2):  # a second launch patches afresh (the first restored triton.language)
        _helpers_kernel[(4,)](x, out, BLOCK=16)
        y = 4 * x.view(4, 16)
        ref = y + y.sum(dim=1, keepdim=True) + y.amax(dim=1, keepdim=True)
        torch.testing.assert_close(out, ref.flatten(), rtol=0, atol=0)
    # Each launch: the kernel's own patching, then one for triton.language.core the first
    # time a standard helper asks; the other 4 programs x 5 helper calls patch nothing.
    assert calls == ["_helpers_kernel", "sum", "_helpers_kernel", "sum"], calls


def test_a_helper_called_outside_a_launch_still_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _real_patchings(monkeypatch)
    from triton.runtime import interpreter

    scope = interpreter._patch_lang(_twice.fn if hasattr(_twice, "fn") else _twice)
    scope.restore()  # what it patched goes back: nothing runs on a patched language after this
    assert calls == ["_twice"]
