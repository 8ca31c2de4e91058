"""Split-KV flash-decoding over the page-size-1 cache: stage 1 per split, stage 2 merge."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from execrt.core.config import TRITON_DECODE_PROGRAMS
from execrt.core.kv_quant import FP8_DTYPES, K_INV_SCALE, V_INV_SCALE, fp8_format
from execrt.kernels._triton import (
    FP8_DECODE_KERNELS,
    cdiv,
    check_index,
    fail,
    fp8_decode_kernel,
    fp8_words_opaque,
    interpreter_enabled,
    merge_chunk,
    next_power_of_2,
    pdl_kwargs,
    pdl_prefetch,
    pow2_at_least,
    sm_count,
    tuned_table_name,
)
from execrt.kernels.attention.common import (
    COMPONENT,
    DEFAULT_PROGRAMS_PER_SM,
    LOG2E,
    check_block,
    check_paged,
    check_qkvo,
    fp16_dots,
    int32_slot_offsets,
)
from execrt.kernels.attention.indices import (
    check_arrivals,
    check_work,
    clamp_splits,
    decode_work,
    slot_offsets,
    work_size,
)
from execrt.kernels.triton_dot import dot
from execrt.kernels.triton_pdl import pdl_prologue, prefetch_rows_l2
from execrt.kernels.triton_rotary import norm_rope_heads, store_kv_heads

# ----------------------------------------------------------------------------------------------
# Tile choices
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape of decode stage 1: tokens per loop step, warps, pipelining depth (K/V
    blocks are gathered ``num_stages - 1`` steps ahead). ``benchmarks/tune_triton_decode.py``
    sweeps these and writes a per-GPU table (:func:`decode_tiles` reads it).

    A table entry may also tune how its batch size splits and merges (0 and "" leave both to
    the attention backend's options and defaults): ``min_split_len``, the shortest split in
    tokens (``SplitPolicy.min_split_len``: a request of up to this many tokens gets one split),
    and ``merge``, ``fused`` or ``separate`` (where the backend's ``decode_merge`` is auto).
    A batch of a few requests (8-16 on an H100) is faster with one split per short request and
    no merge launch than with the GPU filled by short splits and a merge (docs/kernels.md)."""

    block_n: int
    num_warps: int
    num_stages: int
    min_split_len: int = 0
    merge: str = ""

    def __post_init__(self) -> None:
        check_block("block_n", self.block_n)
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            fail(
                COMPONENT,
                f"decode tiles {self} unsupported (num_warps 1/2/4/8/16, num_stages >= 1)",
            )
        split = self.min_split_len
        if not isinstance(split, int) or isinstance(split, bool) or split < 0:
            fail(
                COMPONENT,
                f"decode tiles min_split_len {self.min_split_len!r} unsupported (a token "
                "count >= 1, or 0 for the policy's)",
            )
        if self.merge not in TILE_MERGES:
            fail(
                COMPONENT,
                f"decode tiles merge {self.merge!r} unsupported (supported: "
                f"{', '.join(repr(m) for m in TILE_MERGES)})",
            )


#: A tile entry's ``merge``: "" (the backend decides), or the merge its batch size runs.
TILE_MERGES = ("", "fused", "separate")


# Untuned defaults, keyed by the cache's bytes per element. Each program has one or two K/V
# blocks in flight, so the bytes a block moves set the bandwidth an SM can reach: a 16-bit
# block of 128 tokens moves 64 KB (D = 128), the same block in fp8 half that. fp8 therefore
# gathers two blocks ahead (3 stages): from an AOT compile for sm90 (triton 3.6, D 128, GQA
# 4), 164 registers and 104 KB of shared memory (two 32 KB K/V buffers, 32 KB where V is
# transposed as fp16), two programs per SM, 128 KB in flight per SM as for bf16 (168
# registers, 72 KB, three programs per SM of one 64 KB block each). 16-bit: the H200 sweeps
# of docs/kernels.md (128 tokens, 4 warps, 2 stages).
_GPU_TILES: dict[int, DecodeTiles] = {
    1: DecodeTiles(128, 4, 3),
    2: DecodeTiles(128, 4, 2),
    4: DecodeTiles(128, 4, 2),
}
# The interpreter ignores warps and stages; 128-token blocks keep the program count low.
_CPU_TILES = DecodeTiles(128, 4, 1)

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "decode_configs")


def decode_tiles(
    kv_dtype: torch.dtype, head_dim: int, batch_size: int, device: torch.device
) -> DecodeTiles:
    """The tiles for a decode batch: the GPU's tuned table for this cache dtype (its entry for
    the padded head dim at the smallest tuned batch size >= ``batch_size``, else the largest
    tuned one), else the default for the cache's element size. Host-side and cached: a
    graph bucket captures what its batch size gets."""
    if device.type != "cuda":
        return _CPU_TILES
    return _decode_tiles(torch.cuda.get_device_name(device), kv_dtype, head_dim, batch_size)


@functools.lru_cache(maxsize=256)
def _decode_tiles(
    device_name: str, kv_dtype: torch.dtype, head_dim: int, batch_size: int
) -> DecodeTiles:
    table = load_tile_table(os.path.join(CONFIG_DIR, tuned_table_name(device_name, kv_dtype)))
    by_bs = (table or {}).get(pow2_at_least(head_dim))
    if by_bs:
        above = [bs for bs in by_bs if bs >= batch_size]
        return by_bs[min(above) if above else max(by_bs)]
    return _GPU_TILES[torch.empty((), dtype=kv_dtype).element_size()]


@functools.lru_cache(maxsize=16)
def load_tile_table(path: str) -> dict[int, dict[int, DecodeTiles]] | None:
    """``{padded head dim: {batch size: tiles}}`` from a tuned table file, None if absent.

    The file (``tile_table_json``): ``{"tiles": {"<head dim>": {"<batch size>": {"block_n":
    .., "num_warps": .., "num_stages": ..}}}}`` plus free-form provenance keys.

    Raises:
        ValueError: on a malformed file, naming it.
    """
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            data = json.load(fh)
        return {
            int(d): {int(bs): DecodeTiles(**t) for bs, t in by_bs.items()}
            for d, by_bs in data["tiles"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        fail(
            COMPONENT,
            f"decode tile table {path} unreadable ({exc}); expected "
            '{"tiles": {"<head dim>": {"<batch size>": {"block_n", "num_warps", "num_stages"}}}}',
        )


def tile_table_json(tiles: dict[int, dict[int, DecodeTiles]], **provenance: Any) -> dict[str, Any]:
    """The file form of a tile table (what :func:`load_tile_table` reads)."""
    return {
        **provenance,
        "tiles": {
            str(d): {str(bs): asdict(t) for bs, t in sorted(by_bs.items())}
            for d, by_bs in sorted(tiles.items())
        },
    }


# ----------------------------------------------------------------------------------------------
# Decode: split-KV flash decoding
# ----------------------------------------------------------------------------------------------

#: Stage 1 launches programs for at least this many per SM over the kv heads (when the batch
#: has that many work items; one per request at the least).
PROGRAMS_PER_SM = 8
#: How ``decode_programs`` sizes the grid: ``request`` (a program per request at the least)
#: or ``sm`` (``DEFAULT_PROGRAMS_PER_SM`` resident programs per SM, each taking an equal share
#: of the work items, so every program runs the look-ahead over several items); the values of
#: the triton backend's ``decode_programs`` option.
DECODE_PROGRAMS = TRITON_DECODE_PROGRAMS


def prefetch_tokens(block_n: int) -> int:
    """Tokens of its first item a split program prefetches ahead of its PDL wait: the first
    two blocks, up to 128 tokens (64 KB of 128-dim bf16 K and V per program, so the programs
    resident at once ask L2 for far less than it holds), one block at least."""
    return min(2 * block_n, max(block_n, 128))


def prefetch_lines(head_dim: int, element_size: int) -> int:
    """128-byte lines of one K or V row of a kv head (a power of two: the prefetch's width)."""
    return next_power_of_2(cdiv(head_dim * element_size, 128))


def _check_programs(policy: str) -> None:
    if policy not in DECODE_PROGRAMS:
        supported = ", ".join(DECODE_PROGRAMS)
        fail(COMPONENT, f"programs {policy!r} unsupported (supported: {supported})")


def decode_programs(
    batch: int, num_kv_heads: int, max_splits: int, num_sms: int, policy: str = "request"
) -> int:
    """Stage-1 programs per kv head. ``request``: one per request, or ``PROGRAMS_PER_SM`` per
    SM over the heads where that is more. ``sm``: ``DEFAULT_PROGRAMS_PER_SM`` per SM over the
    heads, the items there can be (``batch * max_splits``) shared out evenly (e.g. 128
    one-split requests on 132 SMs and 8 kv heads: 32 programs of 4 items per head, one wave,
    instead of 128 programs of one). Never more than the items. Depends only on its
    arguments, so a graph bucket replays the grid it captured.

    The grid used to be ``(B, Hkv, max_splits)``, with ``max_splits`` set by the longest
    context allowed: at 256 requests, 8 kv heads and a 40k context limit, 40,960 programs
    per layer of which 2,048 had a split to do."""
    _check_programs(policy)
    items = max(1, batch * max_splits)
    heads = max(1, num_kv_heads)
    if policy == "sm":
        resident = max(1, -(-DEFAULT_PROGRAMS_PER_SM * num_sms // heads))
        per_program = -(-items // resident)
        return -(-items // per_program)
    want = max(batch, -(-PROGRAMS_PER_SM * num_sms // heads))
    return max(1, min(items, want))


# ----------------------------------------------------------------------------------------------
# fp8 K/V read as 32-bit words
# ----------------------------------------------------------------------------------------------
# Triton gives every operand of a dot fed by fp8 values kWidth 4 (sm90, triton 3.6-3.9): q and
# p are then re-read from shared memory with LDS.64 each block and assembled by ~270 moves,
# 1,195 instructions per 128-token block against bf16's 579 (benchmarks/kernel_sass.py). Read
# as int32 words and unpacked by PTX into fp16 pairs, the tiles trace back to 32-bit values and
# the dots keep kWidth 2 in triton 3.9 (617 instructions, 3 stages). Triton 3.6 (the H200's)
# halves the operand width it finds for every join on the way back from a dot, so the joins
# that lay the four values of a word side by side gave kWidth 4 again there (883
# instructions, 200 of them register moves). An identity the compiler cannot see through
# (``_opaque``) between the joined tile and the dot ends that search: kWidth 2, 680
# instructions, K and V passing once through shared memory as fp16 (sm90 AOT, triton 3.6).
# The H200 ran that loop slower (8B, 128 x 512: 8.205 against 8.038 ms a step), so it is off
# unless EXECRT_FP8_WORDS_OPAQUE=1.

_CVT_ASM = """{
.reg .b16 lo, hi;
.reg .b32 a, b;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.FMTx2 a, lo;
cvt.rn.f16x2.FMTx2 b, hi;
mov.b32 {$0, $1}, a;
mov.b32 {$2, $3}, b;
}"""
# jit functions read module globals only as constexprs
_CVT_E4M3 = tl.constexpr(_CVT_ASM.replace("FMT", "e4m3"))
_CVT_E5M2 = tl.constexpr(_CVT_ASM.replace("FMT", "e5m2"))


@triton.jit
def _fp8_byte_to_f16(word, SHIFT: tl.constexpr, E5M2: tl.constexpr):
    """Byte ``SHIFT // 8`` of int32 ``word`` as the fp16 value of that fp8 code (exact: every
    e4m3 and e5m2 value is an fp16 value). The interpreter's stand-in for the PTX: e5m2 is the
    high byte of an fp16; e4m3 (bias 7, 3 mantissa bits) placed under fp16's sign and exponent
    bits is its value / 2^8 (fp16's bias is 15), subnormals included."""
    byte = (word >> SHIFT) & 0xFF
    if E5M2:
        bits = byte << 8
    else:
        bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
    half = bits.to(tl.int16).to(tl.float16, bitcast=True)
    if not E5M2:
        half = (half * 256.0).to(tl.float16)
    return half


@triton.jit
def _unpack_fp8_words(words, E5M2: tl.constexpr, ASM: tl.constexpr):
    """The four fp8 values of each int32 word as fp16, byte 0 (the lowest address) first."""
    if ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            _CVT_E5M2 if E5M2 else _CVT_E4M3, "=h,=h,=h,=h,r", [words],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        b0 = _fp8_byte_to_f16(words, 0, E5M2)
        b1 = _fp8_byte_to_f16(words, 8, E5M2)
        b2 = _fp8_byte_to_f16(words, 16, E5M2)
        b3 = _fp8_byte_to_f16(words, 24, E5M2)
    # [..., 2, 2] with element [i, k] = byte 2i + k: flattening the two new dims gives bytes
    # 0, 1, 2, 3 in order.
    return tl.join(tl.join(b0, b2), tl.join(b1, b3))


_IDENTITY_ASM = tl.constexpr("mov.b32 $0, $1;")


@triton.jit
def _opaque(x, ON: tl.constexpr):
    """``x`` (fp16) unchanged. ``ON`` (a GPU with ``EXECRT_FP8_WORDS_OPAQUE=1``): through an
    identity in PTX that Triton does not look through (not pure), so the dot it feeds takes
    its operand width from here, not from the joins behind it (see above). Any two values may
    share the asm's 32-bit register: an identity does not care which."""
    if ON:
        x = tl.inline_asm_elementwise(
            _IDENTITY_ASM, "=r,r", [x], dtype=tl.float16, is_pure=False, pack=2
        )
    return x


@triton.jit
def _load_kt_words(k_words, slots, mask_n, stride_ks, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, E5M2: tl.constexpr, ASM: tl.constexpr,
                   OPAQUE: tl.constexpr):  # fmt: skip
    """K^T ``[BLOCK_D, BLOCK_N]`` as fp16 from the int32 words of an fp8 cache (``stride_ks``
    in words; ``HEAD_DIM % 4 == 0``); padding rows and masked tokens are 0."""
    offs_w = tl.arange(0, BLOCK_D // 4)
    words = tl.load(
        k_words + offs_w[:, None] + slots[None, :] * stride_ks,
        mask=(offs_w < HEAD_DIM // 4)[:, None] & mask_n[None, :],
        other=0,
    )  # [BLOCK_D // 4, BLOCK_N]
    quads = _unpack_fp8_words(words, E5M2, ASM)  # [BLOCK_D // 4, BLOCK_N, 2, 2]
    return _opaque(tl.reshape(tl.permute(quads, (0, 2, 3, 1)), (BLOCK_D, slots.shape[0])), OPAQUE)


@triton.jit
def _load_v_words(v_words, slots, mask_n, stride_vs, HEAD_DIM_V: tl.constexpr,
                  BLOCK_DV: tl.constexpr, E5M2: tl.constexpr, ASM: tl.constexpr,
                  OPAQUE: tl.constexpr):  # fmt: skip
    """V ``[BLOCK_N, BLOCK_DV]`` as fp16 from the int32 words of an fp8 cache."""
    offs_w = tl.arange(0, BLOCK_DV // 4)
    words = tl.load(
        v_words + slots[:, None] * stride_vs + offs_w[None, :],
        mask=mask_n[:, None] & (offs_w < HEAD_DIM_V // 4)[None, :],
        other=0,
    )  # [BLOCK_N, BLOCK_DV // 4]
    quads = _unpack_fp8_words(words, E5M2, ASM)  # [BLOCK_N, BLOCK_DV // 4, 2, 2]
    return _opaque(tl.reshape(quads, (slots.shape[0], BLOCK_DV)), OPAQUE)


# The prefetch's bounds vary step to step (the batch, the context lengths' sum): not
# specialised, they add no compiled variants (divisible by 16, equal to 1) to a serving run.
@triton.jit(do_not_specialize=["batch", "num_ids", "num_slots"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    num_splits_ptr,
    work_ptr,
    part_o_ptr,
    part_lse_ptr,
    kv_scales_ptr,
    o_ptr,
    arrivals_ptr,
    qk_scale,
    max_splits,
    num_kv_heads,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    # PROLOGUE only (``DecodePrologue``): this step's raw k and v, the rotation's inputs and
    # the cache as stored to (typed, where ``k_ptr``/``v_ptr`` may be its int32 words)
    k_new_ptr,
    v_new_ptr,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos,
    stride_sin,
    q_w_ptr,
    k_w_ptr,
    eps,
    loc_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    KV_SCALED: tl.constexpr,
    DOT_F16: tl.constexpr,
    FUSED: tl.constexpr,
    F8_WORDS: tl.constexpr,
    F8_E5M2: tl.constexpr,
    F8_ASM: tl.constexpr,
    F8_OPAQUE: tl.constexpr,
    SLOT_I32: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    HADAMARD: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr,
    K_INV: tl.constexpr,
    V_INV: tl.constexpr,
    PDL: tl.constexpr,
    # PREFETCH only: the bounds every prefetch address is clamped into
    batch,
    num_ids,
    num_slots,
    PREFETCH: tl.constexpr,
    PF_TOKENS: tl.constexpr,
    PF_LINES_K: tl.constexpr,
    PF_LINES_V: tl.constexpr,
):
    # One axis, kv head fastest: the GPU hands out programs in launch order, so every kv head
    # takes the work list's items in its order together (longest first, when the list is
    # built so: the last programs to start are then the shortest, and a ragged batch ends
    # with fewer programs idling behind one long split).
    pid = tl.program_id(0)
    kv_head = pid % num_kv_heads
    # The (request, split) items of the work list, round robin over this kv head's programs:
    # the grid is sized by the batch, not by the most splits a request could have, so no
    # program is launched only to find its split empty, and a long request's splits still
    # run on programs of their own.
    programs = tl.num_programs(0) // num_kv_heads
    item = pid // num_kv_heads
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    # A K and a V row in elements of the base pointers' type (int32 words: four fp8 values)
    PF_ROW_K: tl.constexpr = HEAD_DIM // 4 if F8_WORDS else HEAD_DIM
    PF_ROW_V: tl.constexpr = HEAD_DIM_V // 4 if F8_WORDS else HEAD_DIM_V
    if PREFETCH:  # the first item's first K/V rows, before the wait (see _prefetch_item)
        _prefetch_item(
            work_ptr, kv_indptr_ptr, num_splits_ptr, kv_indices_ptr, k_base, v_base, item,
            batch, num_ids, num_slots, max_splits, stride_ks, stride_vs, PF_ROW_K, PF_ROW_V,
            BLOCK_N, PF_TOKENS, PF_LINES_K, PF_LINES_V,
        )  # fmt: skip
    pdl_prologue(PDL)
    n_items = tl.load(work_ptr)
    # An item's inputs are a chain of loads (its record, its request's lengths, its slot ids,
    # then K/V): loaded in its own turn, each is a round trip before the item's first K/V
    # block. So the program loads them ahead: the record two items ahead, the lengths one item
    # ahead, and the next item's q and first slot ids before this item's epilogue. Only
    # programs with several items gain (a ragged batch past ~132 requests, or long splits);
    # on the H200 +1.3% end to end on the throughput workload (docs/kernels.md, session 14).
    # Records past the list read item 0's (in bounds, never computed).
    # With PROLOGUE, q_ptr holds the raw (un-normalised, unrotated) queries: each item
    # rotates its query heads into o (whose rows the merge overwrites last), and reads them
    # from there; see _item_prologue.
    q_src = o_ptr if PROLOGUE else q_ptr
    stride_qsb = stride_ob if PROLOGUE else stride_qb
    stride_qsh = stride_oh if PROLOGUE else stride_qh
    if PROLOGUE:
        # Every item of this program first, in a loop of its own: inside the item loop, the
        # rotation's loop-invariant addresses stayed live through the K/V loop (179 registers
        # per thread against 111 without it, sm90). Items past the list are never rotated:
        # item 0's request may be merged into o by then.
        pro_item = item
        while pro_item < n_items:
            b_p, _, _, lo_p, hi_p, _, seq_len_p = _item_bounds(
                _record(work_ptr, pro_item, n_items), kv_indptr_ptr, num_splits_ptr, max_splits,
                BLOCK_N,
            )  # fmt: skip
            _item_prologue(
                q_ptr, stride_qb, stride_qh, o_ptr, stride_ob, stride_oh, k_new_ptr, stride_knt,
                stride_knh, v_new_ptr, stride_vnt, stride_vnh, pos_ptr, cos_ptr, sin_ptr,
                stride_cos, stride_sin, q_w_ptr, k_w_ptr, eps, loc_ptr, k_cache_ptr,
                v_cache_ptr, kv_scales_ptr, stride_kcs, stride_kch, stride_vcs, stride_vch,
                kv_head, b_p, (lo_p < hi_p) & (hi_p == seq_len_p), GROUP, HAS_Q_NORM,
                HAS_K_NORM, HADAMARD, KV_SCALED, FP8_MAX, FP8_MANT, FP8_EMIN, K_INV, V_INV, HALF,
                HEAD_DIM_V, BLOCK_G, BLOCK_HALF, BLOCK_DV,
            )  # fmt: skip
            pro_item += programs
        # What every thread rotated and stored is visible to all of the program's threads.
        tl.debug_barrier()
    b, split, kv_start, lo, hi, n_splits, _ = _item_bounds(
        _record(work_ptr, item, n_items), kv_indptr_ptr, num_splits_ptr, max_splits, BLOCK_N
    )
    q, ids = _item_inputs(
        q_src, kv_indices_ptr, kv_scales_ptr, kv_head, b, kv_start, lo, hi, qk_scale, stride_qsb,
        stride_qsh, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_N, KV_SCALED, DOT_F16,
    )  # fmt: skip
    record_next = _record(work_ptr, item + programs, n_items)
    while item < n_items:
        b_n, split_n, kv_start_n, lo_n, hi_n, n_splits_n, _ = _item_bounds(
            record_next, kv_indptr_ptr, num_splits_ptr, max_splits, BLOCK_N
        )
        record_next = _record(work_ptr, item + 2 * programs, n_items)
        m_i, l_i, acc = _split_blocks(
            q, ids, k_base, v_base, kv_indices_ptr + kv_start, lo, hi, stride_ks, stride_vs,
            qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_DV, KV_SCALED,
            F8_WORDS, F8_E5M2, F8_ASM, F8_OPAQUE, SLOT_I32,
        )  # fmt: skip
        if PREFETCH:  # the next item's first K/V come from DRAM during this one's epilogue
            if item + programs < n_items:
                _prefetch_span(
                    kv_indices_ptr, k_base, v_base, kv_start_n, lo_n, hi_n, num_ids, num_slots,
                    stride_ks, stride_vs, PF_ROW_K, PF_ROW_V, PF_TOKENS, PF_LINES_K, PF_LINES_V,
                )  # fmt: skip
        q_n, ids_n = _item_inputs(
            q_src, kv_indices_ptr, kv_scales_ptr, kv_head, b_n, kv_start_n, lo_n, hi_n,
            qk_scale, stride_qsb, stride_qsh, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_N,
            KV_SCALED, DOT_F16,
        )  # fmt: skip
        _split_epilogue(
            m_i, l_i, acc, part_o_ptr, part_lse_ptr, kv_scales_ptr, o_ptr, arrivals_ptr,
            kv_head, num_kv_heads, b, split, n_splits, max_splits, stride_pob, stride_poh,
            stride_pos, stride_plb, stride_plh, stride_ob, stride_oh, GROUP, HEAD_DIM_V, BLOCK_H,
            BLOCK_DV, BLOCK_S, MERGE_CHUNK, KV_SCALED, FUSED,
        )  # fmt: skip
        b, split, kv_start, lo, hi, n_splits = b_n, split_n, kv_start_n, lo_n, hi_n, n_splits_n
        q = q_n
        ids = ids_n
        item += programs


@triton.jit(noinline=True)
def _prefetch_item(
    work_ptr, kv_indptr_ptr, num_splits_ptr, kv_indices_ptr, k_base, v_base, item, batch,
    num_ids, num_slots, max_splits, stride_ks, stride_vs, ROW_K: tl.constexpr,
    ROW_V: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, LINES_K: tl.constexpr,
    LINES_V: tl.constexpr,
):  # fmt: skip
    """``_prefetch_span`` of ``item``'s first tokens, from its work-list record. Issued before
    the PDL wait, it may read a work list, lengths or slot ids that the grid ahead is still
    writing (a caller that builds them just before this launch); so every address is clamped
    into its buffer, and stale values only fetch lines nobody reads."""
    packed = _record(work_ptr, item, tl.load(work_ptr))
    packed = tl.minimum(tl.maximum(packed, 0), batch * max_splits - 1)
    _, _, kv_start, lo, hi, _, _ = _item_bounds(
        packed, kv_indptr_ptr, num_splits_ptr, max_splits, BLOCK_N
    )
    _prefetch_span(
        kv_indices_ptr, k_base, v_base, kv_start, lo, hi, num_ids, num_slots, stride_ks,
        stride_vs, ROW_K, ROW_V, TOKENS, LINES_K, LINES_V,
    )  # fmt: skip


@triton.jit
def _prefetch_span(
    kv_indices_ptr, k_base, v_base, kv_start, lo, hi, num_ids, num_slots, stride_ks, stride_vs,
    ROW_K: tl.constexpr, ROW_V: tl.constexpr, TOKENS: tl.constexpr, LINES_K: tl.constexpr,
    LINES_V: tl.constexpr,
):  # fmt: skip
    """``prefetch_l2`` of the K and V rows (``ROW_K``/``ROW_V`` elements of the base pointers'
    type) of tokens ``[lo, lo + TOKENS)`` of ``[lo, hi)``, whose slot ids start at
    ``kv_start`` in ``kv_indices``: what a split's first loads wait for. Slot-id positions
    and slots are clamped into ``[0, num_ids)`` and ``[0, num_slots)``."""
    if lo < hi:
        t = kv_start + lo + tl.minimum(tl.arange(0, TOKENS), hi - lo - 1)
        t = tl.minimum(tl.maximum(t, 0), num_ids - 1)
        ids = tl.load(kv_indices_ptr + t).to(tl.int64)
        ids = tl.minimum(tl.maximum(ids, 0), num_slots - 1)
        prefetch_rows_l2(k_base, ids * stride_ks, 0, ROW_K, LINES_K)
        prefetch_rows_l2(v_base, ids * stride_vs, 0, ROW_V, LINES_V)


@triton.jit
def _record(work_ptr, item, n_items):
    """The work list's packed (request, split) of ``item``, item 0's past the list."""
    return tl.load(work_ptr + 1 + tl.where(item < n_items, item, 0))


@triton.jit
def _item_bounds(packed, kv_indptr_ptr, num_splits_ptr, max_splits, BLOCK_N: tl.constexpr):
    """(request, split, its context's start in kv_indices, the split's [lo, hi) in it, the
    request's split count, its context length) of a packed work item."""
    b = packed // max_splits
    split = packed - b * max_splits
    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int32)
    seq_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int32) - kv_start
    n_splits = clamp_splits(tl.load(num_splits_ptr + b), max_splits)  # as the work list
    # Splits are whole multiples of BLOCK_N so only the last block of the context is ragged.
    # split_len * n_splits >= seq_len, so a split can come out empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    return b, split, kv_start, lo, hi, n_splits, seq_len


@triton.jit
def _item_prologue(
    q_ptr, stride_qb, stride_qh, o_ptr, stride_ob, stride_oh, k_new_ptr, stride_knt, stride_knh,
    v_new_ptr, stride_vnt, stride_vnh, pos_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin,
    q_w_ptr, k_w_ptr, eps, loc_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr, stride_kcs,
    stride_kch, stride_vcs, stride_vch, kv_head, b, holds_last, GROUP: tl.constexpr,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, HADAMARD: tl.constexpr,
    KV_SCALED: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr, K_INV: tl.constexpr, V_INV: tl.constexpr, HALF: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """What ``qk_norm_rope`` does for request ``b``'s token, inside the item that needs it.

    Every item of the request rotates (norm, RoPE, optional Hadamard) the query heads of its
    kv head into ``o`` (the same values from every split, as the separate kernel computes
    them), and the one item whose split holds the context's last token (``holds_last``: this
    step's own slot) also rotates the kv head's k and stores it with v into the cache, as
    ``kv_quant.store`` stores them. The caller's barrier makes both visible to every thread
    of the program before it loads q and that slot back. No other program reads the slot:
    it is the last token of this request only."""
    pos = tl.load(pos_ptr + b).to(tl.int64)
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    head0 = kv_head * GROUP
    norm_rope_heads(
        q_ptr, stride_qb, stride_qh, o_ptr, stride_ob, stride_oh, q_w_ptr, cos_row, sin_row, b,
        head0, head0 + GROUP, eps, HAS_Q_NORM, HALF, BLOCK_G, BLOCK_HALF, HADAMARD,
    )  # fmt: skip
    if holds_last:
        k1, k2 = norm_rope_heads(
            k_new_ptr, stride_knt, stride_knh, k_new_ptr, 0, 0, k_w_ptr, cos_row, sin_row, b,
            kv_head, kv_head + 1, eps, HAS_K_NORM, HALF, 1, BLOCK_HALF, HADAMARD, False,
        )  # fmt: skip
        store_kv_heads(
            k1, k2, v_new_ptr, stride_vnt, stride_vnh, k_cache_ptr, v_cache_ptr, kv_scales_ptr,
            stride_kcs, stride_kch, stride_vcs, stride_vch, b,
            tl.load(loc_ptr + b).to(tl.int64), kv_head, kv_head + 1, K_INV, V_INV, KV_SCALED,
            KV_SCALED, FP8_MAX, FP8_MANT, FP8_EMIN, HALF, HEAD_DIM_V, 1, BLOCK_HALF, BLOCK_DV,
        )  # fmt: skip


@triton.jit
def _item_inputs(
    q_ptr, kv_indices_ptr, kv_scales_ptr, kv_head, b, kv_start, lo, hi, qk_scale, stride_qb,
    stride_qh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, KV_SCALED: tl.constexpr,
    DOT_F16: tl.constexpr,
):  # fmt: skip
    """An item's query tile (the GROUP query heads of ``kv_head``; rows past GROUP are zero
    padding so that the tile is tall enough for tl.dot) and the slot ids of its first block."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=(offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if KV_SCALED:
        # An fp8 cache holds K / k_scale: the softmax scale and k_scale go into q once, not
        # into every score. With 16-bit q the dots then run in fp16: fp8 -> fp16 is one
        # instruction per pair of values and exact, fp8 -> bf16 goes through fp16 and costs
        # a slow conversion per value more, which left the fp8 decode no faster than bf16.
        # fp16 q is clamped to its finite range (|q| * scale > 65504 would otherwise be inf).
        q = q.to(tl.float32) * (qk_scale * tl.load(kv_scales_ptr))
        if DOT_F16:
            q = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
    offs_b = lo + tl.arange(0, BLOCK_N)
    ids = tl.load(kv_indices_ptr + kv_start + offs_b, mask=offs_b < hi, other=0)
    return q, ids


@triton.jit
def _split_blocks(
    q, ids, k_base, v_base, idx_base, lo, hi, stride_ks, stride_vs, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, KV_SCALED: tl.constexpr,
    F8_WORDS: tl.constexpr, F8_E5M2: tl.constexpr, F8_ASM: tl.constexpr,
    F8_OPAQUE: tl.constexpr, SLOT_I32: tl.constexpr,
):  # fmt: skip
    """The online softmax of ``q`` over the split's tokens ``[lo, hi)`` (``ids``: the slot ids
    of its first block): (running max, sum, unnormalised output), log2 domain.
    ``F8_WORDS``: ``k_base``/``v_base`` and their strides address the fp8 cache as int32 words
    of four values (see ``fp8_words``)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    offs_b = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    # The slot ids of block i + 1 are loaded during block i and carried over, so the K/V
    # gathers never depend on a load of their own iteration: the pipeliner issues them
    # num_stages - 1 blocks ahead (with the ids loaded in the same iteration, one block ahead
    # whatever num_stages, in the sm90 TTGIR of triton 3.9).
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + offs_b
        mask_n = offs_n < hi
        offs_next = offs_n + BLOCK_N
        ids_next = tl.load(idx_base + offs_next, mask=offs_next < hi, other=0)
        slots = slot_offsets(ids, SLOT_I32)  # [BLOCK_N]
        # K is gathered as K^T [BLOCK_D, BLOCK_N]: with the head dim contiguous in shared
        # memory it is already in the dot's operand order, so an fp8 K is converted in place
        # (transposing fp8 in registers took byte-wise shared loads and spilled).
        if F8_WORDS:
            kt = _load_kt_words(
                k_base, slots, mask_n, stride_ks, HEAD_DIM, BLOCK_D, F8_E5M2, F8_ASM, F8_OPAQUE
            )
        else:
            kt = tl.load(
                k_base + offs_d[:, None] + slots[None, :] * stride_ks,
                mask=mask_d[:, None] & mask_n[None, :],
                other=0.0,
            )
        s = dot(q, kt.to(q.dtype))  # [BLOCK_H, BLOCK_N]; fp8 -> fp16 is exact
        if not KV_SCALED:  # (fp8: q holds the scale)
            s = s * qk_scale  # log2 domain
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Every block holds at least one valid token, so m_new is finite for real rows.
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_H]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if F8_WORDS:
            v = _load_v_words(
                v_base, slots, mask_n, stride_vs, HEAD_DIM_V, BLOCK_DV, F8_E5M2, F8_ASM,
                F8_OPAQUE,
            )  # fmt: skip
        else:
            v = tl.load(
                v_base + slots[:, None] * stride_vs + offs_dv[None, :],
                mask=mask_n[:, None] & mask_dv[None, :],
                other=0.0,
            ).to(q.dtype)  # [BLOCK_N, BLOCK_DV]
        if KV_SCALED and not F8_WORDS:
            # A no-op on the values (the load already zero-fills), but an operation between
            # the conversion and the dot makes Triton convert V in the load's layout and
            # transpose it through shared memory as fp16 (ldmatrix.trans); without it, it
            # read the fp8 tile transposed one byte per load (sm90, triton 3.6 and 3.9).
            v = tl.where(mask_n[:, None], v, 0.0)
        # p in the compute dtype (never fp8: rounding p to V's dtype would cost the most).
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v)
        m_i = m_new
        ids = ids_next
    return m_i, l_i, acc


@triton.jit
def _split_epilogue(
    m_i, l_i, acc, part_o_ptr, part_lse_ptr, kv_scales_ptr, o_ptr, arrivals_ptr, kv_head,
    num_kv_heads, b, split, n_splits, max_splits, stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh, stride_ob, stride_oh, GROUP: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
    MERGE_CHUNK: tl.constexpr, KV_SCALED: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """One split's partial output and log-sum-exp. ``FUSED``: a request of one split writes
    its output directly, and the last split of a request to finish merges them all (see
    :func:`decode_attention`'s ``arrivals``)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_h = offs_h < GROUP
    mask_dv = offs_dv < HEAD_DIM_V
    heads = kv_head * GROUP + offs_h
    # Empty splits (no loop iteration) leave l_i == 0: they publish lse = -inf, which stage 2
    # reads as "skip", and do not write their partial row at all.
    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]  # [BLOCK_H, BLOCK_DV]
    if KV_SCALED:  # V / v_scale was stored; the merge is linear, so scale each split here
        out = out * tl.load(kv_scales_ptr + 1)

    if FUSED and n_splits == 1:
        # The whole context in one split: its normalised output is the answer (the separate
        # merge would compute exactly this: weight exp2(0) = 1, denominator 1).
        tl.store(
            o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=mask_h[:, None] & mask_dv[None, :],
        )
    else:
        tl.store(part_lse_ptr + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)
        po = part_o_ptr + b * stride_pob + split * stride_pos
        tl.store(
            po + heads[:, None] * stride_poh + offs_dv[None, :],
            out,
            mask=(mask_h & nonempty)[:, None] & mask_dv[None, :],
        )
        if FUSED:
            # Every thread's partial stores come before the arrival (the barrier), and the
            # arrival releases them at GPU scope; the program that arrives last acquires all
            # the others' and merges. It then zeroes the counter for the next launch.
            tl.debug_barrier()
            counter = arrivals_ptr + b * num_kv_heads + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == n_splits - 1:
                _merge_group(
                    o_ptr, part_o_ptr, part_lse_ptr, b, heads, mask_h, n_splits, max_splits,
                    stride_ob, stride_oh, stride_pob, stride_poh, stride_pos, stride_plb,
                    stride_plh, HEAD_DIM_V, BLOCK_H, BLOCK_S, BLOCK_DV, MERGE_CHUNK,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_group(
    o_ptr, part_o_ptr, part_lse_ptr, b, heads, mask_h, n_splits, max_splits, stride_ob,
    stride_oh, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Stage 2 for the query heads ``heads`` of request ``b``: in a merge program of its own
    (``_decode_merge_kernel``, one head) or in the last stage-1 program to finish the request
    (fused, the kv head's group). The partials are read past L1 (``.cg``): a fused merge's SM
    may hold older lines of the same scratch from an earlier layer.

    ``CHUNK`` (:func:`execrt.kernels._triton.merge_chunk`; 8 unless set) 0: two passes, every
    split's log-sum-exp and their maximum first (a reduction across the program's threads),
    then the weighted partials one split at a time. The merge costs dependent round trips to
    L2, not bytes, and that is about 2n + 2 of them for n splits. ``CHUNK`` >= 1: one pass in
    split order with a running maximum (no reduction across threads), every load addressed
    by ``max_splits`` (in bounds of the scratch) instead of by ``n_splits`` (itself a load
    in the separate merge) and what lies past ``n_splits`` dropped by value, ``CHUNK``
    splits loaded at a time: up to ``CHUNK`` splits in one round trip. Its sums run split
    by split whatever the chunk, so every chunk >= 1 gives the same bits; they agree with
    the two-pass merge to rounding."""
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    lse_base = part_lse_ptr + b * stride_plb + heads * stride_plh  # [BLOCK_H]
    po_base = part_o_ptr + b * stride_pob + heads[:, None] * stride_poh + offs_dv[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    if CHUNK == 0:
        offs_s = tl.arange(0, BLOCK_S)
        lse_all = tl.load(
            lse_base[:, None] + offs_s[None, :],
            mask=mask_h[:, None] & (offs_s < n_splits)[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )  # [BLOCK_H, BLOCK_S]
        lse_max = tl.max(lse_all, 1)
        # Every split empty (seq_len 0): 0 as the reference keeps the exponentials 0, not NaN.
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        denom = tl.sum(tl.exp2(lse_all - lse_max[:, None]), 1)
        for split in range(0, n_splits):
            lse = tl.load(lse_base + split, mask=mask_h, other=float("-inf"), cache_modifier=".cg")
            # Empty splits wrote no partial row: masking the load keeps stale memory (possibly
            # NaN) out of the sum, where a zero weight alone would not (0 * NaN).
            written = mask_h & (lse > float("-inf"))
            part = tl.load(
                po_base + split * stride_pos,
                mask=written[:, None] & mask_dv[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            acc += tl.exp2(lse - lse_max)[:, None] * part
    else:
        denom = tl.zeros([BLOCK_H], dtype=tl.float32)
        lse_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        acc, denom, lse_max = _merge_chunk(
            acc, denom, lse_max, lse_base, po_base, mask_h, mask_dv, 0, n_splits, max_splits,
            stride_pos, CHUNK,
        )  # fmt: skip
        for first in range(CHUNK, n_splits, CHUNK):
            acc, denom, lse_max = _merge_chunk(
                acc, denom, lse_max, lse_base, po_base, mask_h, mask_dv, first, n_splits,
                max_splits, stride_pos, CHUNK,
            )  # fmt: skip
    # Every split empty (seq_len 0): acc is 0 and so is the output, as the reference's.
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(
        o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_h[:, None] & mask_dv[None, :],
    )


@triton.jit
def _merge_chunk(
    acc, denom, lse_max, lse_base, po_base, mask_h, mask_dv, first, n_splits, max_splits,
    stride_pos, CHUNK: tl.constexpr,
):  # fmt: skip
    """``(acc, denom, lse_max)`` after splits ``first`` to ``first + CHUNK - 1`` (those below
    ``n_splits``), rescaled to the running maximum as they come. The loads, unrolled, depend
    on nothing of the sums: they all go out before the first product."""
    for c in tl.static_range(CHUNK):
        split = first + c + tl.zeros_like(mask_h.to(tl.int32))  # per head: [BLOCK_H]
        inb = mask_h & (split < max_splits)
        lse = tl.load(lse_base + split, mask=inb, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            po_base + split[:, None] * stride_pos,
            mask=inb[:, None] & mask_dv[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        # Splits past n_splits (stale scratch) and empty splits (lse -inf; they wrote no
        # partial row: stale, possibly NaN, memory that a zero weight alone would not
        # cancel, 0 * NaN) add nothing.
        lse = tl.where(split < n_splits, lse, float("-inf"))
        written = lse > float("-inf")
        new_max = tl.maximum(lse_max, lse)
        # -inf while every split so far was empty: acc and denom are still 0.
        base = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(lse_max - base)  # 1 exactly while the maximum stays
        weight = tl.where(written, tl.exp2(lse - base), 0.0)
        part = tl.where(written[:, None], part, 0.0)
        acc = acc * rescale[:, None] + weight[:, None] * part
        denom = denom * rescale + weight
        lse_max = new_max
    return acc, denom, lse_max


@triton.jit
def _decode_merge_kernel(
    o_ptr,
    num_splits_ptr,
    part_o_ptr,
    part_lse_ptr,
    max_splits,
    stride_ob,
    stride_oh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stage 2 as a launch of its own: one program per (request, query head)."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    heads = tl.program_id(1) + tl.arange(0, 1)
    n_splits = clamp_splits(tl.load(num_splits_ptr + b), max_splits)
    _merge_group(
        o_ptr, part_o_ptr, part_lse_ptr, b, heads, heads >= 0, n_splits, max_splits, stride_ob,
        stride_oh, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, HEAD_DIM_V, 1,
        BLOCK_S, BLOCK_DV, CHUNK,
    )  # fmt: skip


def fp8_words_unsupported(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor
) -> str | None:
    """Why :func:`decode_attention` cannot read this cache as int32 words (``fp8_words``),
    or None when it can: an fp8 cache with 16-bit ``q``, head dims and the K/V strides and
    offsets in whole words, on a CUDA GPU of compute capability 8.9 or later (the PTX
    conversion) or under the Triton interpreter (its emulation)."""
    if k_buffer.dtype not in FP8_DTYPES:
        return f"the cache dtype {k_buffer.dtype} is not fp8"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"q dtype {q.dtype} is not fp16/bf16 (fp32 q keeps fp32 dots)"
    for name, buf in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if buf.dim() != 3 or buf.stride(2) != 1 or buf.shape[2] % 4:
            shape = tuple(buf.shape)
            return f"{name} shape {shape}, strides {buf.stride()}: rows not in whole words"
        if buf.stride(0) % 4 or buf.stride(1) % 4 or buf.data_ptr() % 4:
            return f"{name} strides {buf.stride()} or offset not in whole 4-byte words"
    if q.device.type == "cuda":
        if torch.cuda.get_device_capability(q.device) < (8, 9):
            return "the GPU's compute capability is below 8.9 (no fp8x2 -> f16x2 conversion)"
    elif not interpreter_enabled():
        return f"device {q.device} runs no Triton kernel"
    return None


def fp8_words_supported(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` reads this cache as int32 words by default."""
    return fp8_words_unsupported(q, k_buffer, v_buffer) is None


class DecodePrologue(NamedTuple):
    """What ``decode_attention`` does to this step's q and k before it attends, when it runs
    ``qk_norm_rope`` in its own launch (see its ``prologue``): the raw keys and values, the
    rotation's inputs and the slots they are stored at, as ``rotary.qk_norm_rope`` takes
    them."""

    k: torch.Tensor  # [B, Hkv, D] raw keys (may be a strided view of the qkv output)
    v: torch.Tensor  # [B, Hkv, Dv]
    positions: torch.Tensor  # [B] int32/int64 rows of cos/sin
    cos: torch.Tensor  # [P, D] fp32
    sin: torch.Tensor  # [P, D] fp32
    q_norm_weight: torch.Tensor | None  # [D]; None: no q norm
    k_norm_weight: torch.Tensor | None  # [D]; None: no k norm
    eps: float
    out_cache_loc: torch.Tensor  # [B] int32/int64 cache slots of this step's K/V
    hadamard: bool = False  # rotate q and k by the Hadamard matrix after RoPE


def _unread_prologue(q: torch.Tensor, o: torch.Tensor, ints: torch.Tensor) -> DecodePrologue:
    """Stand-in arguments for a launch without a prologue, from tensors the launch has
    anyway (never read: PROLOGUE off; nothing allocated on the decode path)."""
    return DecodePrologue(q, o, ints, o, o, None, None, 0.0, ints)


def _check_prologue(
    p: DecodePrologue,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_scales: torch.Tensor | None,
    head_dim_v: int,
) -> None:
    """Refuse a prologue that ``qk_norm_rope`` would refuse, or that this launch cannot run."""
    from execrt.kernels.rotary import KVStore
    from execrt.kernels.triton_rotary import check_kv_store, check_rotation

    t, _, hkv, d = check_rotation(
        q, p.k, p.positions, p.cos, p.sin, p.q_norm_weight, p.k_norm_weight
    )
    if kv_scales is not None and k_buffer.dtype not in FP8_DTYPES:
        fail(COMPONENT, f"prologue: kv_scales given for a {k_buffer.dtype} cache (fp8 only)")
    check_kv_store(KVStore(p.v, k_buffer, v_buffer, p.out_cache_loc, kv_scales), q, t, hkv, d)
    if head_dim_v != d:
        fail(COMPONENT, f"prologue: v head dim {head_dim_v} must equal the head dim {d}")
    if p.hadamard and d & (d - 1):
        fail(COMPONENT, f"prologue: hadamard needs a power-of-two head dim, got {d}")


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_splits: torch.Tensor,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
    sm_scale: float,
    max_splits: int,
    *,
    kv_scales: torch.Tensor | None = None,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
    work: torch.Tensor | None = None,
    arrivals: torch.Tensor | None = None,
    fp8_words: bool | None = None,
    prologue: DecodePrologue | None = None,
    programs: str = "request",
    fp8_kernel: str | None = None,
) -> None:
    """Single-token decode attention over a page-size-1 KV cache (split-KV flash decoding).

    Request b attends, for every query head h, to the K/V rows at slots
    ``kv_indices[kv_indptr[b] : kv_indptr[b+1]]`` of kv head ``h // (Hq // Hkv)``, with softmax
    scale ``sm_scale``, and the result is written to ``o[b, h]``. The context is cut into
    ``num_splits[b]`` splits processed in parallel (stage 1: each program covers all query
    heads of one kv head and takes the (request, split) items of the work list round robin,
    grid ``(decode_programs(...) * Hkv,)``, kv head fastest) and merged with their
    log-sum-exp weights (stage 2, grid ``(B, Hq)``; with ``arrivals``, inside stage 1
    instead). No host synchronisation, and no allocation when ``work`` is given: the launch
    can be captured in a CUDA graph with fixed ``max_splits``.

    A request with an empty context (``kv_indptr[b+1] == kv_indptr[b]``) gets ``o[b] = 0``.

    Args:
        q: ``[B, Hq, D]`` fp16/bf16/fp32 queries, last dim contiguous.
        k_buffer: ``[S, Hkv, D]`` key cache on ``q``'s device, in ``q``'s dtype or fp8.
        v_buffer: ``[S, Hkv, Dv]`` value cache, in ``k_buffer``'s dtype.
        o: ``[B, Hq, Dv]`` output, same dtype as ``q``; written in place.
        kv_indptr: int32/int64 ``[>= B+1]`` prefix sum of context lengths.
        kv_indices: int32/int64 slot ids of all contexts, request after request.
        num_splits: int32 ``[>= B]``, ``1 <= num_splits[b] <= max_splits`` (see
            :func:`decode_num_splits`); values outside that range are clamped into it.
        partial_o: fp32 ``[>= B, Hq, >= max_splits, Dv]`` scratch, overwritten.
        partial_lse: fp32 ``[>= B, Hq, >= max_splits]`` scratch (log2 domain), overwritten.
        sm_scale: softmax scale, usually ``D ** -0.5``.
        max_splits: the most splits per request (``>= 1``), see
            :meth:`SplitPolicy.max_splits`.
        kv_scales: fp32 device tensor whose first two values are ``k_scale`` and ``v_scale``
            (the cache holds ``K / k_scale`` and ``V / v_scale``), read on the device so a
            graph replays whatever it holds; required for an fp8 cache. ``q`` is multiplied
            by ``sm_scale * k_scale`` (once per program) and the output by ``v_scale``. With
            fp16/bf16 ``q`` the dots run in fp16: K and V are converted to it exactly, ``q``
            is rounded to it (clamped to +-65504), and the probabilities stay in it (never
            fp8). With fp32 ``q`` everything stays fp32.
        block_n: tokens per stage-1 loop step (power of two >= 16); :func:`decode_tiles`
            gives the tuned choice, with ``num_warps`` and ``num_stages``.
        num_warps: warps per stage-1 program.
        num_stages: software pipelining depth of the stage-1 loop (K/V gathered
            ``num_stages - 1`` blocks ahead).
        work: int32 ``[>= 1 + B * max_splits]``, the work list of ``num_splits``
            (:func:`decode_work`, or :func:`decode_metadata`'s ``work_out``); None builds it
            here (one more launch and an allocation).
        arrivals: int32 ``[>= B * Hkv]``, zero on entry and zero again on return: one launch
            instead of two. A request of one split writes ``o`` from stage 1; for the others
            each split counts its arrival per (request, kv head) with a GPU-scope atomic, and
            the split that arrives last merges them (the separate merge's arithmetic, the
            denominator summed per head in one reduction). None: the separate merge launch.
        fp8_words: read an fp8 cache as int32 words of four values, unpacked to fp16 pairs by
            one PTX conversion each (``cvt.rn.f16x2.e4m3x2``; sm89+, or emulated under the
            interpreter), so that the dots keep 32-bit operands: about half the instructions
            per block of the element path. Same values; the dots may sum in another order.
            None takes it wherever :func:`fp8_words_supported` holds, True requires it (an
            error naming the reason otherwise), False keeps the element path. Set, it names
            the words kernel (``fp8_kernel`` ``words``; with ``mma`` it is an error).
        prologue: run ``qk_norm_rope`` inside the launch (:class:`DecodePrologue`): ``q`` is
            then the raw queries (e.g. a strided view of the fused qkv output), and each
            program normalises and rotates the query heads it needs (through ``o``, which
            needs ``Dv == D``) while the program whose split holds a request's last token
            also rotates that token's k and stores it and v at ``out_cache_loc`` (quantized
            as ``kv_quant.store`` does, with ``kv_scales`` the layer's full row of four), just
            before it reads them back. One launch fewer per layer; the same values as
            ``qk_norm_rope(..., use_triton=True)`` followed by this function without it.
        programs: how many stage-1 programs take the work list (:func:`decode_programs`):
            ``request`` (the default) or ``sm`` (one wave of programs, several items each).
        fp8_kernel: which kernel reads an fp8 cache: ``words`` (this module's split kernel),
            ``mma`` (:mod:`execrt.kernels.attention.decode_mma`, which converts K/V
            straight into the tensor cores' registers; an error naming the reason where it
            cannot run) or ``auto`` (``mma`` from ``decode_mma.MMA_MIN_BATCH`` requests
            where it can run, else ``words``). None: ``EXECRT_FP8_DECODE_KERNEL``, else the
            default (``auto``), with ``mma`` falling back to ``words`` where it cannot run.
            Ignored for other caches.

    Raises:
        ValueError: on unsupported dtypes, shapes, head dims (> 256), head counts
            (``Hq % Hkv != 0``), devices, block sizes or ``max_splits < 1``.
    """
    if fp8_kernel is not None and fp8_kernel not in FP8_DECODE_KERNELS:
        fail(
            COMPONENT,
            f"fp8_kernel {fp8_kernel!r} unsupported (supported: {', '.join(FP8_DECODE_KERNELS)})",
        )
    if fp8_words is not None and fp8_kernel == "mma":
        fail(COMPONENT, "fp8_words applies to the words kernel, not fp8_kernel='mma'")
    if fp8_words is not None and fp8_kernel is None:
        fp8_kernel = "words"  # a words-kernel option names the kernel
    batch, num_q_heads, num_kv_heads, head_dim, head_dim_v = check_qkvo(
        q, k_buffer, v_buffer, o, kv_scales
    )
    if prologue is not None:
        _check_prologue(prologue, q, k_buffer, v_buffer, kv_scales, head_dim_v)
    if max_splits < 1:
        fail(COMPONENT, f"max_splits {max_splits} unsupported (supported: >= 1)")
    _check_programs(programs)
    check_block("block_n", block_n)
    check_paged(
        batch, kv_indptr, kv_indices, q, k_buffer=k_buffer, v_buffer=v_buffer, o=o,
        num_splits=num_splits, partial_o=partial_o, partial_lse=partial_lse,
        **({} if kv_scales is None else {"kv_scales": kv_scales}),
    )  # fmt: skip
    check_index(COMPONENT, "num_splits", num_splits, batch, (torch.int32,))
    if partial_o.dtype != torch.float32 or partial_lse.dtype != torch.float32:
        fail(
            COMPONENT,
            f"partial_o/partial_lse dtypes {partial_o.dtype}/{partial_lse.dtype} unsupported "
            "(supported: float32)",
        )
    if (
        partial_o.dim() != 4
        or partial_o.shape[0] < batch
        or partial_o.shape[1] != num_q_heads
        or partial_o.shape[2] < max_splits
        or partial_o.shape[3] != head_dim_v
    ):
        fail(
            COMPONENT,
            f"partial_o shape {tuple(partial_o.shape)} unsupported "
            f"(need [>= {batch}, {num_q_heads}, >= {max_splits}, {head_dim_v}])",
        )
    if (
        partial_lse.dim() != 3
        or partial_lse.shape[0] < batch
        or partial_lse.shape[1] != num_q_heads
        or partial_lse.shape[2] < max_splits
    ):
        fail(
            COMPONENT,
            f"partial_lse shape {tuple(partial_lse.shape)} unsupported "
            f"(need [>= {batch}, {num_q_heads}, >= {max_splits}])",
        )
    # The K/V prefetch ahead of the PDL wait reads the work list, lengths and slot ids early:
    # a work list built just here (by the kernel ahead) would always be stale then.
    prefetch = work is not None and pdl_prefetch(q.device, "decode", batch)
    if work is None:
        work = torch.empty(work_size(batch, max_splits), dtype=torch.int32, device=q.device)
        decode_work(num_splits[:batch], max_splits, work)
    else:
        check_work(work, batch, max_splits, q.device)
    if arrivals is not None:
        check_arrivals(arrivals, batch, num_kv_heads, q.device)
    if batch == 0:
        return

    group = num_q_heads // num_kv_heads
    sms = sm_count(q.device)
    grid = decode_programs(batch, num_kv_heads, max_splits, sms, programs)
    if k_buffer.dtype in FP8_DTYPES and _run_mma(
        fp8_kernel, q, k_buffer, v_buffer, prologue is not None
    ):
        from execrt.kernels.attention.decode_mma import launch_mma  # (it imports this module)

        assert kv_scales is not None  # check_qkvo requires them for an fp8 cache
        launch_mma(
            q, k_buffer, v_buffer, o, kv_indptr, kv_indices, num_splits, work, partial_o,
            partial_lse, kv_scales, arrivals, sm_scale * LOG2E, max_splits, grid,
            slot_i32=int32_slot_offsets(k_buffer, v_buffer), pdl=pdl_kwargs(q.device),
            prefetch=prefetch, sms=sms,
        )  # fmt: skip
        if arrivals is None:
            _merge(o, num_splits, partial_o, partial_lse, max_splits, batch, num_q_heads)
        return

    why_not = fp8_words_unsupported(q, k_buffer, v_buffer)
    if fp8_words and why_not:
        fail(COMPONENT, f"fp8_words=True unsupported here: {why_not}")
    words = why_not is None and fp8_words is not False
    k_arg, v_arg = (
        (k_buffer.view(torch.int32), v_buffer.view(torch.int32)) if words else (k_buffer, v_buffer)
    )
    pro = prologue or _unread_prologue(q, o, kv_indptr)
    fmt = fp8_format(k_buffer.dtype if k_buffer.dtype in FP8_DTYPES else torch.float8_e4m3fn)
    _decode_split_kernel[(grid * num_kv_heads,)](
        q,
        k_arg,
        v_arg,
        kv_indptr,
        kv_indices,
        num_splits,
        work,
        partial_o,
        partial_lse,
        partial_lse if kv_scales is None else kv_scales,  # unread unless KV_SCALED
        o,
        work if arrivals is None else arrivals,  # unread unless FUSED
        sm_scale * LOG2E,
        max_splits,
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        k_arg.stride(0),
        k_arg.stride(1),
        v_arg.stride(0),
        v_arg.stride(1),
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        o.stride(0),
        o.stride(1),
        pro.k,
        pro.v,
        pro.k.stride(0),
        pro.k.stride(1),
        pro.v.stride(0),
        pro.v.stride(1),
        pro.positions,
        pro.cos,
        pro.sin,
        pro.cos.stride(0),
        pro.sin.stride(0),
        o if pro.q_norm_weight is None else pro.q_norm_weight,  # unread without a norm
        o if pro.k_norm_weight is None else pro.k_norm_weight,
        pro.eps,
        pro.out_cache_loc,
        k_buffer,
        v_buffer,
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_H=pow2_at_least(group),
        BLOCK_N=block_n,
        BLOCK_D=pow2_at_least(head_dim),
        BLOCK_DV=pow2_at_least(head_dim_v),
        BLOCK_S=pow2_at_least(max_splits, 2),
        MERGE_CHUNK=merge_chunk(max_splits) if arrivals is not None else 0,  # (no merge inside)
        KV_SCALED=kv_scales is not None,
        DOT_F16=fp16_dots(q, k_buffer),
        FUSED=arrivals is not None,
        F8_WORDS=words,
        F8_E5M2=k_buffer.dtype == torch.float8_e5m2,
        F8_ASM=q.device.type == "cuda",
        F8_OPAQUE=q.device.type == "cuda" and fp8_words_opaque(),
        SLOT_I32=int32_slot_offsets(k_buffer, v_buffer),
        PROLOGUE=prologue is not None,
        HAS_Q_NORM=pro.q_norm_weight is not None,
        HAS_K_NORM=pro.k_norm_weight is not None,
        HADAMARD=pro.hadamard,
        HALF=head_dim // 2,
        BLOCK_HALF=pow2_at_least(head_dim // 2, 1),
        BLOCK_G=pow2_at_least(group, 1),  # the rotation's rows: the group unpadded
        FP8_MAX=fmt.max,
        FP8_MANT=fmt.mantissa_bits,
        FP8_EMIN=fmt.min_exponent,
        K_INV=K_INV_SCALE,
        V_INV=V_INV_SCALE,
        batch=batch,
        num_ids=max(1, kv_indices.numel()),
        num_slots=k_arg.shape[0],
        PREFETCH=prefetch and kv_indices.numel() > 0,
        PF_TOKENS=prefetch_tokens(block_n),
        PF_LINES_K=prefetch_lines(head_dim, k_buffer.element_size()),
        PF_LINES_V=prefetch_lines(head_dim_v, v_buffer.element_size()),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kwargs(q.device),
    )
    if arrivals is None:
        _merge(o, num_splits, partial_o, partial_lse, max_splits, batch, num_q_heads)


def _run_mma(
    fp8_kernel: str | None,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    prologue: bool,
) -> bool:
    """Whether an fp8 cache's decode runs on the mma kernel (see ``fp8_kernel``)."""
    kernel = fp8_kernel or fp8_decode_kernel()
    if kernel == "words":
        return False
    from execrt.kernels.attention import decode_mma  # (it imports this module)

    if kernel == "auto" and q.shape[0] < decode_mma.MMA_MIN_BATCH:
        return False
    why = decode_mma.mma_unsupported(q, k_buffer, v_buffer, prologue=prologue)
    if why is not None and fp8_kernel == "mma":
        fail(COMPONENT, f"fp8_kernel='mma' unsupported here: {why}")
    return why is None


def decode_wave(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    *,
    fp8_kernel: str | None = None,
    prologue: bool = False,
) -> int:
    """Work items per kv head that one wave of :func:`decode_attention`'s launch for ``q``
    (``[B, Hq, D]``; an expanded view will do) runs at once: ``decode_metadata``'s ``wave``.
    Where that launch is the fp8 mma kernel, every item is a program of its own and all of
    a wave's are resident together, so items a little past a wave double the launch
    (:func:`execrt.kernels.attention.indices.wave_cap`). 0 for the Triton kernels, whose
    programs share the items out in a fixed round robin. Depends only on the shapes, the
    device and the kernel choice, so a graph bucket replays the rule it captured."""
    if k_buffer.dtype not in FP8_DTYPES or not _run_mma(
        fp8_kernel, q, k_buffer, v_buffer, prologue
    ):
        return 0
    from execrt.kernels.attention import decode_mma  # (it imports this module)

    shape = decode_mma.mma_launch_shape(q.shape[0])
    resident = decode_mma.mma_resident(shape, q.shape[-1], v_buffer.shape[-1], q.device)
    return max(1, resident // k_buffer.shape[1])


def _merge(
    o: torch.Tensor,
    num_splits: torch.Tensor,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
    max_splits: int,
    batch: int,
    num_q_heads: int,
) -> None:
    """Stage 2 as a launch of its own (one program per request and query head)."""
    head_dim_v = o.shape[-1]
    _decode_merge_kernel[(batch, num_q_heads)](
        o,
        num_splits,
        partial_o,
        partial_lse,
        max_splits,
        o.stride(0),
        o.stride(1),
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        HEAD_DIM_V=head_dim_v,
        BLOCK_S=pow2_at_least(max_splits, 2),
        BLOCK_DV=pow2_at_least(head_dim_v),
        CHUNK=merge_chunk(max_splits),
        num_warps=4 if head_dim_v > 128 else 2,
        **pdl_kwargs(o.device),
    )
