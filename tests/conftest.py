"""Shared pytest fixtures: fresh plugin hosts and runtime contexts, tiny HF checkpoints."""

from __future__ import annotations

import os

# Triton kernels run under the interpreter on machines without CUDA. The flag is read when a
# kernel module is imported, so it must be set before any test imports one.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass
