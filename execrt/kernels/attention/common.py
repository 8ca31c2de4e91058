"""Shared validation helpers and constants of the Triton attention kernels."""

from __future__ import annotations

from typing import NamedTuple

import torch

from execrt.core.kv_quant import FP8_DTYPES
from execrt.kernels._triton import (
    check_device,
    check_index,
    check_last_dim_contiguous,
    check_same_device,
    fail,
)

MAX_HEAD_DIM = 256

# Stage 1 of decode processes one (request, kv head, split) per program. A program must be
# worth its fixed cost (loading q, writing a partial row per head, one more merge step in stage
# 2), so a split should not be shorter than this many tokens. Measured on an H200 (8 KV heads,
# % of copy bandwidth at 1x512 / 1x2k / 32x512 / 1x32k / 64x4k): 256 gave 6.4/19.7/61.5/72.1/
# 97.4, 128 gave 7.8/20.0/61.9/72.0/97.3, 64 (with 64-token blocks) 7.8/17.1/63.5/63.9/95.1.
DEFAULT_MIN_SPLIT_LEN = 128

# Split length that streamed best on an H200 once the GPU holds enough programs: 2k-token
# splits beat 1k-token ones at 16 x 4k (89% vs 78% of copy bandwidth) and 64 x 4k (99.8% vs
# 95.8%); see docs/kernels.md.
DEFAULT_TARGET_SPLIT_LEN = 2048

# Stage-1 programs per SM the split policy asks for before it lets splits get longer: with
# fewer (bs 1 x 32k cut into 16 splits of 2k: 128 programs) the H200 streamed at 59%, with
# two per SM (33 splits of 1k) at 73%.
DEFAULT_PROGRAMS_PER_SM = 2

# Upper bound on the splits of one request: the partial buffers grow linearly with it and stage 2
# merges splits sequentially, so past this point more splits cost more than they return.
DEFAULT_MAX_SPLITS_CAP = 64

LOG2E = 1.4426950408889634

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
COMPONENT = "triton attention"


class AttentionDims(NamedTuple):
    """Sizes read off q, the KV buffers and o by :func:`check_paged`."""

    rows: int  # query rows: requests at decode, new tokens at extend
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int


#: Caches below this many elements address every row with int32 offsets (slot x row stride).
INT32_OFFSETS_LIMIT = 2**31


def int32_slot_offsets(*buffers: torch.Tensor) -> bool:
    """Whether every offset into these caches (slot x row stride + head and column) fits int32:
    the kernels then compute their gathers' addresses in 32 bits, which on triton 3.6 (the
    H200's) took 13-19% of the decode loop's instructions and 7% of the extend loop's in
    64-bit arithmetic (sm90 AOT). Larger caches keep int64."""
    return all(b.numel() < INT32_OFFSETS_LIMIT for b in buffers)


def fp16_dots(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    """Whether the kernels run their dots in fp16: an fp8 cache read by 16-bit q (fp8 ->
    fp16 is exact and one instruction per pair; fp8 -> bf16 costs a slow conversion more)."""
    return k_buffer.dtype in FP8_DTYPES and q.dtype != torch.float32


def check_head_dim(name: str, dim: int) -> None:
    if not 1 <= dim <= MAX_HEAD_DIM:
        fail(COMPONENT, f"{name} {dim} unsupported (supported: 1..{MAX_HEAD_DIM})")


def check_block(name: str, value: int, minimum: int = 16) -> None:
    if value < minimum or value & (value - 1):
        fail(COMPONENT, f"{name} {value} unsupported (supported: a power of two >= {minimum})")


def check_qkvo(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> AttentionDims:
    """Validate q/k/v/o ranks, dtypes and shapes, and that q is on a device Triton runs on.

    K/V are in q's dtype, or fp8 with ``kv_scales`` (fp32, k_scale then v_scale first)."""
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o)):
        if t.dim() != 3:
            fail(COMPONENT, f"{name} must be 3-D, got shape {tuple(t.shape)}")
    check_device(COMPONENT, "q", q)
    if q.dtype not in FLOAT_DTYPES:
        fail(COMPONENT, f"q dtype {q.dtype} unsupported (supported: float16, bfloat16, float32)")
    if o.dtype != q.dtype:
        fail(COMPONENT, f"o dtype {o.dtype} differs from q dtype {q.dtype} (must match)")
    if k_buffer.dtype != q.dtype and k_buffer.dtype not in FP8_DTYPES:
        fail(
            COMPONENT,
            f"k_buffer dtype {k_buffer.dtype} differs from q dtype {q.dtype} (must match, or "
            "be float8_e4m3fn or float8_e5m2)",
        )
    if v_buffer.dtype != k_buffer.dtype:
        fail(COMPONENT, f"v_buffer dtype {v_buffer.dtype} differs from k_buffer's {k_buffer.dtype}")
    if k_buffer.dtype in FP8_DTYPES and kv_scales is None:
        fail(COMPONENT, f"a {k_buffer.dtype} cache needs kv_scales (k_scale, v_scale)")
    if kv_scales is not None and (kv_scales.dtype != torch.float32 or kv_scales.numel() < 2):
        fail(
            COMPONENT,
            f"kv_scales {tuple(kv_scales.shape)} {kv_scales.dtype} unsupported "
            "(supported: float32 with k_scale, v_scale first)",
        )
    rows, num_q_heads, head_dim = q.shape
    num_slots, num_kv_heads, k_dim = k_buffer.shape
    head_dim_v = v_buffer.shape[2]
    if k_dim != head_dim:
        fail(COMPONENT, f"k_buffer head dim {k_dim} differs from q head dim {head_dim}")
    if tuple(v_buffer.shape[:2]) != (num_slots, num_kv_heads):
        fail(
            COMPONENT,
            f"v_buffer shape {tuple(v_buffer.shape)} does not match "
            f"k_buffer shape {tuple(k_buffer.shape)} in its first two dims",
        )
    if tuple(o.shape) != (rows, num_q_heads, head_dim_v):
        expected = (rows, num_q_heads, head_dim_v)
        fail(COMPONENT, f"o shape {tuple(o.shape)} unsupported (expected {expected})")
    check_head_dim("head_dim", head_dim)
    check_head_dim("head_dim_v", head_dim_v)
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        fail(
            COMPONENT,
            f"{num_q_heads} query heads unsupported with {num_kv_heads} kv heads "
            "(supported: Hq a multiple of Hkv)",
        )
    return AttentionDims(rows, num_q_heads, num_kv_heads, head_dim, head_dim_v)


def check_paged(
    batch: int,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    q: torch.Tensor,
    **tensors: torch.Tensor,
) -> None:
    """What decode and extend both need past :func:`check_qkvo`: ``kv_indptr`` / ``kv_indices``
    of ``batch`` requests, and q and every other tensor on one device and contiguous in its
    last dim (the kernels vectorise along it; the other strides are passed, so slices of a
    larger static buffer are fine)."""
    check_index(COMPONENT, "kv_indptr", kv_indptr, batch + 1)
    check_index(COMPONENT, "kv_indices", kv_indices, 0)
    check_same_device(COMPONENT, q, kv_indptr=kv_indptr, kv_indices=kv_indices, **tensors)
    check_last_dim_contiguous(COMPONENT, q=q, **tensors)
