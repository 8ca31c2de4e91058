"""The test suite's Triton interpreter patching (``tests/interpreter_patching.py``): one patching
of ``triton.language`` per launch and per language module, the same results."""

from __future__ import annotations

import dataclasses
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


@triton.jit
def _types_kernel(x_ptr, i_ptr, out_ptr, acc_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + rows * COLS + cols)  # fp16 [ROWS, COLS]
    i = tl.load(i_ptr + cols)  # int32 [1, COLS], broadcast against the rows
    y = x.to(tl.float32) * 0.5 + i  # casts, a promotion to fp32, a broadcast
    z = tl.where(y > 1.0, y, -y) + tl.sum(y, axis=1)[:, None]  # a reduction's shape back
    tl.store(out_ptr + rows * COLS + cols, z.to(tl.float16))
    tl.store(acc_ptr + tl.arange(0, COLS), tl.max(y, axis=0) + i.reshape(COLS))


def test_shared_block_types_leave_the_types_and_the_results_as_they_were() -> None:
    from triton.runtime import interpreter

    if not install():
        pytest.skip("this triton's interpreter has other internals: the tests run unpatched")
    builder = interpreter.InterpreterBuilder()
    a, b = builder.get_block_ty(tl.float32, [4, 8]), builder.get_block_ty(tl.float32, [4, 8])
    assert a is b and a == tl.block_type(tl.float32, [4, 8])  # one object per type
    assert a.with_element_ty(tl.int32) == tl.block_type(tl.int32, [4, 8])
    assert builder.get_block_ty(tl.float16, [4, 8]) != a  # the element type is in the key
    t1, t2 = tl.core.tensor(None, a), tl.core.tensor(None, a)
    assert t1.shape is not t2.shape and list(t1.shape) == list(t2.shape) == [4, 8]
    assert t1.numel == 32 and t1.dtype == tl.float32 and t1.type is a

    x = torch.randn(4, 8).to(torch.float16)
    i = torch.arange(8, dtype=torch.int32) - 3
    out, acc = torch.empty_like(x), torch.empty(8)
    for cols in (8, 8):  # the second launch runs on the cached types
        _types_kernel[(1,)](x, i, out, acc, ROWS=4, COLS=cols)
        y = x.float() * 0.5 + i
        z = torch.where(y > 1.0, y, -y) + y.sum(dim=1, keepdim=True)
        torch.testing.assert_close(out, z.half(), rtol=0, atol=0)
        torch.testing.assert_close(acc, y.amax(dim=0) + i, rtol=0, atol=0)


@triton.jit
def _int32_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, (x + 7) * 3 - x)


def test_overflow_checks_are_dropped_only_where_their_assertion_never_fires() -> None:
    from triton.runtime import interpreter

    if not install():
        pytest.skip("this triton's interpreter has other internals: the tests run unpatched")
    builder = interpreter.interpreter_builder
    assert builder.options.debug is False and builder.options.sanitize_overflow is False
    x = torch.tensor([2**31 - 1, -(2**31), 5, -9], dtype=torch.int32)  # two overflow
    outs = []
    patched = builder.options
    try:
        for sanitize in (False, True):  # True: the interpreter's own options
            builder.options = dataclasses.replace(patched, sanitize_overflow=sanitize)
            out = torch.empty_like(x)
            _int32_kernel[(1,)](x, out, BLOCK=4)
            outs.append(out)
    finally:
        builder.options = patched
    assert torch.equal(outs[0], outs[1])  # unchecked, both wrap the same way
    assert outs[0][2:].tolist() == [31, 3]
