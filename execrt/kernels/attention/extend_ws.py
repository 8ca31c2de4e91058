"""Warp-specialised extend kernel for Hopper, written in Gluon (``kernel="ws"``).

The Triton extend kernels (:mod:`execrt.kernels.attention.extend`) run one instruction stream
per program: each K/V block's gather, both wgmmas and the softmax take turns, and Triton
3.6's automatic warp specialisation leaves such a loop unpartitioned on sm90 (see
docs/kernels.md). FlashAttention-3 gets its last third from splitting the program into
warp groups with separate jobs. This kernel does that with Gluon's explicit partitions:

- **producer** (``LOAD_WARPS`` warps, few registers): walks the tile's context blocks,
  loads each block's slot ids one block ahead, and gathers the K and V rows with ``cp.async``
  into a ring of ``STAGES`` shared-memory buffers. Every producer thread signals a block's
  K (then V) buffer full with ``cp.async.mbarrier.arrive.noinc``, which fires once that
  thread's copies have landed, so the barrier completes when all of them have.
- **consumers** (two partitions of one warp group each, ``num_warps`` 8 in all; the first is
  the default partition): each takes its own 64 rows of the 128-row query tile (one wgmma
  row block of 16 rows per warp), holds them in shared memory, and per block runs ``S =
  Q K^T`` (async wgmma, K read transposed from shared memory), the online softmax in
  registers (exp2, scale folded in, masks only on the diagonal blocks), and ``O += P V``
  with P fed from registers. The ``P V`` product of block ``j`` runs on the tensor cores
  while the softmax of block ``j + 1`` runs on the ALUs (``OVERLAP``): QK of block j+1 is
  issued first, then PV of block j, and the first wait returns the scores while PV is still
  in flight. The two warp groups are separate partitions, so they drift apart and one's
  softmax overlaps the other's wgmmas (FA3's two consumer warp groups), and neither waits at
  the barrier Triton puts after a wgmma wait spanning two warp groups. Every consumer thread
  releases a buffer once its wgmmas that read it are done; a buffer is refilled once every
  consumer thread has released it.

Tiles and the schedule are the gather kernel's: a tile is ``BLOCK_M // HEADS`` consecutive
new tokens times ``HEADS`` query heads of one kv head, and the tiles run (request, head block)
pairs in L2-sized chunks, longest tiles first: one program per tile, or (``persistent``) one
per SM taking every ``num_programs``-th tile, the ring's block count (``ring``) carrying on
from tile to tile so that the producer gathers the next tile while the consumers finish this
one. The context comes from the cache through its slot ids (page size 1), prefix and new
tokens alike.

Scope: CUDA sm90 with Gluon (triton >= 3.6), q and cache in fp16 or bf16 (no fp8 cache),
equal power-of-two head dims 64 or 128 for K and V. Gluon kernels do not run under the
Triton interpreter; :func:`ws_unsupported` says why a call cannot run here, and
:mod:`execrt.kernels.attention.extend` keeps the other kernels for those calls.
"""

# (No ``from __future__ import annotations``: Gluon's aggregates check their fields against the
# annotations' types at run time, so those must be types, not strings.)
import torch

from execrt.kernels._triton import cuda_capability, interpreter_enabled, sm_count
from execrt.kernels.attention.common import int32_slot_offsets

try:  # Gluon: triton >= 3.5 (the H200 runs 3.6)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # cp.async into shared memory: ``async_copy_global_to_shared`` in triton 3.6 (the H200's),
    # renamed ``async_load`` by 3.9 (the same arguments).
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    from triton.language.core import _aggregate as aggregate

    GLUON_IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the installed triton
    GLUON_IMPORT_ERROR = f"this triton has no Gluon ({exc})"

WS_HEAD_DIMS = (64, 128)
WS_DTYPES = (torch.float16, torch.bfloat16)
# Producer side: one warp group gathering with cp.async. 56 registers hold a 128 x 128 block's
# row offsets and masks, spilling only the loop-carried ids (sm90 AOT, triton 3.6: 12 spill
# instructions at 56, 54 at 40); 8 consumer warps then keep 224 registers each (65,536 per
# SM over 12 warps).
LOAD_WARPS = 4
LOAD_REGS = 56
# A second consumer warp group, a partition of its own, asks for 224 registers: with the
# producer's 56 that leaves the first (default) partition up to 232 of 512 per thread slot.
CONSUMER_REGS = 224
SHARED_MEMORY_PER_SM = 227 * 1024  # what one sm90 program may hold


def gluon_on_sm90() -> bool:
    """Whether this machine runs the kernel at all: Gluon, a CUDA device of compute
    capability 9.x, and not the Triton interpreter."""
    return (
        GLUON_IMPORT_ERROR is None
        and torch.cuda.is_available()
        and not interpreter_enabled()
        and cuda_capability(torch.device("cuda"))[0] == 9
    )


def ws_unsupported(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_scales: object,
    head_dim: int,
    head_dim_v: int,
) -> str | None:
    """Why the warp-specialised kernel cannot run this call, or None when it can."""
    if GLUON_IMPORT_ERROR is not None:
        return GLUON_IMPORT_ERROR
    if q.device.type != "cuda" or interpreter_enabled():
        return "it is a Gluon kernel: CUDA only, never the Triton interpreter"
    if cuda_capability(q.device)[0] != 9:
        major, minor = cuda_capability(q.device)
        return f"sm{major}{minor} (it uses Hopper's wgmma: sm90 only)"
    if q.dtype not in WS_DTYPES or k_buffer.dtype != q.dtype or kv_scales is not None:
        return f"q {q.dtype} / cache {k_buffer.dtype} (it reads fp16 or bf16 caches in q's dtype)"
    if head_dim != head_dim_v or head_dim not in WS_HEAD_DIMS:
        return f"head dims {head_dim}/{head_dim_v} (it takes equal head dims in {WS_HEAD_DIMS})"
    if not int32_slot_offsets(k_buffer, v_buffer):
        return "a cache of 2^31 elements or more (its row offsets are int32)"
    return None


if GLUON_IMPORT_ERROR is None:

    @aggregate
    class _Schedule:
        """The tiles and their order (the gather kernel's): what both partitions read to know
        which tile comes next (a worker partition takes no tensors from the default one)."""

        qo_indptr_ptr: gl.tensor
        kv_indptr_ptr: gl.tensor
        prefix_lens_ptr: gl.tensor
        num_m_tiles: gl.tensor
        num_head_blocks: gl.tensor
        num_pairs: gl.tensor
        pairs_per_chunk: gl.tensor
        GROUP: gl.constexpr
        HEADS: gl.constexpr
        BLOCK_M: gl.constexpr
        BLOCK_N: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, qo_indptr_ptr, kv_indptr_ptr, prefix_lens_ptr, num_m_tiles,
                     num_head_blocks, num_pairs, pairs_per_chunk, GROUP, HEADS, BLOCK_M,
                     BLOCK_N):  # fmt: skip
            self.qo_indptr_ptr = qo_indptr_ptr
            self.kv_indptr_ptr = kv_indptr_ptr
            self.prefix_lens_ptr = prefix_lens_ptr
            self.num_m_tiles = num_m_tiles
            self.num_head_blocks = num_head_blocks
            self.num_pairs = num_pairs
            self.pairs_per_chunk = pairs_per_chunk
            self.GROUP = gl.constexpr(GROUP)
            self.HEADS = gl.constexpr(HEADS)
            self.BLOCK_M = gl.constexpr(BLOCK_M)
            self.BLOCK_N = gl.constexpr(BLOCK_N)

    @aggregate
    class _Ring:
        """The K/V ring: ``STAGES`` K and V buffers and their barriers (ready: filled by the
        producer; empty: released by every consumer thread)."""

        k_bufs: gl.shared_memory_descriptor
        v_bufs: gl.shared_memory_descriptor
        k_ready: gl.shared_memory_descriptor
        v_ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        STAGES: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, k_bufs, v_bufs, k_ready, v_ready, empty, STAGES):
            self.k_bufs = k_bufs
            self.v_bufs = v_bufs
            self.k_ready = k_ready
            self.v_ready = v_ready
            self.empty = empty
            self.STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def _ws_tile(tile, sched):
        """Tile ``tile`` of the schedule, as the gather kernel's ``_tile_coords`` /
        ``_tile_rows`` give its program: ``(head0, kv_head, q_start, extend_len, kv_start,
        prefix, tok0, kv_hi, full_hi)``. Context ``[0, full_hi)`` is seen by every row (whole
        blocks), ``[full_hi, kv_hi)`` holds the diagonal; a tile past its request's new
        tokens has ``kv_hi = 0``."""
        TOKENS: gl.constexpr = sched.BLOCK_M // sched.HEADS
        pairs_per_chunk = sched.pairs_per_chunk
        chunk_programs = pairs_per_chunk * sched.num_m_tiles
        chunk = tile // chunk_programs
        local = tile - chunk * chunk_programs
        first_pair = chunk * pairs_per_chunk
        width = gl.minimum(pairs_per_chunk, sched.num_pairs - first_pair)
        m_tile = sched.num_m_tiles - 1 - local // width
        pair = first_pair + local % width
        b = pair // sched.num_head_blocks
        head0 = (pair - b * sched.num_head_blocks) * sched.HEADS
        kv_head = head0 // sched.GROUP
        q_start = gl.load(sched.qo_indptr_ptr + b).to(gl.int32)
        extend_len = gl.load(sched.qo_indptr_ptr + b + 1).to(gl.int32) - q_start
        kv_start = gl.load(sched.kv_indptr_ptr + b).to(gl.int32)
        kv_len = gl.load(sched.kv_indptr_ptr + b + 1).to(gl.int32) - kv_start
        prefix = gl.load(sched.prefix_lens_ptr + b).to(gl.int32)
        tok0 = m_tile * TOKENS
        last_tok = gl.minimum(tok0 + TOKENS, extend_len) - 1
        kv_hi = gl.minimum(prefix + last_tok + 1, kv_len)
        full_hi = gl.minimum(prefix + tok0 + 1, kv_hi) // sched.BLOCK_N * sched.BLOCK_N
        if tok0 >= extend_len:
            kv_hi = 0
            full_hi = 0
        return head0, kv_head, q_start, extend_len, kv_start, prefix, tok0, kv_hi, full_hi

    @gluon.constexpr_function
    def _row_layout(rows, head_dim, warps):
        """Rows of ``head_dim`` 16-bit values in 16-byte pieces: a warp covers whole rows."""
        lanes_d = min(32, head_dim // 8)
        return gl.BlockedLayout([1, 8], [32 // lanes_d, lanes_d], [warps, 1], [1, 0])

    @gluon.jit
    def _ws_producer(
        k_ptr, v_ptr, kv_indices_ptr, stride_ks, stride_kh, stride_vs, stride_vh, sched,
        ring_bufs, HEAD_DIM: gl.constexpr, LOAD_WARPS: gl.constexpr,
    ):  # fmt: skip
        """Gather the context blocks of this program's tiles into the ring (see the module
        docstring). ``ring`` counts the blocks passed through the ring, across tiles: block
        ``ring`` goes into buffer ``ring % STAGES``, on that buffer's lap ``ring // STAGES``."""
        BLOCK_N: gl.constexpr = sched.BLOCK_N
        STAGES: gl.constexpr = ring_bufs.STAGES
        layout: gl.constexpr = _row_layout(BLOCK_N, HEAD_DIM, LOAD_WARPS)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        ring = 0
        for tile in range(gl.program_id(0), sched.num_pairs * sched.num_m_tiles,
                          gl.num_programs(0)):  # fmt: skip
            _h, kv_head, _qs, _el, kv_start, _p, _t, kv_hi, _f = _ws_tile(tile, sched)
            k_base = k_ptr + kv_head.to(gl.int64) * stride_kh
            v_base = v_ptr + kv_head.to(gl.int64) * stride_vh
            idx_base = kv_indices_ptr + kv_start
            # Slot ids run one block ahead: a block's copies never wait for its own id load.
            ids = gl.load(idx_base + offs_n, mask=offs_n < kv_hi, other=0)
            n_blocks = gl.cdiv(kv_hi, BLOCK_N)
            for j in range(n_blocks):
                start = j * BLOCK_N
                nxt = start + BLOCK_N + offs_n
                ids_next = gl.load(idx_base + nxt, mask=nxt < kv_hi, other=0)
                stage = (ring + j) % STAGES
                # Fresh barriers count as a completed phase 1: the first lap does not wait.
                mbarrier.wait(ring_bufs.empty.index(stage), (((ring + j) // STAGES) & 1) ^ 1)
                rows = ids.to(gl.int32)[:, None]  # the host checks the cache is < 2^31 elements
                # Rows past the context are zero-filled: p = 0 times a NaN would be NaN.
                in_kv = ((start + offs_n) < kv_hi)[:, None]
                _async_load(
                    ring_bufs.k_bufs.index(stage), k_base + rows * stride_ks + offs_d[None, :],
                    mask=in_kv,
                )  # fmt: skip
                async_copy.mbarrier_arrive(ring_bufs.k_ready.index(stage), increment_count=False)
                _async_load(
                    ring_bufs.v_bufs.index(stage), v_base + rows * stride_vs + offs_d[None, :],
                    mask=in_kv,
                )  # fmt: skip
                async_copy.mbarrier_arrive(ring_bufs.v_ready.index(stage), increment_count=False)
                ids = ids_next
            ring += n_blocks
        # Let the last copies land before these warps retire.
        async_copy.commit_group()
        async_copy.wait_group(0)

    @gluon.jit
    def _ws_scores(q_smem, ring_bufs, ring, zero_s):
        """Issue ``S = Q K^T`` for the ring's block ``ring`` once its K has landed (async;
        returns the token)."""
        stage = ring % ring_bufs.STAGES
        mbarrier.wait(ring_bufs.k_ready.index(stage), (ring // ring_bufs.STAGES) & 1)
        fence_async_shared()  # cp.async wrote through the generic proxy, wgmma reads async
        k_t = ring_bufs.k_bufs.index(stage).permute((1, 0))
        return warpgroup_mma(q_smem, k_t, zero_s, use_acc=False, is_async=True)

    @gluon.jit
    def _ws_pv(p16, acc, ring_bufs, ring):
        """Issue ``O += P V`` for the ring's block ``ring`` once its V has landed (async)."""
        stage = ring % ring_bufs.STAGES
        mbarrier.wait(ring_bufs.v_ready.index(stage), (ring // ring_bufs.STAGES) & 1)
        fence_async_shared()
        return warpgroup_mma(p16, ring_bufs.v_bufs.index(stage), acc, is_async=True)

    @gluon.jit
    def _ws_softmax(s, m_i, l_i, qk_scale, j, full_blocks, q_pos, offs_ns, kv_hi,
                    BLOCK_N: gl.constexpr):  # fmt: skip
        """Fold block j's scores into the running max and sum: ``(p, alpha, m_i, l_i)``.
        Whole blocks skip the mask (the scale then goes in after the row max)."""
        if j < full_blocks:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
        else:
            cols = j * BLOCK_N + offs_ns
            visible = (cols[None, :] <= q_pos[:, None]) & (cols < kv_hi)[None, :]
            s = gl.where(visible, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _ws_consumer(q_ptr, o_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, q_smem,
                     sched, ring_bufs, HEAD_DIM: gl.constexpr, OVERLAP: gl.constexpr,
                     ROW0: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
        """Rows ``[ROW0, ROW0 + 16 WARPS)`` of each of this program's query tiles, reading
        the ring in the producer's order (``ring``: blocks passed so far)."""
        ring = 0
        for tile in range(gl.program_id(0), sched.num_pairs * sched.num_m_tiles,
                          gl.num_programs(0)):  # fmt: skip
            head0, _kvh, q_start, extend_len, _ks, prefix, tok0, kv_hi, full_hi = _ws_tile(
                tile, sched
            )
            n_blocks = gl.cdiv(kv_hi, sched.BLOCK_N)
            if n_blocks > 0:
                _ws_attend(
                    q_ptr, o_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, q_smem,
                    sched, ring_bufs, head0, q_start, extend_len, prefix, tok0, kv_hi, full_hi,
                    n_blocks, ring, HEAD_DIM, OVERLAP, ROW0, WARPS,
                )  # fmt: skip
            ring += n_blocks

    @gluon.jit
    def _ws_attend(
        q_ptr, o_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, q_smem, sched,
        ring_bufs, head0, q_start, extend_len, prefix, tok0, kv_hi, full_hi, n_blocks, ring,
        HEAD_DIM: gl.constexpr, OVERLAP: gl.constexpr, ROW0: gl.constexpr, WARPS: gl.constexpr,
    ):  # fmt: skip
        """One query tile's rows ``[ROW0, ROW0 + 16 WARPS)`` over its ``n_blocks`` context
        blocks, which are the ring's blocks ``ring ..``: the flash-attention loop of the module
        docstring, then the output rows."""
        HEADS: gl.constexpr = sched.HEADS
        BLOCK_N: gl.constexpr = sched.BLOCK_N
        TOKENS: gl.constexpr = sched.BLOCK_M // HEADS
        ROWS: gl.constexpr = 16 * WARPS
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_layout: gl.constexpr = _row_layout(ROWS, HEAD_DIM, WARPS)

        # The query tile: row r is token tok0 + r // HEADS, head head0 + r % HEADS. (The
        # previous tile's wgmmas that read q_smem are done: each was waited for.)
        offs_r = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
        tok = tok0 + offs_r // HEADS
        row_ok = (offs_r < TOKENS * HEADS) & (tok < extend_len)
        rows = (q_start + tok).to(gl.int64)
        heads = head0 + offs_r % HEADS
        q = gl.load(
            q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        q_smem.store(q)
        fence_async_shared()

        offs_rs = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        offs_ns = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        q_pos = prefix + tok0 + offs_rs // HEADS  # the row sees context j <= q_pos
        full_blocks = full_hi // BLOCK_N
        zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        empty = ring_bufs.empty
        STAGES: gl.constexpr = ring_bufs.STAGES

        # Block 0 (position 0, seen by every row: m_i is finite from here on).
        s = warpgroup_mma_wait(0, deps=(_ws_scores(q_smem, ring_bufs, ring, zero_s),))
        p, alpha, m_i, l_i = _ws_softmax(
            s, m_i, l_i, qk_scale, 0, full_blocks, q_pos, offs_ns, kv_hi, BLOCK_N
        )
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_blocks):
            prev = ring + j - 1  # the block whose P V is due
            if OVERLAP:
                # QK of block j first, then PV of block j - 1: wgmmas complete in order, so
                # the first wait returns S while P V still runs under the softmax.
                s_tok = _ws_scores(q_smem, ring_bufs, ring + j, zero_s)
                o_tok = _ws_pv(p16, acc, ring_bufs, prev)
                s = warpgroup_mma_wait(1, deps=(s_tok,))
                p, alpha, m_i, l_i = _ws_softmax(
                    s, m_i, l_i, qk_scale, j, full_blocks, q_pos, offs_ns, kv_hi, BLOCK_N
                )
                acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
            else:
                acc = warpgroup_mma_wait(0, deps=(_ws_pv(p16, acc, ring_bufs, prev),))
                s = warpgroup_mma_wait(0, deps=(_ws_scores(q_smem, ring_bufs, ring + j, zero_s),))
                p, alpha, m_i, l_i = _ws_softmax(
                    s, m_i, l_i, qk_scale, j, full_blocks, q_pos, offs_ns, kv_hi, BLOCK_N
                )
            # Block j - 1's K and V are read: hand its buffer back (every thread).
            async_copy.mbarrier_arrive(empty.index(prev % STAGES), increment_count=False)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p16 = gl.convert_layout(p.to(dtype), p_layout)
        last = ring + n_blocks - 1
        acc = warpgroup_mma_wait(0, deps=(_ws_pv(p16, acc, ring_bufs, last),))
        async_copy.mbarrier_arrive(empty.index(last % STAGES), increment_count=False)

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
        offs_ro = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        offs_do = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        tok_o = tok0 + offs_ro // HEADS
        ok_o = (offs_ro < TOKENS * HEADS) & (tok_o < extend_len)
        gl.store(
            o_ptr + (q_start + tok_o).to(gl.int64)[:, None] * stride_ot
            + (head0 + offs_ro % HEADS)[:, None] * stride_oh + offs_do[None, :],
            out.to(dtype),
            mask=ok_o[:, None],
        )  # fmt: skip

    @gluon.jit(do_not_specialize=["num_m_tiles", "num_head_blocks", "num_pairs", "pairs_per_chunk"])
    def _extend_ws_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
        prefix_lens_ptr, qk_scale, num_m_tiles, num_head_blocks, num_pairs, pairs_per_chunk,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
        GROUP: gl.constexpr, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        OVERLAP: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        # Two consumer partitions of num_warps (4) warps, one warp group each, take ROWS query
        # rows each: the default partition the first, a worker the second (module docstring).
        ROWS: gl.constexpr = BLOCK_M // 2
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        kv_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_smem_layout)
        barrier: gl.constexpr = mbarrier.MBarrierLayout()
        ring_bufs = _Ring(
            gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_smem),
            gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_smem),
            gl.allocate_shared_memory(gl.int64, [STAGES, 1], barrier),
            gl.allocate_shared_memory(gl.int64, [STAGES, 1], barrier),
            gl.allocate_shared_memory(gl.int64, [STAGES, 1], barrier),
            STAGES,
        )
        for i in gl.static_range(STAGES):
            # Every thread of a side arrives once per use (cp.async.mbarrier.arrive.noinc).
            mbarrier.init(ring_bufs.k_ready.index(i), count=LOAD_WARPS * 32)
            mbarrier.init(ring_bufs.v_ready.index(i), count=LOAD_WARPS * 32)
            mbarrier.init(ring_bufs.empty.index(i), count=2 * num_warps * 32)
        sched = _Schedule(
            qo_indptr_ptr, kv_indptr_ptr, prefix_lens_ptr, num_m_tiles, num_head_blocks,
            num_pairs, pairs_per_chunk, GROUP, HEADS, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        gl.warp_specialize([
            (_ws_consumer, (q_ptr, o_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                            q_smem.index(0), sched, ring_bufs, HEAD_DIM, OVERLAP, 0, num_warps)),
            (_ws_consumer, (q_ptr, o_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                            q_smem.index(1), sched, ring_bufs, HEAD_DIM, OVERLAP, ROWS,
                            num_warps)),
            (_ws_producer, (k_ptr, v_ptr, kv_indices_ptr, stride_ks, stride_kh, stride_vs,
                            stride_vh, sched, ring_bufs, HEAD_DIM, LOAD_WARPS)),
        ], [num_warps, LOAD_WARPS], [CONSUMER_REGS, LOAD_REGS])  # fmt: skip


def ws_shared_memory(
    block_m: int, block_n: int, num_stages: int, head_dim: int, elem_bytes: int
) -> int:
    """Bytes of shared memory a program holds: the query tile and a K and a V buffer per
    stage (the barriers add a few bytes)."""
    return (block_m + 2 * num_stages * block_n) * head_dim * elem_bytes


def ws_tiles_unsupported(
    block_m: int, block_n: int, num_warps: int, num_stages: int, head_dim: int, elem_bytes: int
) -> str | None:
    """Why these tiles cannot run the warp-specialised kernel, or None when they can: two
    consumer warp groups (``num_warps`` 8) of 64 query rows each, one wgmma row block
    (``block_m`` 128; 128 rows per group spilled in sm90 compiles), a K/V block is one wgmma N
    (<= 256), and the ring and the query tile must fit Hopper's 227 KB of shared memory."""
    if num_warps != 8 or block_m != 128:
        return f"num_warps {num_warps} / block_m {block_m} (8 warps, 128 rows: two groups of 64)"
    if not 16 <= block_n <= 256 or num_stages < 2:
        return f"block_n {block_n} / num_stages {num_stages} (16-256 tokens, >= 2 stages)"
    smem = ws_shared_memory(block_m, block_n, num_stages, head_dim, elem_bytes)
    if smem > SHARED_MEMORY_PER_SM:
        return f"{smem // 1024} KB of shared memory (Hopper has 227 KB)"
    return None


def launch_ws(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    qk_scale: float,
    schedule: tuple[int, int, int, int],
    *,
    group: int,
    heads: int,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    persistent: bool = False,
    overlap: bool = True,
) -> None:
    """Launch the kernel over ``schedule = (num_m_tiles, num_head_blocks, num_pairs,
    pairs_per_chunk)`` (the gather kernel's tiles and order): one program per tile, or with
    ``persistent`` as many as fit on the GPU at once, each taking every ``programs``-th tile
    of the order. The caller has checked the call with :func:`ws_unsupported` and
    :func:`ws_tiles_unsupported`."""
    num_m_tiles, num_head_blocks, num_pairs, pairs_per_chunk = schedule
    tiles = num_pairs * num_m_tiles
    programs = tiles
    if persistent:
        smem = ws_shared_memory(block_m, block_n, num_stages, q.shape[2], q.element_size())
        programs = min(tiles, sm_count(q.device) * max(1, SHARED_MEMORY_PER_SM // smem))
    _extend_ws_kernel[(programs,)](
        q, k_buffer, v_buffer, o, qo_indptr, kv_indptr, kv_indices, prefix_lens, qk_scale,
        num_m_tiles, num_head_blocks, num_pairs, pairs_per_chunk, q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        o.stride(0), o.stride(1), GROUP=group, HEADS=heads, HEAD_DIM=q.shape[2],
        BLOCK_M=block_m, BLOCK_N=block_n, STAGES=num_stages, LOAD_WARPS=LOAD_WARPS,
        LOAD_REGS=LOAD_REGS, CONSUMER_REGS=CONSUMER_REGS, OVERLAP=overlap,
        num_warps=num_warps // 2,
    )  # fmt: skip
