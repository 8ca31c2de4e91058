"""Triton kernels for paged (page size 1) decode and extend attention over a slot KV cache."""

from __future__ import annotations

from execrt.backends.attention.triton_kernels.common import (
    DEFAULT_MAX_SPLITS_CAP,
    DEFAULT_MIN_SPLIT_LEN,
    DEFAULT_PROGRAMS_PER_SM,
    DEFAULT_TARGET_SPLIT_LEN,
    MAX_HEAD_DIM,
)
from execrt.backends.attention.triton_kernels.decode import decode_attention
from execrt.backends.attention.triton_kernels.extend import extend_attention
from execrt.backends.attention.triton_kernels.indices import (
    SplitPolicy,
    decode_metadata,
    decode_num_splits,
)

__all__ = [
    "DEFAULT_MAX_SPLITS_CAP",
    "DEFAULT_MIN_SPLIT_LEN",
    "DEFAULT_PROGRAMS_PER_SM",
    "DEFAULT_TARGET_SPLIT_LEN",
    "MAX_HEAD_DIM",
    "SplitPolicy",
    "decode_attention",
    "decode_metadata",
    "decode_num_splits",
    "extend_attention",
]
