"""Extend (prefill) attention benchmark: ms, causal TFLOP/s and the ratio to the best peer.

Every request has ``prefix`` cached tokens and ``new`` tokens to prefill; all of them sit at
random slots of a page-size-1 cache (a random permutation, so no two neighbouring tokens are
neighbours in memory). Registered backends run ``attend`` over that cache, handed this
step's K/V as a model hands them (the new tokens' rows, consecutive: the triton backend reads
those instead of their cache slots; flashinfer reads everything from the cache), timed
eagerly with CUDA events (each call is a millisecond-scale kernel, far above launch cost),
layers rotated so consecutive calls do not find their K/V in L2.

``flashinfer`` runs once per prefill variant: ``auto`` (FlashInfer's own choice, FA3 on sm90),
``fa2``, ``fa3``. The backend's ``attend`` is FlashInfer's planned paged-prefill wrapper
``run``, so these records are FlashInfer's prefill; ``vs_flashinfer`` is over the best of them.
``triton`` runs once per extend kernel asked for (``triton_kernels``: ``auto``, the kernel the
GPU's tuned table chose, by default; ``gather``, ``fresh``, ``ws`` by name).
The ``sdpa`` peer is torch's ``scaled_dot_product_attention`` on contiguous ``[bs, Hq, L, D]``
copies of the same K/V (kv heads expanded to Hq, copies made outside the timing) with a
bottom-right-aligned causal mask (``causal_lower_right``), which torch runs with its flash
kernel.

Each result is checked against an fp32 reference first: one past the dtype's tolerance is
recorded as failed and not ranked; a backend that cannot build or run is recorded with the
reason. The records so far are saved after each one.

The physical limit: a dense bf16 matmul (an 8192-cube, ``timing.run_peak_tflops``) timed once at
the start of the run, on the same GPU; ``pct_peak`` is a record's causal TFLOP/s over it (a
prefill's attention is compute-bound at these shapes; fp16 runs at the same tensor-core rate).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from execrt.bench.common import (
    PASSED,
    Checkpoint,
    build_attention_backend,
    cell,
    check_cell,
    check_error,
    median_us,
    note_error,
    passing,
    prepare_out_dir,
    rank,
    run_fields,
)
from execrt.bench.timing import run_peak_tflops
from execrt.core.batch import ForwardBatch, ForwardMode
from execrt.core.config import TRITON_EXTEND_KERNELS
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import (
    AttentionBackend,
    AttentionLayer,
    AttentionStep,
)
from execrt.core.memory import KVCache, ReqToTokenPool
from execrt.plugins.host import PluginHost

# (requests, new tokens each, cached prefix each): the rows of issue 16.
DEFAULT_SHAPES = ((1, 8192, 0), (4, 2048, 0), (16, 512, 2048), (64, 128, 1024), (8, 1024, 8192))
DEFAULT_BACKENDS = ("triton", "flashinfer", "sdpa")
SDPA = "sdpa"
FLASHINFER = "flashinfer"
TRITON = "triton"
TRITON_KERNELS = TRITON_EXTEND_KERNELS  # its extend_kernel option
FLASHINFER_VARIANTS = ("auto", "fa2", "fa3")  # its prefill_backend option
L2_BYTES = 60 << 20


@dataclass
class Record:
    backend: str
    bs: int
    new: int
    prefix: int
    ms: float | None  # None: it could not run here (``note`` says why)
    tflops: float | None
    # over the row's best TFLOP/s, itself included (as in bench attention); 0: not ranked
    # (it did not run or failed the check)
    vs_best_peer: float
    vs_flashinfer: float  # over the best flashinfer variant's TFLOP/s; 0 without flashinfer
    max_rel_err: float | None
    timed_on: str  # "paged cache" or "contiguous K/V"
    gpu: str
    date: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    # flashinfer: the prefill variant asked for (auto, fa2, fa3); triton: the extend kernel
    # named (gather, fresh, ws), empty for its tuned choice
    variant: str = ""
    build_s: float | None = None  # building the backend (a first FlashInfer start: its JIT)
    note: str = ""  # what ran ("auto runs fa3"), why nothing did, or the check it failed
    check: str = ""  # passed, failed (past the tolerance) or error (see common.Checked)
    env: dict[str, str | None] = field(default_factory=dict)  # environment.run_environment
    peak_tflops: float | None = None  # the dense bf16 matmul rate, measured in the run
    pct_peak: float | None = None  # tflops / peak_tflops x 100


def causal_flops(bs: int, new: int, prefix: int, num_q_heads: int, head_dim: int) -> float:
    """2 GEMMs x 2 FLOP per visible (query, key) pair: token i sees prefix + i + 1 keys."""
    visible = bs * (new * prefix + new * (new + 1) // 2)
    return 4.0 * head_dim * num_q_heads * visible


class ExtendProblem:
    """``bs`` requests of ``prefix`` cached + ``new`` new tokens over a permuted slot cache."""

    def __init__(
        self,
        bs: int,
        new: int,
        prefix: int,
        hq: int,
        hkv: int,
        d: int,
        dtype: torch.dtype,
        seed: int = 0,
        device: str = "cuda",
    ) -> None:
        self.device = dev = torch.device(device)
        g = torch.Generator(device=dev).manual_seed(seed)
        self.bs, self.new, self.prefix, self.ctx = bs, new, prefix, prefix + new
        self.hq, self.hkv, self.d, self.dtype = hq, hkv, d, dtype
        tokens = bs * self.ctx
        layer_bytes = 2 * tokens * hkv * d * torch.empty((), dtype=dtype).element_size()
        self.num_layers = max(1, min(8, math.ceil(3 * L2_BYTES / layer_bytes)))
        self.kv_cache = KVCache(tokens, self.num_layers, hkv, d, dtype, dev)
        for layer in range(self.num_layers):
            self.kv_cache.k_buffers[layer].normal_(generator=g)
            self.kv_cache.v_buffers[layer].normal_(generator=g)
        self.pool = ReqToTokenPool(bs, self.ctx, dev)
        perm = torch.randperm(tokens, generator=g, device=dev) + 1
        self.pool.req_to_token[1:] = perm.view(bs, self.ctx).to(torch.int32)
        self.q = torch.randn(bs * new, hq, d, dtype=dtype, device=dev, generator=g)
        # This step's K/V per layer as a model hands them to ``attend`` (rows as q's): copies
        # of what the cache holds at the new tokens' slots, made once, outside any timing.
        new_slots = self.pool.req_to_token[1:, prefix:].reshape(-1).long()
        self.kv = [
            (self.kv_cache.k_buffers[i][new_slots], self.kv_cache.v_buffers[i][new_slots])
            for i in range(self.num_layers)
        ]
        self.layers = [AttentionLayer(i, hq, hkv, d, d, d**-0.5) for i in range(self.num_layers)]
        self.flops = causal_flops(bs, new, prefix, hq, d)

    def slots(self, b: int) -> torch.Tensor:
        return self.pool.req_to_token[1 + b].long()  # [ctx]

    def forward_batch(self) -> ForwardBatch:
        bs, new, prefix, dev = self.bs, self.new, self.prefix, self.device
        positions = (prefix + torch.arange(new, device=dev)).repeat(bs)  # [T]
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.zeros(bs * new, dtype=torch.int64, device=dev),
            positions=positions,
            req_pool_indices=torch.arange(1, bs + 1, device=dev),
            seq_lens=torch.full((bs,), self.ctx, dtype=torch.int64, device=dev),
            out_cache_loc=self.pool.req_to_token[1:, prefix:].reshape(-1).long(),
            seq_lens_cpu=[self.ctx] * bs,
            prefix_lens_cpu=[prefix] * bs,
            extend_lens_cpu=[new] * bs,
        )

    def reference(self, b: int) -> torch.Tensor:
        """fp32 attention of request b's new tokens in layer 0: ``[new, Hq, D]``."""
        slots, group = self.slots(b), self.hq // self.hkv
        k = self.kv_cache.k_buffers[0][slots].float().repeat_interleave(group, dim=1)
        v = self.kv_cache.v_buffers[0][slots].float().repeat_interleave(group, dim=1)
        q = self.q[b * self.new : (b + 1) * self.new].float()  # [new, Hq, D]
        pos = torch.arange(self.ctx, device=self.device)
        out = torch.empty_like(q)
        for lo in range(0, self.new, 1024):  # chunks keep the score matrix near 1 GB
            s = torch.einsum("nhd,lhd->hnl", q[lo : lo + 1024], k) * self.d**-0.5
            rows = self.prefix + lo + torch.arange(s.shape[1], device=self.device)
            s.masked_fill_(pos[None, None, :] > rows[None, :, None], float("-inf"))
            out[lo : lo + 1024] = torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)
        return out

    def rel_err(self, out: torch.Tensor) -> float:
        """Worst norm-relative error of the first and last request against fp32."""
        errs = []
        for b in sorted({0, self.bs - 1}):
            ref = self.reference(b)
            got = out[b * self.new : (b + 1) * self.new].float()
            errs.append(float((got - ref).norm() / ref.norm()))
        return max(errs)


def time_calls(calls: Sequence[Callable[[], object]], iters: int, reps: int) -> float:
    """Median ms per call over ``reps`` samples of ``iters`` rounds of every call."""

    def every_call() -> None:
        for call in calls:
            call()

    return median_us(every_call, iters, reps) / 1e3 / len(calls)


def backend_calls(
    host: PluginHost,
    name: str,
    p: ExtendProblem,
    context: RuntimeContext,
    options: Mapping[str, Any] | None = None,
) -> tuple[list[Callable[[], torch.Tensor]], AttentionBackend]:
    """One ``attend`` call per layer of a registered backend (with its ``options``), planned
    once."""
    backend = build_attention_backend(
        host,
        name,
        pool=p.pool,
        kv_cache=p.kv_cache,
        num_q_heads=p.hq,
        max_batch_size=p.bs,
        context=context,
        options=options,
    )
    fb = p.forward_batch()
    step = AttentionStep(backend, backend.plan(fb), fb.out_cache_loc, fb.mode)
    calls: list[Callable[[], torch.Tensor]] = [
        functools.partial(backend.attend, p.q, layer, step, p.kv[layer.layer_id])
        for layer in p.layers
    ]
    return calls, backend


def sdpa_calls(p: ExtendProblem) -> list[Callable[[], torch.Tensor]]:
    """torch SDPA per layer on contiguous, head-expanded K/V; outputs ``[T, Hq, D]``."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    group = p.hq // p.hkv
    slots = torch.stack([p.slots(b) for b in range(p.bs)])  # [bs, ctx]

    def contiguous(buf: torch.Tensor) -> torch.Tensor:
        x = buf[slots].repeat_interleave(group, dim=2)  # [bs, ctx, Hq, D]
        return x.transpose(1, 2).contiguous()  # [bs, Hq, ctx, D]

    q = p.q.view(p.bs, p.new, p.hq, p.d).transpose(1, 2).contiguous()  # [bs, Hq, new, D]
    mask = causal_lower_right(p.new, p.ctx)  # query i sees keys <= prefix + i

    def call(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p.d**-0.5)
        return out.transpose(1, 2).reshape(p.bs * p.new, p.hq, p.d)  # a view: no copy

    cache = p.kv_cache
    return [
        functools.partial(call, contiguous(cache.k_buffers[i]), contiguous(cache.v_buffers[i]))
        for i in range(p.num_layers)
    ]


def measure(
    calls: Sequence[Callable[[], torch.Tensor]], p: ExtendProblem, iters: int, reps: int
) -> tuple[float, float]:
    """(ms per call, relative error of layer 0): the first calls also warm up (JIT, plans)."""
    err = p.rel_err(calls[0]())
    for call in calls:
        call()
    return time_calls(calls, iters, reps), err


def run(
    backends: Sequence[str] | None = None,
    shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES,
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 10,
    reps: int = 5,
    variants: Sequence[str] = FLASHINFER_VARIANTS,
    triton_kernels: Sequence[str] = ("auto",),
    out_dir: str | None = "benchmarks/results",
) -> list[Record]:
    """Benchmark every requested backend (flashinfer in each of ``variants``) on every shape;
    print a table; save JSON, the records so far after each one. A backend or variant that
    cannot build or run here is recorded with the reason and the run goes on."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench extend: needs a CUDA device")
    prepare_out_dir("extend", out_dir)
    saved = Checkpoint(out_dir, "extend")
    host = PluginHost()
    names = list(backends or DEFAULT_BACKENDS)
    each = {
        FLASHINFER: tuple(variants),
        TRITON: tuple("" if k == "auto" else k for k in triton_kernels),
    }
    gpu = torch.cuda.get_device_name()
    shared = run_fields(gpu, num_q_heads, num_kv_heads, head_dim, dtype)
    peak = run_peak_tflops(torch.device("cuda"))
    print(f"# {gpu}: extend attention, {num_q_heads}/{num_kv_heads} heads, D={head_dim}, {dtype}")
    print(f"# the physical limit: a dense bf16 matmul at {peak:.0f} TFLOP/s, measured now")
    records: list[Record] = []
    for bs, new, prefix in shapes:
        p = ExtendProblem(bs, new, prefix, num_q_heads, num_kv_heads, head_dim, dtype)
        row: list[Record] = []
        for name in names:
            for variant in each.get(name, ("",)):
                record = Record(
                    backend=name,
                    bs=bs,
                    new=new,
                    prefix=prefix,
                    ms=None,
                    tflops=None,
                    vs_best_peer=0.0,
                    vs_flashinfer=0.0,
                    max_rel_err=None,
                    timed_on="contiguous K/V" if name == SDPA else "paged cache",
                    variant=variant,
                    **shared,
                )
                time_into(record, host, p, iters, reps)
                add_peak(record, peak)
                row.append(record)
                rank_row(row)
                saved.save([*records, *row])
        records += row
        del p
        torch.cuda.empty_cache()
    return saved.report(records, format_table)


def add_peak(record: Record, peak_tflops: float) -> None:
    """``record``'s share of the matmul peak measured in the run (None where it did not
    run)."""
    record.peak_tflops = round(peak_tflops, 1)
    if record.tflops is not None:
        record.pct_peak = round(100 * record.tflops / peak_tflops, 1)


def rank_row(row: Sequence[Record]) -> None:
    """Set ``vs_best_peer`` and ``vs_flashinfer`` (over the best flashinfer variant) of one
    shape's records from those that passed the check; the others keep 0."""
    ranked = passing(row)
    rank(ranked, "tflops")
    best_fi = max((r.tflops or 0.0 for r in ranked if r.backend == FLASHINFER), default=0.0)
    rank(ranked, "tflops", "vs_flashinfer", against=best_fi)


def time_into(record: Record, host: PluginHost, p: ExtendProblem, iters: int, reps: int) -> None:
    """Time ``record``'s backend (or variant) on ``p`` into it and check its result
    (``check_error``); a failure to build or run goes to its note."""
    name, context = record.backend, RuntimeContext()
    label = f"{name}[{record.variant}]" if record.variant else name
    label = f"{label:<16} {p.bs}x{p.new}+{p.prefix}"
    try:
        if name == SDPA:
            ms, err = measure(sdpa_calls(p), p, iters, reps)
        else:
            key = "prefill_backend" if name == FLASHINFER else "extend_kernel"
            options = {key: record.variant} if record.variant else None
            start = time.perf_counter()
            calls, backend = backend_calls(host, name, p, context, options)
            record.build_s = time.perf_counter() - start
            chosen = getattr(backend, "prefill_variant", record.variant)
            if name == FLASHINFER and chosen != record.variant:
                record.note = f"{record.variant} runs {chosen}"
            ms, err = measure(calls, p, iters, reps)
            backend.close()
    except Exception as exc:  # report it and keep benchmarking the rest
        note_error(record, exc, label)
        return
    finally:
        context.close()
    record.ms, record.max_rel_err = ms, err
    record.tflops = p.flops / (ms * 1e-3) / 1e12
    check_error(record, err, p.dtype, label)


def format_table(records: Sequence[Record]) -> str:
    """One line per (shape, backend, variant): TFLOP/s over the row's best backend and over
    the best flashinfer variant ("-" where not ranked)."""

    lines = [
        f"{'backend':<12} {'variant':<7} {'bs':>4} {'new':>6} {'prefix':>6} {'ms':>8} "
        f"{'TFLOP/s':>8} {'%peak':>6} {'vs best':>7} {'vs fi':>6} {'rel err':>8} {'build s':>7} "
        f"{'check':<7} note"
    ]
    for r in records:
        ranked = r.check == PASSED
        vs_best, vs_fi = (r.vs_best_peer, r.vs_flashinfer) if ranked else (None, None)
        lines.append(
            f"{r.backend:<12} {r.variant:<7} {r.bs:>4} {r.new:>6} {r.prefix:>6} "
            f"{cell(r.ms, 8, '.3f')} {cell(r.tflops, 8, '.1f')} {cell(r.pct_peak, 6, '.1f')} "
            f"{cell(vs_best, 7, '.2f')} "
            f"{cell(vs_fi, 6, '.2f')} {cell(r.max_rel_err, 8, '.1e')} {cell(r.build_s, 7, '.1f')}"
            f" {check_cell(r):<7} {r.note}"
        )
    return "\n".join(lines)
