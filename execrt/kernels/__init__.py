"""Kernels shared by models and backends (norms, rotary, activations, fused MoE, attention).

Every model kernel has a torch reference that runs anywhere (CPU CI, the Triton
interpreter's oracle) and a Triton implementation imported only when it is used, so
importing a kernel module never imports triton; the ``triton_*`` modules, ``triton_pdl`` and
the ``attention`` package are the Triton halves. ``_triton`` is the one switch they share:
``use_triton``, the interpreter check, device and index checks, launch sizing, PDL.
Layering: kernels import torch, triton and ``execrt.core`` only; models and backends may
import kernels, the core never does.
"""

from execrt.kernels._triton import KernelMode, use_triton

__all__ = ["KernelMode", "use_triton"]
