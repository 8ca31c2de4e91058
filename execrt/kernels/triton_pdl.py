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
