"""Causal extend (prefill on top of a cached prefix) over the page-size-1 cache.

Three kernels, one launch function (:func:`extend_attention`):

- ``gather`` reads every context row (prefix and new tokens) from the cache through its slot
  id. It needs nothing but the cache, reads an fp8 cache, and runs on every device.
- ``fresh`` reads the prefix the same way but this step's new tokens from their own K/V
  tensors (``k_new`` / ``v_new``, the rows the attention layer has just computed, request
  after request like ``q``): those rows are consecutive, so on sm90+ they are loaded by TMA
  through tensor descriptors, and the causal diagonal lines up with the query tiles instead of
  with the prefix length. Chosen when the caller hands the new K/V, the cache is in ``q``'s
  dtype and the GPU is sm90+ (or the interpreter), unless the tuned table says ``gather`` won.
- ``ws`` (:mod:`execrt.kernels.attention.extend_ws`) reads what ``gather`` reads, with a
  producer warp group gathering K/V into shared memory while the consumer warps run the
  wgmmas and the softmax (Gluon, sm90, 16-bit caches). Chosen where the GPU's tuned table
  says it won, or asked for by name.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from execrt.core.kv_quant import FP8_DTYPES
from execrt.kernels._triton import (
    cdiv,
    check_index,
    check_last_dim_contiguous,
    check_same_device,
    cuda_capability,
    fail,
    interpreter_enabled,
    pow2_at_least,
)
from execrt.kernels.attention.common import (
    COMPONENT,
    LOG2E,
    check_block,
    check_paged,
    check_qkvo,
    fp16_dots,
    int32_slot_offsets,
)
from execrt.kernels.attention.extend_ws import (
    launch_ws,
    ws_tiles_unsupported,
    ws_unsupported,
)
from execrt.kernels.attention.indices import slot_offsets
from execrt.kernels.triton_dot import dot

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the fresh kernel loads without TMA
    TensorDescriptor = None

GATHER, FRESH, WS = "gather", "fresh", "ws"
KERNELS = (GATHER, FRESH, WS)

# ----------------------------------------------------------------------------------------------
# Tile choices
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtendTiles:
    """Launch shape of the extend kernel: rows of a query tile, KV tokens per loop step, warps
    and software-pipelining depth. ``benchmarks/tune_triton_extend.py`` sweeps these."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def named(
        self,
        block_m: int | None,
        block_n: int | None,
        num_warps: int | None,
        num_stages: int | None,
    ) -> ExtendTiles:
        """These tiles with the values a caller named in place of their own."""
        return ExtendTiles(
            self.block_m if block_m is None else block_m,
            self.block_n if block_n is None else block_n,
            self.num_warps if num_warps is None else num_warps,
            self.num_stages if num_stages is None else num_stages,
        )


# Keyed by (bytes per element, padded head dim). The compiled tiles follow fast Hopper
# flash-attention kernels: 128-row query tiles over two warpgroups (8 warps), 64-token K/V
# blocks, 3 stages (K/V gathered two blocks ahead into 3 shared-memory buffers). At bf16
# D=128 that is 128 KB of shared memory and ~200 registers per thread (no spills), from an
# AOT compile for sm90; D=256 halves block_n (160 KB). fp32 runs in TF32 and is not a fast
# path: small tiles keep it far from the shared-memory limit. The 16-bit rows for D 64, 128
# and 256 are the best of benchmarks/tune_triton_extend.py's sweep on an H200 (bf16 and fp16
# measured; at D=256 the 128-row tile is 2.3x the 64-row one); see docs/kernels.md.
_GPU_TILES: dict[tuple[int, int], ExtendTiles] = {
    (2, 16): ExtendTiles(128, 64, 8, 3),
    (2, 32): ExtendTiles(128, 64, 8, 3),
    (2, 64): ExtendTiles(128, 64, 8, 3),
    (2, 128): ExtendTiles(128, 64, 8, 3),
    (2, 256): ExtendTiles(128, 32, 8, 3),
    (4, 16): ExtendTiles(64, 32, 4, 2),
    (4, 32): ExtendTiles(64, 32, 4, 2),
    (4, 64): ExtendTiles(64, 32, 4, 2),
    (4, 128): ExtendTiles(32, 32, 4, 2),
    (4, 256): ExtendTiles(32, 16, 4, 2),
}

# The warp-specialised kernel (``ws``) where no tuned table names its launch (other GPUs,
# dtypes, head dims), keyed by padded head dim: a 128-row query tile over two consumer warp
# groups, 64-token K/V blocks in a ring of 4 stages (D 128: 160 KB with the query tile). The
# H200 sweep of session 21 (bf16, D 128) found it best overall: 459/335/410/324/464 TFLOP/s
# on the rows against 395/301/347/274/391 for 128-token blocks in 2 stages.
# :func:`choose_kernel` takes the kernel itself only from a tuned table.
_WS_TILES: dict[int, ExtendTiles] = {
    64: ExtendTiles(128, 64, 8, 4),
    128: ExtendTiles(128, 64, 8, 4),
}

# Under the CPU interpreter every tl op is a NumPy call per program: mid-sized tiles keep the
# program count (and so the run time) low while still crossing tile boundaries in small tests.
_CPU_TILES = ExtendTiles(32, 32, 4, 1)

# Share of the L2 cache the query tiles running together may fill with their K/V before the
# schedule moves on to the next group of (request, head) pairs; see _pairs_per_chunk.
L2_SHARE = 0.5
_DEFAULT_L2_BYTES = 50 << 20


def default_extend_tiles(
    dtype: torch.dtype, head_dim: int, device: torch.device, kernel: str = GATHER
) -> ExtendTiles:
    """The tiles a launch of ``kernel`` uses for this dtype and (padded) head dim: the tuned
    table's for this GPU, else ``_GPU_TILES``, or the interpreter's tiles on CPU."""
    return extend_choice(dtype, head_dim, device, kernel).tiles


def shared_memory_estimate(tiles: ExtendTiles, elem_bytes: int, block_d: int, block_dv: int) -> int:
    """Bytes of shared memory a launch needs: the q tile plus num_stages K and V buffers.

    Matches what Triton allocated for sm90 to within a few percent (it adds small scratch).
    """
    q_tile = tiles.block_m * block_d
    kv_tiles = tiles.num_stages * tiles.block_n * (block_d + block_dv)
    return (q_tile + kv_tiles) * elem_bytes


@functools.lru_cache(maxsize=8)
def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_L2_BYTES
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", _DEFAULT_L2_BYTES))


def _pairs_per_chunk(num_pairs: int, max_kv_len: int, row_bytes: int, l2_bytes: int) -> int:
    """(request, head block) pairs whose query tiles are interleaved longest first.

    The query tiles of one pair all read that pair's K/V; they should run close together so
    later ones find it in L2. Across pairs, long tiles should start first so that the grid
    ends on short ones. Pairs are therefore scheduled in chunks whose K/V fits in a share of
    L2, and inside a chunk the tiles run longest first.
    """
    pair_bytes = max(1, max_kv_len * row_bytes)
    return max(1, min(num_pairs, int(l2_bytes * L2_SHARE) // pair_bytes))


def _default_heads_per_tile(group: int, block_m: int) -> int:
    """Pack the whole GQA group into a tile when it fits, else its largest divisor that does."""
    return max(h for h in range(1, min(group, block_m) + 1) if group % h == 0)


# ----------------------------------------------------------------------------------------------
# Tuned tables
# ----------------------------------------------------------------------------------------------

#: Per-GPU tables written by ``benchmarks/tune_triton_extend.py``: ``<GPU name>.json`` with every
#: character outside ``[A-Za-z0-9]`` replaced by ``_`` (``NVIDIA_H200.json``).
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "extend_configs")


@dataclass(frozen=True)
class ExtendChoice:
    """One kernel's launch for a (dtype, head dim): tiles plus the knobs ``extend_attention``
    takes (``None``: its default). ``tma`` matters to the fresh kernel only, ``persistent``
    to the ws kernel only."""

    tiles: ExtendTiles
    heads_per_tile: int | None = None
    pairs_per_chunk: int | None = None
    tma: bool = True
    persistent: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self.tiles) | {
            "heads_per_tile": self.heads_per_tile,
            "pairs_per_chunk": self.pairs_per_chunk,
            "tma": self.tma,
            "persistent": self.persistent,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExtendChoice:
        tiles = ExtendTiles(d["block_m"], d["block_n"], d["num_warps"], d["num_stages"])
        return cls(
            tiles,
            d.get("heads_per_tile"),
            d.get("pairs_per_chunk"),
            d.get("tma", True),
            d.get("persistent", False),
        )


@dataclass(frozen=True)
class TableEntry:
    """A tuned (dtype, head dim): the kernel that won (``use``) and each kernel's best launch."""

    use: str
    choices: dict[str, ExtendChoice]


def table_key(dtype: torch.dtype, head_dim: int) -> str:
    """``"bfloat16,128"``: the dtype and the padded head dim."""
    return f"{str(dtype).replace('torch.', '')},{pow2_at_least(head_dim)}"


def table_file_name(device_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", device_name) + ".json"


@functools.lru_cache(maxsize=8)
def load_table(path: str) -> dict[str, TableEntry]:
    """``{table_key: entry}`` of a tuned table; empty if there is none. A malformed file
    raises (a table that silently does nothing would hide a broken tuning run)."""
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        data = json.load(fh)
    table = {}
    for key, entry in data["entries"].items():
        choices = {k: ExtendChoice.from_json(entry[k]) for k in KERNELS if k in entry}
        use = entry.get("use", FRESH)
        if use not in choices:
            raise ValueError(f"{path}: entry {key} uses {use!r} but tunes only {sorted(choices)}")
        table[key] = TableEntry(use, choices)
    return table


def table_entry(dtype: torch.dtype, head_dim: int, device: torch.device) -> TableEntry | None:
    """This GPU's tuned entry for the dtype and head dim, or None (CPU, untuned)."""
    if device.type != "cuda" or interpreter_enabled():
        return None
    name = torch.cuda.get_device_name(device)
    return load_table(os.path.join(CONFIG_DIR, table_file_name(name))).get(
        table_key(dtype, head_dim)
    )


def _builtin_choice(
    dtype: torch.dtype, head_dim: int, device: torch.device, kernel: str
) -> ExtendChoice:
    if device.type != "cuda":
        return ExtendChoice(_CPU_TILES)
    if kernel == WS and pow2_at_least(head_dim) in _WS_TILES:
        return ExtendChoice(_WS_TILES[pow2_at_least(head_dim)])
    key = (4 if dtype == torch.float32 else 2, pow2_at_least(head_dim))
    return ExtendChoice(_GPU_TILES[key])


def extend_choice(
    dtype: torch.dtype, head_dim: int, device: torch.device, kernel: str = GATHER
) -> ExtendChoice:
    """The kernel's launch for this dtype and (padded) head dim: the tuned table's entry for
    this GPU, else the built-in tiles (``_GPU_TILES``; the interpreter's on CPU). The fresh
    kernel's built-in tiles are the gather kernel's: both are flash-attention loops over the
    same q tile, and only the tuning sweep tells them apart."""
    entry = table_entry(dtype, head_dim, device)
    if entry is not None and kernel in entry.choices:
        return entry.choices[kernel]
    return _builtin_choice(dtype, head_dim, device, kernel)


def fresh_supported(q: torch.Tensor, k_buffer: torch.Tensor, kv_scales: object) -> str | None:
    """Why the fresh kernel cannot serve this call, or None when it can.

    It reads the new tokens' K/V from the step's own (unquantized) rows: an fp8 cache would
    then see the prefix quantized and the new tokens not, so fp8 caches stay on the gather
    kernel (it folds their scales). On CUDA it needs sm90 (TMA; its tiles were tuned there);
    older GPUs keep the gather kernel, whose table was measured on them.
    """
    if kv_scales is not None or k_buffer.dtype != q.dtype:
        return f"the cache is {k_buffer.dtype} (the fresh kernel reads {q.dtype} caches)"
    if q.device.type == "cuda" and not interpreter_enabled():
        major, minor = cuda_capability(q.device)
        if major < 9:
            return f"sm{major}{minor} (the fresh kernel needs sm90+)"
    return None


def extend_kernel_refusal(
    kernel: str,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    head_dim: int,
    head_dim_v: int,
) -> str | None:
    """Why ``kernel`` can never serve extends of ``q``'s dtype and device over this cache
    (an fp8 cache comes with scales), or None: what a backend asked for one kernel by name
    checks once, when it is built."""
    if kernel not in KERNELS:
        return f"kernel {kernel!r} unknown (known: {', '.join(KERNELS)})"
    scales = torch.ones(2) if k_buffer.dtype in FP8_DTYPES else None
    if kernel == FRESH:
        return fresh_supported(q, k_buffer, scales)
    if kernel == WS:
        return ws_unsupported(q, k_buffer, v_buffer, scales, head_dim, head_dim_v)
    return None


def choose_kernel(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    k_new: torch.Tensor | None,
    kv_scales: object,
    head_dim: int,
    *,
    v_buffer: torch.Tensor | None = None,
    head_dim_v: int | None = None,
    allow_ws: bool = True,
) -> str:
    """The kernel this GPU's tuned table measured fastest (``use``) where it can serve the
    call; else ``fresh`` when the new K/V were handed and the fresh kernel serves the cache
    and the device (see :func:`fresh_supported`) and the table lists it; else ``gather``. A
    GPU without a table keeps ``gather``: another kernel becomes a default only where a
    tuning run on that GPU checked and timed it. Under the Triton interpreter (CPU) ``fresh``
    is the default, so the CPU tests run it; ``ws`` never runs there."""
    entry = table_entry(q.dtype, head_dim, q.device)
    if entry is not None and entry.use == WS and allow_ws:
        v = k_buffer if v_buffer is None else v_buffer
        dv = head_dim if head_dim_v is None else head_dim_v
        if ws_unsupported(q, k_buffer, v, kv_scales, head_dim, dv) is None:
            return WS
    if k_new is None or fresh_supported(q, k_buffer, kv_scales) is not None:
        return GATHER
    if entry is None:
        return FRESH if q.device.type == "cpu" else GATHER
    return FRESH if entry.use == FRESH or (entry.use == WS and FRESH in entry.choices) else GATHER


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(base, slots, stride, offs, DIM: tl.constexpr, BLOCK: tl.constexpr, mask_n):
    """Gather rows ``base[slots[i] * stride + offs]``; ``mask_n`` None means every row is valid.

    Masks are built only where needed (a padded head dim, a ragged block), so the unmasked
    blocks issue plain vector loads. One return: older Triton rejects returns in branches.
    """
    ptrs = base + slots[:, None] * stride + offs[None, :]
    if mask_n is None:
        if DIM == BLOCK:
            rows = tl.load(ptrs)
        else:
            rows = tl.load(ptrs, mask=(offs < DIM)[None, :], other=0.0)
    else:
        if DIM == BLOCK:
            rows = tl.load(ptrs, mask=mask_n[:, None], other=0.0)
        else:
            rows = tl.load(ptrs, mask=mask_n[:, None] & (offs < DIM)[None, :], other=0.0)
    return rows


# The helpers below hold what both kernels share (tile schedule, query rows, the online-softmax
# step, the whole-block prefix loop, the output store). Triton inlines jit calls before any
# optimisation pass, so each kernel compiles to what it would be with the code written out.


@triton.jit
def _tile_coords(
    num_m_tiles, num_head_blocks, num_pairs, pairs_per_chunk, GROUP: tl.constexpr,
    HEADS: tl.constexpr,
):  # fmt: skip
    """This program's query tile: ``(m_tile, request b, first query head head0, kv_head)``.

    Schedule (1-D grid): chunks of pairs_per_chunk (request, head block) pairs; inside a chunk
    the highest query tiles (the longest causal rows) are dispatched first.
    """
    pid = tl.program_id(0)
    chunk_programs = pairs_per_chunk * num_m_tiles
    chunk = pid // chunk_programs
    local = pid - chunk * chunk_programs
    first_pair = chunk * pairs_per_chunk
    width = tl.minimum(pairs_per_chunk, num_pairs - first_pair)
    m_tile = num_m_tiles - 1 - local // width
    pair = first_pair + local % width
    b = pair // num_head_blocks
    head0 = (pair - b * num_head_blocks) * HEADS  # first query head of the tile
    kv_head = head0 // GROUP
    return m_tile, b, head0, kv_head


@triton.jit
def _tile_rows(qo_indptr_ptr, b, m_tile, head0, HEADS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile's rows: ``(q_start, extend_len, tok0, tok, heads, row_ok, rows)``.

    A tile is TOKENS = BLOCK_M // HEADS consecutive new tokens x HEADS query heads of one kv
    head: row r holds token r // HEADS and head r % HEADS, so each K/V tile loaded serves every
    packed head. ``rows`` are the tokens' rows in q / o (int64: token row * row stride passes
    2**31 early); ``row_ok`` is False for rows past the request's new tokens and for the rows
    past TOKENS * HEADS that exist only when HEADS does not divide BLOCK_M.
    """
    TOKENS: tl.constexpr = BLOCK_M // HEADS
    q_start = tl.load(qo_indptr_ptr + b).to(tl.int32)
    extend_len = tl.load(qo_indptr_ptr + b + 1).to(tl.int32) - q_start
    tok0 = m_tile * TOKENS
    offs_r = tl.arange(0, BLOCK_M)
    tok = tok0 + offs_r // HEADS  # [BLOCK_M] new-token index of each row
    heads = head0 + offs_r % HEADS  # [BLOCK_M]
    row_ok = (offs_r < TOKENS * HEADS) & (tok < extend_len)
    rows = (q_start + tok).to(tl.int64)
    return q_start, extend_len, tok0, tok, heads, row_ok, rows


@triton.jit
def _load_q(
    q_ptr, rows, heads, row_ok, stride_qt, stride_qh, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The query tile ``[BLOCK_M, BLOCK_D]``; masked rows and padded columns read zeros."""
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )


@triton.jit
def _softmax_init(BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Empty online-softmax state ``(m_i, l_i, acc)``: running max (log2 domain), sum, output."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def _softmax_step(s, m_i, l_i, qk_scale, visible):
    """Fold the scores ``s = q @ k^T`` of one K block into the running max and sum.

    ``visible`` None: every row sees every column, so the scale is applied after the row max
    (qk_scale > 0) and no mask is built; else a mask broadcastable to ``s``, and hidden
    columns score -inf. Returns ``(p, alpha, m_i, l_i)``: the block's probabilities, the factor
    that rescales the accumulator, and the new max and sum. The caller loads V after this
    call and then updates ``acc``.
    """
    if visible is None:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 domain
        p = tl.exp2(s * qk_scale - m_new[:, None])
    else:
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _attend_whole_blocks(
    q, m_i, l_i, acc, ids, k_base, v_base, idx_base, hi, stride_ks, stride_vs, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SLOT_I32: tl.constexpr,
):  # fmt: skip
    """Attend to context ``[0, hi)`` (whole blocks every row sees) gathered through slot ids.

    ``ids`` are the first block's slot ids, loaded by the caller. Each block's successor ids
    are loaded during the block and carried over, so the K/V gathers never depend on a load
    of their own iteration: the pipeliner treats them as direct loads and issues them
    num_stages - 1 blocks ahead. K/V are converted to q's dtype (an fp8 cache, exactly).
    Returns the new ``(m_i, l_i, acc)``.
    """
    offs_b = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start in range(0, hi, BLOCK_N):
        offs_next = start + BLOCK_N + offs_b
        ids_next = tl.load(idx_base + offs_next, mask=offs_next < hi, other=0)
        slots = slot_offsets(ids, SLOT_I32)  # [BLOCK_N]
        k = _load_rows(k_base, slots, stride_ks, offs_d, HEAD_DIM, BLOCK_D, None).to(q.dtype)
        s = dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, None)
        v = _load_rows(v_base, slots, stride_vs, offs_dv, HEAD_DIM_V, BLOCK_DV, None).to(q.dtype)
        # p in the compute dtype: with fp8 V, rounding p to V's dtype would cost the most.
        acc = dot(p.to(q.dtype), v, acc * alpha[:, None])  # [BLOCK_M, BLOCK_DV]
        ids = ids_next
    return m_i, l_i, acc


@triton.jit
def _store_o(
    o_ptr, out, rows, heads, row_ok, stride_ot, stride_oh, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Store the finished tile ``out [BLOCK_M, BLOCK_DV]`` into o's valid rows and columns."""
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(
        o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :],
    )


# Runtime sizes vary from step to step: keep them out of Triton's divisibility
# specialisation so that a new batch shape never costs a recompile.
@triton.jit(do_not_specialize=["num_m_tiles", "num_head_blocks", "num_pairs", "pairs_per_chunk"])
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    prefix_lens_ptr,
    kv_scales_ptr,
    qk_scale,
    num_m_tiles,
    num_head_blocks,
    num_pairs,
    pairs_per_chunk,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KV_SCALED: tl.constexpr,
    DOT_F16: tl.constexpr,
    SLOT_I32: tl.constexpr,
):
    # Query tiles (see _tile_rows) in the L2-chunked, longest-first schedule of _tile_coords.
    TOKENS: tl.constexpr = BLOCK_M // HEADS
    m_tile, b, head0, kv_head = _tile_coords(
        num_m_tiles, num_head_blocks, num_pairs, pairs_per_chunk, GROUP, HEADS
    )
    q_start, extend_len, tok0, tok, heads, row_ok, rows = _tile_rows(
        qo_indptr_ptr, b, m_tile, head0, HEADS, BLOCK_M
    )
    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int32) - kv_start
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = _load_q(q_ptr, rows, heads, row_ok, stride_qt, stride_qh, HEAD_DIM, BLOCK_D)
    q_pos = prefix + tok  # [BLOCK_M] absolute position; the row sees context j <= q_pos
    if KV_SCALED:  # an fp8 cache holds K / k_scale: fold k_scale into the softmax scale
        qk_scale = qk_scale * tl.load(kv_scales_ptr)
        if DOT_F16:
            # With 16-bit q the dots run in fp16, as decode's: fp8 -> fp16 is exact and one
            # instruction per pair of values, fp8 -> bf16 takes a quarter-rate F2F per value
            # more (64 per thread and block at 128 x 64, as many cycles as the block's
            # wgmmas). The scale goes into q (clamped to fp16's range), and p stays fp16.
            q = q.to(tl.float32) * qk_scale
            q = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
            qk_scale = 1.0

    # Context [0, full_hi) is visible to every row (whole blocks, no mask math);
    # [full_hi, kv_hi) holds the diagonal, masked per row. A tile past the request's new
    # tokens gets two empty loops and stores nothing.
    tile_ok = tok0 < extend_len
    last_tok = tl.minimum(tok0 + TOKENS, extend_len) - 1
    kv_hi = tl.where(tile_ok, tl.minimum(prefix + last_tok + 1, kv_len), 0)
    full_hi = tl.where(tile_ok, tl.minimum(prefix + tok0 + 1, kv_hi) // BLOCK_N * BLOCK_N, 0)

    m_i, l_i, acc = _softmax_init(BLOCK_M, BLOCK_DV)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    idx_base = kv_indices_ptr + kv_start

    # Slot ids run one block ahead (see _attend_whole_blocks). The first diagonal block's ids
    # are loaded up front, so the switch between the loops waits for one load, not two.
    offs_b = tl.arange(0, BLOCK_N)
    ids = tl.load(idx_base + offs_b, mask=offs_b < full_hi, other=0)
    ids_diag = tl.load(idx_base + full_hi + offs_b, mask=full_hi + offs_b < kv_hi, other=0)

    # The first block processed (full or diagonal) starts at position 0, which every row
    # sees, so m_i is finite from then on and no row computes exp2(-inf - -inf).
    m_i, l_i, acc = _attend_whole_blocks(
        q, m_i, l_i, acc, ids, k_base, v_base, idx_base, full_hi, stride_ks, stride_vs,
        qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, SLOT_I32,
    )  # fmt: skip

    for start in range(full_hi, kv_hi, BLOCK_N):
        offs_n = start + offs_b
        in_kv = offs_n < kv_hi
        ids_next = tl.load(idx_base + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < kv_hi, other=0)
        slots = slot_offsets(ids_diag, SLOT_I32)
        # Columns past kv_hi load zeros, not slot 0's row: p = 0 times NaN would still be NaN.
        k = _load_rows(k_base, slots, stride_ks, offs_d, HEAD_DIM, BLOCK_D, in_kv).to(q.dtype)
        s = dot(q, tl.trans(k))
        visible = offs_n[None, :] <= q_pos[:, None]
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, visible)
        v = _load_rows(v_base, slots, stride_vs, offs_dv, HEAD_DIM_V, BLOCK_DV, in_kv).to(q.dtype)
        acc = dot(p.to(q.dtype), v, acc * alpha[:, None])
        ids_diag = ids_next

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_DV]
    if KV_SCALED:  # V / v_scale was stored
        out = out * tl.load(kv_scales_ptr + 1)
    _store_o(o_ptr, out, rows, heads, row_ok, stride_ot, stride_oh, HEAD_DIM_V, BLOCK_DV)


@triton.jit(do_not_specialize=["num_m_tiles", "num_head_blocks", "num_pairs", "pairs_per_chunk"])
def _extend_fresh_kernel(
    q_ptr,
    k_new,  # TMA: a [T, Hkv * D] tensor descriptor; else a pointer to k_new [T, Hkv, D]
    v_new,
    k_ptr,
    v_ptr,
    o_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    prefix_lens_ptr,
    qk_scale,
    num_m_tiles,
    num_head_blocks,
    num_pairs,
    pairs_per_chunk,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    TMA: tl.constexpr,
    SLOT_I32: tl.constexpr,
):
    # Query tiles and their schedule are the gather kernel's (_tile_coords, _tile_rows).
    TOKENS: tl.constexpr = BLOCK_M // HEADS
    m_tile, b, head0, kv_head = _tile_coords(
        num_m_tiles, num_head_blocks, num_pairs, pairs_per_chunk, GROUP, HEADS
    )
    q_start, extend_len, tok0, tok, heads, row_ok, rows = _tile_rows(
        qo_indptr_ptr, b, m_tile, head0, HEADS, BLOCK_M
    )
    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int32)
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_q(q_ptr, rows, heads, row_ok, stride_qt, stride_qh, HEAD_DIM, BLOCK_D)

    # Two sources, each split into blocks every row sees (no mask math) and masked ones:
    #   prefix  [0, prefix): every new token sees all of it; only a ragged last block is
    #           masked (by column, not per row), gathered from the cache through slot ids;
    #   new     [0, new_hi): new token j is row q_start + j of k_new / v_new; blocks below
    #           full_hi are seen by every row, the rest hold the diagonal (masked per row).
    # A tile past the request's new tokens gets empty loops and stores nothing.
    tile_ok = tok0 < extend_len
    pre_hi = tl.where(tile_ok, prefix, 0)
    pre_full = pre_hi // BLOCK_N * BLOCK_N
    new_hi = tl.where(tile_ok, tl.minimum(tok0 + TOKENS, extend_len), 0)
    new_full = tl.where(tile_ok, (tok0 + 1) // BLOCK_N * BLOCK_N, 0)

    m_i, l_i, acc = _softmax_init(BLOCK_M, BLOCK_DV)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    idx_base = kv_indices_ptr + kv_start
    offs_b = tl.arange(0, BLOCK_N)

    # Prefix, whole blocks, slot ids one block ahead as in the gather kernel. Whatever block
    # runs first starts at column 0, which every row sees: m_i is finite from then on and no
    # row computes exp2(-inf - -inf).
    ids = tl.load(idx_base + offs_b, mask=offs_b < pre_full, other=0)
    m_i, l_i, acc = _attend_whole_blocks(
        q, m_i, l_i, acc, ids, k_base, v_base, idx_base, pre_full, stride_ks, stride_vs,
        qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, SLOT_I32,
    )  # fmt: skip

    # Prefix, the ragged last block (zero or one iteration).
    for start in range(pre_full, pre_hi, BLOCK_N):
        offs_n = start + offs_b
        in_pre = offs_n < pre_hi
        slots = slot_offsets(tl.load(idx_base + offs_n, mask=in_pre, other=0), SLOT_I32)
        # Columns past the prefix load zeros, not slot 0's row: p = 0 times NaN is NaN.
        k = _load_rows(k_base, slots, stride_ks, offs_d, HEAD_DIM, BLOCK_D, in_pre)
        s = dot(q, tl.trans(k))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, in_pre[None, :])
        v = _load_rows(v_base, slots, stride_vs, offs_dv, HEAD_DIM_V, BLOCK_DV, in_pre)
        acc = dot(p.to(q.dtype), v, acc * alpha[:, None])

    # New tokens, whole blocks: consecutive rows of k_new / v_new, below every row's diagonal.
    for start in range(0, new_full, BLOCK_N):
        if TMA:
            k = k_new.load([q_start + start, kv_head * HEAD_DIM])  # [BLOCK_N, BLOCK_D]
        else:
            new_rows = (q_start + start + offs_b).to(tl.int64)
            k = _load_rows(k_new + kv_head * stride_knh, new_rows, stride_knt, offs_d, HEAD_DIM,
                           BLOCK_D, None)  # fmt: skip
        s = dot(q, tl.trans(k))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, None)
        if TMA:
            v = v_new.load([q_start + start, kv_head * HEAD_DIM_V])
        else:
            new_rows = (q_start + start + offs_b).to(tl.int64)
            v = _load_rows(v_new + kv_head * stride_vnh, new_rows, stride_vnt, offs_dv, HEAD_DIM_V,
                           BLOCK_DV, None)  # fmt: skip
        acc = dot(p.to(q.dtype), v, acc * alpha[:, None])

    # New tokens, the diagonal blocks: row r sees new tokens j <= tok[r].
    for start in range(new_full, new_hi, BLOCK_N):
        offs_n = start + offs_b
        if TMA:
            # Rows past this request (the next one's, or zeros past T) are masked below.
            k = k_new.load([q_start + start, kv_head * HEAD_DIM])
        else:
            new_rows = (q_start + offs_n).to(tl.int64)
            k = _load_rows(k_new + kv_head * stride_knh, new_rows, stride_knt, offs_d, HEAD_DIM,
                           BLOCK_D, offs_n < new_hi)  # fmt: skip
        s = dot(q, tl.trans(k))
        visible = offs_n[None, :] <= tok[:, None]
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, visible)
        if TMA:
            # Zero the rows past this request: p = 0 there, but 0 times a NaN row is NaN.
            v = v_new.load([q_start + start, kv_head * HEAD_DIM_V])
            v = tl.where((offs_n < new_hi)[:, None], v, 0.0)
        else:
            new_rows = (q_start + offs_n).to(tl.int64)
            v = _load_rows(v_new + kv_head * stride_vnh, new_rows, stride_vnt, offs_dv, HEAD_DIM_V,
                           BLOCK_DV, offs_n < new_hi)  # fmt: skip
        acc = dot(p.to(q.dtype), v, acc * alpha[:, None])

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    _store_o(o_ptr, out, rows, heads, row_ok, stride_ot, stride_oh, HEAD_DIM_V, BLOCK_DV)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    *,
    kv_scales: torch.Tensor | None = None,
    max_kv_len: int | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    kernel: str | None = None,
    tma: bool | None = None,
    persistent: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads_per_tile: int | None = None,
    pairs_per_chunk: int | None = None,
) -> None:
    """Causal prefill attention for new tokens on top of an optional cached prefix.

    Request b owns query rows ``qo_indptr[b] : qo_indptr[b+1]`` of ``q`` / ``o`` and the
    context slots ``kv_indices[kv_indptr[b] : kv_indptr[b+1]]`` (prefix followed by its new
    tokens, so the context length is ``prefix_lens[b] + extend_len[b]``). Its new token i sits
    at position ``prefix_lens[b] + i`` and attends to context positions
    ``j <= prefix_lens[b] + i``. A request may have no new tokens.

    The gather kernel reads the whole context from the cache (the new tokens' K/V must be
    stored there already). Given ``k_new`` / ``v_new``, the fresh kernel reads the prefix from
    the cache and the new tokens from those rows (TMA on sm90+), see the module docstring;
    ``kernel`` None picks (:func:`choose_kernel`).

    One program handles ``block_m // heads_per_tile`` new tokens of one request times
    ``heads_per_tile`` query heads sharing one kv head, so each K/V tile loaded feeds all of
    them. Context blocks every row sees run without masks; only the diagonal blocks (and the
    fresh kernel's ragged last prefix block) are masked. The 1-D grid covers (request, head
    block, query tile), longest tiles first inside chunks of pairs sized to L2. No host
    synchronisation and no allocation.

    Args:
        q: ``[T, Hq, D]`` fp16/bf16/fp32 new-token queries, last dim contiguous.
        k_buffer: ``[S, Hkv, D]`` key cache on ``q``'s device, in ``q``'s dtype or fp8.
        v_buffer: ``[S, Hkv, Dv]`` value cache, in ``k_buffer``'s dtype.
        o: ``[T, Hq, Dv]`` output, same dtype as ``q``; rows of the requests written in place.
        qo_indptr: int32/int64 ``[B+1]`` offsets of each request's rows in ``q``.
        kv_indptr: int32/int64 ``[>= B+1]`` offsets of each request's context in
            ``kv_indices``.
        kv_indices: int32/int64 slot ids of all contexts, request after request.
        prefix_lens: int32/int64 ``[>= B]`` cached prefix length of each request.
        max_extend_len: upper bound on any request's new-token count (sizes the grid).
        sm_scale: softmax scale, usually ``D ** -0.5``.
        kv_scales: fp32 device tensor whose first two values are ``k_scale`` and ``v_scale``
            (the cache holds ``K / k_scale`` and ``V / v_scale``); required for an fp8 cache.
            As in :func:`decode_attention`: ``sm_scale * k_scale``, output times ``v_scale``,
            K/V converted to ``q``'s dtype, probabilities kept in it. Gather kernel only.
        max_kv_len: host upper bound on any context length, used only to size the schedule's
            chunks (``None``: ``max_extend_len``).
        k_new: ``[T, Hkv, D]`` this step's keys in ``q``'s dtype and row order (what the cache
            holds at the new tokens' slots); rows and heads may be strided, the last dim must
            be contiguous. Enables the fresh kernel.
        v_new: ``[T, Hkv, Dv]`` this step's values, likewise; given with ``k_new`` or not at all.
        kernel: ``"gather"``, ``"fresh"`` (needs ``k_new`` / ``v_new`` and a cache in
            ``q``'s dtype) or ``"ws"`` (CUDA sm90, a 16-bit cache in ``q``'s dtype, equal head
            dims of 64 or 128; see :func:`~execrt.kernels.attention.extend_ws.ws_unsupported`);
            ``None``: :func:`choose_kernel`.
        tma: fresh kernel: load the new K/V through TMA tensor descriptors (CUDA sm90+, pow2
            head dims, 16-byte aligned rows); ``None``: the table's choice where TMA is
            possible. ``True`` where it is not is refused; the interpreter runs either.
        persistent: ws kernel: one program per SM walks the schedule's tiles (its producer
            gathers the next tile's K/V while the consumers finish this one) instead of one
            program per tile; ``None``: the table's choice (else one per tile).
        block_m: rows per query tile (power of two >= 16); ``None``: :func:`extend_choice`.
        block_n: context tokens per loop step (power of two >= 16); ``None`` likewise.
        num_warps: warps per program (``ws``: its consumer warps; 4 producer warps come on
            top); ``None`` likewise.
        num_stages: software pipelining depth of the loops (``ws``: K/V buffers in its
            ring); ``None`` likewise.
        heads_per_tile: query heads packed into a tile, a divisor of ``Hq // Hkv`` that is
            ``<= block_m``; ``None``: the tuned table's, else the largest such divisor.
        pairs_per_chunk: (request, head block) pairs per schedule chunk (>= 1); ``None``:
            the tuned table's, else as many as have their K/V fit in half the L2 cache.

    Raises:
        ValueError: on unsupported dtypes, shapes, head dims (> 256), head counts, devices,
            block sizes, head packing, chunk sizes, a negative ``max_extend_len``, a kernel
            that cannot serve the call, or TMA asked for where it cannot run.
    """
    num_tokens, num_q_heads, num_kv_heads, head_dim, head_dim_v = check_qkvo(
        q, k_buffer, v_buffer, o, kv_scales
    )
    if max_extend_len < 0:
        fail(COMPONENT, f"max_extend_len {max_extend_len} unsupported (supported: >= 0)")
    _check_new_kv(q, k_new, v_new, num_kv_heads, head_dim, head_dim_v)
    block_dim = max(head_dim, head_dim_v)
    if kernel is None:
        kernel = choose_kernel(
            q, k_buffer, k_new, kv_scales, block_dim, v_buffer=v_buffer, head_dim_v=head_dim_v
        )
        explicit = (block_m, block_n, num_warps, num_stages)
        if kernel == WS and any(t is not None for t in explicit):
            # The table chose ws, but the caller names tiles: keep ws only if they fit it.
            t = extend_choice(q.dtype, block_dim, q.device, WS).tiles.named(*explicit)
            why = ws_tiles_unsupported(
                t.block_m, t.block_n, t.num_warps, t.num_stages, block_dim, q.element_size()
            )
            if why is not None:
                kernel = choose_kernel(
                    q, k_buffer, k_new, kv_scales, block_dim, v_buffer=v_buffer,
                    head_dim_v=head_dim_v, allow_ws=False,
                )  # fmt: skip
    elif kernel not in KERNELS:
        fail(COMPONENT, f"kernel {kernel!r} unsupported (supported: {', '.join(KERNELS)})")
    elif kernel == FRESH:
        why = "no k_new / v_new given" if k_new is None else fresh_supported(q, k_buffer, kv_scales)
        if why is not None:
            fail(COMPONENT, f"kernel 'fresh' cannot run this call: {why}")
    elif kernel == WS:
        why = ws_unsupported(q, k_buffer, v_buffer, kv_scales, head_dim, head_dim_v)
        if why is not None:
            fail(COMPONENT, f"kernel 'ws' cannot run this call: {why}")
    choice = extend_choice(q.dtype, block_dim, q.device, kernel)
    tiles = choice.tiles.named(block_m, block_n, num_warps, num_stages)
    block_m, block_n = tiles.block_m, tiles.block_n
    warps, stages = tiles.num_warps, tiles.num_stages
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    group = num_q_heads // num_kv_heads
    heads = heads_per_tile
    tuned_heads = choice.heads_per_tile
    if heads is None and tuned_heads and group % tuned_heads == 0 and tuned_heads <= block_m:
        heads = tuned_heads  # a table entry's packing, where this group size allows it
    if heads is None:
        heads = _default_heads_per_tile(group, block_m)
    if heads < 1 or group % heads or heads > block_m:
        fail(
            COMPONENT,
            f"heads_per_tile {heads} unsupported (supported: a divisor of the group size "
            f"{group} that is <= block_m {block_m})",
        )
    if pairs_per_chunk is not None and pairs_per_chunk < 1:
        fail(COMPONENT, f"pairs_per_chunk {pairs_per_chunk} unsupported (supported: >= 1)")
    if qo_indptr.dim() != 1 or qo_indptr.shape[0] < 1:
        fail(COMPONENT, f"qo_indptr must be 1-D [B+1], got shape {tuple(qo_indptr.shape)}")
    batch = qo_indptr.shape[0] - 1
    check_index(COMPONENT, "qo_indptr", qo_indptr, batch + 1)
    check_index(COMPONENT, "prefix_lens", prefix_lens, batch)
    check_paged(
        batch, kv_indptr, kv_indices, q, k_buffer=k_buffer, v_buffer=v_buffer, o=o,
        qo_indptr=qo_indptr, prefix_lens=prefix_lens,
        **({} if kv_scales is None else {"kv_scales": kv_scales}),
    )  # fmt: skip
    if kernel == WS:
        why = ws_tiles_unsupported(block_m, block_n, warps, stages, block_dim, q.element_size())
        if why is not None:
            fail(COMPONENT, f"tiles unsupported by kernel 'ws': {why}")
    use_tma = False
    if kernel == FRESH:
        possible = _tma_possible(k_new, v_new, head_dim, head_dim_v, block_n)  # type: ignore[arg-type]
        if tma and possible is not None:
            fail(COMPONENT, f"tma unsupported here: {possible}")
        use_tma = possible is None and (choice.tma if tma is None else tma)
    if batch == 0 or max_extend_len == 0 or num_tokens == 0:
        return

    num_m_tiles = cdiv(max_extend_len, block_m // heads)
    num_head_blocks = num_q_heads // heads
    num_pairs = batch * num_head_blocks
    if pairs_per_chunk is None:
        pairs_per_chunk = choice.pairs_per_chunk
    if pairs_per_chunk is None:
        row_bytes = (head_dim + head_dim_v) * k_buffer.element_size()
        kv_bound = max_extend_len if max_kv_len is None else max(max_kv_len, max_extend_len)
        pairs_per_chunk = _pairs_per_chunk(num_pairs, kv_bound, row_bytes, _l2_bytes(q.device))
    pairs_per_chunk = min(pairs_per_chunk, num_pairs)
    if kernel == WS:
        launch_ws(
            q, k_buffer, v_buffer, o, qo_indptr, kv_indptr, kv_indices, prefix_lens,
            sm_scale * LOG2E, (num_m_tiles, num_head_blocks, num_pairs, pairs_per_chunk),
            group=group, heads=heads, block_m=block_m, block_n=block_n, num_warps=warps,
            num_stages=stages, persistent=choice.persistent if persistent is None else persistent,
        )  # fmt: skip
        return
    grid = (num_pairs * num_m_tiles,)
    common = dict(
        GROUP=group,
        HEADS=heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=pow2_at_least(head_dim),
        BLOCK_DV=pow2_at_least(head_dim_v),
        SLOT_I32=int32_slot_offsets(k_buffer, v_buffer),
        num_warps=warps,
        num_stages=stages,
    )
    if kernel == FRESH:
        assert k_new is not None and v_new is not None
        if use_tma:
            k_src: Any = _descriptor(k_new, block_n, head_dim)
            v_src: Any = _descriptor(v_new, block_n, head_dim_v)
        else:
            k_src, v_src = k_new, v_new
        _extend_fresh_kernel[grid](
            q, k_src, v_src, k_buffer, v_buffer, o, qo_indptr, kv_indptr, kv_indices,
            prefix_lens, sm_scale * LOG2E, num_m_tiles, num_head_blocks, num_pairs,
            pairs_per_chunk, q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
            v_new.stride(0), v_new.stride(1), k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1), o.stride(0), o.stride(1),
            TMA=use_tma, **common,
        )  # fmt: skip
        return
    _extend_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        prefix_lens,
        prefix_lens if kv_scales is None else kv_scales,  # unread unless KV_SCALED
        sm_scale * LOG2E,
        num_m_tiles,
        num_head_blocks,
        num_pairs,
        pairs_per_chunk,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        o.stride(0),
        o.stride(1),
        KV_SCALED=kv_scales is not None,
        DOT_F16=fp16_dots(q, k_buffer),  # an fp8 cache always comes with kv_scales
        **common,
    )


def _check_new_kv(
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int,
) -> None:
    if (k_new is None) != (v_new is None):
        fail(COMPONENT, "k_new and v_new go together (one was given without the other)")
    if k_new is None or v_new is None:
        return
    want_k = (q.shape[0], num_kv_heads, head_dim)
    want_v = (q.shape[0], num_kv_heads, head_dim_v)
    for name, t, want in (("k_new", k_new, want_k), ("v_new", v_new, want_v)):
        if tuple(t.shape) != want:
            fail(COMPONENT, f"{name} shape {tuple(t.shape)} unsupported (expected {want})")
        if t.dtype != q.dtype:
            fail(COMPONENT, f"{name} dtype {t.dtype} differs from q dtype {q.dtype} (must match)")
    check_same_device(COMPONENT, q, k_new=k_new, v_new=v_new)
    check_last_dim_contiguous(COMPONENT, k_new=k_new, v_new=v_new)


def _tma_possible(
    k_new: torch.Tensor, v_new: torch.Tensor, head_dim: int, head_dim_v: int, block_n: int
) -> str | None:
    """Why the new K/V cannot be read through TMA descriptors, or None when they can.

    A descriptor spans ``[T, Hkv * D]`` (heads side by side in a row), so heads must be packed
    (stride D); TMA wants 16-byte aligned bases and row strides, and a box of power-of-two
    sides <= 256 (a padded head dim would read the next head's columns)."""
    if TensorDescriptor is None:
        return "this triton has no tensor descriptors"
    if k_new.device.type == "cuda" and not interpreter_enabled():
        if cuda_capability(k_new.device) < (9, 0):
            return "TMA needs sm90+"
    if k_new.shape[0] == 0:
        return "no rows"
    for name, t, d in (("k_new", k_new, head_dim), ("v_new", v_new, head_dim_v)):
        if d & (d - 1) or not 16 <= d <= 256 or block_n > 256:
            return f"{name} head dim {d} / block_n {block_n} is not a TMA box side"
        if t.stride(1) != d:
            return f"{name} heads are not packed (strides {tuple(t.stride())})"
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return f"{name} is not 16-byte aligned (strides {tuple(t.stride())})"
    return None


def _descriptor(t: torch.Tensor, block_n: int, head_dim: int) -> Any:
    """A TMA descriptor of ``t [T, Hkv, D]`` as ``[T, Hkv * D]``, boxes ``[block_n, D]``."""
    rows = t.as_strided((t.shape[0], t.shape[1] * t.shape[2]), (t.stride(0), 1))
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [block_n, head_dim])
