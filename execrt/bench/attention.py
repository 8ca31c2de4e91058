"""Decode-attention benchmark: µs, GB/s of K/V read, % of measured copy bandwidth, vs peers.

Each backend's decode over a randomly permuted slot cache is captured in a CUDA graph (one
launch per layer, layers rotated so the K/V being read is never resident in L2) and the
replays are timed with CUDA events. Backends without graph support are timed eagerly. Each
result is checked against an fp32 reference first: one past the dtype's tolerance is recorded
as failed and not ranked, and a backend that cannot build or run is recorded with the reason.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from execrt.bench.common import (
    L2_BYTES,
    PASSED,
    Checkpoint,
    build_attention_backend,
    cell,
    check_cell,
    check_error,
    copy_bandwidth_gbps,
    median_us,
    note_error,
    passing,
    prepare_out_dir,
    rank,
    run_fields,
)
from execrt.core.batch import ForwardBatch, ForwardMode
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import (
    AttentionBackend,
    AttentionLayer,
    AttentionStep,
)
from execrt.core.kv_quant import K_SCALE, V_SCALE, dequantize, kv_storage_dtype, quantize
from execrt.core.memory import KVCache, ReqToTokenPool
from execrt.plugins.host import PluginHost

DEFAULT_SHAPES = ((1, 4096), (1, 32768), (16, 4096), (64, 4096), (256, 2048), (64, 16384))


@dataclass
class Record:
    backend: str
    bs: int
    ctx: int
    us: float | None  # None: it did not run (``note`` says why)
    gbps: float | None
    pct_copy_bw: float | None  # gbps / copy_gbps x 100
    copy_gbps: float  # the run's device-to-device copy rate (read + write)
    vs_best_peer: float  # over the best that passed the check; 0: not ranked
    max_rel_err: float | None
    graph: bool | None
    gpu: str
    date: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_dtype: str = "auto"  # kv_cache_dtype: auto (the model dtype) or fp8_e4m3 / fp8_e5m2
    vs_kv_auto: float | None = None  # us / the same backend's us with kv auto (< 1: faster)
    check: str = ""  # passed, failed (past the tolerance) or error (see common.Checked)
    note: str = ""  # why it failed or did not run
    env: dict[str, str | None] = field(default_factory=dict)  # environment.run_environment


class DecodeProblem:
    """``bs`` requests of ``ctx`` tokens each, or of ``lens[b]`` tokens where ``lens`` is given
    (ragged, as a serving batch is; ``ctx`` is then their maximum), slots a random permutation
    of the cache (stored in ``kv_dtype``, default the model's ``dtype``)."""

    def __init__(
        self,
        bs: int,
        ctx: int,
        hq: int,
        hkv: int,
        d: int,
        dtype: torch.dtype,
        seed: int = 0,
        kv_dtype: torch.dtype | None = None,
        lens: Sequence[int] | None = None,
    ) -> None:
        if lens is not None and (len(lens) != bs or min(lens, default=0) < 1):
            shown = f"{list(lens)[:8]}" + ("..." if len(lens) > 8 else "")
            raise ValueError(f"lens {shown} unsupported: must be {bs} positive lengths")
        self.lens = list(lens) if lens is not None else [ctx] * bs
        ctx = max(self.lens)
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.bs, self.ctx, self.hq, self.hkv, self.d, self.dtype = bs, ctx, hq, hkv, d, dtype
        kv_dtype = kv_dtype or dtype
        tokens = sum(self.lens)
        layer_bytes = 2 * tokens * hkv * d * torch.empty((), dtype=kv_dtype).element_size()
        self.kv_bytes = layer_bytes
        # Enough distinct layers that consecutive calls never find their K/V in L2.
        self.num_layers = max(1, min(16, math.ceil(3 * L2_BYTES / layer_bytes)))
        self.kv_cache = KVCache(tokens, self.num_layers, hkv, d, kv_dtype, "cuda")
        for buf in (*self.kv_cache.k_buffers, *self.kv_cache.v_buffers):
            buf.copy_(quantize(torch.empty_like(buf, dtype=dtype).normal_(generator=g), kv_dtype))
        self.pool = ReqToTokenPool(bs, ctx, "cuda")
        perm = (torch.randperm(tokens, generator=g, device="cuda") + 1).to(torch.int32)
        for b, part in enumerate(perm.split(self.lens)):
            self.pool.req_to_token[b + 1, : part.numel()] = part
        self.q = torch.randn(bs, hq, d, dtype=dtype, device="cuda", generator=g)
        self.layers = [AttentionLayer(i, hq, hkv, d, d, d**-0.5) for i in range(self.num_layers)]

    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(self.lens, dtype=torch.int64, device="cuda")

    def forward_batch(self) -> ForwardBatch:
        bs = self.bs
        seq = self.seq_lens()
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.zeros(bs, dtype=torch.int64, device="cuda"),
            positions=seq - 1,
            req_pool_indices=torch.arange(1, bs + 1, device="cuda"),
            seq_lens=seq,
            out_cache_loc=torch.zeros(bs, dtype=torch.int64, device="cuda"),
            seq_lens_cpu=list(self.lens),
            prefix_lens_cpu=[n - 1 for n in self.lens],
            extend_lens_cpu=[1] * bs,
        )

    def reference(self) -> torch.Tensor:
        """fp32 attention of layer 0 over the gathered K/V: ``[bs, Hq, D]``."""
        out = []
        scales = self.kv_cache.layer_scales[0]
        for b, n in enumerate(self.lens):  # one request at a time keeps fp32 temporaries small
            slots = self.pool.req_to_token[b + 1, :n].long()
            k = dequantize(self.kv_cache.k_buffers[0][slots], scales[K_SCALE])  # [n, Hkv, D]
            v = dequantize(self.kv_cache.v_buffers[0][slots], scales[V_SCALE])
            q = self.q[b].float().view(self.hkv, self.hq // self.hkv, self.d)
            s = torch.einsum("hgd,lhd->hgl", q, k) * self.d**-0.5
            out.append(torch.einsum("hgl,lhd->hgd", s.softmax(-1), v).reshape(self.hq, self.d))
        return torch.stack(out)


def build_backend(
    host: PluginHost, name: str, p: DecodeProblem, ctx: RuntimeContext
) -> AttentionBackend:
    return build_attention_backend(
        host,
        name,
        pool=p.pool,
        kv_cache=p.kv_cache,
        num_q_heads=p.hq,
        max_batch_size=p.bs,
        context=ctx,
        dtype=p.dtype,
    )


def time_backend(
    backend: AttentionBackend, p: DecodeProblem, iters: int, reps: int
) -> tuple[float, float, bool]:
    """(µs per layer call, max relative error of layer 0 vs fp32, timed through a graph?)."""
    fb = p.forward_batch()
    use_graph = bool(getattr(backend.capabilities, "graph", False))
    if use_graph:
        backend.init_graph_state(p.bs, p.bs)
        meta = backend.plan_graph(fb)
    else:
        meta = backend.plan(fb)
    step = AttentionStep(backend, meta, fb.out_cache_loc, fb.mode)

    def run_all() -> list[torch.Tensor]:
        return [backend.attend(p.q, layer, step) for layer in p.layers]

    outs = run_all()  # warm-up: JIT compilation, autotuning
    torch.cuda.synchronize()
    ref = p.reference()
    err = float((outs[0].float() - ref).norm() / ref.norm())
    launch = run_all
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        launch = graph.replay  # type: ignore[assignment]
        launch()
    return median_us(launch, iters, reps) / p.num_layers, err, use_graph


def run(
    backends: Sequence[str] | None = None,
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 20,
    reps: int = 5,
    out_dir: str | None = "benchmarks/results",
    kv_dtypes: Sequence[str] = ("auto",),
) -> list[Record]:
    """Benchmark every usable attention backend on every shape and KV cache dtype
    (``kv_cache_dtype`` names; each record also gets its time over the same backend's with
    ``auto``); print a table; save JSON, the records so far after each one."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench attention: needs a CUDA device")
    prepare_out_dir("attention", out_dir)
    saved = Checkpoint(out_dir, "attention-decode")
    host = PluginHost()
    names = list(backends or host.registry.names("attention"))
    gpu = torch.cuda.get_device_name()
    shared = run_fields(gpu, num_q_heads, num_kv_heads, head_dim, dtype)
    copy_bw = copy_bandwidth_gbps()
    print(f"# {gpu}: device-to-device copy {copy_bw:.0f} GB/s (read + write)")
    records: list[Record] = []
    for (bs, ctx), kv_name in ((shape, kv) for shape in shapes for kv in kv_dtypes):
        kv_dtype = kv_storage_dtype(kv_name, dtype)
        problem = DecodeProblem(
            bs, ctx, num_q_heads, num_kv_heads, head_dim, dtype, kv_dtype=kv_dtype
        )
        for name in names:
            record = Record(
                backend=name,
                bs=bs,
                ctx=ctx,
                us=None,
                gbps=None,
                pct_copy_bw=None,
                copy_gbps=copy_bw,
                vs_best_peer=0.0,
                max_rel_err=None,
                graph=None,
                kv_dtype=kv_name,
                **shared,
            )
            time_into(record, host, problem, iters, reps)
            records.append(record)
            compare(records)
            saved.save(records)
        del problem
        torch.cuda.empty_cache()
    return saved.report(records, format_table)


def time_into(record: Record, host: PluginHost, p: DecodeProblem, iters: int, reps: int) -> None:
    """Time ``record``'s backend on ``p`` into it and check its result (``check_error``); a
    backend that cannot build or run here gets the reason as its note."""
    context = RuntimeContext()
    label = f"{record.backend:<14} bs={p.bs:<4} ctx={p.ctx:<6} kv={record.kv_dtype}"
    try:
        backend = build_backend(host, record.backend, p, context)
        us, err, graphed = time_backend(backend, p, iters, reps)
        backend.close()
    except Exception as exc:  # recorded, and the run goes on
        note_error(record, exc, label)
        return
    finally:
        context.close()
    record.us, record.max_rel_err, record.graph = us, err, graphed
    record.gbps = p.kv_bytes / (us * 1e-6) / 1e9
    record.pct_copy_bw = 100 * record.gbps / record.copy_gbps
    check_error(record, err, p.dtype, label)


def compare(records: Sequence[Record]) -> None:
    """Set ``vs_best_peer`` (GB/s over the best of the same shape and KV dtype) and
    ``vs_kv_auto`` (µs over the same backend's with kv auto) from the records that passed the
    check; the others keep 0 and None."""
    ranked = passing(records)
    rows: defaultdict[tuple[int, int, str], list[Record]] = defaultdict(list)
    for r in ranked:
        rows[(r.bs, r.ctx, r.kv_dtype)].append(r)
    for row in rows.values():
        rank(row, "gbps")
    auto = {(r.backend, r.bs, r.ctx): r.us for r in ranked if r.kv_dtype == "auto"}
    for r in ranked:
        base = auto.get((r.backend, r.bs, r.ctx))
        if base is not None and r.us is not None:
            r.vs_kv_auto = r.us / base


def format_table(records: Sequence[Record]) -> str:
    lines = [
        f"{'backend':<14} {'kv':<8} {'bs':>4} {'ctx':>6} {'us':>9} {'GB/s':>7} {'%copy':>6} "
        f"{'vs best':>7} {'vs kv':>6} {'rel err':>8} {'graph':<5} {'check':<7} note"
    ]
    for r in records:
        vs_best = r.vs_best_peer if r.check == PASSED else None
        pct = None if r.pct_copy_bw is None else r.pct_copy_bw / 100
        lines.append(
            f"{r.backend:<14} {r.kv_dtype:<8} {r.bs:>4} {r.ctx:>6} {cell(r.us, 9, '.1f')} "
            f"{cell(r.gbps, 7, '.0f')} {cell(pct, 6, '.1%')} {cell(vs_best, 7, '.2f')} "
            f"{cell(r.vs_kv_auto, 6, '.2f')} {cell(r.max_rel_err, 8, '.1e')} "
            f"{'-' if r.graph is None else str(r.graph):<5} {check_cell(r):<7} {r.note}"
        )
    return "\n".join(lines)
