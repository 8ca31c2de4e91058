"""Prefix-cache benchmark: a random-weight model shape on the GPU, the same workloads with the
cache on, off and force-missed; hit rate, TTFT as a user sees it, throughput.

Method:
- workloads (token-id prompts, greedy, ``ignore_eos`` so every request generates exactly its
  output length):
  - ``shared-prefix``: ``groups`` x ``per_group`` prompts, each a group's shared prefix
    (``prefix_len`` random tokens) and its own question (``question_len``), in a seeded
    random order; the ideal hit rate is ``(per_group - 1) * prefix_len / (per_group *
    (prefix_len + question_len))`` (88% for the issue's 32 x 16, 2048 + 128);
  - ``random``: ``random_prompts`` prompts of ``prefix_len + question_len`` random tokens
    (nothing to share: the cache's overhead);
  - ``chat``: ``conversations`` conversations of ``turns`` turns; turn k's prompt is turn
    k-1's prompt, its answer (``answer_len`` tokens) and ``turn_len`` new tokens;
- each cache setting gets its own Engine (``prefix_cache`` "radix" / "none", and
  ``prefix_cache_force_miss``), warmed up (kernels compiled, a cache hit taken), and the cache
  is flushed before each workload, so every run starts cold;
- a workload's requests are all submitted at once through the Engine's request API
  (``submit`` / ``step``, bench/load.py ``replay``), so TTFT is what a user sees: from
  submission to the first token handed to the caller, queueing included (wall clock);
- throughput counts prompt and output tokens per second of the whole run; the hit rate is the
  prefix cache's (prompt tokens found cached at admission / prompt tokens admitted);
- the floor (``workload_floor``): the run's ideal time, from the workload's token lists alone
  (not the engine's hits), at a dense matmul rate and a copy rate measured in the same run
  (``measure_roof``): the prefill FLOPs of the prompt tokens that must be computed (cache off
  or force-missed: all; on: those no earlier prompt or answer of the run computed, and at
  least each prompt's last) at the matmul rate, plus the bytes the decode steps must read
  (the weights once a step, every request the K/V of its context, all requests of a wave
  decoding together) at the copy rate. ``pct_floor`` = floor / measured seconds x 100.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from execrt.bench.common import (
    cell,
    failure_note,
    prepare_out_dir,
    release_memory,
    report,
    require_cuda_unless_cpu,
    smoke_defaults,
    smoke_note,
    utc_now,
    where_problems,
)
from execrt.bench.floor import Roof, Served, measure_roof, workload_floor
from execrt.bench.http_load import Request, Run
from execrt.bench.load import percentile, replay
from execrt.bench.models import (
    MODELS,
    SMOKE_MODEL,
    SMOKE_SHAPE,
    RandomWeightsLoader,
    model_config,
)
from execrt.core.errors import ExecrtError
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine
from execrt.engine.client import EngineStats, RequestOutput
from execrt.models.config import ModelConfig

WORKLOADS = ("shared-prefix", "random", "chat")
#: cache setting -> Engine keywords
CACHES: dict[str, dict[str, Any]] = {
    "on": {"prefix_cache": "radix"},
    "off": {"prefix_cache": "none"},
    "force_miss": {"prefix_cache": "radix", "prefix_cache_force_miss": True},
}
#: ``--device cpu``: what a field left at its default (the GPU run's) becomes, see
#: ``smoke_defaults``. The GPU defaults there (qwen3-8b, 32 x 16 prompts of 2,176 tokens)
#: took over 20 GB of host memory before the kernel killed the run.
CPU_SMOKE: dict[str, Any] = {
    "model": SMOKE_MODEL,
    "config": SMOKE_SHAPE,
    "groups": 3,
    "per_group": 4,
    "prefix_len": 48,
    "question_len": 8,
    "output_len": 4,
    "random_prompts": 4,
    "turns": 3,
    "turn_len": 24,
    "answer_len": 4,
    "conversations": 2,
}


@dataclass(frozen=True)
class Options:
    """What one ``execrt bench prefix`` run measures (defaults: the issue's workloads)."""

    model: str = "qwen3-8b"
    layers: int | None = None
    config: dict[str, Any] | None = None  # a custom shape, labelled ``model``, instead of MODELS
    workloads: tuple[str, ...] = WORKLOADS
    caches: tuple[str, ...] = ("on", "off", "force_miss")
    groups: int = 32
    per_group: int = 16
    prefix_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    random_prompts: int = 64
    turns: int = 5
    turn_len: int = 1024
    answer_len: int = 64
    conversations: int = 3
    # 0: the engine's own sizing, what a user gets (on a GPU every prompt of the default
    # workload runs at once; a cap makes TTFT mostly the queue behind the running requests).
    max_running_requests: int = 0
    max_prefill_tokens: int = 0
    kv_cache_memory_fraction: float = 0.0
    kv_cache_tokens: int = 0  # 0: the memory fraction decides
    device: str = "cuda"  # "cpu": the whole method, on CPU_SMOKE where nothing else was set
    seed: int = 0
    out_dir: str | None = "benchmarks/results"
    #: Fields the caller set on purpose (the CLI's typed flags): a ``--device cpu`` smoke run
    #: keeps them even where they equal the GPU default (``smoke_defaults``).
    typed: frozenset[str] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        problems = []
        if self.config is None and self.model not in MODELS:
            problems.append(f"model {self.model!r} unknown (known: {', '.join(MODELS)})")
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            problems.append(f"workloads {list(self.workloads)} (known: {', '.join(WORKLOADS)})")
        bad = [c for c in self.caches if c not in CACHES]
        if bad or not self.caches:
            problems.append(f"caches {list(self.caches)} (known: {', '.join(CACHES)})")
        sizes = ["groups", "per_group", "prefix_len", "question_len", "output_len", "turns"]
        sizes += ["random_prompts", "turn_len", "answer_len", "conversations"]
        problems += [f"{n} {getattr(self, n)} must be >= 1" for n in sizes if getattr(self, n) < 1]
        if self.layers is not None and self.layers < 1:
            problems.append(f"layers {self.layers} must be >= 1")
        engine_sizes = ["max_running_requests", "max_prefill_tokens", "kv_cache_tokens"]
        problems += [
            f"{n} {getattr(self, n)} must be >= 0 (0: the engine's own sizing)"
            for n in engine_sizes
            if getattr(self, n) < 0
        ]
        if not 0.0 <= self.kv_cache_memory_fraction <= 1.0:
            problems.append(
                f"kv_cache_memory_fraction {self.kv_cache_memory_fraction} not in [0, 1]"
            )
        problems += where_problems(self.device, self.out_dir)
        if problems:
            raise ExecrtError("bench prefix: " + "; ".join(problems))

    @property
    def context_len(self) -> int:
        """Long enough for the longest request: the last chat turn, or a prompt and its output."""
        chat = self.turns * (self.turn_len + self.answer_len)
        return max(chat, self.prefix_len + self.question_len + self.output_len) + 8


@dataclass
class Record:
    workload: str
    cache: str  # on | off | force_miss
    hit_rate: float  # prompt tokens found cached / prompt tokens admitted
    ttft_ms_mean: float | None
    ttft_ms_p50: float | None
    throughput_tok_s: float  # prompt + output tokens per second
    model: str
    gpu: str
    date: str
    layers: int = 0
    output_tok_s: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    duration_s: float = 0.0
    retractions: int = 0
    ttft_ms_per_turn: list[float] | None = None  # chat: mean over conversations, per turn
    ttft_vs_off: float | None = None  # off's mean TTFT / this one's (> 1: faster first token)
    throughput_vs_off: float | None = None  # this throughput / off's
    # The floor (``workload_floor``) and the rates it divides by, both measured in the run.
    computed_tokens: int = 0  # prompt tokens the floor computes (all, or the cache's misses)
    prefill_floor_s: float | None = None  # their FLOPs at the matmul rate
    decode_floor_s: float | None = None  # the decode steps' bytes at the copy rate
    floor_s: float | None = None  # prefill_floor_s + decode_floor_s
    pct_floor: float | None = None  # floor_s / duration_s x 100
    ttft_floor_ms: float | None = None  # mean over requests: its own prefill at the rates
    pct_ttft_floor: float | None = None  # ttft_floor_ms / ttft_ms_mean x 100
    peak_tflops: float = 0.0  # dense matmul, the engine's dtype (bf16 on CUDA, fp32 on CPU)
    copy_gbps: float = 0.0  # read + write
    note: str = ""


@dataclass
class _Measured:
    ttft_ms: list[float]
    prompt_tokens: int
    output_tokens: int
    duration_s: float
    before: EngineStats
    after: EngineStats
    waves: list[list[Served]]  # what the floor counts: the requests, as they were submitted
    per_turn: list[float] | None = field(default=None)


def shared_prefix_requests(opts: Options, vocab: int) -> list[Request]:
    rng = random.Random(opts.seed)
    reqs = []
    for _ in range(opts.groups):
        prefix = _tokens(rng, opts.prefix_len, vocab)
        for _ in range(opts.per_group):
            prompt = prefix + _tokens(rng, opts.question_len, vocab)
            reqs.append(Request(prompt, opts.output_len))
    rng.shuffle(reqs)
    return reqs


def random_requests(opts: Options, vocab: int) -> list[Request]:
    rng = random.Random(opts.seed + 1)
    n = opts.prefix_len + opts.question_len
    return [Request(_tokens(rng, n, vocab), opts.output_len) for _ in range(opts.random_prompts)]


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def run(opts: Options) -> list[Record]:
    """Run every workload under every cache setting; print a table; save JSON to ``out_dir``.
    On CPU the fields ``opts`` leaves at their defaults take CPU_SMOKE's values."""
    device = torch.device(opts.device)
    require_cuda_unless_cpu("prefix", device)
    given, opts = opts, smoke_defaults(opts, CPU_SMOKE)
    prepare_out_dir("prefix", opts.out_dir)
    config = model_config(opts.model, opts.layers, opts.config)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    date, layers = utc_now(), int(config["num_hidden_layers"])
    vocab = int(config["vocab_size"])
    mc = ModelConfig.from_dict(config)
    roof = measure_roof(device, mc)  # before any engine holds the device
    print(
        f"# {gpu}: {opts.model}, {layers} layers; workloads {', '.join(opts.workloads)}; "
        f"matmul {roof.tflops:.3g} TFLOP/s, copy {roof.gbps:.0f} GB/s (the floor's rates)"
    )
    if note := smoke_note(given, opts):
        print(note)
    records: list[Record] = []
    for cache in opts.caches:
        print(f"# prefix cache {cache}", flush=True)
        try:
            with _engine(opts, config, cache) as engine:
                _warm_up(engine, opts, vocab)
                for workload in opts.workloads:
                    engine.flush_cache()
                    m = _measure(engine, opts, workload, vocab)
                    records.append(_record(opts, workload, cache, m, gpu, date, layers))
                    _add_floor(records[-1], m, mc, roof)
                    print(f"  {_describe(records[-1])}", flush=True)
        except Exception as exc:  # e.g. out of memory: say so in the records, go on
            done = {r.workload for r in records if r.cache == cache}
            note = failure_note(exc)
            for workload in (w for w in opts.workloads if w not in done):
                records.append(Record(workload, cache, 0.0, None, None, 0.0, opts.model, gpu, date))
                records[-1].note, records[-1].layers = note, layers
                records[-1].peak_tflops, records[-1].copy_gbps = roof.tflops, roof.gbps
                print(f"  {workload:<13} {cache:<10} failed: {note}", flush=True)
        release_memory()
    _compare_to_off(records)
    return report(records, format_table, opts.out_dir, "prefix")


def _engine(opts: Options, config: dict[str, Any], cache: str) -> Engine:
    sizing: dict[str, Any] = {}
    if opts.kv_cache_memory_fraction:
        sizing = {"kv_cache_memory_fraction": opts.kv_cache_memory_fraction}
    if opts.kv_cache_tokens:
        sizing = {"kv_cache_tokens": opts.kv_cache_tokens}
    positions = max(int(config["max_position_embeddings"]), opts.context_len)
    return Engine(
        loader=RandomWeightsLoader(config | {"max_position_embeddings": positions}),
        device=opts.device,
        dtype="auto",  # the shape's bfloat16 on CUDA, float32 on CPU
        context_len=opts.context_len,
        max_running_requests=opts.max_running_requests,
        max_prefill_tokens=opts.max_prefill_tokens,
        seed=opts.seed,
        **sizing,
        **CACHES[cache],
    )


def _warm_up(engine: Engine, opts: Options, vocab: int) -> None:
    """Compile what the runs use: long prefills, an extend on a cached prefix, decodes."""
    rng = random.Random(opts.seed + 2)
    prompt = _tokens(rng, opts.prefix_len + opts.question_len, vocab)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    engine.generate([prompt, _tokens(rng, len(prompt), vocab)], params)
    engine.generate(prompt[:-1] + [0], params)  # on the cached prefix (with the cache on)


def _measure(engine: Engine, opts: Options, workload: str, vocab: int) -> _Measured:
    before = engine.stats()
    if workload == "chat":
        return _chat(engine, opts, vocab, before)
    if workload == "shared-prefix":
        reqs = shared_prefix_requests(opts, vocab)
    else:
        reqs = random_requests(opts, vocab)
    timings, seconds = replay(engine, Run(None, None, tuple(reqs), (0.0,) * len(reqs)))
    failed = [t.error for t in timings if t.error or not t.chunks]
    if failed:
        raise ExecrtError(f"bench prefix: {len(failed)} requests failed ({failed[0]})")
    return _Measured(
        ttft_ms=[(t.chunks[0] - t.sent) * 1e3 for t in timings],
        prompt_tokens=sum(len(r.prompt) for r in reqs),
        output_tokens=sum(t.tokens for t in timings),
        duration_s=seconds,
        before=before,
        after=engine.stats(),
        waves=[[Served(r.prompt, r.output_len) for r in reqs]],  # all submitted at once
    )


def _chat(engine: Engine, opts: Options, vocab: int, before: EngineStats) -> _Measured:
    rng = random.Random(opts.seed + 3)
    per_turn: list[list[float]] = [[] for _ in range(opts.turns)]
    prompt_tokens = output_tokens = 0
    waves: list[list[Served]] = []  # one request at a time
    start = time.perf_counter()
    for _ in range(opts.conversations):
        prompt = _tokens(rng, opts.turn_len, vocab)
        for turn in range(opts.turns):
            ttft, answer = _one_request(engine, prompt, opts.answer_len)
            per_turn[turn].append(ttft)
            prompt_tokens, output_tokens = prompt_tokens + len(prompt), output_tokens + len(answer)
            waves.append([Served(prompt, opts.answer_len, answer)])
            prompt = prompt + answer + _tokens(rng, opts.turn_len, vocab)
    return _Measured(
        ttft_ms=[t for turn in per_turn for t in turn],
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        duration_s=time.perf_counter() - start,
        before=before,
        after=engine.stats(),
        waves=waves,
        per_turn=[statistics.fmean(t) for t in per_turn],
    )


def _one_request(engine: Engine, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """One request alone through ``submit`` / ``step``: its TTFT (ms) and its tokens."""
    tokens: list[int] = []
    first: list[float] = []
    errors: list[str] = []

    def on_output(out: RequestOutput) -> None:
        if out.token_ids and not first:
            first.append(time.perf_counter())
        tokens.extend(out.token_ids)
        if out.error:
            errors.append(out.error)

    sent = time.perf_counter()
    engine.submit(prompt, SamplingParams(n, temperature=0, ignore_eos=True), on_output=on_output)
    while engine.step():
        pass
    if errors or not first:
        raise ExecrtError(f"bench prefix: a chat turn failed ({errors[0] if errors else 'empty'})")
    return (first[0] - sent) * 1e3, tokens


def _record(
    opts: Options,
    workload: str,
    cache: str,
    m: _Measured,
    gpu: str,
    date: str,
    layers: int,
) -> Record:
    hits = m.after.prefix_hit_tokens - m.before.prefix_hit_tokens
    queries = m.after.prefix_query_tokens - m.before.prefix_query_tokens
    seconds = m.duration_s
    return Record(
        workload=workload,
        cache=cache,
        hit_rate=hits / queries if queries else 0.0,
        ttft_ms_mean=statistics.fmean(m.ttft_ms) if m.ttft_ms else None,
        ttft_ms_p50=percentile(m.ttft_ms, 50),
        throughput_tok_s=(m.prompt_tokens + m.output_tokens) / seconds if seconds else 0.0,
        model=opts.model,
        gpu=gpu,
        date=date,
        layers=layers,
        output_tok_s=m.output_tokens / seconds if seconds else 0.0,
        requests=len(m.ttft_ms),
        prompt_tokens=m.prompt_tokens,
        output_tokens=m.output_tokens,
        duration_s=seconds,
        retractions=m.after.retractions - m.before.retractions,
        ttft_ms_per_turn=m.per_turn,
    )


def _add_floor(r: Record, m: _Measured, config: ModelConfig, roof: Roof) -> None:
    """``r``'s floor: its requests' ideal time, reusing computed K/V with the cache on only."""
    floor = workload_floor(config, m.waves, roof, reuse=r.cache == "on")
    r.computed_tokens = floor.computed_tokens
    r.prefill_floor_s, r.decode_floor_s, r.floor_s = floor.prefill_s, floor.decode_s, floor.seconds
    r.pct_floor = 100 * floor.seconds / m.duration_s if m.duration_s else None
    r.ttft_floor_ms = statistics.fmean(floor.first_token_s) * 1e3
    r.pct_ttft_floor = 100 * r.ttft_floor_ms / r.ttft_ms_mean if r.ttft_ms_mean else None
    r.peak_tflops, r.copy_gbps = roof.tflops, roof.gbps


def _compare_to_off(records: list[Record]) -> None:
    off = {r.workload: r for r in records if r.cache == "off"}
    for r in records:
        base = off.get(r.workload)
        if base is None:
            continue
        if base.ttft_ms_mean and r.ttft_ms_mean:
            r.ttft_vs_off = base.ttft_ms_mean / r.ttft_ms_mean
        if base.throughput_tok_s:
            r.throughput_vs_off = r.throughput_tok_s / base.throughput_tok_s


def _describe(r: Record) -> str:
    turns = ""
    if r.ttft_ms_per_turn:
        turns = "  turns " + " ".join(f"{t:.1f}" for t in r.ttft_ms_per_turn) + " ms"
    floor = "-" if r.pct_floor is None else f"{r.pct_floor:.1f}%"
    return (
        f"{r.workload:<13} {r.cache:<10} hit {100 * r.hit_rate:5.1f}%  TTFT mean "
        f"{_ms(r.ttft_ms_mean)} p50 {_ms(r.ttft_ms_p50)}  {r.throughput_tok_s:,.0f} tok/s  "
        f"floor {floor}{turns}"
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def format_table(records: Sequence[Record]) -> str:
    lines = [
        f"{'workload':<14}{'cache':<11}{'hit rate':>9}{'TTFT mean':>11}{'TTFT p50':>11}"
        f"{'tok/s':>11}{'TTFT off/x':>11}{'tok/s x/off':>12}{'retract':>8}{'%floor':>7}  note"
    ]
    for r in records:
        lines.append(
            f"{r.workload:<14}{r.cache:<11}{cell(100 * r.hit_rate, 8, '.1f')}%"
            f"{cell(r.ttft_ms_mean, 11, '.1f')}{cell(r.ttft_ms_p50, 11, '.1f')}"
            f"{cell(r.throughput_tok_s, 11, ',.0f')}{cell(r.ttft_vs_off, 11, '.2f')}"
            f"{cell(r.throughput_vs_off, 12, '.2f')}{r.retractions:>8}"
            f"{cell(r.pct_floor, 7, '.1f')}  {r.note}"
        )
    lines.append(
        "(TTFT in ms; tok/s counts prompt and output tokens; %floor: the ideal time of the "
        "run's requests / its measured time)"
    )
    for r in records:
        if r.ttft_ms_per_turn:
            turns = ", ".join(f"{t:.1f}" for t in r.ttft_ms_per_turn)
            last = r.ttft_ms_per_turn[-1] / r.ttft_ms_per_turn[0]
            lines.append(f"chat TTFT per turn, cache {r.cache}: {turns} ms (last/first {last:.2f})")
    return "\n".join(lines).rstrip()
