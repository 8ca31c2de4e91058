"""The prologue of a kernel launched with programmatic dependent launch (see ``use_pdl``), and
the variant that first asks the L2 for the kernel's weights (``prefetch_plan``)."""

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


@triton.jit
def prefetch_l2(ptrs):
    """Ask the L2 for the line holding each address of ``ptrs`` and go on: nothing waits for
    the data (``prefetch.global.L2``; GPU only, the interpreter cannot run inline PTX)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def pdl_prologue_prefetch(
    PDL: tl.constexpr,
    base_ptr,
    pf_lines,
    pf_per_prog,
    PF_ELEMS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """``pdl_prologue``, after which this program (in launch order) asks the L2 for lines
    ``[pid * pf_per_prog, (pid + 1) * pf_per_prog)`` of the ``pf_lines`` 128-byte lines at
    ``base_ptr`` (``PF_ELEMS`` elements each; ``_triton.prefetch_plan`` sizes them). The
    data must not be written by the kernels ahead (weights): the requests go out before the
    wait, while the kernel ahead still runs, so the loads after it hit the L2."""
    if PREFETCH:
        pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
        lo = pid * pf_per_prog
        if lo < pf_lines:
            lanes = tl.arange(0, 128)
            for i in range(lo, lo + pf_per_prog, 128):
                line = tl.minimum(i + lanes, pf_lines - 1).to(tl.int64)
                prefetch_l2(base_ptr + line * PF_ELEMS)
    pdl_prologue(PDL)
