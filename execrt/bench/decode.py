"""End-to-end decode-step benchmark: a named model shape with random weights on the GPU, timed
through ``generate()`` and ``ModelRunner.forward``, eager and graphed, against its roofline
(weight + K/V bytes over the measured copy bandwidth) and transformers on the same weights.

Method (docs/kernels.md, "Decode-step benchmark"):
- generate path: the step time is (t(1 + S new tokens) - t(1 new token)) / S, the median over
  ``reps`` pairs of synchronised wall-clock runs timed back to back, after a warm-up, the
  garbage collector off inside each; the best t(1) is reported as the prefill time;
- forward path: one decode batch built after a real prefill, ``model_runner.forward`` +
  ``sample`` replayed S times on it between CUDA events (the K/V of the step lands in the same
  slots each time);
- peer: transformers ``generate`` on the same weights, DynamicCache (eager), and at bs 1 a static
  cache with transformers' torch.compile (reduce-overhead), under a time limit;
- TTFT (``ttft``): one prompt of N tokens, generate 1 token, on an engine of the default
  sizes (prefill chunks included); its FLOP/s against a bf16 matmul timed in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from execrt.bench.common import (
    cell,
    chosen_backend,
    failure_note,
    measure_copy_rate,
    prepare_out_dir,
    release_memory,
    report,
    utc_now,
)
from execrt.bench.models import (
    MODELS,
    RandomWeightsLoader,
    build_hf_model,
    kv_bytes_per_step,
    model_config,
    prefill_flops,
    weight_bytes_per_step,
)
from execrt.bench.timing import (
    StepProfile,
    TimeLimitExceeded,
    dense_bf16_peak_tflops,
    difference_timing,
    host_hotspots,
    profile_difference,
    profile_kernels,
    profile_steps,
    run_peak_tflops,
    step_seconds,
    time_limit,
    timed_call,
)
from execrt.core import envs
from execrt.core.batch import ForwardBatch
from execrt.core.config import KV_CACHE_DTYPES
from execrt.core.errors import ExecrtError
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.engine import Engine
from execrt.models.config import ModelConfig

DEFAULT_BS = (1, 8, 32, 128)
QUICK_BS = (1, 32)
MODES = {"eager": "none", "graph": "full_cuda_graph"}  # mode -> graph_backend
KV_MARGIN = 16  # context slots past ctx + steps, so no request hits the context limit
PREFILL_CHUNK = 16384  # tokens per prefill forward
PROFILE_STEPS = 5
KERNEL_ROWS = 14  # the forward profile's kernel table (GPU kernels by time per step)
HF_MOE_BS = (1, 32)  # transformers' MoE is slow in eager: only these batch sizes ...
HF_MOE_STEPS = 8  # ... and at most this many steps
DEFAULT_TTFT = (8192, 32768)  # the CLI's time-to-first-token prompt lengths


@dataclass(frozen=True)
class Options:
    """What one ``execrt bench decode`` run measures."""

    model: str = "qwen3-0.6b"
    layers: int | None = None
    batch_sizes: tuple[int, ...] = DEFAULT_BS
    ctx: int = 512
    steps: int = 32
    attention: str = "auto"
    modes: tuple[str, ...] = ("eager", "graph")
    hf: bool = True
    hf_compile_timeout: float = 180.0  # seconds; 0 skips the compiled peer
    profile: bool = False
    overlap: bool = True  # RuntimeConfig.overlap_schedule of the generate path
    fused_kernels: str = "auto"  # RuntimeConfig.fused_kernels
    kv_dtypes: tuple[str, ...] = ("auto",)  # RuntimeConfig.kv_cache_dtype values, each timed
    reps: int = 3
    out_dir: str | None = "benchmarks/results"
    seed: int = 0
    device: str = "cuda"  # "cpu" runs the whole method on tiny shapes (tests)
    config: dict[str, Any] | None = None  # a custom shape, labelled ``model``, instead of MODELS
    ttft: tuple[int, ...] = ()  # prompt lengths of the time-to-first-token rows (bs 1)
    #: The engine's context limit: "model" (the model's own limit: what a user's engine gets
    #: by default, so the default), "run" (ctx + steps + a margin, the least the run needs)
    #: or a number. A graph bucket's decode launch is sized by it; the KV pool holds what
    #: the run needs.
    context_len: str = "model"
    #: The generate path's step is ``(t(base + steps) - t(base)) / steps``, ``t(n)`` a generate
    #: of ``n`` new tokens. 1 (the default): the difference also holds what a call pays once
    #: per request after its prefill (the first decode steps, and the whole batch finishing
    #: at once at the end, where t(1)'s requests finish chunk by chunk under the next
    #: chunk's prefill). Larger: both generates decode and finish every request, so only
    #: steady decode steps are left; the two together split a call's cost.
    generate_base: int = 1

    @property
    def decoded(self) -> int:
        """Steps the longest generate decodes past its prompt (its first token comes from
        the prefill): ``generate_base - 1 + steps``."""
        return self.generate_base - 1 + self.steps

    @property
    def run_len(self) -> int:
        """Context slots one request of the run needs: ctx + the steps decoded + a margin."""
        return self.ctx + self.decoded + KV_MARGIN

    def context_limit(self, model_limit: int) -> int:
        """``context_len`` as the engine's limit (``model_limit``: the model's own)."""
        if self.context_len == "run":
            return self.run_len
        return model_limit if self.context_len == "model" else int(self.context_len)

    def __post_init__(self) -> None:
        problems = []
        if self.context_len not in ("run", "model") and not (
            self.context_len.isdigit() and int(self.context_len) > self.ctx + self.decoded
        ):
            base = " + generate base - 1" if self.generate_base > 1 else ""
            problems.append(
                f"context_len {self.context_len!r} unsupported (run, model, or a number above "
                f"ctx + steps{base} = {self.ctx + self.decoded})"
            )
        if self.config is None and self.model not in MODELS:
            problems.append(f"model {self.model!r} unknown (known: {', '.join(MODELS)})")
        if self.layers is not None and self.layers < 1:
            problems.append(f"layers {self.layers} must be >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            problems.append(f"batch sizes {list(self.batch_sizes)} must be integers >= 1")
        if any(n < 1 for n in self.ttft):
            problems.append(f"ttft prompt lengths {list(self.ttft)} must be >= 1")
        if self.ctx < 1 or self.steps < 1 or self.reps < 1:
            problems.append(f"ctx {self.ctx}, steps {self.steps}, reps {self.reps} must be >= 1")
        if self.generate_base < 1:
            problems.append(f"generate base {self.generate_base} must be >= 1")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            problems.append(f"modes {list(self.modes)} unsupported (supported: {', '.join(MODES)})")
        if not self.kv_dtypes or any(k not in KV_CACHE_DTYPES for k in self.kv_dtypes):
            problems.append(
                f"kv dtypes {list(self.kv_dtypes)} unsupported "
                f"(supported: {', '.join(KV_CACHE_DTYPES)})"
            )
        if problems:
            raise ExecrtError("bench decode: " + "; ".join(problems))


def timed_context(ctx: int, path: str, base: int, steps: int) -> float:
    """K/V tokens per request that a timed decode step reads, on average, after a ``ctx``-token
    prompt. A forward step reads ctx + 1 (its own token's too). The generate path's timed
    steps are the differenced ones, decode steps ``base .. base + steps - 1`` of every request
    (its first token comes from the prefill), step ``j`` reading ctx + j: ctx + base +
    (steps - 1) / 2 on average (ctx + 16.5 at base 1 and 32 steps)."""
    if path != "generate":
        return ctx + 1
    return ctx + base + (steps - 1) / 2


@dataclass
class Record:
    model: str
    layers: int
    mode: str  # eager | graph | hf-eager | hf-compile | ttft
    path: str  # generate | forward
    bs: int
    ctx: int
    steps: int
    step_ms: float | None
    prefill_ms: float | None
    tokens_per_s: float | None
    roofline_ms: float
    pct_roofline: float | None
    copy_gbps: float
    weight_gb: float  # weight bytes read per step (MoE: expected experts touched)
    kv_gb: float  # K/V bytes read per step
    gpu: str
    date: str
    attention: str
    vs_hf_eager: float | None = None  # hf-eager step_ms / this step_ms (> 1: this is faster)
    vs_hf_compile: float | None = None
    overlap: bool | None = None  # execrt's overlap_schedule (None for the peer)
    fused_kernels: str | None = None  # execrt's fused_kernels setting (None for the peer)
    context_len: int | None = None  # execrt's context limit (None for the peer)
    kv_dtype: str = "auto"  # execrt's kv_cache_dtype (the peer: its own, the model dtype)
    generate_base: int | None = None  # execrt's generate path: Options.generate_base
    #: K/V tokens per request a timed step reads, on average (``timed_context``): the
    #: roofline's K/V bytes count these, not the prompt alone
    kv_ctx: float | None = None
    vs_kv_auto: float | None = None  # this step_ms / the kv auto step_ms (< 1: this is faster)
    note: str = ""
    #: execrt's ``EXECRT_*`` config overrides in effect (e.g. an A/B of a backend option run
    #: as two calls); None for the peer
    env_config: dict[str, str] | None = None
    #: the kernel switches set in the environment (``envs.KERNEL_SWITCHES``: PDL, its
    #: prefetch), e.g. an A/B of one run as two calls; None for the peer
    kernel_env: dict[str, str] | None = None
    profile: dict[str, float] | None = None
    hotspots: list[tuple[str, float]] | None = None  # host functions, µs/step (generate)
    #: forward --profile: the GPU's top kernels as (name, µs/step, critical µs/step, calls/step);
    #: critical: the busy time each alone adds (they sum to the GPU busy time)
    kernels: list[tuple[str, float, float, float]] | None = None
    prefill_tflops: float | None = None  # ttft: the prompt's FLOPs over the time to 1 token
    peak_tflops: float | None = None  # ttft: a dense bf16 matmul, timed in the same run
    pct_peak: float | None = None  # ttft: prefill_tflops / peak_tflops x 100
    spec_peak_tflops: float | None = None  # ttft: the GPU's datasheet dense bf16 peak
    pct_spec_peak: float | None = None  # ttft: prefill_tflops / spec_peak_tflops x 100


@dataclass
class _Context:
    """What every record of one run shares."""

    opts: Options
    config: dict[str, Any]
    model_config: ModelConfig
    device: torch.device
    copy_gbps: float
    gpu: str
    date: str
    records: list[Record] = field(default_factory=list)
    #: where the records so far are kept while the run goes on (None: no out_dir)
    partial: str | None = None

    def checkpoint(self) -> None:
        """Write the records so far to ``partial`` (a run cut short, e.g. by a device call's
        time limit, keeps what it measured), compared as the final file compares them. The
        final file replaces it."""
        if self.partial is None:
            return
        _compare_to_peers(self.records)
        _compare_kv_dtypes(self.records)
        os.makedirs(os.path.dirname(self.partial) or ".", exist_ok=True)
        tmp = f"{self.partial}.tmp"
        with open(tmp, "w") as fh:
            json.dump([asdict(r) for r in self.records], fh, indent=2)
        os.replace(tmp, self.partial)

    def add(
        self,
        mode: str,
        path: str,
        bs: int,
        step_s: float | None,
        attention: str,
        *,
        base: int | None = None,
        **extra: Any,
    ) -> Record:
        """``base``: the difference base of a generate record's timing; by default the run's
        ``generate_base`` for execrt's own modes (the record says it), 1 for a peer."""
        mc, steps = self.model_config, extra.pop("steps", self.opts.steps)
        ours = mode in MODES and path == "generate"
        if base is None:
            base = self.opts.generate_base if ours else 1
        kv_ctx = timed_context(self.opts.ctx, path, base, steps)
        weights = weight_bytes_per_step(mc, bs)
        fp8 = extra.get("kv_dtype", "auto") != "auto"
        kv = kv_bytes_per_step(mc, bs, kv_ctx, dtype_bytes=1 if fp8 else 2)
        roofline_ms = (weights + kv) / (self.copy_gbps * 1e9) * 1e3
        step_ms = None if step_s is None else step_s * 1e3
        record = Record(
            model=self.opts.model,
            layers=mc.num_layers,
            mode=mode,
            path=path,
            bs=bs,
            ctx=self.opts.ctx,
            kv_ctx=kv_ctx,
            generate_base=base if ours else None,
            steps=steps,
            step_ms=step_ms,
            prefill_ms=None,
            tokens_per_s=bs / step_s if step_s else None,
            roofline_ms=roofline_ms,
            pct_roofline=100 * roofline_ms / step_ms if step_ms else None,
            copy_gbps=self.copy_gbps,
            weight_gb=weights / 1e9,
            kv_gb=kv / 1e9,
            gpu=self.gpu,
            date=self.date,
            attention=attention,
            **extra,
        )
        self.records.append(record)
        shown = f"{step_ms:.3f} ms/step" if step_ms is not None else f"skipped: {record.note}"
        kv_dtype = f" kv={record.kv_dtype}" if record.kv_dtype != "auto" else ""
        print(f"  {mode:<10} {path:<8} bs={bs:<4}{kv_dtype} {shown}", flush=True)
        return record


def run(opts: Options) -> list[Record]:
    """Run every configuration of ``opts``; print a table last; save JSON to ``out_dir``."""
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExecrtError("bench decode: needs a CUDA device (none is visible)")
    prepare_out_dir("decode", opts.out_dir)
    config = model_config(opts.model, opts.layers, opts.config)
    mc = ModelConfig.from_dict(config)
    limit = mc.max_position_embeddings
    if opts.run_len > limit:
        raise ExecrtError(f"bench decode: ctx + steps must stay below {limit - KV_MARGIN}")
    gpu, copy_gbps = measure_copy_rate(device)
    ctx = _Context(opts, config, mc, device, copy_gbps, gpu, utc_now())
    if opts.out_dir:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        ctx.partial = os.path.join(opts.out_dir, f"decode-partial-{stamp}.json")
    print(f"# {gpu}: device-to-device copy {ctx.copy_gbps:.0f} GB/s (read + write)")
    print(f"# {opts.model}, {mc.num_layers} layers, ctx {opts.ctx}, {opts.steps} steps timed")
    for mode in opts.modes:
        for kv_dtype in opts.kv_dtypes:
            _run_execrt(ctx, mode, kv_dtype)
            release_memory()
    if opts.ttft:
        _run_ttft(ctx)
        release_memory()
        ctx.checkpoint()
    if opts.hf:
        _run_hf(ctx)
        release_memory()
    _compare_to_peers(ctx.records)
    _compare_kv_dtypes(ctx.records)
    if opts.profile:
        print(format_profiles(ctx.records))
    records = report(ctx.records, format_table, opts.out_dir, "decode-step")
    if ctx.partial is not None and os.path.exists(ctx.partial):
        os.remove(ctx.partial)  # the final file has every record
    return records


# -- execrt ---------------------------------------------------------------------------------------
def _run_execrt(ctx: _Context, mode: str, kv_dtype: str = "auto") -> None:
    opts = ctx.opts
    sizes = sorted(set(opts.batch_sizes))
    context_len = opts.context_limit(ctx.model_config.max_position_embeddings)
    graph: dict[str, Any] = {"cuda_graph_bs": ",".join(map(str, sizes))} if mode == "graph" else {}
    print(f"# execrt {mode}, KV cache {kv_dtype}", flush=True)
    try:
        engine = Engine(
            loader=RandomWeightsLoader(ctx.config, opts.seed),
            device=opts.device,
            dtype="auto",  # the config's bfloat16 on CUDA, float32 on CPU
            attention_backend=opts.attention,
            graph_backend=MODES[mode],
            max_running_requests=max(sizes),
            kv_cache_tokens=max(sizes) * opts.run_len,  # the KV pool holds what the run needs
            context_len=context_len,
            max_prefill_tokens=max(opts.ctx, PREFILL_CHUNK),
            seed=opts.seed,
            overlap_schedule=opts.overlap,
            fused_kernels=opts.fused_kernels,
            kv_cache_dtype=kv_dtype,
            **graph,
        )
    except Exception as exc:  # e.g. a backend that cannot run graphs: report, keep going
        note = failure_note(exc)
        for bs in opts.batch_sizes:
            ctx.add(
                mode, "generate", bs, None, opts.attention, note=note, overlap=opts.overlap,
                kv_dtype=kv_dtype,
            )  # fmt: skip
        return
    attention = chosen_backend(engine.resolution, "attention")
    ov: dict[str, Any] = {
        "overlap": opts.overlap, "fused_kernels": opts.fused_kernels, "kv_dtype": kv_dtype,
        "context_len": engine.worker.limits.context_len, "env_config": envs.config_overrides(),
        "kernel_env": envs.kernel_switches(),
    }  # fmt: skip
    tag = mode if kv_dtype == "auto" else f"{mode}-{kv_dtype}"  # profile trace names
    with engine:
        for bs in opts.batch_sizes:
            prompts = _prompts(bs, opts.ctx, ctx.model_config.vocab_size, opts.seed + bs)
            try:
                generate = functools.partial(_generate_s, engine, prompts)
                t = difference_timing(generate, opts.steps, opts.reps, base=opts.generate_base)
                rec = ctx.add(mode, "generate", bs, t.step_s, attention, note=t.note, **ov)
                rec.prefill_ms = t.prefill_s * 1e3
                if opts.profile:
                    _profile_generate(engine, prompts, opts, rec, f"{tag}-generate-bs{bs}")
            except Exception as exc:
                ctx.add(mode, "generate", bs, None, attention, note=failure_note(exc), **ov)
            try:
                label = f"{tag}-bs{bs}" if opts.profile else None
                fwd = _time_forward(engine, prompts, opts, profile=label)
                note = "" if fwd.graphed or mode == "eager" else "graph not used"
                rec = ctx.add(mode, "forward", bs, fwd.step_s, attention, note=note, **ov)
                if fwd.profile:
                    rec.profile = asdict(fwd.profile) | {"gpu_busy_pct": fwd.profile.gpu_busy_pct}
                    rec.kernels = fwd.kernels
                    print(f"    profile: {fwd.profile.describe()}", flush=True)
                    print(format_kernels(fwd.kernels or []), flush=True)
            except Exception as exc:
                ctx.add(mode, "forward", bs, None, attention, note=failure_note(exc), **ov)
            ctx.checkpoint()


def _generate_s(engine: Engine, prompts: list[list[int]], new_tokens: int, reps: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    device = engine.worker.limits.device
    best = math.inf
    for _ in range(reps):
        # A cold prefix cache each time: the same prompts would otherwise hit it (t(1) would
        # time no prefill), and the K/V it keeps from earlier calls fills a cache sized for
        # one run, so decode steps would evict as they go.
        engine.flush_cache()
        seconds, results = timed_call(lambda: engine.generate(prompts, params), device)
        best = min(best, seconds)
        for r in results:
            if r.error or len(r.token_ids) != new_tokens or r.num_retractions:
                raise RuntimeError(
                    f"generate gave {len(r.token_ids)} of {new_tokens} tokens, "
                    f"{r.num_retractions} retractions ({r.error or r.finish_reason})"
                )
    return best


def _profile_generate(
    engine: Engine, prompts: list[list[int]], opts: Options, rec: Record, label: str
) -> None:
    """Profile the generate path's decode steps: kernels and GPU busy vs wall per step by
    difference (a generate of base + ``opts.steps`` tokens less one of base, as the step is
    timed: the prefill cancels), and where the host's own time goes per step (cProfile, by
    the same difference)."""
    steps, base = opts.steps, opts.generate_base
    device = engine.worker.limits.device

    def run(tokens: int) -> None:
        _generate_s(engine, prompts, tokens, 1)

    report = profile_difference(run, steps, device, _trace_path(opts, label), base=base)
    host = host_hotspots(lambda: run(base + steps), steps, base=lambda: run(base))
    report = dataclasses.replace(report, host_us_per_step=host.host_us_per_step)
    rec.profile = asdict(report) | {"gpu_busy_pct": report.gpu_busy_pct}
    rec.hotspots = [(where, round(us, 1)) for where, us in host.hotspots]
    print(f"    profile: {report.describe()}", flush=True)
    print("    host hotspots (us/step, own time): " + ", ".join(
        f"{where} {us:.0f}" for where, us in rec.hotspots[:8]
    ), flush=True)  # fmt: skip


def _trace_path(opts: Options, label: str) -> str | None:
    if not opts.out_dir:
        return None
    os.makedirs(opts.out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return os.path.join(opts.out_dir, f"decode-trace-{opts.model}-{label}-{stamp}.json")


@dataclass
class _ForwardTiming:
    step_s: float
    graphed: bool
    profile: StepProfile | None
    kernels: list[tuple[str, float, float, float]] | None = None  # see Record.kernels


def _time_forward(
    engine: Engine, prompts: list[list[int]], opts: Options, *, profile: str | None
) -> _ForwardTiming:
    """Prefill ``prompts`` through the worker, then time forward + sample of one decode batch."""
    worker, memory = engine.worker, engine.worker.memory
    mr = worker.model_runner
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = [Req(-1 - i, list(p), params) for i, p in enumerate(prompts)]
    try:
        per_chunk = max(1, engine.config.max_prefill_tokens // opts.ctx)
        for start in range(0, len(reqs), per_chunk):
            chunk = reqs[start : start + per_chunk]
            inputs = memory.reserve_extend(chunk, [len(r.origin_input_ids) for r in chunk])
            if inputs is None:
                raise RuntimeError("the KV cache cannot hold the prompts")
            result = worker.forward_batch_generation(ScheduleBatch.of(chunk, inputs, memory.stager))
            for req, token in zip(chunk, result.token_ids(), strict=True):
                req.kv_len = req.seq_len
                req.output_ids.append(int(token))
        inputs = memory.reserve_decode(reqs)
        if inputs is None:
            raise RuntimeError("the KV cache has no slot left for the decode step")
        decode = ScheduleBatch.of(reqs, inputs, memory.stager)
        fb = ForwardBatch.init_new(decode)

        def step() -> bool:
            out = mr.forward(fb)
            mr.sample(out.logits_output, fb)
            return out.can_run_graph

        graphed = step()
        step()
        step_s = step_seconds(step, opts.steps, opts.reps, mr.device)
        if not profile:
            return _ForwardTiming(step_s, graphed, None)
        report = profile_steps(step, PROFILE_STEPS, mr.device, _trace_path(opts, profile))
        by_kernel = profile_kernels(
            lambda: [step() for _ in range(PROFILE_STEPS)], mr.device, top=KERNEL_ROWS
        )
        kernels = [
            (k.name, round(k.ms * 1e3 / PROFILE_STEPS, 2),
             round(k.critical_ms * 1e3 / PROFILE_STEPS, 2), k.calls / PROFILE_STEPS)
            for k in by_kernel.kernels
        ]  # fmt: skip
        return _ForwardTiming(step_s, graphed, report, kernels)
    finally:
        for req in reqs:
            memory.release(req)


# -- time to first token -------------------------------------------------------------------------
def _run_ttft(ctx: _Context) -> None:
    """One prompt of each ``ttft`` length, 1 new token, on an engine of the default sizes
    (its own: a longer context would change the decode engine's split plans); the prompt's
    FLOPs over that time, against a bf16 matmul timed now."""
    opts, mc = ctx.opts, ctx.model_config
    longest = max(opts.ttft)
    print(f"# time to first token, prompts of {', '.join(map(str, opts.ttft))}", flush=True)
    peak = run_peak_tflops(ctx.device)
    fits = longest + 1 + KV_MARGIN <= mc.max_position_embeddings
    try:
        if not fits:
            raise ExecrtError(f"prompt of {longest} exceeds the model's context")
        engine = Engine(
            loader=RandomWeightsLoader(ctx.config, opts.seed),
            device=opts.device,
            attention_backend=opts.attention,
            graph_backend="none",  # prefill runs eagerly in any mode
            max_running_requests=1,
            context_len=longest + 1 + KV_MARGIN,
            kv_cache_tokens=longest + 1 + KV_MARGIN,
            seed=opts.seed,
            overlap_schedule=opts.overlap,
            fused_kernels=opts.fused_kernels,
        )
    except Exception as exc:
        for n in opts.ttft:
            _add_ttft(ctx, n, None, opts.attention, failure_note(exc), peak)
        return
    attention = chosen_backend(engine.resolution, "attention")
    chunk = engine.worker.limits.max_prefill_tokens
    with engine:
        for n in opts.ttft:
            prompts = _prompts(1, n, mc.vocab_size, opts.seed + n)
            note = f"{math.ceil(n / chunk)} chunk(s) of <= {chunk}"
            try:
                _generate_s(engine, prompts, 1, 1)  # warm-up: kernels for this length
                seconds = _generate_s(engine, prompts, 1, opts.reps)
                _add_ttft(ctx, n, seconds, attention, note, peak)
            except Exception as exc:
                _add_ttft(ctx, n, None, attention, failure_note(exc), peak)


def _add_ttft(
    ctx: _Context, n: int, seconds: float | None, attention: str, note: str, peak: float
) -> Record:
    """A ttft record: ``prefill_ms`` is the time to the first token, its roofline the prompt's
    FLOPs at the measured matmul rate (``pct_roofline`` = ``pct_peak``); ``pct_spec_peak``
    is against the GPU's datasheet dense bf16 peak (None for a GPU not listed)."""
    opts, flops = ctx.opts, prefill_flops(ctx.model_config, n)
    roofline_ms = flops / (peak * 1e12) * 1e3
    achieved = None if seconds is None else flops / seconds / 1e12
    pct = None if achieved is None else 100 * achieved / peak
    spec = dense_bf16_peak_tflops(ctx.gpu) if ctx.device.type == "cuda" else None
    pct_spec = None if achieved is None or spec is None else 100 * achieved / spec
    if achieved is not None:
        datasheet = "" if pct_spec is None else f", {pct_spec:.1f}% of the {spec:.0f} datasheet"
        note = f"{achieved:.0f} TFLOP/s, bf16 matmul {peak:.0f}{datasheet}; {note}"
    rec = Record(
        model=opts.model,
        layers=ctx.model_config.num_layers,
        mode="ttft",
        path="generate",
        bs=1,
        ctx=n,
        steps=1,
        step_ms=None,
        prefill_ms=None if seconds is None else seconds * 1e3,
        tokens_per_s=None if seconds is None else n / seconds,
        roofline_ms=roofline_ms,
        pct_roofline=pct,
        copy_gbps=ctx.copy_gbps,
        weight_gb=0.0,
        kv_gb=0.0,
        gpu=ctx.gpu,
        date=ctx.date,
        attention=attention,
        overlap=opts.overlap,
        fused_kernels=opts.fused_kernels,
        note=note,
        prefill_tflops=achieved,
        peak_tflops=peak,
        pct_peak=pct,
        spec_peak_tflops=spec,
        pct_spec_peak=pct_spec,
    )
    ctx.records.append(rec)
    shown = "skipped" if seconds is None else f"{rec.prefill_ms:.1f} ms, {pct:.1f}% of peak"
    print(f"  ttft       {n} tokens: {shown}: {note}", flush=True)
    return rec


# -- transformers, the peer -----------------------------------------------------------------------
def _run_hf(ctx: _Context) -> None:
    opts, mc = ctx.opts, ctx.model_config
    try:
        import transformers
    except ImportError:
        print("# transformers not importable: no peer timing")
        return
    transformers.logging.set_verbosity_error()
    sizes = [b for b in opts.batch_sizes if not mc.is_moe or b in HF_MOE_BS]
    steps = min(opts.steps, HF_MOE_STEPS) if mc.is_moe else opts.steps
    print("# transformers " + transformers.__version__, flush=True)
    try:
        dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
        model = build_hf_model(ctx.config, opts.seed, ctx.device, dtype)
    except Exception as exc:
        for bs in sizes:
            ctx.add("hf-eager", "generate", bs, None, "hf", steps=steps, note=failure_note(exc))
        return
    attention = "hf-" + str(getattr(model.config, "_attn_implementation", "?"))
    for bs in sizes:
        ids = _hf_ids(bs, opts, mc, ctx.device)
        try:
            t = difference_timing(functools.partial(_hf_generate_s, model, ids), steps, opts.reps)
            rec = ctx.add("hf-eager", "generate", bs, t.step_s, attention, steps=steps, note=t.note)
            rec.prefill_ms = t.prefill_s * 1e3
        except Exception as exc:
            note = failure_note(exc)
            ctx.add("hf-eager", "generate", bs, None, attention, steps=steps, note=note)
        del ids
    if 1 in opts.batch_sizes:
        _run_hf_compile(ctx, model, steps, attention)
    del model


def _run_hf_compile(ctx: _Context, model: Any, steps: int, attention: str) -> None:
    """bs 1 with a static cache and transformers' own torch.compile of the decode forward."""
    opts = ctx.opts
    if opts.hf_compile_timeout <= 0:
        ctx.add("hf-compile", "generate", 1, None, attention, steps=steps, note="disabled")
        return
    ids = _hf_ids(1, opts, ctx.model_config, ctx.device)
    kwargs: dict[str, Any] = {"cache_implementation": "static"}
    if not hasattr(model, "_valid_auto_compile_criteria"):  # transformers without auto-compile
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    try:
        with time_limit(opts.hf_compile_timeout):  # the timing too: a late recompile counts
            start = time.perf_counter()
            # Compile and capture at the largest cache the timing uses (1 + 2S new tokens).
            _hf_generate_s(model, ids, 1 + 2 * steps, reps=2, **kwargs)
            compile_s = time.perf_counter() - start
            generate = functools.partial(_hf_generate_s, model, ids, **kwargs)
            t = difference_timing(generate, steps, opts.reps, base=1 + steps)
        compiled = getattr(model, "_compiled_call", None) is not None or not hasattr(
            model, "_valid_auto_compile_criteria"
        )
        note = f"compile + warm-up {compile_s:.0f} s" + ("" if compiled else "; NOT compiled")
        note += f"; {t.note}" if t.note else ""
        rec = ctx.add(
            "hf-compile", "generate", 1, t.step_s, attention, steps=steps, note=note, base=1 + steps
        )
        rec.prefill_ms = t.prefill_s * 1e3
    except (Exception, TimeLimitExceeded) as exc:
        ctx.add("hf-compile", "generate", 1, None, attention, steps=steps, note=failure_note(exc))
        torch.compiler.reset()


def _hf_ids(bs: int, opts: Options, mc: ModelConfig, device: torch.device) -> torch.Tensor:
    prompts = _prompts(bs, opts.ctx, mc.vocab_size, opts.seed + bs)
    return torch.tensor(prompts, dtype=torch.int64, device=device)  # [bs, ctx]


def _hf_generate_s(
    model: Any, ids: torch.Tensor, new_tokens: int, reps: int, **kwargs: Any
) -> float:
    best = math.inf
    for _ in range(reps):
        seconds, out = timed_call(
            lambda: model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                **kwargs,
            ),
            ids.device,
        )  # as execrt's runs
        best = min(best, seconds)
        if out.shape[1] != ids.shape[1] + new_tokens:
            raise RuntimeError(f"generate gave {out.shape[1] - ids.shape[1]} of {new_tokens}")
    return best


# -- helpers --------------------------------------------------------------------------------------
def _prompts(bs: int, ctx: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (bs, ctx), generator=g).tolist()


def _compare_to_peers(records: list[Record]) -> None:
    """``vs_hf_eager`` / ``vs_hf_compile`` of the generate-path records: transformers is timed
    through a whole ``generate`` (scheduling, sampling, the token's copy to the host), which
    the forward path leaves out, so only the generate path compares like with like. A compile
    peer that did not compile (its note says so) is no compile peer."""
    peers = {
        (r.mode, r.bs): r.step_ms
        for r in records
        if r.mode.startswith("hf-") and r.step_ms and "NOT compiled" not in r.note
    }
    for r in records:
        if r.mode.startswith("hf-") or not r.step_ms or r.path != "generate":
            continue
        if (eager := peers.get(("hf-eager", r.bs))) is not None:
            r.vs_hf_eager = eager / r.step_ms
        if (compiled := peers.get(("hf-compile", r.bs))) is not None:
            r.vs_hf_compile = compiled / r.step_ms


def _compare_kv_dtypes(records: list[Record]) -> None:
    """Each execrt record's step time over the same run's with ``kv_cache_dtype`` auto."""
    auto = {
        (r.mode, r.path, r.bs): r.step_ms
        for r in records
        if r.kv_dtype == "auto" and not r.mode.startswith("hf-") and r.step_ms
    }
    for r in records:
        base = auto.get((r.mode, r.path, r.bs))
        if base and r.step_ms and not r.mode.startswith("hf-"):
            r.vs_kv_auto = r.step_ms / base


def format_kernels(kernels: Sequence[tuple[str, float, float, float]]) -> str:
    """The forward profile's kernel table (Record.kernels), one line each."""
    lines = [f"    {'us/step':>8} {'crit us':>8} {'calls':>6}  kernel (GPU, top {len(kernels)})"]
    lines += [f"    {us:8.1f} {crit:8.1f} {n:6.1f}  {name}" for name, us, crit, n in kernels]
    return "\n".join(lines)


def format_profiles(records: Sequence[Record]) -> str:
    """Per profiled configuration: kernels, launch calls, GPU busy, wall and host per step."""
    lines = [
        f"{'mode':<10} {'path':<8} {'bs':>4} {'kernels':>8} {'launches':>8} {'GPU ms':>8} "
        f"{'wall ms':>8} {'host us':>8}   (per step, profiler on)"
    ]
    for r in records:
        if not r.profile:
            continue
        p, host = r.profile, r.profile.get("host_us_per_step")
        lines.append(
            f"{r.mode:<10} {r.path:<8} {r.bs:>4} {p['kernels_per_step']:>8.0f} "
            f"{p['launch_calls_per_step']:>8.0f} {p['gpu_busy_ms_per_step']:>8.3f} "
            f"{p['wall_ms_per_step']:>8.3f} {'-' if host is None else f'{host:.0f}':>8}"
        )
    return "\n".join(lines)


def format_table(records: Sequence[Record]) -> str:
    lines = [
        f"{'mode':<10} {'path':<8} {'kv':<8} {'bs':>4} {'ctx':>5} {'step ms':>8} {'tok/s':>8} "
        f"{'prefill':>8} {'roof ms':>7} {'%roof':>6} {'vs hf':>6} {'vs hf-c':>7} "
        f"{'vs kv':>6}  note"
    ]
    for r in records:
        lines.append(
            f"{r.mode:<10} {r.path:<8} {r.kv_dtype:<8} {r.bs:>4} {r.ctx:>5} "
            f"{cell(r.step_ms, 8, '.3f')} "
            f"{cell(r.tokens_per_s, 8, '.0f')} {cell(r.prefill_ms, 8, '.1f')} "
            f"{r.roofline_ms:>7.3f} {cell(r.pct_roofline, 6, '.1f')} "
            f"{cell(r.vs_hf_eager, 6, '.2f')} {cell(r.vs_hf_compile, 7, '.2f')} "
            f"{cell(r.vs_kv_auto, 6, '.2f')}  {r.note}"
        )
    return "\n".join(lines)
