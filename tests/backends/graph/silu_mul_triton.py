"""A small Triton kernel for the CUDA-graph tests: ``silu(gate) * up``, one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[bs, 2H]`` (gate then up) -> ``[bs, H]``, in the input dtype."""
    bs, width = gate_up.shape
    hidden = width // 2
    out = torch.empty(bs, hidden, device=gate_up.device, dtype=gate_up.dtype)  # [bs, H]
    block = triton.next_power_of_2(hidden)
    _silu_mul_kernel[(bs,)](gate_up, out, hidden, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
