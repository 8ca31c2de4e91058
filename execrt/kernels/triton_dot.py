"""``tl.dot`` at the inputs' own precision: IEEE fp32 for fp32 operands.

Triton's default for fp32 operands on a GPU is TF32 (a 10-bit mantissa: about 5e-4 relative
error per product), which an fp32 model asks not to get; fp16/bf16 operands are unaffected.
The interpreter computes in fp32 either way, so only a GPU test can see the difference."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc=None):
    """``tl.dot(a, b, acc)``, in IEEE fp32 when ``a`` is fp32."""
    if a.dtype.is_fp32():
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out
