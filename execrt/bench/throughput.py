"""Offline throughput benchmark: the workload nano-vllm and mini-sglang publish, through
``Engine.generate``, against the bytes it must read over the copy bandwidth of the same run.

The workload (nano-vllm's ``bench.py``): the Qwen3-0.6B shape with seeded random weights, 256
sequences drawn with Python's ``random`` seeded 0 - every prompt first, ``randint(100, 1024)``
token ids each ``randint(0, 10000)``, then every ``max_tokens`` ``randint(100, 1024)`` - with
``ignore_eos``: 142,827 prompt and 133,966 output tokens. Published on it: vLLM 9,530 output
tok/s (A100 80GB PCIe), nano-vllm 10,009 (A800).

Each named configuration (``CONFIGS``: the defaults, the issue's tuned settings, ...) builds
one engine, warms it up on the first sequences, then times ``generate`` of the whole
workload per temperature (0.6 as published, and greedy): ``repeats`` runs, the median
reported (of an even count, the slower middle run: one run's own numbers, never flattered)
and every run's seconds kept. The roofline is the ideal schedule's
bytes: every prompt prefilled in one step, then all sequences decoding together, each leaving
after its last token; every step reads the weights once (MoE: the experts its batch touches)
and each running sequence reads the K/V of its context. Prefill compute is not counted.
"""

from __future__ import annotations

import collections
import random
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
from execrt.bench.environment import run_environment
from execrt.bench.models import (
    MODELS,
    RandomWeightsLoader,
    kv_bytes_per_step,
    model_config,
    weight_bytes_per_step,
)
from execrt.bench.timing import gc_timer, jit_compiles, profile_kernels, synchronize
from execrt.core.errors import ExecrtError
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine
from execrt.models.config import ModelConfig

#: nano-vllm's draw gives exactly this many output tokens (checked by a test)
PUBLISHED_OUTPUT_TOKENS = 133_966
TUNED = {"max_running_requests": 256, "max_prefill_tokens": 16384, "kv_cache_memory_fraction": 0.85}
#: name -> RuntimeConfig settings; "defaults" sets nothing
CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "tuned": TUNED,
    "tuned-no-overlap": TUNED | {"overlap_schedule": False},
    "tuned-flashinfer": TUNED | {"attention_backend": "flashinfer"},
    "tuned-sample-after-graph": TUNED | {"cuda_graph_sampling": False},
    "defaults-fused-merge": {"triton_decode_merge": "fused"},
    "defaults-auto-merge": {"triton_decode_merge": "auto"},
    "defaults-separate-merge": {"triton_decode_merge": "separate"},
    "defaults-split-2048": {"triton_decode_split_target": 2048},
    "defaults-split-1024": {"triton_decode_split_target": 1024},
    "defaults-split-512": {"triton_decode_split_target": 512},
    # shorter splits with the merge in its own launch (auto fuses it into multi-split launches)
    "defaults-split-1024-separate": {
        "triton_decode_split_target": 1024,
        "triton_decode_merge": "separate",
    },
    "defaults-split-512-separate": {
        "triton_decode_split_target": 512,
        "triton_decode_merge": "separate",
    },
    "defaults-request-order": {"triton_decode_order": "request"},
    "defaults-split-512-separate-request-order": {
        "triton_decode_split_target": 512,
        "triton_decode_merge": "separate",
        "triton_decode_order": "request",
    },
    # one wave of decode programs, several work items each (with the look-ahead)
    "defaults-programs-sm": {"triton_decode_programs": "sm"},
}
WARMUP_SEQS = 32  # the warm-up generate: this many sequences ...
WARMUP_TOKENS = 16  # ... of this many new tokens each
GAPS = 12  # ``--profile``: how many of the longest GPU idle gaps to report
PROFILE_TOP = 40  # ... and kernels by GPU time (the rest is one sum)


@dataclass(frozen=True)
class Options:
    """What one ``execrt bench throughput`` run measures."""

    model: str = "qwen3-0.6b"
    configs: tuple[str, ...] = ("defaults", "tuned")
    temperatures: tuple[float, ...] = (0.6, 0.0)
    num_seqs: int = 256
    min_len: int = 100  # prompt and output lengths are uniform in [min_len, max_len]
    max_len: int = 1024
    max_token_id: int = 10000
    seed: int = 0
    attention: str = "auto"  # unless the configuration names one
    device: str = "cuda"  # "cpu" runs the method on a tiny shape (tests)
    config: dict[str, Any] | None = None  # a custom shape, labelled ``model``, instead of MODELS
    out_dir: str | None = "benchmarks/results"
    #: After each timed run, one more under torch.profiler: the GPU's time by kernel.
    profile: bool = False
    #: With ``profile``: record the host's ops too, and name those that overlap each idle gap.
    profile_host: bool = False
    #: Timed generates per configuration and temperature; the median run is reported (the
    #: slower of the two middle ones for an even count).
    repeats: int = 1

    def __post_init__(self) -> None:
        problems = []
        if self.config is None and self.model not in MODELS:
            problems.append(f"model {self.model!r} unknown (known: {', '.join(MODELS)})")
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            problems.append(f"configs {list(self.configs)} unknown (known: {', '.join(CONFIGS)})")
        if not self.temperatures or min(self.temperatures) < 0:
            problems.append(f"temperatures {list(self.temperatures)} must be >= 0")
        if self.num_seqs < 1 or not 1 <= self.min_len <= self.max_len:
            problems.append(
                f"num_seqs {self.num_seqs} must be >= 1 and 1 <= min_len {self.min_len} "
                f"<= max_len {self.max_len}"
            )
        if self.repeats < 1:
            problems.append(f"repeats {self.repeats} must be >= 1")
        if problems:
            raise ExecrtError("bench throughput: " + "; ".join(problems))


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def draw_workload(
    num_seqs: int = 256,
    min_len: int = 100,
    max_len: int = 1024,
    max_token_id: int = 10000,
    seed: int = 0,
) -> Workload:
    """nano-vllm's draw, in its order: every prompt (length, then its ids), then every
    sequence's ``max_tokens``."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, max_token_id) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_seqs)
    ]
    max_tokens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return Workload(prompts, max_tokens)


def workload_bytes(config: ModelConfig, workload: Workload) -> tuple[float, float]:
    """``(weight bytes, K/V bytes)`` the ideal schedule reads (see the module docstring):
    one prefill step, then decode step ``t`` = 1, 2, ... in which every sequence with more
    than ``t`` tokens to make reads the K/V of its prompt and ``t`` generated tokens."""
    per_token = kv_bytes_per_step(config, 1, 1)
    weights = weight_bytes_per_step(config, len(workload.prompts))  # the prefill step
    kv = 0.0
    decode_steps: collections.Counter[int] = collections.Counter()  # running -> steps
    for prompt, out in zip(workload.prompts, workload.max_tokens, strict=True):
        steps = out - 1  # the first token comes from the prefill
        kv += (steps * len(prompt) + steps * (steps + 1) // 2) * per_token
    for t in range(1, max(workload.max_tokens)):
        decode_steps[sum(1 for out in workload.max_tokens if out - 1 >= t)] += 1
    for running, count in decode_steps.items():
        weights += count * weight_bytes_per_step(config, running)
    return weights, float(kv)


@dataclass
class Record:
    config: dict[str, Any]  # name, the settings given, and what the sizes resolved to
    model: str
    gpu: str
    date: str
    temperature: float
    num_seqs: int
    input_tokens: int
    output_tokens: int
    seconds: float | None
    out_tok_s: float | None
    total_tok_s: float | None
    steps: int
    extend_steps: int
    decode_steps: int
    mean_decode_batch: float | None  # (output tokens - sequences) / decode steps
    retractions: int
    #: The host's time per step beside its waits for the device, and the waits: with overlap,
    #: wait ~0 means the host (scheduling, bookkeeping, launches) bounds the step.
    host_ms_per_step: float | None
    wait_ms_per_step: float | None
    weight_gb: float
    kv_gb: float
    roofline_s: float
    pct_roofline: float | None
    copy_gbps: float
    attention: str
    startup_s: float | None  # building the engine (weights, KV pool, graphs, kernels)
    note: str = ""
    #: ``--profile``: a second run under torch.profiler; GPU busy and the kernels by time
    profile: dict[str, Any] | None = None
    #: Every timed generate's seconds, in order (``seconds`` is their median)
    seconds_each: list[float] = field(default_factory=list)
    #: Milliseconds Python's garbage collector ran during the reported run
    gc_ms: float | None = None
    #: Triton JIT compilations during the reported run, and their milliseconds (a warm engine
    #: has none: each is a specialisation the warm-up did not meet, and stalls the GPU)
    jit_compiles: int | None = None
    jit_compile_ms: float | None = None
    #: What produced the record: execrt's version and commit, the libraries', CUDA's and the
    #: driver's (``environment.run_environment``)
    env: dict[str, str | None] = field(default_factory=dict)


@dataclass
class _Run:
    """What every record of one run shares."""

    opts: Options
    shape: dict[str, Any]
    model_config: ModelConfig
    workload: Workload
    copy_gbps: float
    gpu: str
    date: str
    weight_bytes: float
    kv_bytes: float
    env: dict[str, str | None]
    records: list[Record] = field(default_factory=list)


def run(opts: Options) -> list[Record]:
    """Every configuration at every temperature; print a table last; save JSON."""
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExecrtError("bench throughput: needs a CUDA device (none is visible)")
    prepare_out_dir("throughput", opts.out_dir)
    shape = model_config(opts.model, config=opts.config)
    mc = ModelConfig.from_dict(shape)
    if opts.max_token_id >= mc.vocab_size:
        raise ExecrtError(
            f"bench throughput: token ids up to {opts.max_token_id} exceed the vocabulary"
        )
    workload = draw_workload(
        opts.num_seqs, opts.min_len, opts.max_len, opts.max_token_id, opts.seed
    )
    gpu, gbps = measure_copy_rate(device)
    weights, kv = workload_bytes(mc, workload)
    r = _Run(opts, shape, mc, workload, gbps, gpu, utc_now(), weights, kv, run_environment())
    print(
        f"# {gpu}: copy {gbps:.0f} GB/s; {opts.model}, {opts.num_seqs} sequences, "
        f"{workload.input_tokens} prompt + {workload.output_tokens} output tokens; roofline "
        f"{(weights + kv) / (gbps * 1e9):.2f} s ({weights / 1e9:.0f} GB weights + "
        f"{kv / 1e9:.0f} GB K/V)",
        flush=True,
    )
    for name in opts.configs:
        _run_config(r, name)
        release_memory()  # before the next engine sizes its KV pool from free memory
    return report(r.records, format_table, opts.out_dir, "throughput")


def _run_config(r: _Run, name: str) -> None:
    opts, settings = r.opts, CONFIGS[name]
    kwargs = {"attention_backend": opts.attention} | settings
    print(f"# {name}: {settings or 'the defaults'}", flush=True)
    start = time.perf_counter()
    try:
        engine = Engine(
            loader=RandomWeightsLoader(r.shape, opts.seed),
            device=opts.device,
            seed=opts.seed,
            **kwargs,
        )
    except Exception as exc:
        given: dict[str, Any] = {"name": name, "settings": settings}
        note = failure_note(exc)
        for t in opts.temperatures:
            _add(r, given, t, None, None, "none", None, note=note)
        return
    startup = time.perf_counter() - start
    limits = engine.worker.limits
    config: dict[str, Any] = {
        "name": name,
        "settings": settings,
        "max_running_requests": limits.max_running_requests,
        "max_prefill_tokens": limits.max_prefill_tokens,
        "kv_cache_tokens": engine.stats().kv_slots_total,
        "overlap_schedule": engine.config.overlap_schedule,
    }
    attention = chosen_backend(engine.resolution, "attention")
    print(f"  engine ready in {startup:.1f} s: {config}", flush=True)
    with engine:
        for t in opts.temperatures:
            try:
                warm = r.workload.prompts[:WARMUP_SEQS]
                engine.generate(warm, _params(t, [WARMUP_TOKENS] * len(warm)))
                runs = [_timed_generate(engine, r.workload, t) for _ in range(opts.repeats)]
                seconds, stats = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
                rec = _add(r, config, t, seconds, stats, attention, startup)
                rec.seconds_each = [run[0] for run in runs]
                each = ", ".join(f"{x:.3f}" for x in rec.seconds_each)
                print(
                    f"    runs (s): {each}; garbage collection {rec.gc_ms:.1f} ms; "
                    f"{rec.jit_compiles} JIT compiles ({rec.jit_compile_ms:.0f} ms)",
                    flush=True,
                )
                if opts.profile:
                    rec.profile = prof = _profile(engine, r.workload, t, host=opts.profile_host)
                    # The profiler slows the host: the GPU's idle time is better estimated
                    # from the unprofiled run's wall clock.
                    prof["unprofiled_idle_s"] = seconds - prof["gpu_busy_s"]
                    print(
                        f"    unprofiled {seconds:.3f} s - profiled GPU busy "
                        f"{prof['gpu_busy_s']:.3f} s = {prof['unprofiled_idle_s'] * 1e3:.0f} ms "
                        "of GPU idle (an estimate)",
                        flush=True,
                    )
            except Exception as exc:
                _add(r, config, t, None, None, attention, startup, note=failure_note(exc))


def _params(temperature: float, max_tokens: Sequence[int]) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=m, temperature=temperature, ignore_eos=True)
        for m in max_tokens
    ]


def _timed_generate(
    engine: Engine, workload: Workload, temperature: float
) -> tuple[float, dict[str, float]]:
    """Seconds for one generate of the whole workload, and the scheduler's step counts."""
    stats = engine.scheduler.stats
    before = dict(vars(stats))
    params = _params(temperature, workload.max_tokens)
    device = engine.worker.limits.device
    engine.flush_cache()  # every run prefills every prompt (the warm-up's and earlier runs')
    synchronize(device)
    # the collector stays on, as a user's process has it
    with gc_timer() as collected, jit_compiles() as compiled:
        start = time.perf_counter()
        results = engine.generate(workload.prompts, params)
        synchronize(device)
        seconds = time.perf_counter() - start
    _say_compiles(compiled, "timed")
    for res, want in zip(results, workload.max_tokens, strict=True):
        if res.error or len(res.token_ids) != want:
            raise RuntimeError(
                f"generate gave {len(res.token_ids)} of {want} tokens ({res.error or 'no error'})"
            )
    return seconds, {k: v - before[k] for k, v in vars(stats).items()} | {
        "gc_s": collected[0],
        "jit_compiles": len(compiled),
        "jit_compile_s": sum(took for _, took in compiled),
    }


def _say_compiles(compiled: list[tuple[str, float]], run: str) -> None:
    """Print each Triton compilation ``jit_compiles`` caught in the ``run`` run."""
    for kernel, took in compiled:
        print(f"    JIT compile in the {run} run: {took * 1e3:.0f} ms {kernel}", flush=True)


def _profile(
    engine: Engine, workload: Workload, temperature: float, *, host: bool = False
) -> dict[str, Any]:
    """The whole workload once more under torch.profiler: where the GPU's time goes."""
    params = _params(temperature, workload.max_tokens)

    def run() -> None:
        engine.flush_cache()
        with jit_compiles() as compiled:
            engine.generate(workload.prompts, params)
        _say_compiles(compiled, "profiled")

    prof = profile_kernels(run, engine.worker.limits.device, top=PROFILE_TOP, gaps=GAPS, host=host)
    print(prof.describe(), flush=True)
    return asdict(prof)


def _add(
    r: _Run,
    config: dict[str, Any],
    temperature: float,
    seconds: float | None,
    stats: dict[str, float] | None,
    attention: str,
    startup: float | None,
    note: str = "",
) -> Record:
    wl, stats = r.workload, stats or {}
    roofline_s = (r.weight_bytes + r.kv_bytes) / (r.copy_gbps * 1e9)
    decode_steps = int(stats.get("decode_steps", 0))
    steps = int(stats.get("steps", 0))
    wait_s = stats.get("wait_s")
    host_ms = wait_ms = None
    if seconds is not None and wait_s is not None and steps:
        host_ms, wait_ms = (seconds - wait_s) / steps * 1e3, wait_s / steps * 1e3
    rec = Record(
        config=config,
        model=r.opts.model,
        gpu=r.gpu,
        date=r.date,
        temperature=temperature,
        num_seqs=len(wl.prompts),
        input_tokens=wl.input_tokens,
        output_tokens=wl.output_tokens,
        seconds=seconds,
        out_tok_s=None if seconds is None else wl.output_tokens / seconds,
        total_tok_s=None if seconds is None else (wl.input_tokens + wl.output_tokens) / seconds,
        steps=steps,
        extend_steps=int(stats.get("extend_steps", 0)),
        decode_steps=decode_steps,
        mean_decode_batch=(wl.output_tokens - len(wl.prompts)) / decode_steps
        if decode_steps
        else None,
        retractions=int(stats.get("retractions", 0)),
        host_ms_per_step=host_ms,
        wait_ms_per_step=wait_ms,
        weight_gb=r.weight_bytes / 1e9,
        kv_gb=r.kv_bytes / 1e9,
        roofline_s=roofline_s,
        pct_roofline=None if seconds is None else 100 * roofline_s / seconds,
        copy_gbps=r.copy_gbps,
        attention=attention,
        startup_s=startup,
        note=note,
        gc_ms=None if "gc_s" not in stats else stats["gc_s"] * 1e3,
        jit_compiles=None if "jit_compiles" not in stats else int(stats["jit_compiles"]),
        jit_compile_ms=None if "jit_compile_s" not in stats else stats["jit_compile_s"] * 1e3,
        env=r.env,
    )
    r.records.append(rec)
    shown = f"{rec.out_tok_s:,.0f} output tok/s" if rec.out_tok_s else f"skipped: {note}"
    print(f"  {config['name']:<16} temperature {temperature:<4} {shown}", flush=True)
    return rec


def format_table(records: Sequence[Record]) -> str:
    lines = [
        f"{'config':<16} {'temp':>4} {'out tok/s':>9} {'total tok/s':>11} {'s':>6} "
        f"{'steps':>6} {'mean bs':>7} {'host ms':>7} {'wait ms':>7} {'retract':>7} {'%roof':>6} "
        f"{'running':>7} "
        f"{'prefill':>7} {'KV slots':>9}  note"
    ]
    for r in records:
        c = r.config
        lines.append(
            f"{c['name']:<16} {r.temperature:>4} {cell(r.out_tok_s, 9, ',.0f')} "
            f"{cell(r.total_tok_s, 11, ',.0f')} {cell(r.seconds, 6, '.2f')} {r.steps:>6} "
            f"{cell(r.mean_decode_batch, 7, '.1f')} {cell(r.host_ms_per_step, 7, '.2f')} "
            f"{cell(r.wait_ms_per_step, 7, '.2f')} {r.retractions:>7} "
            f"{cell(r.pct_roofline, 6, '.1f')} {c.get('max_running_requests', '-'):>7} "
            f"{c.get('max_prefill_tokens', '-'):>7} {c.get('kv_cache_tokens', '-'):>9}  {r.note}"
        )
    return "\n".join(lines)
