"""Triton kernels for paged (page size 1) decode and extend attention over a slot KV cache.

Importing this package imports triton (every module here is a Triton kernel); the torch-only
index build the backends share is ``execrt.kernels.kv_indices``.
"""

from __future__ import annotations

from execrt.kernels.attention.common import (
    DEFAULT_MAX_SPLITS_CAP,
    DEFAULT_MIN_SPLIT_LEN,
    DEFAULT_PROGRAMS_PER_SM,
    DEFAULT_TARGET_SPLIT_LEN,
    MAX_HEAD_DIM,
)
from execrt.kernels.attention.decode import (
    DECODE_PROGRAMS,
    DecodePrologue,
    DecodeTiles,
    decode_attention,
    decode_programs,
    decode_tiles,
    decode_wave,
    load_tile_table,
    tile_table_json,
)
from execrt.kernels.attention.extend import extend_attention, extend_kernel_refusal
from execrt.kernels.attention.indices import (
    SplitPolicy,
    decode_metadata,
    decode_num_splits,
    decode_work,
    work_size,
)

__all__ = [
    "DECODE_PROGRAMS",
    "DEFAULT_MAX_SPLITS_CAP",
    "DEFAULT_MIN_SPLIT_LEN",
    "DEFAULT_PROGRAMS_PER_SM",
    "DEFAULT_TARGET_SPLIT_LEN",
    "MAX_HEAD_DIM",
    "DecodePrologue",
    "DecodeTiles",
    "SplitPolicy",
    "decode_attention",
    "decode_programs",
    "decode_tiles",
    "decode_wave",
    "decode_metadata",
    "decode_num_splits",
    "decode_work",
    "extend_attention",
    "extend_kernel_refusal",
    "load_tile_table",
    "tile_table_json",
    "work_size",
]
