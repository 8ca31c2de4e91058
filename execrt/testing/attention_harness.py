"""Attention scenarios: a poisoned slot cache, requests, one step's batch, and its checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from execrt.core.batch import ForwardBatch, ForwardMode, padded_decode_batch
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import (
    AttentionBackend,
    AttentionBackendInit,
    AttentionLayer,
    AttentionStep,
    QKPrologue,
)
from execrt.core.kv_quant import K_INV_SCALE, V_INV_SCALE, KVScales, store
from execrt.core.memory import KVCache, ReqToTokenPool
from execrt.core.plugins import BackendSpec
from execrt.core.runners import InputBuffers
from execrt.testing.oracles import attention_oracle, compare, qk_prologue_oracle

# Slots no request owns hold this value: a backend that reads them without masking sees
# scores that swamp the softmax, so its output is visibly wrong. Finite on purpose: reading a
# slot and then masking it out is allowed, and NaN * 0 would punish that.
POISON = 100.0
# Entries of a request row past its length point at poisoned slots, as stale rows would.
TAIL = 8


@dataclass(frozen=True)
class Step:
    """One forward step: per request a cached prefix and new tokens, plus options."""

    mode: str  # "decode" or "extend"
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    padded_rows: int = 0  # decode rows appended as graph padding does (row 0 / slot 0)
    permuted: bool = False  # slots scattered at random over the cache
    # Continues the previous step's requests in its rows, as an engine's next step does: each
    # request's prefix is what it held (its K/V stay in place) and only its new tokens take
    # slots, written after its last one in its row. ``fresh``: batch positions where a new
    # request has taken over the finished one's row (new slots for all of its tokens).
    continues: bool = False
    fresh: tuple[int, ...] = ()
    # Multiplies this step's new queries: at 50 the largest logits pass 100, where exp
    # overflows in fp32 (past 88.7) and fp16 (past 11.1), so a softmax without its row
    # maximum gives inf or NaN (random q and k alone keep logits within a few units).
    q_scale: float = 1.0

    @staticmethod
    def decode(context_lens: Sequence[int], **options: Any) -> Step:
        lens = tuple(context_lens)
        return Step("decode", tuple(n - 1 for n in lens), (1,) * len(lens), **options)

    @staticmethod
    def extend(prefix_lens: Sequence[int], extend_lens: Sequence[int], **options: Any) -> Step:
        return Step("extend", tuple(prefix_lens), tuple(extend_lens), **options)

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    @property
    def num_slots(self) -> int:
        return sum(self.prefix_lens) + sum(self.extend_lens)

    @property
    def max_context(self) -> int:
        return max(
            (p + n for p, n in zip(self.prefix_lens, self.extend_lens, strict=True)), default=0
        )


@dataclass(frozen=True)
class Geometry:
    num_kv_heads: int
    gqa_ratio: int
    head_dim: int
    num_layers: int = 1

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.gqa_ratio


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class Prepared:
    """A step ready to run: the batch, per-layer q/k/v, and what the oracle needs."""

    step: Step
    fb: ForwardBatch
    qkv: list[QKV]  # per layer, padded rows last
    rows: list[int]
    num_real_tokens: int
    real_locs: torch.Tensor  # [T_real] int64 (device)
    table: torch.Tensor  # req_to_token as laid out, to catch a backend that edits it
    graph: bool = False
    # The batch's tensors and host lists as laid out, to catch a backend that writes into them
    batch: dict[str, Any] = field(default_factory=dict)
    #: inputs the backend wrote into (q, k, v are read-only), found by ``attend_layers``
    input_writes: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    max_error: float = 0.0
    problems: list[str] = field(default_factory=list)
    max_exact_error: float = 0.0  # fp8 cache: against the unquantized K/V

    def add(self, other: Outcome) -> None:
        """Fold in one more check's outcome: the worst errors, every problem."""
        self.max_error = max(self.max_error, other.max_error)
        self.max_exact_error = max(self.max_exact_error, other.max_exact_error)
        self.problems += other.problems


class AttentionHarness:
    """Owns the pools, the cache (and an independent mirror of what it must hold), the backend.

    The cache starts poisoned (slot 0, the padding slot, is zero). Every step takes fresh
    slots, so earlier steps' K/V stay in place; request rows are reused at random, leaving
    stale entries behind as a long-running server does.

    With ``kv_dtype`` fp8 the cache stores ``kv_quant.store``'s bytes with ``scales`` (per
    layer) and the mirror holds those bytes; ``exact_k`` / ``exact_v`` keep the same K/V in
    the model dtype, what a cache of that dtype would hold, to measure what fp8 costs.
    """

    def __init__(
        self,
        spec: BackendSpec,
        device: str,
        dtype: torch.dtype,
        geometry: Geometry,
        *,
        max_reqs: int,
        max_context_len: int,
        cache_slots: int,
        seed: int,
        graph_max_bs: int = 0,
        options: Mapping[str, Any] | None = None,
        kv_dtype: torch.dtype | None = None,
        scales: KVScales | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.geo = geometry
        self.gen = torch.Generator().manual_seed(seed)
        g = geometry
        self.pool = ReqToTokenPool(max_reqs, max_context_len, self.device)
        kv_dtype = kv_dtype or dtype
        self.kv = KVCache(
            cache_slots, g.num_layers, g.num_kv_heads, g.head_dim, kv_dtype, self.device
        )
        if scales is not None:
            self.kv.set_scales(scales)
        for buf in (*self.kv.k_buffers, *self.kv.v_buffers):
            buf.fill_(POISON)
            buf[0] = 0
        self.mirror_k = [b.clone() for b in self.kv.k_buffers]
        self.mirror_v = [b.clone() for b in self.kv.v_buffers]
        self.exact_k, self.exact_v = self.mirror_k, self.mirror_v
        if kv_dtype != dtype:
            self.exact_k = [b.to(dtype) for b in self.mirror_k]
            self.exact_v = [b.to(dtype) for b in self.mirror_v]
        self.free = list(range(1, cache_slots + 1))
        self.last: tuple[list[int], list[int]] | None = None  # the last step's rows, lengths
        # Not head_dim ** -0.5: a backend must use the layer's scaling, not its own guess.
        scaling = 0.9 * g.head_dim**-0.5
        self.layers = [
            AttentionLayer(i, g.num_q_heads, g.num_kv_heads, g.head_dim, g.head_dim, scaling)
            for i in range(g.num_layers)
        ]
        self.context = RuntimeContext()
        init = AttentionBackendInit.over_cache(
            spec.capabilities,
            self.kv,
            self.pool,
            num_q_heads=g.num_q_heads,
            max_batch_size=max(max_reqs, graph_max_bs),
            context=self.context,
            dtype=dtype,
            options=options,
        )
        self.backend: AttentionBackend = spec.create(init)
        self.static: InputBuffers | None = None
        if graph_max_bs:
            self.backend.init_graph_state(graph_max_bs, graph_max_bs)
            self.static = InputBuffers(graph_max_bs, graph_max_bs, self.device)

    def close(self) -> None:
        self.backend.close()
        self.context.close()

    # -- building a step ------------------------------------------------------------------------
    def _randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        values = torch.randn(shape, generator=self.gen) * scale  # x 1.0 is exact
        return values.to(self.dtype).to(self.device)

    def _take_slots(self, n: int, permuted: bool) -> list[int]:
        if permuted:
            picks = torch.randperm(len(self.free), generator=self.gen)[:n].tolist()
            chosen = [self.free[i] for i in picks]
        else:
            chosen = self.free[:n]
        taken = set(chosen)
        self.free = [s for s in self.free if s not in taken]
        return chosen

    def prepare(
        self, step: Step, *, graph: bool = False, reuse: Prepared | None = None
    ) -> Prepared:
        """Lay out ``step``'s requests in the pool and cache and build its ForwardBatch.

        ``graph``: the int inputs go into the static buffers (as a graph runner does).
        ``reuse``: write this step's q/k/v into that step's tensors (same shapes; for replay).
        """
        rows, fb, real_locs = self._lay_out(step, graph)
        qkv = self._new_qkv(fb.num_tokens, reuse, q_scale=step.q_scale)
        self._store_new_kv(qkv, real_locs)
        table = self.pool.req_to_token.clone()
        return Prepared(
            step, fb, qkv, rows, real_locs.numel(), real_locs, table, graph, batch_snapshot(fb)
        )

    def prepare_prologue(
        self, step: Step, *, graph: bool = False, norm: bool = True, hadamard: bool = False
    ) -> PrologueStep:
        """A decode step whose q/k the backend rotates itself (``attend_with_prologue``):
        raw q/k/v and each layer's ``QKPrologue`` (norm weights drawn when ``norm``), while
        the oracle and the mirror get ``qk_prologue_oracle``'s q and k rounded to the dtype.
        This step's K/V are not put in the cache: the backend must store them."""
        if step.mode != "decode":
            raise ValueError("harness: the q/k prologue is decode-only")
        rows, fb, real_locs = self._lay_out(step, graph)
        raw = self._new_qkv(fb.num_tokens, None, projected=True)
        g, t = self.geo, real_locs.numel()
        cos, sin = rope_tables(self.pool.max_context_len, g.head_dim, self.device)
        qkv: list[QKV] = []
        rotations = []
        for layer, (q, k, v) in enumerate(raw):
            q_w, k_w = (
                (1 + 0.2 * self._randn(g.head_dim).float()).to(self.dtype) if norm else None
                for _ in range(2)
            )
            rotation = QKPrologue(fb.positions, cos, sin, q_w, k_w, PROLOGUE_EPS, hadamard)
            q_rot, k_rot = qk_prologue_oracle(
                q, k, fb.positions, cos, sin, q_w, k_w, PROLOGUE_EPS, hadamard
            )
            qkv.append((q_rot.to(self.dtype), k_rot.to(self.dtype), v))
            self._mirror(layer, real_locs, qkv[-1][1][:t], v[:t])
            rotations.append(rotation)
        table = self.pool.req_to_token.clone()
        prepared = Prepared(step, fb, qkv, rows, t, real_locs, table, graph, batch_snapshot(fb))
        return PrologueStep(prepared, raw, rotations)

    def _lay_out(self, step: Step, graph: bool) -> tuple[list[int], ForwardBatch, torch.Tensor]:
        """``step``'s request rows, its ForwardBatch and its new tokens' slots."""
        if step.num_slots > len(self.free):
            raise ValueError(f"harness: step needs {step.num_slots} slots, {len(self.free)} free")
        if step.padded_rows and step.mode != "decode":
            raise ValueError("harness: padded rows are decode-only")
        if step.continues:
            rows = self._continued_rows(step)
            kept = set(range(step.batch_size)) - set(step.fresh)
        else:
            drawn = torch.randperm(self.pool.size, generator=self.gen)[: step.batch_size] + 1
            rows, kept = drawn.tolist(), set()
        locs = self._lay_out_requests(step, rows, kept)
        self.last = (rows, [p + n for p, n in zip(step.prefix_lens, step.extend_lens, strict=True)])
        fb = self._batch(step, rows, locs, graph)
        return rows, fb, torch.tensor(locs, dtype=torch.int64, device=self.device)

    def _continued_rows(self, step: Step) -> list[int]:
        """The previous step's rows, checked to hold what ``step`` continues."""
        if self.last is None or len(self.last[0]) != step.batch_size or step.padded_rows:
            raise ValueError("harness: a continuing step follows one of its batch size, unpadded")
        rows, lengths = self.last
        for i, (prefix, held) in enumerate(zip(step.prefix_lens, lengths, strict=True)):
            if i not in step.fresh and prefix != held:
                raise ValueError(f"harness: request {i} continues at {prefix}, held {held}")
        return list(rows)

    def _lay_out_requests(self, step: Step, rows: list[int], kept: set[int]) -> list[int]:
        """Give each request its slots in ``req_to_token`` (stale ids past its length, as a
        reused row has) and its cached prefix's K/V; returns the new tokens' slots. A ``kept``
        request already holds its prefix: its new tokens' slots follow it in its row."""
        g, table = self.geo, self.pool.req_to_token
        locs: list[int] = []
        for i, (row, prefix, n) in enumerate(
            zip(rows, step.prefix_lens, step.extend_lens, strict=True)
        ):
            length = prefix + n
            if i in kept:
                slots = self._take_slots(n, step.permuted)
                table[row, prefix:length] = torch.tensor(slots, dtype=torch.int32)
                locs += slots
                continue
            slots = self._take_slots(length, step.permuted)
            table[row, :length] = torch.tensor(slots, dtype=torch.int32)
            tail = min(TAIL, self.pool.max_context_len - length, len(self.free))
            if tail > 0:
                stale = torch.randperm(len(self.free), generator=self.gen)[:tail].tolist()
                table[row, length : length + tail] = torch.tensor(
                    [self.free[i] for i in stale], dtype=torch.int32
                )
            prefix_slots = torch.tensor(slots[:prefix], dtype=torch.int64, device=self.device)
            for layer in range(g.num_layers):
                k = self._randn(prefix, g.num_kv_heads, g.head_dim)
                v = self._randn(prefix, g.num_kv_heads, g.head_dim)
                # What earlier steps stored: in the cache, as the store writes it.
                self._store((self.kv.k_buffers, self.kv.v_buffers), layer, prefix_slots, k, v)
                self._mirror(layer, prefix_slots, k, v)
            locs += slots[prefix:]
        return locs

    def _batch(self, step: Step, rows: list[int], locs: list[int], graph: bool) -> ForwardBatch:
        """The step's ForwardBatch, padded by the core's rule (into the static buffers for a
        graph) when it has padded rows or runs as a graph."""
        seq_lens = [p + n for p, n in zip(step.prefix_lens, step.extend_lens, strict=True)]
        positions = [i for p, n in zip(step.prefix_lens, step.extend_lens, strict=True)
                     for i in range(p, p + n)]  # fmt: skip

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        fb = ForwardBatch(
            ForwardMode.DECODE if step.mode == "decode" else ForwardMode.EXTEND,
            ints([0] * len(locs)), ints(positions), ints(rows), ints(seq_lens), ints(locs),
            seq_lens, list(step.prefix_lens), list(step.extend_lens),
        )  # fmt: skip
        if not (graph or step.padded_rows):
            return fb
        fill = int(self.backend.graph_seq_len_fill_value)
        if graph:
            assert self.static is not None, "harness: built without graph_max_bs"
            return self.static.load_padded(fb, step.batch_size + step.padded_rows, fill)
        return padded_decode_batch(fb, step.batch_size + step.padded_rows, fill)

    def _new_qkv(
        self, tokens: int, reuse: Prepared | None, projected: bool = False, q_scale: float = 1.0
    ) -> list[QKV]:
        """Fresh q/k/v per layer for ``tokens`` rows (padding last); written into ``reuse``'s
        tensors when given, so a captured graph reads them.

        Laid out as a model hands them: ``v`` is a strided view of one ``[T, Hq + 2 Hkv, D]``
        projection (q and k come out of the rotation as tensors of their own), and with
        ``projected`` (the prologue's raw inputs) q and k are views of it too. The rest of
        that projection holds NaN, so a kernel that ignores the strides reads NaN."""
        g = self.geo
        out: list[QKV] = []
        hq, hkv = g.num_q_heads, g.num_kv_heads
        for layer in range(g.num_layers):
            q, k, v = (
                self._randn(tokens, g.num_q_heads, g.head_dim, scale=q_scale),
                self._randn(tokens, g.num_kv_heads, g.head_dim),
                self._randn(tokens, g.num_kv_heads, g.head_dim),
            )
            fused = torch.full(
                (tokens, hq + 2 * hkv, g.head_dim), float("nan"), dtype=v.dtype, device=v.device
            )
            parts = (fused[:, :hq], fused[:, hq : hq + hkv], fused[:, hq + hkv :])
            new = (
                parts[0].copy_(q) if projected else q,
                parts[1].copy_(k) if projected else k,
                parts[2].copy_(v),
            )
            if reuse is not None:
                old = reuse.qkv[layer]
                new = (old[0].copy_(new[0]), old[1].copy_(new[1]), old[2].copy_(new[2]))
            out.append(new)
        return out

    def _store_new_kv(self, qkv: list[QKV], real_locs: torch.Tensor) -> None:
        """This step's K/V into the mirror and, when the model is the writer, into the cache
        (the backend only reads them); a ``stores_kv`` backend is handed them in ``attend``."""
        t = real_locs.numel()
        for layer, (_, k, v) in enumerate(qkv):
            self._mirror(layer, real_locs, k[:t], v[:t])
            if not self.backend.capabilities.stores_kv:
                self.kv.set_kv(layer, real_locs, k[:t], v[:t])

    def _store(self, bufs: tuple[list[torch.Tensor], ...], layer: int, *kv: torch.Tensor) -> None:
        """``(slots, k, v)`` into ``bufs = (k_buffers, v_buffers)`` as the cache's store does."""
        slots, k, v = kv
        inv = self.kv.layer_scales[layer] if self.kv.is_fp8 else None
        store(bufs[0][layer], slots, k, None if inv is None else inv[K_INV_SCALE])
        store(bufs[1][layer], slots, v, None if inv is None else inv[V_INV_SCALE])

    def _mirror(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """What the cache must hold (its bytes) and, fp8 aside, the K/V themselves."""
        self._store((self.mirror_k, self.mirror_v), layer, slots, k, v)
        if self.exact_k is not self.mirror_k:
            self.exact_k[layer][slots] = k
            self.exact_v[layer][slots] = v

    # -- running and checking -------------------------------------------------------------------
    def plan(self, prepared: Prepared) -> AttentionStep:
        """The backend's plan for the step (graph: into its static buffers), as a runner
        hands it to the model."""
        fb = prepared.fb
        meta = self.backend.plan_graph(fb) if prepared.graph else self.backend.plan(fb)
        return AttentionStep(self.backend, meta, fb.out_cache_loc, fb.mode)

    def plan_graph_checked(
        self, prepared: Prepared, label: str, *, seen_bucket: bool
    ) -> tuple[AttentionStep, list[str]]:
        """``plan`` through ``plan_graph``, and what it must not do (on CUDA): wait for the
        device (torch's sync debug mode, set to error around the call: a host sync there
        stalls every replayed step and defeats overlap) or, planning a bucket it has planned
        before (``seen_bucket``: what runs before every replay), keep new device memory (it
        must write into what ``init_graph_state`` or its first plan of the bucket allocated,
        e.g. a FlashInfer wrapper per batch size; a temporary freed before it returns is
        allowed)."""
        if not prepared.graph or self.device.type != "cuda":
            return self.plan(prepared), []
        problems = []
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        synced: RuntimeError | None = None
        try:
            step = self.plan(prepared)
        except RuntimeError as exc:
            if "synchroniz" not in str(exc):
                raise
            synced = exc
        finally:
            torch.cuda.set_sync_debug_mode(mode)
        if synced is not None:
            problems.append(
                f"{label}: plan_graph waited for the device ({str(synced).splitlines()[0]}); "
                "it must plan from the batch's host mirrors and device tensors without a sync"
            )
            step = self.plan(prepared)  # the plan for the rest of the checks
        kept = torch.cuda.memory_allocated(self.device) - before
        if kept > 0 and seen_bucket:
            problems.append(
                f"{label}: plan_graph kept {kept} bytes of new device memory; it must write "
                "into the buffers init_graph_state or its first plan of this batch size "
                "allocated"
            )
        return step, problems

    def attend_with_prologue(self, p: PrologueStep, step: AttentionStep) -> list[Any]:
        """Every layer's ``attend_with_prologue`` on the raw q/k/v."""
        return [
            _read_only(
                self.backend.attend_with_prologue,
                (q, k, v, layer, step, rotation),
                f"layer {layer.layer_id}'s raw",
                p.prepared.input_writes,
            )
            for layer, (q, k, v), rotation in zip(self.layers, p.raw, p.rotations, strict=True)
        ]

    def attend_layers(self, prepared: Prepared, step: AttentionStep) -> list[Any]:
        """Every layer's ``attend``, handed this step's K/V as a model hands them: a backend
        that stores K/V itself must store them; the others may read them (the cache holds
        them already). A write into q, k or v is noted (and undone, so the oracle reads what
        the backend was given)."""
        return [
            _read_only(
                self.backend.attend,
                (q, layer, step, (k, v)),
                f"layer {layer.layer_id}'s",
                prepared.input_writes,
                inputs=(q, k, v),
            )
            for layer, (q, k, v) in zip(self.layers, prepared.qkv, strict=True)
        ]

    def run(self, prepared: Prepared) -> list[Any]:
        """``plan`` once, then every layer's ``attend``."""
        return self.attend_layers(prepared, self.plan(prepared))

    def check(
        self,
        prepared: Prepared,
        outs: list[Any],
        tolerance: float,
        label: str,
        exact_tolerance: float | None = None,
        stored_tolerance: float | None = None,
    ) -> Outcome:
        """Outputs against the float64 oracle over what the cache holds (an fp8 one read
        times its scales); the cache against the mirror. ``exact_tolerance``: also against
        the oracle over the K/V in the model dtype (what an fp8 cache costs).
        ``stored_tolerance``: this step's K/V may differ from the mirror's by the rounding of
        a backend's own rotation (norm-relative, per layer); elsewhere the cache must still
        be exact."""
        result = Outcome()
        step, t_real = prepared.step, prepared.num_real_tokens
        g = self.geo
        want_shape = (prepared.fb.num_tokens, g.num_q_heads, g.head_dim)
        for layer, out in enumerate(outs):
            where = f"{label}, layer {layer}"
            q = prepared.qkv[layer][0]
            if not isinstance(out, torch.Tensor):
                result.problems.append(f"{where}: forward returned {type(out).__name__}")
                continue
            if tuple(out.shape) != want_shape or out.dtype != q.dtype or out.device != q.device:
                result.problems.append(
                    f"{where}: output {tuple(out.shape)} {out.dtype} on {out.device}, expected "
                    f"{want_shape} {q.dtype} on {q.device} ([T, Hq, Dv], q's dtype)"
                )
                continue
            padded = out[t_real:]
            if not bool(torch.isfinite(padded).all()):
                result.problems.append(
                    f"{where}: padded rows {t_real}..{out.shape[0] - 1} hold non-finite values "
                    "(a padded row's output is dropped, but the model then stores that row's "
                    "K/V into slot 0, which requests read under a mask: 0 x NaN is NaN)"
                )
            out, problems = out[:t_real], result.problems
            k_scale, v_scale = self.kv.scales.k[layer], self.kv.scales.v[layer]
            ref = self._oracle(prepared, layer, self.mirror_k, self.mirror_v, k_scale, v_scale)
            err = self._compare(out, ref, tolerance, where, step, problems)
            result.max_error = max(result.max_error, err)
            if exact_tolerance is not None:
                ref = self._oracle(prepared, layer, self.exact_k, self.exact_v, 1.0, 1.0)
                where += " (vs the unquantized K/V)"
                err = self._compare(out, ref, exact_tolerance, where, step, problems)
                result.max_exact_error = max(result.max_exact_error, err)
        result.problems += [f"{label}: {w}" for w in dict.fromkeys(prepared.input_writes)]
        result.problems += self.cache_problems(prepared, label, stored_tolerance)
        if not torch.equal(self.pool.req_to_token, prepared.table):
            result.problems.append(f"{label}: the backend modified req_to_token")
        for name in batch_changes(prepared.fb, prepared.batch):
            result.problems.append(
                f"{label}: the backend wrote into the batch's {name} (a backend reads the "
                "ForwardBatch; the model and the runner read it after)"
            )
        return result

    def _oracle(self, p: Prepared, layer: int, *kv_and_scales: Any) -> torch.Tensor:
        """The float64 oracle of one layer over ``(k_bufs, v_bufs, k_scale, v_scale)``."""
        k_bufs, v_bufs, k_scale, v_scale = kv_and_scales
        q, step = p.qkv[layer][0][: p.num_real_tokens], p.step
        return attention_oracle(
            q, k_bufs[layer], v_bufs[layer], p.table, p.rows, step.prefix_lens,
            step.extend_lens, self.layers[layer].scaling, k_scale, v_scale,
        )  # fmt: skip

    def _compare(
        self, out: torch.Tensor, ref: torch.Tensor, tol: float, where: str, step: Step,
        problems: list[str],
    ) -> float:  # fmt: skip
        """The relative error of ``out``; a problem when it exceeds ``tol``."""
        cmp = compare(out, ref)
        if cmp.ok(tol):
            return cmp.rel_error
        at = f"request {self._request_of(step, cmp.worst_index[0])} head {cmp.worst_index[1]}"
        dtypes = str(self.dtype).replace("torch.", "")
        if self.kv.dtype != self.dtype:
            dtypes += ", KV cache " + str(self.kv.dtype).replace("torch.", "")
        problems.append(
            f"{where}: {cmp.num_nonfinite} non-finite output values, first at {at}"
            if cmp.num_nonfinite
            else f"{where}: max {cmp.kind} error {cmp.rel_error:.3g} exceeds tolerance "
            f"{tol:.3g} ({dtypes}); worst at {at}"
        )
        return cmp.rel_error

    def cache_problems(
        self, prepared: Prepared, label: str, stored_tolerance: float | None = None
    ) -> list[str]:
        """K/V must sit exactly at out_cache_loc (within ``stored_tolerance`` when given) and
        nowhere else (slot 0 is padding's: a padded row may write it, but only finite values,
        since a gathering backend reads it under a mask and 0 x NaN is NaN)."""
        problems = []
        locs = set(prepared.real_locs.tolist())
        for layer in range(self.geo.num_layers):
            for name, have, want in (
                ("K", self.kv.k_buffers[layer], self.mirror_k[layer]),
                ("V", self.kv.v_buffers[layer], self.mirror_v[layer]),
            ):
                if stored_tolerance is not None:
                    where = prepared.real_locs
                    cmp = compare(have[where], want[where].double())
                    if not cmp.ok(stored_tolerance):
                        problems.append(
                            f"{label}, layer {layer}: {name} stored at out_cache_loc off by "
                            f"{cmp.rel_error:.3g} (tolerance {stored_tolerance:.3g})"
                        )
                    want[where] = have[where]  # the mirror keeps what was stored; the rest
                    # must be exact (now and in later steps)
                padded = bool(prepared.step.padded_rows)
                if padded and not bool(torch.isfinite(have[0].float()).all()):
                    problems.append(
                        f"{label}, layer {layer}: {name} cache slot 0 (padding's) holds inf or "
                        "NaN after a padded step: a backend that gathers it under a mask reads "
                        "0 x NaN = NaN"
                    )
                if self.kv.is_fp8:  # compare the stored bytes
                    have, want = have.view(torch.uint8), want.view(torch.uint8)
                differ = (have != want).flatten(1).any(1)  # [S+1]
                if padded:
                    differ[0] = False
                bad = differ.nonzero().flatten().tolist()
                if not bad:
                    continue
                inside = [s for s in bad if s in locs]
                outside = [s for s in bad if s not in locs]
                if outside:
                    problems.append(
                        f"{label}, layer {layer}: {name} cache written outside out_cache_loc "
                        f"at slots {outside[:8]}"
                    )
                if inside:
                    problems.append(
                        f"{label}, layer {layer}: {name} at out_cache_loc not stored exactly "
                        f"(slots {inside[:8]})"
                    )
        return problems

    @staticmethod
    def _request_of(step: Step, token: int) -> str:
        start = 0
        for b, n in enumerate(step.extend_lens):
            if token < start + n:
                return f"{b} token {token - start}"
            start += n
        return f"(padding) token {token}"


#: The norm epsilon of the prologue cases.
PROLOGUE_EPS = 1e-6


@dataclass
class PrologueStep:
    """A decode step for ``attend_with_prologue``: ``prepared`` holds the rotated q/k the
    oracle reads, ``raw`` the projections the backend gets, per layer."""

    prepared: Prepared
    raw: list[QKV]
    rotations: list[QKPrologue]


def _read_only(
    call: Callable[..., Any],
    args: tuple[Any, ...],
    what: str,
    writes: list[str],
    inputs: QKV | None = None,
) -> Any:
    """``call(*args)``, noting in ``writes`` which of ``inputs`` (q, k, v; default: the
    first three ``args``) it wrote into, and putting their values back. Not while a CUDA
    graph is being captured (no copies or host reads may run then); the eager call before a
    capture is checked."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return call(*args)
    inputs = inputs if inputs is not None else (args[0], args[1], args[2])
    before = [x.clone() for x in inputs]
    out = call(*args)
    for name, x, was in zip("qkv", inputs, before, strict=True):
        if not _same(x, was):
            writes.append(
                f"the backend wrote into {what} {name} (q, k and v are read-only: the model "
                "reads them after, and a graph replays from them)"
            )
            x.copy_(was)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN (the inputs hold none, but a backend may write some)."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def rope_tables(positions: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """fp32 rotate-half RoPE tables ``[P, D]`` (base 10000), as a model builds them."""
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


#: Metadata dataclass fields marked ``field(metadata={GRAPH_OPAQUE: "why"})`` are not inspected
#: by the buffer-stability check: e.g. a kernel library's planned wrapper whose internal host
#: fields do not reach its graph-mode kernels. The CUDA replay test still covers them.
GRAPH_OPAQUE = "graph_opaque"


def tensor_fields(obj: Any, prefix: str = "metadata", depth: int = 3) -> dict[str, Any]:
    """Leaves of a metadata object: tensors as ``(data_ptr, shape)``, host scalars as values."""
    out: dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = ("tensor", obj.data_ptr(), tuple(obj.shape))
    elif isinstance(obj, (int, float, bool, str)) or obj is None:
        out[prefix] = obj
    elif depth == 0:
        return out
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if GRAPH_OPAQUE in f.metadata:  # the backend vouches for it (see docs/conformance.md)
                continue
            out |= tensor_fields(getattr(obj, f.name), f"{prefix}.{f.name}", depth - 1)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out |= tensor_fields(value, f"{prefix}[{key!r}]", depth - 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out |= tensor_fields(value, f"{prefix}[{i}]", depth - 1)
    elif hasattr(obj, "__dict__"):
        for key, value in vars(obj).items():
            out |= tensor_fields(value, f"{prefix}.{key}", depth - 1)
    return out


def moved_buffers(label: str, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Graph metadata of one bucket must reuse the same buffers and the same host values."""
    problems = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        if isinstance(old, tuple) and isinstance(new, tuple):
            problems.append(
                f"{label}: graph metadata {path} moved (data_ptr {old[1]:#x} -> {new[1]:#x}, "
                f"shape {old[2]} -> {new[2]}); plan_graph must write into the buffers "
                "init_graph_state allocated"
            )
        else:
            problems.append(
                f"{label}: graph metadata {path} changed between two steps of one bucket "
                f"({old!r} -> {new!r}); a captured graph would replay the old value"
            )
    return problems


def matches_eager(
    harness: AttentionHarness, prepared: Prepared, outs: list[Any], tol: float, label: str
) -> list[str]:
    """Run the same batch through the eager path; real rows must agree with the graph path."""
    fb = prepared.fb
    eager_fb = dataclasses.replace(
        fb,
        input_ids=fb.input_ids.clone(),
        positions=fb.positions.clone(),
        req_pool_indices=fb.req_pool_indices.clone(),
        seq_lens=fb.seq_lens.clone(),
        out_cache_loc=fb.out_cache_loc.clone(),
    )
    eager = dataclasses.replace(prepared, fb=eager_fb, graph=False)
    problems = []
    t = prepared.num_real_tokens
    # A backend may hand out the same output buffer on every call: keep the graph results.
    outs = [o.clone() if isinstance(o, torch.Tensor) else o for o in outs]
    for layer, (graph_out, eager_out) in enumerate(zip(outs, harness.run(eager), strict=True)):
        if not isinstance(graph_out, torch.Tensor) or not isinstance(eager_out, torch.Tensor):
            continue  # the oracle check already reported the bad output
        ref = eager_out[:t].double()
        err = float((graph_out[:t].double() - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err <= tol:
            problems.append(
                f"{label}, layer {layer}: graph path differs from eager by {err:.3g} "
                f"(tolerance {tol:.3g})"
            )
    return problems


def batch_snapshot(fb: ForwardBatch) -> dict[str, Any]:
    """Copies of ``fb``'s tensors and host lists (``batch_changes`` compares against them)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(fb):
        value = getattr(fb, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = value.clone()
        elif isinstance(value, list):
            out[f.name] = list(value)
    return out


def batch_changes(fb: ForwardBatch, snapshot: dict[str, Any]) -> list[str]:
    """The fields of ``fb`` whose tensors or lists differ from ``snapshot``'s copies."""
    changed = []
    for name, before in snapshot.items():
        now = getattr(fb, name)
        if isinstance(before, torch.Tensor):
            same = (
                isinstance(now, torch.Tensor)
                and now.shape == before.shape
                and torch.equal(now, before)
            )
        else:
            same = now == before
        if not same:
            changed.append(name)
    return changed
