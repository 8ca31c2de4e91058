"""Fused MoE expert compute in Triton: alignment, grouped GEMMs, per-device tile configs.

Importing this package does not import triton; the kernels load on the first call.
"""

from __future__ import annotations

from execrt.kernels.fused_moe.api import (
    MoEAlignment,
    fused_experts,
    max_padded_pairs,
    moe_align,
)
from execrt.kernels.fused_moe.config import (
    GemmTile,
    MoEConfig,
    config_file_name,
    default_config,
    get_config,
)

__all__ = [
    "GemmTile",
    "MoEAlignment",
    "MoEConfig",
    "config_file_name",
    "default_config",
    "fused_experts",
    "get_config",
    "max_padded_pairs",
    "moe_align",
]
