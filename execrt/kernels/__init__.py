"""Fused kernels shared by models and backends (norms, rotary, activations, fused MoE).

Every kernel has a torch reference that runs anywhere (CPU CI, the Triton interpreter's
oracle) and a Triton implementation imported only when it is used, so importing a kernel
module never imports triton. Layering: kernels import torch, triton and ``execrt.core``
only; models and backends may import kernels, the core never does.
"""

from execrt.kernels._triton import KernelMode, use_triton

__all__ = ["KernelMode", "use_triton"]
