"""The prologue of a kernel launched with programmatic dependent launch (see ``use_pdl``)."""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older triton: PDL is never requested (``_triton_has_pdl``)

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of every kernel that may be launched with PDL: wait until the grid
    ahead has finished and its writes are visible (nothing of this kernel may run before), then
    let the next kernel's grid be scheduled while this one runs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


#: ``prefetch_l2``'s instruction (inline asm must produce a value: a dummy 0), for kernels
#: that issue it themselves (Gluon: ``decode_mma``).
PREFETCH_L2_ASM = "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;"
# jit functions read module globals only as constexprs
_PREFETCH_L2 = tl.constexpr(PREFETCH_L2_ASM)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line of every pointer of ``ptrs`` without waiting for it (no
    register receives the data; CUDA only, never under the interpreter). Issued before
    ``pdl_prologue``, it lets a kernel's first reads of memory that the grid ahead does not
    write (weights, older K/V) overlap that grid instead of following it."""
    tl.inline_asm_elementwise(
        _PREFETCH_L2,
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_rows_l2(base, rows, lo, hi, LINES: tl.constexpr):
    """``prefetch_l2`` of elements ``[lo, hi)`` of each row of ``base`` (``rows``: each row's
    offset in elements), ``LINES`` lines per row per pass; nothing when the range is empty."""
    per_line: tl.constexpr = 1024 // base.dtype.element_ty.primitive_bitwidth
    cols = tl.arange(0, LINES) * per_line
    if lo < hi:
        for k0 in range(lo, hi, LINES * per_line):
            prefetch_l2(base + rows[:, None] + tl.minimum(k0 + cols, hi - 1)[None, :])
