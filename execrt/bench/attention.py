"""Decode-attention benchmark: µs, GB/s of K/V read, % of measured copy bandwidth, vs peers.

Each backend's decode over a randomly permuted slot cache is captured in a CUDA graph (one
launch per layer, layers rotated so the K/V being read is never resident in L2) and the
replays are timed with CUDA events. Backends without graph support are timed eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from execrt.bench.common import (
    L2_BYTES,
    build_attention_backend,
    copy_bandwidth_gbps,
    median_us,
    prepare_out_dir,
    rank,
    report,
    utc_now,
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
    us: float
    gbps: float
    pct_copy_bw: float
    vs_best_peer: float
    max_rel_err: float
    graph: bool
    gpu: str
    date: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_dtype: str = "auto"  # kv_cache_dtype: auto (the model dtype) or fp8_e4m3 / fp8_e5m2
    vs_kv_auto: float | None = None  # us / the same backend's us with kv auto (< 1: faster)


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
    ``auto``); print a table; save JSON."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench attention: needs a CUDA device")
    prepare_out_dir("attention", out_dir)
    host = PluginHost()
    names = list(backends or host.registry.names("attention"))
    gpu = torch.cuda.get_device_name()
    date = utc_now()
    copy_bw = copy_bandwidth_gbps()
    print(f"# {gpu}: device-to-device copy {copy_bw:.0f} GB/s (read + write)")
    records: list[Record] = []
    for (bs, ctx), kv_name in ((shape, kv) for shape in shapes for kv in kv_dtypes):
        kv_dtype = kv_storage_dtype(kv_name, dtype)
        problem = DecodeProblem(
            bs, ctx, num_q_heads, num_kv_heads, head_dim, dtype, kv_dtype=kv_dtype
        )
        shape_records = []
        for name in names:
            context = RuntimeContext()
            try:
                backend = build_backend(host, name, problem, context)
                us, err, graphed = time_backend(backend, problem, iters, reps)
                backend.close()
            except Exception as exc:
                print(f"  {name:<14} bs={bs:<4} ctx={ctx:<6} kv={kv_name} skipped: {exc}")
                continue
            finally:
                context.close()
            gbps = problem.kv_bytes / (us * 1e-6) / 1e9
            shape_records.append(
                Record(
                    name,
                    bs,
                    ctx,
                    us,
                    gbps,
                    100 * gbps / copy_bw,
                    0.0,
                    err,
                    graphed,
                    gpu,
                    date,
                    num_q_heads,
                    num_kv_heads,
                    head_dim,
                    str(dtype).replace("torch.", ""),
                    kv_name,
                )
            )
        rank(shape_records, "gbps")
        records += shape_records
        del problem
        torch.cuda.empty_cache()
    auto = {(r.backend, r.bs, r.ctx): r.us for r in records if r.kv_dtype == "auto"}
    for r in records:
        if (base := auto.get((r.backend, r.bs, r.ctx))) is not None:
            r.vs_kv_auto = r.us / base
    return report(records, format_table, out_dir, "attention-decode")


def format_table(records: Sequence[Record]) -> str:
    lines = [
        f"{'backend':<14} {'kv':<8} {'bs':>4} {'ctx':>6} {'us':>9} {'GB/s':>7} {'%copy':>6} "
        f"{'vs best':>7} {'vs kv':>6} {'rel err':>8} graph"
    ]
    for r in records:
        vs_kv = "-" if r.vs_kv_auto is None else f"{r.vs_kv_auto:.2f}"
        lines.append(
            f"{r.backend:<14} {r.kv_dtype:<8} {r.bs:>4} {r.ctx:>6} {r.us:>9.1f} {r.gbps:>7.0f} "
            f"{r.pct_copy_bw:>5.1f}% {r.vs_best_peer:>7.2f} {vs_kv:>6} {r.max_rel_err:>8.1e} "
            f"{r.graph}"
        )
    return "\n".join(lines)
