"""fp8 split-KV decode that converts K and V straight into the tensor cores' registers (Gluon).

The Triton split kernel (:mod:`execrt.kernels.attention.decode`) reads an fp8 cache through
shared memory: Triton lays the converted K and V out for ``mma`` by storing them and loading
them back, 176-240 KB of shared-memory traffic per 32 KB block, which held fp8 decode near
the bf16 step (docs/kernels.md). This kernel (``fp8_kernel="mma"``) never touches shared
memory in its K/V loop: every thread loads exactly the fp8 bytes that its ``mma.m16n8k16``
fragments hold, converts them in registers (``cvt.rn.f16x2.e4m3x2``), and hands them to the
tensor cores.

Two facts make that possible:

- **Scores do not care about the order of the head dim, outputs do not care about the order
  of tokens.** ``q.k`` sums over ``d``: any permutation of ``d`` applied to both q and K gives
  the same score. So the kernel reads K's 128 bytes in the order that makes each thread's
  fragment 32 contiguous bytes (two 16-byte loads), and loads q permuted alike (once per
  item). V's head dim is permuted so each thread's fragment rows are 16 contiguous bytes of
  one token, and the output is stored back through the inverse permutation.
- **Heads on the mma's N side.** ``S^T = K q^T`` (``[tokens, heads]``: A = K from registers,
  B = q^T) and ``O^T += V^T P^T`` (A = V^T from registers, B = P^T). A GQA group of up to 8
  query heads fills one ``n8`` tile (the Triton kernel pads the group to 16 rows of M). P^T
  moves from the accumulator layout to the B operand with one ``movmatrix`` (an 8 x 8
  transpose within a warp) per 8 tokens.

Each warp is independent: it takes its own ``T`` tokens of every ``W * T``-token block, runs
its own online softmax, and the warps' partial results are combined once per work item
(through shared memory, outside the loop). K/V come through a ``cp.async`` ring of shared
memory ``RING - 1`` steps ahead (each thread copies exactly the chunks it reads back), or
with ``RING = 0`` straight into registers ``AHEAD`` steps ahead. The bytes of a V fragment
pair two tokens per 32-bit register (the mma's k side is tokens): one ``PRMT`` per four
values interleaves them before the conversion.

Launch shape: by batch from ``MMA_SHAPES_BY_BATCH`` (one-warp programs, each warp its own
item, where the batch gives many items; 4-warp programs below), unless the ``MMA_*``
overrides are set. ``decode_attention`` runs this kernel by default from ``MMA_MIN_BATCH``
requests (``EXECRT_FP8_DECODE_KERNEL=auto``). ``MMA_STEAL`` (off until timed) has programs
draw their items from an atomic queue instead of a fixed round robin.

The work list, splits, partial outputs and fused merge are those of the Triton kernel: the
same ``decode_work`` items, the same ``[B, Hq, splits, Dv]`` partials and log2-sum-exps, so
the separate merge launch and the ``arrivals`` counters work unchanged.

Scope: CUDA sm89+ (the fp8 conversions) with Gluon, an fp8 cache (e4m3 or e5m2) read with
16-bit q (the dots run in fp16, as in the Triton kernel), a GQA group of at most 8, head
dims 64, 128 or 256, no decode prologue. :func:`mma_unsupported` names what a call lacks.
Gluon kernels do not run under the Triton interpreter: CPU tests compile it for sm90.
"""

import math

import torch

from execrt.core.kv_quant import FP8_DTYPES
from execrt.kernels._triton import (
    cuda_capability,
    interpreter_enabled,
    programs_per_sm,
    sm_count,
    stream_scratch,
)

try:  # Gluon: triton >= 3.5 (the H200 runs 3.6)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from execrt.kernels.attention.decode import _CVT_ASM, _item_bounds, _record
    from execrt.kernels.attention.indices import slot_offsets
    from execrt.kernels.triton_pdl import PREFETCH_L2_ASM, pdl_prologue

    # A barrier over the program's threads: ``thread_barrier`` in triton 3.6 (the H200's),
    # ``barrier`` by 3.9.
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # cp.async into shared memory: ``async_copy_global_to_shared`` in triton 3.6, renamed
    # ``async_load`` by 3.9 (the same arguments).
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    GLUON_IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the installed triton
    GLUON_IMPORT_ERROR = f"this triton has no Gluon ({exc})"

MMA_HEAD_DIMS = (64, 128, 256)
MMA_MAX_GROUP = 8  # query heads per kv head: one n8 tile
#: Launch shape overrides (the tuner and tests set them; None: ``MMA_SHAPES_BY_BATCH``):
#: warps per program, tokens per warp per step, registers per thread (0: as ptxas
#: allocates), stages of the cp.async ring K/V go through (0: loaded straight into
#: registers, ``MMA_AHEAD`` steps ahead). Read at each launch.
MMA_WARPS: int | None = None
MMA_TOKENS: int | None = None
MMA_MAXNREG: int | None = None
MMA_RING: int | None = None
MMA_AHEAD = 2
#: (least batch, (warps, tokens, maxnreg, ring)): the first row whose batch a launch reaches
#: gives its shape. From the H200 sweep of session 22 (docs/kernels.md): one-warp programs
#: (each warp its own work item) where the batch gives many items (from 64: 16-token steps, a
#: 4-stage ring), 32-token steps with a 3-stage ring in the middle, 4-warp programs sharing
#: out a few long items below. Session 24's 3-stage, 128-register row from 64 won alone
#: (43.8 against 45.6 us a layer at 128 x 512) and lost in the step: the 8B fp8 step at
#: 128 x 512 was 8.71 against 8.36 ms on an H100, 0.89 against 0.85 of bf16 (session 27).
MMA_SHAPES_BY_BATCH: tuple[tuple[int, tuple[int, int, int, int]], ...] = (
    (64, (1, 16, 0, 4)),
    (16, (1, 32, 0, 3)),
    (1, (4, 16, 128, 3)),
)
#: The least batch whose fp8 decode runs on this kernel when none is named
#: (``EXECRT_FP8_DECODE_KERNEL`` unset or ``auto``): below it a launch is a few µs of
#: latency whatever reads the bytes, and the Triton words kernel's is shorter (H200: 6.7
#: against 7.6-8.7 µs per layer call at 1 x 512).
MMA_MIN_BATCH = 8
#: Work stealing (session 23; off until timed): each program takes its next work item from
#: an atomic counter per kv head instead of every ``programs``-th item, and the grid is
#: ``MMA_STEAL_WARPS_PER_SM`` warps per SM over the kv heads (never more programs than
#: items). With one-warp programs every program is resident from the start, so a fixed share
#: per program cannot be evened out by the GPU; taken from a queue, the items are.
MMA_STEAL = False
MMA_STEAL_WARPS_PER_SM = 8


def steal_queue(device: torch.device, num_kv_heads: int) -> torch.Tensor:
    """The work-stealing counters of ``device``'s current stream (``stream_scratch``): at
    least ``2 * num_kv_heads`` zeroed int32, two per kv head (the next item, and the
    programs done), which every launch leaves zero for the next."""
    return stream_scratch(
        "mma decode queue", device, 2 * num_kv_heads, torch.int32, zeroed=True, least=256
    )


def steal_programs(batch: int, max_splits: int, num_kv_heads: int, warps: int, sms: int) -> int:
    """Programs per kv head under work stealing: ``MMA_STEAL_WARPS_PER_SM`` warps per SM
    over the heads, at most one per work item there can be. Depends only on its arguments."""
    want = -(-MMA_STEAL_WARPS_PER_SM * sms // (max(1, warps) * max(1, num_kv_heads)))
    return max(1, min(max(1, batch * max_splits), want))


#: Registers per thread the wave count (:func:`mma_resident`) assumes of a launch shape
#: without ``maxnreg``: a little above what ptxas gives the one-warp shapes (138-154, sm90
#: AOT, triton 3.9), so that a wave is never overcounted by a program per SM.
MMA_REGS_ESTIMATE = 160
#: Resident blocks per SM by compute capability (the CUDA occupancy tables); 16 elsewhere.
_BLOCKS_PER_SM = {(8, 0): 32, (8, 6): 16, (8, 7): 16, (8, 9): 24, (9, 0): 32, (10, 0): 32}


def mma_shared_bytes(warps: int, tokens: int, ring: int, head_dim: int, head_dim_v: int) -> int:
    """Shared memory of one program's cp.async ring: every warp ``ring`` stages of
    ``tokens`` fp8 K and V rows (0 for ``ring`` 0)."""
    return warps * ring * tokens * (head_dim + head_dim_v)


def mma_resident(
    shape: tuple[int, int, int | None, int], head_dim: int, head_dim_v: int, device: torch.device
) -> int:
    """Programs of launch ``shape`` (:func:`mma_launch_shape`'s) that ``device`` holds at once
    (one wave): the least of what its shared memory, registers (``maxnreg``, else
    ``MMA_REGS_ESTIMATE``), warps and blocks per SM allow, times its SMs. H200, D 128: 1,188
    one-warp programs of 32 tokens and a 3-stage ring (shared memory: 9 per SM), 1,584 of 16
    tokens and 4 stages (registers: 12 per SM)."""
    warps, tokens, maxnreg, ring = shape
    props = torch.cuda.get_device_properties(device)
    fit = programs_per_sm(
        maxnreg or MMA_REGS_ESTIMATE,
        warps,
        mma_shared_bytes(warps, tokens, ring, head_dim, head_dim_v),
        shared_per_sm=props.shared_memory_per_multiprocessor,
        threads_per_sm=props.max_threads_per_multi_processor,
        blocks_per_sm=_BLOCKS_PER_SM.get(cuda_capability(device), 16),
    )
    return max(1, fit) * sm_count(device)


def mma_launch_shape(batch: int) -> tuple[int, int, int | None, int]:
    """(warps, tokens, maxnreg or None, ring) of a launch over ``batch`` requests: the
    ``MMA_*`` overrides where set, else the ``MMA_SHAPES_BY_BATCH`` row of the batch. Depends
    only on the batch, so a graph bucket replays the shape it captured."""
    shape = next((s for least, s in MMA_SHAPES_BY_BATCH if batch >= least), (4, 16, 128, 3))
    warps = MMA_WARPS or shape[0]
    tokens = MMA_TOKENS or shape[1]
    maxnreg = shape[2] if MMA_MAXNREG is None else MMA_MAXNREG
    ring = shape[3] if MMA_RING is None else MMA_RING
    return warps, tokens, maxnreg or None, ring


def mma_prefetch_tokens(warps: int, tokens: int, ring: int) -> int:
    """Tokens of an item whose K/V rows the prefetch asks L2 for: what the loop reads before
    its first step can run (a ring's filled stages, else two blocks), a power of two >= 32."""
    return max(32, 1 << (warps * tokens * (max(1, ring - 1) if ring else 2) - 1).bit_length())


def mma_unsupported(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, *, prologue: bool = False
) -> str | None:
    """Why the mma kernel cannot run this decode call (None when it can)."""
    if GLUON_IMPORT_ERROR is not None:
        return GLUON_IMPORT_ERROR
    if k_buffer.dtype not in FP8_DTYPES or v_buffer.dtype != k_buffer.dtype:
        return f"it reads fp8 caches only, got {k_buffer.dtype}/{v_buffer.dtype}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it needs 16-bit q, got {q.dtype}"
    d, dv = q.shape[-1], v_buffer.shape[-1]
    if d not in MMA_HEAD_DIMS or dv not in MMA_HEAD_DIMS:
        return f"head dims {d}/{dv} unsupported (supported: {MMA_HEAD_DIMS})"
    group = q.shape[1] // k_buffer.shape[1]
    if group > MMA_MAX_GROUP:
        return f"a GQA group of {group} query heads unsupported (at most {MMA_MAX_GROUP})"
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        return "the cache's head dim must be contiguous"
    if any(s % 16 for s in (*k_buffer.stride()[:-1], *v_buffer.stride()[:-1])):
        return "K/V row strides must be multiples of 16 bytes (vector loads)"
    if k_buffer.data_ptr() % 16 or v_buffer.data_ptr() % 16:
        return "K/V buffers must be 16-byte aligned"
    if prologue:
        return "the decode prologue runs in the Triton kernel only"
    if interpreter_enabled():
        return "Gluon kernels do not run under the Triton interpreter"
    if q.device.type != "cuda":
        return f"it needs a CUDA device, got {q.device.type}"
    major, minor = cuda_capability(q.device)
    if (major, minor) < (8, 9):
        return f"it needs sm89+ (fp8 conversions), got sm{major}{minor}"
    return None


def _lg(x: int) -> int:
    return int(math.log2(x))


def mma_layouts(warps: int, tokens: int, head_dim: int, head_dim_v: int):
    """The register layouts of the raw K and V tiles, int32 words ``[W, T, D / 4]`` (see the
    kernel), of q as loaded (``[W, 8, D]``, every warp a copy), and the shared layouts of the
    cp.async ring's K and V stages (``[W, T, D / 4]`` each):

    - K as loaded: thread ``(g, t)`` of a warp (``g = lane / 4``, ``t = lane % 4``) holds
      tokens g and g + 8, and of each 64-byte quarter of their rows the 16 bytes at ``16 t``
      (so one load instruction reads whole 32-byte sectors);
    - V as loaded: tokens 2t, 2t + 1, 2t + 8, 2t + 9, bytes ``[16 g, 16 g + 16)`` (D 128);
    - V with each token pair in consecutive registers (the layout its conversion reads);
    - q: K's layout in elements, with its 8 (padded) heads for tokens.

    In the ring, the 8 threads of a shared-memory phase (lanes 0-7) read 8 different 16-byte
    bank groups: K rows g = 0, 1 interleave their quarters' chunks, V's tokens 0, 2, 4, 6
    theirs."""
    warp_bases = [[1 << i, 0, 0] for i in range(_lg(warps))]
    token_reps = [[0, 8 << i, 0] for i in range(_lg(tokens // 8))]
    kw, vw = head_dim // 4, head_dim_v // 4
    quarters = [[0, 0, 16 << i] for i in range(_lg(head_dim // 64))]
    k = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2]] + quarters + token_reps,
        lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=warp_bases,
        block_bases=[],
        shape=[warps, tokens, kw],
    )
    v_words = [[0, 0, 1 << i] for i in range(_lg(vw // 8))]
    v_lanes = [[0, 2, 0], [0, 4, 0]] + [[0, 0, (vw // 8) << i] for i in range(3)]
    v = gl.DistributedLinearLayout(
        reg_bases=v_words + [[0, 1, 0]] + token_reps,
        lane_bases=v_lanes,
        warp_bases=warp_bases,
        block_bases=[],
        shape=[warps, tokens, vw],
    )
    v_pairs = gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0]] + v_words + token_reps,
        lane_bases=v_lanes,
        warp_bases=warp_bases,
        block_bases=[],
        shape=[warps, tokens, vw],
    )
    q = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]]
        + [[0, 0, 64 << i] for i in range(_lg(head_dim // 64))],
        lane_bases=[[0, 0, 16], [0, 0, 32], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=warp_bases,
        block_bases=[],
        shape=[warps, 8, head_dim],
    )
    # Shared offsets, fastest first (words): one 16-byte chunk, then what a phase spans.
    tokens_up = [[0, 2 << i, 0] for i in range(_lg(tokens // 2))]
    k_ring = gl.SharedLinearLayout(
        offset_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0]]
        + quarters
        + tokens_up
        + warp_bases,
        block_bases=[],
    )
    v_ring = gl.SharedLinearLayout(
        offset_bases=v_words
        + [[0, 0, vw // 8], [0, 2, 0], [0, 4, 0]]
        + [[0, 0, (vw // 8) << i] for i in (1, 2)]
        + [[0, 1, 0]]
        + [[0, 8 << i, 0] for i in range(_lg(tokens // 8))]
        + warp_bases,
        block_bases=[],
    )
    return k, v, v_pairs, q, k_ring, v_ring


if GLUON_IMPORT_ERROR is None:
    # One word of four fp8 values (lowest byte first) to four fp16 values: the Triton
    # kernel's conversion.
    _CVT = _CVT_ASM
    # Two words (tokens tau and tau + 1, the same four columns) to four fp16 pairs, one per
    # column, each holding (tau, tau + 1): the mma's k side is tokens for P V.
    _CVT_PAIRS = """{
.reg .b32 x, y;
.reg .b16 xl, xh, yl, yh;
prmt.b32 x, $4, $5, 0x5140;
prmt.b32 y, $4, $5, 0x7362;
mov.b32 {xl, xh}, x;
mov.b32 {yl, yh}, y;
cvt.rn.f16x2.FMTx2 $0, xl;
cvt.rn.f16x2.FMTx2 $1, xh;
cvt.rn.f16x2.FMTx2 $2, yl;
cvt.rn.f16x2.FMTx2 $3, yh;
}"""
    _CVT_E4M3 = gl.constexpr(_CVT.replace("FMT", "e4m3"))
    _CVT_E5M2 = gl.constexpr(_CVT.replace("FMT", "e5m2"))
    _CVT_PAIRS_E4M3 = gl.constexpr(_CVT_PAIRS.replace("FMT", "e4m3"))
    _CVT_PAIRS_E5M2 = gl.constexpr(_CVT_PAIRS.replace("FMT", "e5m2"))
    # An 8 x 8 transpose of 16-bit values across the warp: thread l's register holds row l // 4,
    # columns 2 (l % 4) and 2 (l % 4) + 1, before and after.
    _TRANSPOSE = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")
    _PREFETCH = gl.constexpr(PREFETCH_L2_ASM)

    @gluon.jit
    def _index3(N0: gl.constexpr, N1: gl.constexpr, N2: gl.constexpr, layout: gl.constexpr):
        """Broadcastable indices ``[N0, 1, 1]``, ``[1, N1, 1]``, ``[1, 1, N2]`` in ``layout``."""
        i0 = gl.arange(0, N0, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        i1 = gl.arange(0, N1, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        i2 = gl.arange(0, N2, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        return (
            gl.expand_dims(gl.expand_dims(i0, 1), 2),
            gl.expand_dims(gl.expand_dims(i1, 0), 2),
            gl.expand_dims(gl.expand_dims(i2, 0), 1),
        )

    @gluon.jit
    def _k_dims(x, N0: gl.constexpr, N1: gl.constexpr, D: gl.constexpr):
        """``[N0, N1, D]`` K (or q) values in their bytes' order renamed to the head-dim order
        the mma fragments use: dim ``d = 64 c + 8 j + 2 t + e`` is byte ``64 c + 16 t + 2 j +
        e``, so the dims of thread ``t``'s fragment (``t = lane % 4``: 2t, 2t + 1, 2t + 8, 2t +
        9, ... of every 16) are 16 contiguous bytes of each 64-byte quarter of the row. Scores
        do not depend on the order of ``d``, as long as K and q share it."""
        x = gl.reshape(x, [N0, N1, D // 64, 4, 8, 2])
        return gl.reshape(gl.permute(x, [0, 1, 2, 4, 3, 5]), [N0, N1, D])

    @gluon.jit
    def _v_dims(x, N0: gl.constexpr, N1: gl.constexpr, DV: gl.constexpr):
        """``[N0, N1, DV]`` V values in their bytes' order renamed to the order the mma rows
        use: dim ``dv = 8 q + g`` is byte ``(DV / 8) g + q``, so the rows of thread group ``g``
        (``g = lane / 4``) are DV / 8 contiguous bytes of each of its tokens. The output is
        stored back in byte order (:func:`_in_byte_order`)."""
        x = gl.reshape(x, [N0, N1, 8, DV // 8])
        return gl.reshape(gl.permute(x, [0, 1, 3, 2]), [N0, N1, DV])

    @gluon.jit
    def _tile_ids(idx_base, start, hi, W: gl.constexpr, T: gl.constexpr, layout: gl.constexpr):
        """Slot ids of this step's tokens ``[W, T, 1]`` in ``layout`` (warp w takes tokens
        ``start + w T + [0, T)``), 0 past ``hi``; and whether each is in the split."""
        w, t, _ = _index3(W, T, 1, layout)
        pos = start + w * T + t
        inside = pos < hi
        return gl.load(idx_base + pos, mask=inside, other=0), inside

    @gluon.jit
    def _gather(base, ids, inside, stride_s, WORDS: gl.constexpr, SLOT_I32: gl.constexpr,
                W: gl.constexpr, T: gl.constexpr, layout: gl.constexpr):  # fmt: skip
        """The raw rows at ``ids`` as int32 words ``[W, T, WORDS]`` (0 outside the split).
        Words, not bytes: carried from step to step, a byte tensor takes a register per byte."""
        _, _, col = _index3(W, T, WORDS, layout)
        rows = slot_offsets(ids, SLOT_I32) * stride_s
        return gl.load(base + rows + col, mask=inside & (col < WORDS), other=0)

    @gluon.jit
    def _bytes(b0, b1, b2, b3, W: gl.constexpr, T: gl.constexpr, N: gl.constexpr):
        """Four ``[W, T, N / 4]`` tensors (byte k of each word) as ``[W, T, N]`` in byte order."""
        return gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [W, T, N])

    @gluon.jit
    def _k_fp16(words, E5M2: gl.constexpr, W: gl.constexpr, T: gl.constexpr, D: gl.constexpr):
        """K's words to fp16 ``[W, T, D]`` in byte order (exact: every fp8 value is an fp16)."""
        b0, b1, b2, b3 = gl.inline_asm_elementwise(
            _CVT_E5M2 if E5M2 else _CVT_E4M3, "=h,=h,=h,=h,r", [words],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=1,
        )  # fmt: skip
        return _bytes(b0, b1, b2, b3, W, T, D)

    @gluon.jit
    def _v_fp16(words, E5M2: gl.constexpr, W: gl.constexpr, T: gl.constexpr, DV: gl.constexpr,
                V_PAIRS: gl.constexpr):  # fmt: skip
        """V's words to fp16 ``[W, T, DV]`` in byte order, with the two tokens of each pair
        in one register (one ``PRMT`` per two words interleaves them before converting)."""
        b0, b1, b2, b3 = gl.inline_asm_elementwise(
            _CVT_PAIRS_E5M2 if E5M2 else _CVT_PAIRS_E4M3, "=r,=r,=r,=r,r,r",
            [gl.convert_layout(words, V_PAIRS)],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2,
        )  # fmt: skip
        return _bytes(b0, b1, b2, b3, W, T, DV)

    @gluon.jit
    def _step(kr, vr, start, hi, q_t, m_i, l_i, acc, E5M2: gl.constexpr, W: gl.constexpr,
              T: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, H: gl.constexpr,
              V_PAIRS: gl.constexpr, MMA: gl.constexpr):  # fmt: skip
        """One step of every warp's online softmax over its T tokens from ``start`` (``kr``/
        ``vr``: their raw K and V, zero past ``hi``)."""
        opa: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        opb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        # K [W, T, D] in the A operand's layout: the bytes as loaded, renamed (see _k_dims).
        k = _k_dims(_k_fp16(kr, E5M2, W, T, D), W, T, D)
        s = mma_v2(gl.convert_layout(k, opa), q_t, gl.zeros([W, T, H], gl.float32, layout=MMA))
        # s [W, T, H]: the scores (log2 domain, the scales are in q); tokens outside -inf.
        w, t, _ = _index3(W, T, 1, MMA)
        s = gl.where(start + w * T + t < hi, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A warp may see only padding (-inf) so far: subtract 0 then, not -inf.
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_ref)
        p = gl.exp2(s - gl.expand_dims(m_ref, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        # P^T as the B operand: the accumulator holds (token g, heads 2t, 2t + 1) per register,
        # B wants (tokens 2t, 2t + 1, head g). movmatrix transposes each 8 x 8 block across
        # the warp; the reshape/permute says which element each register now holds.
        y = gl.inline_asm_elementwise(
            _TRANSPOSE, "=r,r", [p.to(gl.float16)], dtype=gl.float16, is_pure=True, pack=2
        )
        y = gl.permute(gl.reshape(y, [W, T // 8, 8, 8]), [0, 1, 3, 2])
        p_t = gl.convert_layout(gl.reshape(y, [W, T, H]), opb)
        # V^T [W, DV, T] in the A operand's layout: token pairs per register, then renamed.
        v = _v_fp16(vr, E5M2, W, T, DV, V_PAIRS)
        v = _v_dims(v, W, T, DV)
        v_t = gl.convert_layout(gl.permute(v, [0, 2, 1]), opa)
        acc = mma_v2(v_t, p_t, acc * gl.expand_dims(alpha, 1))
        return m_new, l_i, acc

    @gluon.jit
    def _tile(idx_base, k_base, v_base, start, hi, stride_ks, stride_vs, SLOT_I32: gl.constexpr,
              W: gl.constexpr, T: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
              LK: gl.constexpr, LV: gl.constexpr):  # fmt: skip
        """The raw K and V words of the step at ``start`` (slot ids loaded here too)."""
        ik, kin = _tile_ids(idx_base, start, hi, W, T, LK)
        iv, vin = _tile_ids(idx_base, start, hi, W, T, LV)
        kr = _gather(k_base, ik, kin, stride_ks, D // 4, SLOT_I32, W, T, LK)
        vr = _gather(v_base, iv, vin, stride_vs, DV // 4, SLOT_I32, W, T, LV)
        return kr, vr

    @gluon.jit
    def _split_loop(q_t, idx_base, k_base, v_base, lo, hi, stride_ks, stride_vs,
                    E5M2: gl.constexpr, SLOT_I32: gl.constexpr, W: gl.constexpr,
                    T: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, H: gl.constexpr,
                    AHEAD: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr,
                    V_PAIRS: gl.constexpr, MMA: gl.constexpr):  # fmt: skip
        """Every warp's (running max, sum, unnormalised O^T) over its tokens of ``[lo, hi)``.

        K/V words are loaded ``AHEAD`` steps before their step. The loop is unrolled
        ``AHEAD + 1`` times so that each step's buffer keeps its registers (a rotating
        assignment would copy every carried word once a step); the steps past ``hi`` that
        unrolling adds are skipped."""
        BLOCK: gl.constexpr = W * T
        m_i = gl.full([W, H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
        l_i = gl.zeros([W, H], gl.float32, layout=gl.SliceLayout(1, MMA))
        acc = gl.zeros([W, DV, H], gl.float32, layout=MMA)
        ka, va = _tile(idx_base, k_base, v_base, lo, hi, stride_ks, stride_vs, SLOT_I32, W, T,
                       D, DV, LK, LV)  # fmt: skip
        if AHEAD == 1:
            for start in range(lo, hi, 2 * BLOCK):
                kb, vb = _tile(idx_base, k_base, v_base, start + BLOCK, hi, stride_ks,
                               stride_vs, SLOT_I32, W, T, D, DV, LK, LV)  # fmt: skip
                m_i, l_i, acc = _step(ka, va, start, hi, q_t, m_i, l_i, acc, E5M2, W, T, D,
                                      DV, H, V_PAIRS, MMA)  # fmt: skip
                ka, va = _tile(idx_base, k_base, v_base, start + 2 * BLOCK, hi, stride_ks,
                               stride_vs, SLOT_I32, W, T, D, DV, LK, LV)  # fmt: skip
                if start + BLOCK < hi:
                    m_i, l_i, acc = _step(kb, vb, start + BLOCK, hi, q_t, m_i, l_i, acc, E5M2,
                                          W, T, D, DV, H, V_PAIRS, MMA)  # fmt: skip
        else:
            kb, vb = _tile(idx_base, k_base, v_base, lo + BLOCK, hi, stride_ks, stride_vs,
                           SLOT_I32, W, T, D, DV, LK, LV)  # fmt: skip
            for start in range(lo, hi, 3 * BLOCK):
                kc, vc = _tile(idx_base, k_base, v_base, start + 2 * BLOCK, hi, stride_ks,
                               stride_vs, SLOT_I32, W, T, D, DV, LK, LV)  # fmt: skip
                m_i, l_i, acc = _step(ka, va, start, hi, q_t, m_i, l_i, acc, E5M2, W, T, D,
                                      DV, H, V_PAIRS, MMA)  # fmt: skip
                ka, va = _tile(idx_base, k_base, v_base, start + 3 * BLOCK, hi, stride_ks,
                               stride_vs, SLOT_I32, W, T, D, DV, LK, LV)  # fmt: skip
                if start + BLOCK < hi:
                    m_i, l_i, acc = _step(kb, vb, start + BLOCK, hi, q_t, m_i, l_i, acc, E5M2,
                                          W, T, D, DV, H, V_PAIRS, MMA)  # fmt: skip
                kb, vb = _tile(idx_base, k_base, v_base, start + 4 * BLOCK, hi, stride_ks,
                               stride_vs, SLOT_I32, W, T, D, DV, LK, LV)  # fmt: skip
                if start + 2 * BLOCK < hi:
                    m_i, l_i, acc = _step(kc, vc, start + 2 * BLOCK, hi, q_t, m_i, l_i, acc,
                                          E5M2, W, T, D, DV, H, V_PAIRS, MMA)  # fmt: skip
        return m_i, l_i, acc

    @gluon.jit
    def _in_byte_order(x, DV: gl.constexpr, H: gl.constexpr):
        """``[DV, H]`` rows named ``dv`` (see _v_dims) renamed to their bytes' order: row
        ``(DV / 8) g + q`` of the result is row ``8 q + g`` of ``x``."""
        return gl.reshape(gl.permute(gl.reshape(x, [DV // 8, 8, H]), [1, 0, 2]), [DV, H])

    @gluon.jit
    def _prefetch_span(idx_ptr, k_base, v_base, kv_start, lo, hi, num_ids, num_slots,
                       stride_ks, stride_vs, SLOT_I32: gl.constexpr, D: gl.constexpr,
                       DV: gl.constexpr, TOKENS: gl.constexpr, W: gl.constexpr):  # fmt: skip
        """Ask L2 for the K and V rows of tokens ``[lo, lo + TOKENS)`` of ``[lo, hi)`` (slot ids
        from ``kv_start`` in ``kv_indices``), one instruction per 128-byte line, no register
        waiting for the data: ``decode._prefetch_span`` for this kernel's int32 rows. Issued
        before the PDL wait it may read slot ids the grid ahead is still writing, so positions
        and slots are clamped into ``[0, num_ids)`` and ``[0, num_slots)``."""
        LINES: gl.constexpr = max(1, max(D, DV) // 128)  # 128-byte lines of the longer row
        LP: gl.constexpr = gl.BlockedLayout([1, LINES], [32, 1], [W, 1], [1, 0])
        if lo < hi:
            tok = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, LP))
            t = kv_start + lo + gl.minimum(tok, hi - lo - 1)
            ids = gl.load(idx_ptr + gl.minimum(gl.maximum(t, 0), num_ids - 1))
            ids = gl.minimum(gl.maximum(ids, 0), num_slots - 1)
            line = gl.expand_dims(gl.arange(0, LINES, layout=gl.SliceLayout(0, LP)) * 32, 0)
            rows = gl.expand_dims(slot_offsets(ids, SLOT_I32), 1)
            k_ptrs = k_base + rows * stride_ks + gl.minimum(line, D // 4 - 1)
            v_ptrs = v_base + rows * stride_vs + gl.minimum(line, DV // 4 - 1)
            gl.inline_asm_elementwise(_PREFETCH, "=r,l", [k_ptrs], dtype=gl.int32,
                                      is_pure=False, pack=1)  # fmt: skip
            gl.inline_asm_elementwise(_PREFETCH, "=r,l", [v_ptrs], dtype=gl.int32,
                                      is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def _prefetch_item(work_ptr, kv_indptr_ptr, num_splits_ptr, idx_ptr, k_base, v_base, item,
                       batch, num_ids, num_slots, max_splits, stride_ks, stride_vs,
                       SLOT_I32: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                       BLOCK: gl.constexpr, TOKENS: gl.constexpr, W: gl.constexpr):  # fmt: skip
        """:func:`_prefetch_span` of ``item``'s first tokens from its work-list record (the
        record clamped into the batch's items, as the Triton kernel's prefetch does)."""
        packed = _record(work_ptr, item, gl.load(work_ptr))
        packed = gl.minimum(gl.maximum(packed, 0), batch * max_splits - 1)
        _, _, kv_start, lo, hi, _, _ = _item_bounds(
            packed, kv_indptr_ptr, num_splits_ptr, max_splits, BLOCK
        )
        _prefetch_span(idx_ptr, k_base, v_base, kv_start, lo, hi, num_ids, num_slots,
                       stride_ks, stride_vs, SLOT_I32, D, DV, TOKENS, W)  # fmt: skip

    @gluon.jit
    def _issue(k_stage, v_stage, ik, kin, iv, vin, k_base, v_base, stride_ks, stride_vs,
               SLOT_I32: gl.constexpr, W: gl.constexpr, T: gl.constexpr, D: gl.constexpr,
               DV: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr):  # fmt: skip
        """cp.async a step's K and V words into their ring stages, as one group. Each thread
        copies exactly the 16-byte chunks it reads back (the load layouts), so no barrier
        orders a thread's reads after another's copies."""
        _, _, kc = _index3(W, T, D // 4, LK)
        _async_load(k_stage, k_base + slot_offsets(ik, SLOT_I32) * stride_ks + kc,
                    mask=kin & (kc < D // 4))  # fmt: skip
        _, _, vc = _index3(W, T, DV // 4, LV)
        _async_load(v_stage, v_base + slot_offsets(iv, SLOT_I32) * stride_vs + vc,
                    mask=vin & (vc < DV // 4))  # fmt: skip
        async_copy.commit_group()

    @gluon.jit
    def _split_loop_ring(q_t, idx_base, k_base, v_base, lo, hi, stride_ks, stride_vs,
                         E5M2: gl.constexpr, SLOT_I32: gl.constexpr, W: gl.constexpr,
                         T: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, H: gl.constexpr,
                         RING: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr,
                         V_PAIRS: gl.constexpr, SK: gl.constexpr, SV: gl.constexpr,
                         MMA: gl.constexpr):  # fmt: skip
        """:func:`_split_loop` with K/V copied ``RING - 1`` steps ahead into a shared-memory
        ring by cp.async (bytes in flight without registers to hold them), each step read
        back into the same registers the direct loads would fill."""
        BLOCK: gl.constexpr = W * T
        m_i = gl.full([W, H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
        l_i = gl.zeros([W, H], gl.float32, layout=gl.SliceLayout(1, MMA))
        acc = gl.zeros([W, DV, H], gl.float32, layout=MMA)
        k_ring = gl.allocate_shared_memory(gl.int32, [RING, W, T, D // 4], SK)
        v_ring = gl.allocate_shared_memory(gl.int32, [RING, W, T, DV // 4], SV)
        for i in gl.static_range(RING - 1):
            ik, kin = _tile_ids(idx_base, lo + i * BLOCK, hi, W, T, LK)
            iv, vin = _tile_ids(idx_base, lo + i * BLOCK, hi, W, T, LV)
            _issue(k_ring.index(i), v_ring.index(i), ik, kin, iv, vin, k_base, v_base,
                   stride_ks, stride_vs, SLOT_I32, W, T, D, DV, LK, LV)  # fmt: skip
        # slot ids one step ahead of their copies
        ik, kin = _tile_ids(idx_base, lo + (RING - 1) * BLOCK, hi, W, T, LK)
        iv, vin = _tile_ids(idx_base, lo + (RING - 1) * BLOCK, hi, W, T, LV)
        step = 0
        for start in range(lo, hi, BLOCK):
            fill = (step + RING - 1) % RING  # the stage the step before read
            _issue(k_ring.index(fill), v_ring.index(fill), ik, kin, iv, vin, k_base, v_base,
                   stride_ks, stride_vs, SLOT_I32, W, T, D, DV, LK, LV)  # fmt: skip
            ik, kin = _tile_ids(idx_base, start + RING * BLOCK, hi, W, T, LK)
            iv, vin = _tile_ids(idx_base, start + RING * BLOCK, hi, W, T, LV)
            async_copy.wait_group(RING - 1)  # this step's group has landed
            read = step % RING
            kr = k_ring.index(read).load(LK)
            vr = v_ring.index(read).load(LV)
            m_i, l_i, acc = _step(kr, vr, start, hi, q_t, m_i, l_i, acc, E5M2, W, T, D, DV, H,
                                  V_PAIRS, MMA)  # fmt: skip
            step += 1
        async_copy.wait_group(0)  # no copy may land in the ring once it is released
        return m_i, l_i, acc

    @gluon.jit
    def _merge_splits(o_ptr, part_o_ptr, part_lse_ptr, b, head0, n_splits, stride_ob, stride_oh,
                      stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                      GROUP: gl.constexpr, H: gl.constexpr, DV: gl.constexpr,
                      W: gl.constexpr):  # fmt: skip
        """The fused merge: the last split of request ``b`` to finish combines every split's
        partial for its kv head's query heads: the maximum log-sum-exp first, then the
        weighted sum (``decode._merge_group`` takes one pass with a running maximum instead;
        the two agree to rounding). The partials are read past L1 (``.cg``): this SM may hold
        older lines of them."""
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
        h = gl.arange(0, H, layout=gl.SliceLayout(1, layout))
        dv = gl.arange(0, DV, layout=gl.SliceLayout(0, layout))
        mask_h = h < GROUP
        lse_base = part_lse_ptr + b * stride_plb + (head0 + h) * stride_plh
        lse_max = gl.full([H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, layout))
        for split in range(0, n_splits):
            lse = gl.load(lse_base + split, mask=mask_h, other=float("-inf"), cache_modifier=".cg")
            lse_max = gl.maximum(lse_max, lse)
        # Every split empty (seq_len 0): 0 as the reference keeps the exponentials 0, not NaN.
        lse_max = gl.where(lse_max == float("-inf"), 0.0, lse_max)
        denom = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, layout))
        acc = gl.zeros([H, DV], gl.float32, layout=layout)
        po = part_o_ptr + b * stride_pob + gl.expand_dims((head0 + h) * stride_poh, 1)
        po = po + gl.expand_dims(dv, 0)
        for split in range(0, n_splits):
            lse = gl.load(lse_base + split, mask=mask_h, other=float("-inf"), cache_modifier=".cg")
            written = mask_h & (lse > float("-inf"))
            weight = gl.exp2(lse - lse_max)
            denom += gl.where(written, weight, 0.0)
            part = gl.load(
                po + split * stride_pos,
                mask=gl.expand_dims(written, 1) & gl.expand_dims(dv < DV, 0),
                other=0.0,
                cache_modifier=".cg",
            )
            acc += gl.expand_dims(weight, 1) * part
        out = acc / gl.expand_dims(gl.where(denom > 0.0, denom, 1.0), 1)
        gl.store(
            o_ptr + b * stride_ob + gl.expand_dims((head0 + h) * stride_oh, 1)
            + gl.expand_dims(dv, 0),
            out.to(o_ptr.dtype.element_ty),
            mask=gl.expand_dims(mask_h, 1) & gl.expand_dims(dv < DV, 0),
        )  # fmt: skip

    @gluon.jit(do_not_specialize=["max_splits"])
    def _decode_mma_kernel(
        q_ptr, k_ptr, v_ptr, kv_indptr_ptr, kv_indices_ptr, num_splits_ptr, work_ptr,
        part_o_ptr, part_lse_ptr, kv_scales_ptr, o_ptr, arrivals_ptr, qk_scale, max_splits,
        num_kv_heads, stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
        stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
        GROUP: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, W: gl.constexpr,
        T: gl.constexpr, AHEAD: gl.constexpr, FUSED: gl.constexpr, E5M2: gl.constexpr,
        SLOT_I32: gl.constexpr, PDL: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr,
        V_PAIRS: gl.constexpr, LQ: gl.constexpr, RING: gl.constexpr, SK: gl.constexpr,
        SV: gl.constexpr, batch, num_ids, num_slots, PREFETCH: gl.constexpr,
        PF_TOKENS: gl.constexpr, queue_ptr, STEAL: gl.constexpr,
    ):  # fmt: skip
        H: gl.constexpr = 8  # query heads on the mma's N side (the group, zero-padded)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8]
        )
        BLOCK: gl.constexpr = W * T
        # Programs and work items exactly as decode._decode_split_kernel (kv head fastest).
        pid = gl.program_id(0)
        kv_head = pid % num_kv_heads
        programs = gl.num_programs(0) // num_kv_heads
        item = pid // num_kv_heads
        head0 = kv_head * GROUP
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        if PREFETCH:  # the first item's first K/V rows into L2, before the wait
            _prefetch_item(work_ptr, kv_indptr_ptr, num_splits_ptr, kv_indices_ptr, k_base,
                           v_base, item, batch, num_ids, num_slots, max_splits, stride_ks,
                           stride_vs, SLOT_I32, D, DV, BLOCK, PF_TOKENS, W)  # fmt: skip
        pdl_prologue(PDL)
        n_items = gl.load(work_ptr)
        if STEAL:  # the first item from the queue (a guess of it was prefetched above)
            item = gl.atomic_add(queue_ptr + kv_head, 1, sem="relaxed", scope="gpu")
        # q^T [W, D, H] as the B operand (every warp holds it), scaled by sm_scale log2(e)
        # k_scale and rounded to fp16 (clamped to its range). Each thread loads its fragment's
        # D / 4 contiguous values, renamed into K's head-dim order (_k_dims) by reshapes.
        qw, qh, qd = _index3(W, H, D, LQ)
        q_off = (head0 + qh) * stride_qh + qd + qw * 0
        q_mask = (qh < GROUP) & (qd < D) & (qw < W)
        q_scale = qk_scale * gl.load(kv_scales_ptr)
        v_scale = gl.load(kv_scales_ptr + 1)
        # The warps' combined output [DV, H] is stored from [DV (bytes), H]: each thread's
        # rows are DV / 8 contiguous bytes of its heads (see _v_dims).
        OL: gl.constexpr = gl.SliceLayout(0, MMA)
        heads = gl.arange(0, H, layout=gl.SliceLayout(0, OL))
        while item < n_items:
            b, split, kv_start, lo, hi, n_splits, _ = _item_bounds(
                _record(work_ptr, item, n_items), kv_indptr_ptr, num_splits_ptr, max_splits, BLOCK
            )
            if PREFETCH and not STEAL:  # the next item's first K/V, from DRAM during this one
                if item + programs < n_items:
                    _prefetch_item(work_ptr, kv_indptr_ptr, num_splits_ptr, kv_indices_ptr,
                                   k_base, v_base, item + programs, batch, num_ids, num_slots,
                                   max_splits, stride_ks, stride_vs, SLOT_I32, D, DV, BLOCK,
                                   PF_TOKENS, W)  # fmt: skip
            q = gl.load(q_ptr + b * stride_qb + q_off, mask=q_mask, other=0.0)
            q = gl.minimum(gl.maximum(q.to(gl.float32) * q_scale, -65504.0), 65504.0)
            q = gl.permute(_k_dims(q.to(gl.float16), W, H, D), [0, 2, 1])
            q = gl.convert_layout(q, gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
            if RING > 0:
                m_w, l_w, acc_w = _split_loop_ring(
                    q, kv_indices_ptr + kv_start, k_base, v_base, lo, hi, stride_ks, stride_vs,
                    E5M2, SLOT_I32, W, T, D, DV, H, RING, LK, LV, V_PAIRS, SK, SV, MMA,
                )  # fmt: skip
            else:
                m_w, l_w, acc_w = _split_loop(
                    q, kv_indices_ptr + kv_start, k_base, v_base, lo, hi, stride_ks, stride_vs,
                    E5M2, SLOT_I32, W, T, D, DV, H, AHEAD, LK, LV, V_PAIRS, MMA,
                )  # fmt: skip
            # The warps' partial softmaxes combined: [H] max and sum, [DV, H] output.
            m = gl.max(m_w, 0)
            m = gl.where(m == float("-inf"), 0.0, m)
            weight = gl.exp2(m_w - gl.expand_dims(m, 0))  # [W, H]; 0 for warps with nothing
            l_sum = gl.sum(l_w * weight, 0)
            acc = gl.sum(acc_w * gl.expand_dims(weight, 1), 0)  # [DV, H]
            l_o = gl.convert_layout(l_sum, gl.SliceLayout(0, OL))
            m_o = gl.convert_layout(m, gl.SliceLayout(0, OL))
            nonempty = l_o > 0.0
            l_safe = gl.where(nonempty, l_o, 1.0)
            # V / v_scale was stored; the merge is linear, so each split scales its own output.
            out = acc / gl.expand_dims(l_safe, 0) * v_scale
            out = _in_byte_order(out, DV, H)
            # (the heads whose split was not empty, laid out as out)
            rows = gl.expand_dims(gl.arange(0, DV, layout=gl.SliceLayout(1, OL)) < DV, 1)
            written = _in_byte_order(gl.expand_dims(nonempty, 0) & rows, DV, H)
            cols = gl.expand_dims(
                gl.arange(0, DV, layout=gl.SliceLayout(1, out.type.layout)), 1
            )  # fmt: skip
            hs = gl.expand_dims(gl.arange(0, H, layout=gl.SliceLayout(0, out.type.layout)), 0)
            o_mask = (hs < GROUP) & (cols < DV)
            lse = gl.where(nonempty, m_o + gl.log2(l_safe), float("-inf"))
            if FUSED and n_splits == 1:
                gl.store(
                    o_ptr + b * stride_ob + (head0 + hs) * stride_oh + cols,
                    out.to(o_ptr.dtype.element_ty),
                    mask=o_mask,
                )
            else:
                gl.store(
                    part_lse_ptr + b * stride_plb + (head0 + heads) * stride_plh + split, lse,
                    mask=heads < GROUP,
                )  # fmt: skip
                gl.store(
                    part_o_ptr + b * stride_pob + split * stride_pos + (head0 + hs) * stride_poh
                    + cols,
                    out,
                    mask=o_mask & written,
                )  # fmt: skip
                if FUSED:
                    # As decode._split_epilogue: every thread's stores, then one GPU-scope
                    # arrival; the last split to arrive merges and zeroes the counter.
                    _barrier()
                    counter = arrivals_ptr + b * num_kv_heads + kv_head
                    ticket = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                    if ticket == n_splits - 1:
                        _merge_splits(
                            o_ptr, part_o_ptr, part_lse_ptr, b, head0, n_splits, stride_ob,
                            stride_oh, stride_pob, stride_poh, stride_pos, stride_plb,
                            stride_plh, GROUP, H, DV, W,
                        )  # fmt: skip
                        gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            # The next item reuses the combination's shared memory.
            _barrier()
            if STEAL:
                item = gl.atomic_add(queue_ptr + kv_head, 1, sem="relaxed", scope="gpu")
            else:
                item += programs
        if STEAL:
            # Each program has drawn exactly one ticket past the items. The last of this kv
            # head's programs to get here (its release/acquire orders every other draw
            # before it) zeroes the queue for the next launch.
            done = gl.atomic_add(queue_ptr + num_kv_heads + kv_head, 1, sem="acq_rel",
                                 scope="gpu")  # fmt: skip
            if done == programs - 1:
                gl.atomic_xchg(queue_ptr + kv_head, 0, sem="relaxed", scope="gpu")
                gl.atomic_xchg(queue_ptr + num_kv_heads + kv_head, 0, sem="relaxed",
                               scope="gpu")  # fmt: skip


def launch_mma(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_splits: torch.Tensor,
    work: torch.Tensor,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
    kv_scales: torch.Tensor,
    arrivals: torch.Tensor | None,
    qk_scale: float,
    max_splits: int,
    programs: int,
    *,
    slot_i32: bool,
    pdl: dict,
    warps: int | None = None,
    tokens: int | None = None,
    ahead: int | None = None,
    maxnreg: int | None = None,
    ring: int | None = None,
    prefetch: bool = False,
    steal: bool | None = None,
    sms: int = 132,
) -> None:
    """Stage 1 of :func:`execrt.kernels.attention.decode_attention` for an fp8 cache on the
    mma kernel (its checks done; ``programs`` per kv head, the work list built). The launch
    shape defaults to :func:`mma_launch_shape`'s, read at each call. ``prefetch``: ask
    L2 for each item's first K/V rows ahead (the first item's before the PDL wait; see
    ``_triton.pdl_prefetch``). ``steal``: take items from an atomic queue (default
    ``MMA_STEAL``), ``MMA_STEAL_WARPS_PER_SM`` warps on each of ``sms`` SMs."""
    shape = mma_launch_shape(q.shape[0])
    warps = warps or shape[0]
    tokens = tokens or shape[1]
    ahead = ahead or MMA_AHEAD
    maxnreg = maxnreg or shape[2]
    ring = shape[3] if ring is None else ring
    num_kv_heads = k_buffer.shape[1]
    # ``programs`` counts 4-warp programs (decode_programs); smaller ones come in more, as
    # many as there are work items.
    steal = MMA_STEAL if steal is None else steal
    if steal:
        programs = steal_programs(q.shape[0], max_splits, num_kv_heads, warps, sms)
    else:
        programs = min(q.shape[0] * max_splits, programs * max(1, 4 // warps))
    lk, lv, lvp, lq, sk, sv = mma_layouts(warps, tokens, q.shape[-1], v_buffer.shape[-1])
    _decode_mma_kernel[(programs * num_kv_heads,)](
        q, k_buffer.view(torch.int32), v_buffer.view(torch.int32), kv_indptr, kv_indices,
        num_splits, work, partial_o, partial_lse, kv_scales, o,
        work if arrivals is None else arrivals, qk_scale, max_splits, num_kv_heads,
        q.stride(0), q.stride(1), k_buffer.stride(0) // 4, k_buffer.stride(1) // 4,
        v_buffer.stride(0) // 4, v_buffer.stride(1) // 4, partial_o.stride(0),
        partial_o.stride(1), partial_o.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), o.stride(0), o.stride(1),
        GROUP=q.shape[1] // num_kv_heads, D=q.shape[-1], DV=v_buffer.shape[-1], W=warps,
        T=tokens, AHEAD=ahead, FUSED=arrivals is not None,
        E5M2=k_buffer.dtype == torch.float8_e5m2, SLOT_I32=slot_i32, LK=lk, LV=lv,
        V_PAIRS=lvp, LQ=lq, RING=ring, SK=sk, SV=sv, batch=q.shape[0],
        num_ids=max(1, kv_indices.numel()), num_slots=k_buffer.shape[0],
        PREFETCH=prefetch and kv_indices.numel() > 0,
        PF_TOKENS=mma_prefetch_tokens(warps, tokens, ring),
        queue_ptr=steal_queue(q.device, num_kv_heads) if steal else work, STEAL=steal,
        num_warps=warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}), **pdl,
    )  # fmt: skip


__all__ = [
    "MMA_HEAD_DIMS",
    "MMA_MAX_GROUP",
    "launch_mma",
    "mma_launch_shape",
    "mma_layouts",
    "mma_resident",
    "mma_shared_bytes",
    "mma_prefetch_tokens",
    "mma_unsupported",
    "steal_programs",
    "steal_queue",
]
