"""Test-only: the Triton interpreter patches ``triton.language`` once per kernel launch, not
once more at every call of a ``@triton.jit`` helper inside it.

Under ``TRITON_INTERPRET=1`` a launch (``GridExecutor.__call__``) swaps ``triton.language``'s
builtins for interpreted ones (``_patch_lang``) and restores them when the grid is done. Every
call of a jitted helper from inside the kernel (``InterpretedFunction.__call__``) runs
``_patch_lang`` again, for every program of the grid, although the launch's patches are still
in place: it walks the members of ``tl``, ``tl.core``, ``tl.tensor`` and ``tl.math`` with
``inspect.getmembers`` and wraps each builtin again. In the CPU suite that was about 30% of the
time of the interpreter-heavy tests (2.8 of 9.5 s in the fp8 extend conformance case at GQA 16).

:func:`install` skips that patching when the helper sees no language module that the running
launch has not patched already: the kernel's own, and those a helper patched earlier in the
launch (``triton.language.standard``'s helpers see ``triton.language.core``, which a kernel
module does not import; the interpreter never undoes a helper's patches, so they stay in place
until the launch ends). A call outside a launch patches as before. The patches are module-wide
and identical whichever function asks for them, so the kernels compute exactly what they
computed before. It wraps triton's private functions and does
nothing where they are not as expected (another triton version): the tests then run as slowly
as before, never differently.

It also shares the result types of interpreted operations (:func:`_share_block_types`): ~30%
of the sampling kernels' interpreted time went to building the same ``block_type`` and shape
tuple again for every operation; and it drops integer-overflow checks whose assertion the
interpreter discards (:func:`_skip_dead_overflow_checks`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from typing import Any

_installed = False


def install() -> bool:
    """Wrap the interpreter's launch and patch functions; True if they were found (once)."""
    global _installed
    if _installed:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # no triton, or one that cannot import here
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or executor is None or scope_type is None:
        return False
    if not callable(getattr(scope_type(), "restore", None)):
        return False
    launch = executor.__call__
    langs_of_triton = (tl, tl.core)
    local = threading.local()  # per thread: the language modules each running launch patched
    seen: dict[Any, frozenset[int]] = {}  # function -> the language modules in its globals

    def langs(fn: Any) -> frozenset[int]:
        found = seen.get(fn)
        if found is None:
            found = seen[fn] = frozenset(
                id(value)
                for value in getattr(fn, "__globals__", {}).values()
                if inspect.ismodule(value) and value in langs_of_triton
            )
        return found

    @functools.wraps(patch_lang)
    def patch_once(fn: Any) -> Any:
        stack = getattr(local, "stack", None)
        mine = langs(fn)
        if stack and mine and mine <= stack[-1]:
            return scope_type()  # patched earlier in the running launch: nothing to undo
        scope = patch_lang(fn)
        if stack:
            stack[-1] |= mine
        return scope

    @functools.wraps(launch)
    def launch_tracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        stack = local.__dict__.setdefault("stack", [])
        stack.append(set())  # filled by the launch's own patching, then its helpers'
        try:
            return launch(self, *args, **kwargs)
        finally:
            stack.pop()

    interpreter._patch_lang = patch_once
    executor.__call__ = launch_tracked
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if callable(np_dtype):
        interpreter._get_np_dtype = _memoised_by_type_name(np_dtype)
    _share_block_types(tl, interpreter)
    _skip_dead_overflow_checks(interpreter)
    _installed = True
    return True


def _skip_dead_overflow_checks(interpreter: Any) -> bool:
    """The interpreter's options ask for integer-overflow checks (``sanitize_overflow``) but
    not for ``debug``, and ``device_assert`` does nothing without ``debug``: every interpreted
    int32 add, sub and mul still cast both operands to int64, redid the operation and compared
    the result with the type's bounds, only for the assertion to be dropped (a third of the
    Triton decode kernel's interpreted time). The checks are turned off only while ``debug``
    is off, where they could never fire; True if they were."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or getattr(options, "debug", True) or not dataclasses.is_dataclass(options):
        return False
    if getattr(options, "sanitize_overflow", None) is not True:
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


#: Entries a type cache keeps before it starts afresh (pointer types are made per call, so a
#: cache keyed by the element type's identity would otherwise grow with the run).
_CACHE_ENTRIES = 4096


def _share_block_types(tl: Any, interpreter: Any) -> bool:
    """Every interpreted operation builds its result's ``block_type`` anew (``with_element_ty``,
    the builder's ``get_block_ty``: shape normalisation, validation, a name string) and then a
    ``tensor`` whose ``__init__`` rebuilds the shape as a ``tl.tuple`` of ``constexpr`` and
    types that tuple again: ~30% of an interpreted kernel's time between them. Types are
    immutable values compared by their fields, so one ``block_type`` per (element type, shape)
    serves every operation, and a tensor of a type seen before takes the shape's values and
    tuple type from the first tensor of that type (a fresh ``tl.tuple`` each time, as before).
    True if installed; nothing changes where triton's classes are not as expected."""
    core = tl.core
    block_type, tensor, tl_tuple = core.block_type, core.tensor, core.tuple
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not callable(getattr(builder, "get_block_ty", None)):
        return False
    fields = {"handle", "shape", "numel", "type", "dtype"}
    sample = tensor(None, block_type(tl.float32, [2]))
    if set(sample.__dict__) != fields or type(sample.shape) is not tl_tuple:
        return False  # not the layout this was written for: triton's own, uncached
    blocks: dict[tuple[int, tuple[Any, ...]], Any] = {}

    def shared_block(element_ty: Any, shape: Any) -> Any:
        key = (id(element_ty), tuple(shape))
        found = blocks.get(key)
        if found is None or found.element_ty is not element_ty:
            if len(blocks) >= _CACHE_ENTRIES:
                blocks.clear()
            found = blocks[key] = block_type(element_ty, shape)
        return found

    init = tensor.__init__
    shapes: dict[int, tuple[Any, list[Any], Any, Any, Any]] = {}

    @functools.wraps(init)
    def tensor_init(self: Any, handle: Any, type: Any) -> None:  # tensor.__init__'s names
        entry = shapes.get(id(type))
        if entry is None or entry[0] is not type:
            init(self, handle, type)
            if len(shapes) >= _CACHE_ENTRIES:
                shapes.clear()
            shape = self.shape
            shapes[id(type)] = (type, list(shape.values), shape.type, self.numel, self.dtype)
            return
        _, values, shape_type, numel, dtype = entry
        shape = tl_tuple.__new__(tl_tuple)
        shape.values = list(values)
        shape.type = shape_type
        self.handle = handle
        self.shape = shape
        self.numel = numel
        self.type = type
        self.dtype = dtype

    block_type.with_element_ty = lambda self, scalar_ty: shared_block(scalar_ty, self.shape)
    builder.get_block_ty = lambda self, dtype, shape: shared_block(dtype, shape)
    tensor.__init__ = tensor_init
    return True


def _memoised_by_type_name(np_dtype: Any) -> Any:
    """The interpreter's ``_get_np_dtype`` (a Triton type -> the numpy dtype holding its values),
    which builds a 19-entry dict on every call (~7% of an interpreted kernel's time), with its
    answers kept per type. A Triton type is named by its class and ``name`` (``dtype.__eq__``
    compares names), and the answer depends on nothing else."""
    answers: dict[tuple[type, str], Any] = {}

    @functools.wraps(np_dtype)
    def memoised(tt_dtype: Any) -> Any:
        name = getattr(tt_dtype, "name", None)
        if not isinstance(name, str):
            return np_dtype(tt_dtype)
        key = (type(tt_dtype), name)
        found = answers.get(key)
        if found is None:
            found = answers[key] = np_dtype(tt_dtype)
        return found

    return memoised
