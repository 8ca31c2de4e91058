"""Serving benchmark: a bounded load generator against ``execrt serve`` over loopback, and the
same requests through the Engine in-process, for the cost of the HTTP path.

Method:
- the server runs a random-weight model shape (``--model``, see bench/models.py) in a child
  process (its own interpreter: the load generator does not share its GIL);
- workloads: ``random`` (prompt and output lengths uniform in [ratio * len, len]) and
  ``shared-prefix`` (groups of prompts sharing a long prefix); token-id prompts, greedy,
  ``ignore_eos`` so every request generates exactly its output length;
- each run is either a fixed ``--max-concurrency`` (a closed loop) or Poisson arrivals at
  ``--request-rate`` (optionally capped by the concurrency); requests stream
  (``stream_options.include_usage``) and the client stamps every chunk;
- the clients (``http_load``: kept-alive connections parsed with h11) run in this process, or,
  for many streams, in load processes of their own (``--client-procs``, by default one per
  ``STREAMS_PER_CLIENT_PROC`` streams, as many as the cores allow) so that the load generator
  is not what limits the numbers;
- metrics as SGLang's ``bench_serving`` and ``vllm bench serve`` define them: TTFT (send to the
  first chunk with tokens), ITL (gaps between chunks), TPOT ((E2E - TTFT) / (tokens - 1)),
  request and output-token throughput;
- then, in this process, one Engine with the same configuration replays every run with the
  same arrivals through its request API (``submit`` / ``step``, no HTTP): ``engine_*`` fields,
  and ``Engine.generate`` of all requests at once for the saturation throughput;
- the limit: each run's output tokens over its floor, at a matmul rate and a copy rate
  measured in the same run once the server has stopped (bench/prefix.py ``measure_roof``).
  The floor is the larger of the ideal schedule of its requests (``workload_floor``: the
  prompt tokens no earlier prompt of the run computed, at the matmul rate; the decode steps,
  at most ``concurrency`` requests at a time, reading the weights once a step and each
  request its K/V, at the copy rate) and the arrivals (no request done before its arrival
  plus its own ideal time alone). ``pct_output_limit`` = ``output_tok_s`` /
  ``output_tok_s_limit`` x 100.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import random
import signal
import statistics
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

import torch

from execrt.bench.common import (
    prepare_out_dir,
    require_cuda_unless_cpu,
    save_records,
    smoke_defaults,
    smoke_note,
    utc_now,
    where_problems,
)
from execrt.bench.floor import Roof, Served, measure_roof, workload_floor
from execrt.bench.http_load import Request, Run, drive_http
from execrt.bench.load import Summary, error_samples, generate_tok_s, replay, summarize
from execrt.bench.models import (
    MODELS,
    SMOKE_MODEL,
    SMOKE_SHAPE,
    RandomWeightsLoader,
    model_config,
)
from execrt.core.errors import ExecrtError
from execrt.engine import Engine
from execrt.engine.process import QUIET_SPAWN
from execrt.models.config import ModelConfig

WORKLOADS = ("random", "shared-prefix")
DEFAULT_CONCURRENCY = (1, 32, 256)  # 256 = max_running_requests: saturation
DEFAULT_RATES = (8.0, 32.0)
CONTEXT_MARGIN = 8
#: Streams one load process carries: at 20-40 us of its CPU per SSE chunk, 16 streams at one
#: chunk per 1-2 ms step keep it under half busy, so its own queueing stays well below a step.
STREAMS_PER_CLIENT_PROC = 16
#: Cores left to the server, its engine and this process when load processes are counted.
RESERVED_CORES = 4
#: Why ``--plot`` cannot draw without the ``plot`` extra.
PLOT_NEEDS = "--plot needs matplotlib (pip install 'execrt[plot]')"
#: ``--device cpu``: what a field left at its default (the GPU run's) becomes, see
#: ``smoke_defaults``. The GPU defaults there (qwen3-0.6b, up to 256 streams of 512-token
#: prompts) would run for hours on a few cores.
CPU_SMOKE: dict[str, Any] = {
    "model": SMOKE_MODEL,
    "config": SMOKE_SHAPE,
    "input_len": 12,
    "output_len": 6,
    "prefix_len": 16,
    "num_groups": 2,
    "concurrencies": (3,),
    "request_rates": (40.0,),
    "num_prompts": 6,
    "max_running_requests": 8,
}


@dataclass(frozen=True)
class Options:
    """What one ``execrt bench serve`` run measures."""

    model: str = "qwen3-0.6b"
    layers: int | None = None
    workload: str = "random"
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.5  # lengths uniform in [ratio * len, len]
    prefix_len: int = 1024  # shared-prefix: tokens every prompt of a group shares
    num_groups: int = 8  # shared-prefix: distinct prefixes
    concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCY
    request_rates: tuple[float, ...] = DEFAULT_RATES
    rate_concurrency: int | None = None  # cap on in-flight requests of the rate runs
    num_prompts: int | None = None  # per run (default: by concurrency or rate, see prompts_for)
    max_running_requests: int = 256
    attention: str = "auto"
    graph: str = "auto"
    device: str = "cuda"  # "cpu": the whole method, on CPU_SMOKE where nothing else was set
    seed: int = 0
    engine: bool = True  # also replay through the Engine in-process
    server: str = "process"  # "process" (measurements) or "thread" (tests: no second start)
    engine_runner: str = "process"  # where the server's engine runs, as ``execrt serve --engine``
    client_procs: int | None = None  # load processes (default: by the streams of each run)
    plot: bool = False
    out_dir: str | None = "benchmarks/results"
    config: dict[str, Any] | None = None  # a custom shape, labelled ``model``, instead of MODELS
    #: Fields the caller set on purpose (the CLI's typed flags): a ``--device cpu`` smoke run
    #: keeps them even where they equal the GPU default (``smoke_defaults``).
    typed: frozenset[str] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        problems = []
        if self.config is None and self.model not in MODELS:
            problems.append(f"model {self.model!r} unknown (known: {', '.join(MODELS)})")
        if self.workload not in WORKLOADS:
            problems.append(f"workload {self.workload!r} unknown (known: {', '.join(WORKLOADS)})")
        if min(self.input_len, self.output_len, self.prefix_len, self.num_groups) < 1:
            problems.append("input_len, output_len, prefix_len and num_groups must be >= 1")
        if not 0.0 < self.range_ratio <= 1.0:
            problems.append(f"range_ratio {self.range_ratio} must be in (0, 1]")
        if not self.concurrencies and not self.request_rates:
            problems.append("give at least one --max-concurrency or --request-rate")
        bad_c = [c for c in self.concurrencies if c < 1]
        if bad_c:
            problems.append(f"max concurrency {', '.join(map(str, bad_c))} must be >= 1")
        bad_r = [r for r in self.request_rates if not (0 < r < math.inf)]  # NaN fails it too
        if bad_r:
            problems.append(
                f"request rate {', '.join(map(str, bad_r))} must be a finite number > 0 per s"
            )
        if self.server not in ("process", "thread"):
            problems.append(f"server {self.server!r} must be 'process' or 'thread'")
        if self.client_procs is not None and self.client_procs < 1:
            problems.append(f"client_procs {self.client_procs} must be >= 1")
        if self.engine_runner not in ("process", "thread"):
            problems.append(f"engine {self.engine_runner!r} must be 'process' or 'thread'")
        for name in ("rate_concurrency", "num_prompts", "layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} {value} must be >= 1")
        problems += where_problems(self.device, self.out_dir)
        if self.plot and not plot_available():  # checked before a run, as the --out folder
            problems.append(PLOT_NEEDS)
        if problems:
            raise ExecrtError("bench serve: " + "; ".join(problems))

    def engine_kwargs(self) -> dict[str, Any]:
        """The Engine configuration the server and the in-process replay share."""
        longest = (self.prefix_len if self.workload == "shared-prefix" else 0) + self.input_len
        return {
            "device": self.device,
            "dtype": "auto",
            "attention_backend": self.attention,
            "graph_backend": self.graph,
            "max_running_requests": self.max_running_requests,
            "context_len": longest + self.output_len + CONTEXT_MARGIN,
            "max_prefill_tokens": max(16384, longest),
            "seed": self.seed,
        }

    def processes_for(self, run: Run) -> int:
        """Load processes of ``run``: as asked, else one per STREAMS_PER_CLIENT_PROC streams
        (at most what the machine has cores for beside the server and its engine)."""
        if self.client_procs is not None:
            return self.client_procs
        streams = run.concurrency or len(run.requests)
        if run.request_rate is not None and run.concurrency is None:  # about rate * E2E
            streams = min(len(run.requests), 64)
        room = max(1, (os.cpu_count() or 1) - RESERVED_CORES)
        return max(1, min(room, math.ceil(streams / STREAMS_PER_CLIENT_PROC)))

    def model_shape(self) -> dict[str, Any]:
        """The benchmark model or the custom ``config``, cut to ``layers`` either way (as the
        other benches do)."""
        return model_config(self.model, self.layers, self.config)


@dataclass
class Record(Summary):
    """One run through HTTP (the Summary fields), its load, and the Engine's numbers."""

    model: str
    layers: int
    gpu: str
    date: str
    workload: str
    concurrency: int | None
    request_rate: float | None
    num_requests: int
    input_len_mean: float
    output_len_mean: float
    engine_output_tok_s: float | None = None  # the same arrivals through Engine.submit/step
    engine_ttft_ms_p50: float | None = None
    engine_itl_ms_p50: float | None = None  # the engine's step time as each request saw it
    engine_tpot_ms_p50: float | None = None
    engine_generate_output_tok_s: float | None = None  # Engine.generate of all requests at once
    throughput_ratio: float | None = None  # output_tok_s / engine_output_tok_s
    generate_ratio: float | None = None  # output_tok_s / engine_generate_output_tok_s
    ttft_overhead_ms: float | None = None  # ttft_ms_p50 - engine_ttft_ms_p50
    itl_ratio: float | None = None  # itl_ms_p50 / engine_itl_ms_p50
    error_samples: list[str] = field(default_factory=list)  # why the first failed requests failed
    server_engine: str = "process"  # where the server's engine ran (execrt serve --engine)
    client_procs: int = 1  # load processes the HTTP clients ran in
    # Engine steps of the run: prefill (extend) steps stall every running request, so how the
    # arrivals batched into prefills explains throughput differences between the two sides.
    extend_steps: int | None = None  # the server's engine, from its /metrics
    decode_steps: int | None = None
    engine_extend_steps: int | None = None  # the in-process replay
    engine_decode_steps: int | None = None
    # Prompt tokens the prefix cache served in the run (each run starts with it flushed: a
    # random workload finds nothing, a shared-prefix one its groups' prefixes).
    prefix_hit_tokens: int | None = None  # the server's engine, from its /metrics
    engine_prefix_hit_tokens: int | None = None
    # The run's physical limit (``run_floor_s``) and the rates it divides by, both measured in
    # the run (dense matmul in the engine's dtype: bf16 on CUDA, fp32 on CPU; copy read + write)
    floor_s: float | None = None
    output_tok_s_limit: float | None = None  # the run's output tokens / floor_s
    pct_output_limit: float | None = None  # output_tok_s / output_tok_s_limit x 100
    engine_pct_output_limit: float | None = None  # engine_output_tok_s / the same limit x 100
    peak_tflops: float | None = None
    copy_gbps: float | None = None


# -- workloads ----------------------------------------------------------------------------------
def make_requests(opts: Options, count: int, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * opts.range_ratio)), n)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prefixes = [tokens(opts.prefix_len) for _ in range(opts.num_groups)]
    out = []
    for i in range(count):
        prompt = tokens(length(opts.input_len))
        if opts.workload == "shared-prefix":
            prompt = prefixes[i % opts.num_groups] + prompt
        out.append(Request(prompt, length(opts.output_len)))
    return out


def prompts_for(opts: Options, concurrency: int | None, rate: float | None) -> int:
    """Requests per run: enough for a steady state, bounded so a run takes seconds."""
    if opts.num_prompts is not None:
        return opts.num_prompts
    if rate is not None:
        return int(min(256, max(32, rate * 8)))
    assert concurrency is not None
    return min(512, max(16, 4 * concurrency))


#: The warm-up's seed offset: no run draws from it (they use ``seed + i``, ``+ 100 + j`` and
#: ``+ 200 + j``), so its prompts share no prefix with a timed run's.
WARM_UP_SEED = 10_000


def warm_up_run(opts: Options, vocab: int) -> Run:
    """Four requests that start the server, the load processes and the engine (imports, first
    connections, kernel compilation) before the timed runs, drawn apart from every run's: a
    warm-up with a run's own prompts would leave them in the prefix cache, and that run's
    first requests would skip their prefill."""
    reqs = make_requests(opts, 4, vocab, opts.seed + WARM_UP_SEED)
    return Run(4, None, tuple(reqs), (0.0,) * len(reqs))


def flush_server_cache(url: str) -> None:
    """Empty the server's prefix cache (``POST /flush_cache``; a server without one answers
    501, which is fine): every timed run starts cold, as its first requests would for a user."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        if exc.code != 501:
            raise


def plan_runs(opts: Options, vocab: int) -> list[Run]:
    runs = []
    for i, c in enumerate(opts.concurrencies):
        reqs = make_requests(opts, prompts_for(opts, c, None), vocab, opts.seed + i)
        runs.append(Run(c, None, tuple(reqs), (0.0,) * len(reqs)))
    for j, rate in enumerate(opts.request_rates):
        reqs = make_requests(opts, prompts_for(opts, None, rate), vocab, opts.seed + 100 + j)
        rng = random.Random(opts.seed + 200 + j)
        t, arrivals = 0.0, []
        for _ in reqs:
            arrivals.append(t)
            t += rng.expovariate(rate)
        runs.append(Run(opts.rate_concurrency, rate, tuple(reqs), tuple(arrivals)))
    return runs


# -- the load generator -------------------------------------------------------------------------
def _serve_child(opts: Options, pipe: Any) -> None:
    """The server process: build, serve on a free loopback port, send its URL, run. It
    starts with SIGINT ignored (QUIET_SPAWN: a Ctrl-C reaches the whole process group, and
    the parent decides); the parent stops it with SIGTERM, which ends a load here and, once
    uvicorn serves, is uvicorn's graceful shutdown."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a load stops as on Ctrl-C
    client: Any = None
    try:
        from execrt.serve.server import UvicornServer, bind, settle_heap, tune_interpreter

        tune_interpreter()  # as execrt serve does
        client = _client(opts)
        server = UvicornServer(client, bind("127.0.0.1", 0))
        if not client.wait_ready():
            pipe.send(("error", client.load_error()))
            client.close()
            return
        settle_heap()  # as execrt serve does once ready
        pipe.send(("ready", server.url))
        server.run()
    except KeyboardInterrupt:  # the parent's SIGTERM while loading
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once is enough: no second traceback
        if client is not None:
            client.close()  # the parent reports the interruption, not this


def _quiet_sigint() -> None:
    """A load process ends on Ctrl-C (the terminal signals the whole group) without printing a
    KeyboardInterrupt traceback of its own: the parent reports the interruption. (Until this
    runs, QUIET_SPAWN has it ignore SIGINT: its bootstrap cannot print one either.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _build_engine(opts: Options) -> Engine:
    return Engine(loader=RandomWeightsLoader(opts.model_shape(), opts.seed), **opts.engine_kwargs())


def _client(opts: Options) -> Any:
    """The server's EngineClient: the engine in a process of its own or on a thread."""
    if opts.engine_runner == "process":
        from execrt.engine.process import ProcessEngineClient

        return ProcessEngineClient(functools.partial(_build_engine, opts), name=opts.model)
    from execrt.engine.threaded import ThreadedEngineClient

    return ThreadedEngineClient(functools.partial(_build_engine, opts), name=opts.model)


class _ServerHandle:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.process: Any = None
        self.thread_server: Any = None

    def start(self) -> str:
        if self.opts.server == "thread":
            from execrt.serve.server import UvicornServer, bind

            client = _client(self.opts)
            if not client.wait_ready():
                client.close()
                raise ExecrtError(f"bench serve: the server failed: {client.load_error()}")
            self.thread_server = UvicornServer(client, bind("127.0.0.1", 0)).start()
            return str(self.thread_server.url)
        parent, child = QUIET_SPAWN.Pipe()
        # Not a daemon: a daemonic process may not start the engine's process.
        self.process = QUIET_SPAWN.Process(target=_serve_child, args=(self.opts, child))
        self.process.start()
        child.close()
        try:
            kind, value = parent.recv()
        except EOFError:  # it died before it could say
            kind, value = "error", f"the server process exited ({self.process.exitcode})"
        if kind != "ready":
            raise ExecrtError(f"bench serve: the server failed: {value}")
        return str(value)

    def stop(self) -> None:
        if self.thread_server is not None:
            self.thread_server.stop()
        if self.process is not None and self.process.is_alive():
            self.process.terminate()  # graceful (SIGTERM, see _serve_child): closes the engine
            self.process.join(120)
            if self.process.is_alive():
                self.process.kill()


def server_steps(url: str) -> tuple[int, int, int]:
    """The server's engine steps so far, (extend, decode), and its prefix-cache hit tokens,
    from its /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from execrt.serve.metrics import P

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    steps = {"extend": 0, "decode": 0}
    hits = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == P + "engine_steps_total":
                steps[sample.labels["kind"]] = int(sample.value)
            elif sample.name == P + "prefix_cache_hits_total":
                hits = int(sample.value)
    return steps["extend"], steps["decode"], hits


def engine_steps(engine: Engine) -> tuple[int, int, int]:
    """The in-process engine's steps so far, (extend, decode), and prefix-cache hit tokens,
    as ``server_steps`` counts them."""
    stats = engine.stats()
    return stats.extend_steps, stats.steps - stats.extend_steps, stats.prefix_hit_tokens


def _steps_between(
    before: tuple[int, int, int], after: tuple[int, int, int]
) -> tuple[int, int, int]:
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_floor_s(config: ModelConfig, run: Run, roof: Roof) -> float:
    """The shortest time ``run`` could take at ``roof``'s rates: its requests' ideal schedule
    (``workload_floor``; at most ``run.concurrency`` at a time, reusing what an earlier prompt
    computed, as the server's prefix cache may), and no request done before its arrival and
    its own ideal time alone."""
    requests = [Served(q.prompt, q.output_len) for q in run.requests]
    floor = workload_floor(config, [requests], roof, reuse=True, slots=run.concurrency)
    arrived = max(at + alone for at, alone in zip(run.arrivals, floor.alone_s, strict=True))
    return max(floor.seconds, arrived)


def _add_limit(rec: Record, config: ModelConfig, run: Run, roof: Roof) -> None:
    rec.floor_s = run_floor_s(config, run, roof)
    rec.output_tok_s_limit = sum(q.output_len for q in run.requests) / rec.floor_s
    rec.pct_output_limit = 100 * rec.output_tok_s / rec.output_tok_s_limit
    rec.peak_tflops, rec.copy_gbps = roof.tflops, roof.gbps


# -- the benchmark ------------------------------------------------------------------------------
class _CtrlC:
    """SIGINT's handler during a run: KeyboardInterrupt, as by default, and remembered. One
    that lands in a ``__del__`` (asyncio closes its transports there) is printed and dropped
    by the interpreter: the run went on, saved its records and exited 0. ``check`` raises it
    again between the steps of a run."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[_CtrlC]:
        """This handler while the block runs (only the main thread may set one)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def run(opts: Options) -> list[Record]:
    """Every run of ``opts`` through HTTP, then through the Engine; print, save, plot. On CPU
    the fields ``opts`` leaves at their defaults take CPU_SMOKE's values."""
    with _CtrlC().installed() as ctrl_c:
        return _run(opts, ctrl_c)


def _run(opts: Options, ctrl_c: _CtrlC) -> list[Record]:
    device = torch.device(opts.device)
    require_cuda_unless_cpu("serve", device)
    given, opts = opts, smoke_defaults(opts, CPU_SMOKE)
    prepare_out_dir("serve", opts.out_dir)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    vocab = int(opts.model_shape()["vocab_size"])
    runs = plan_runs(opts, vocab)
    date = utc_now()
    records = []
    print(f"# {gpu}: {opts.model} served over HTTP, workload {opts.workload}", flush=True)
    if note := smoke_note(given, opts):
        print(note, flush=True)
    server = _ServerHandle(opts)
    most = max(opts.processes_for(r) for r in runs)
    pool: Executor | None = None
    try:  # a Ctrl-C while the server starts must stop it too
        url = server.start()
        warm = warm_up_run(opts, vocab)
        drive_http(url, opts.model, warm)
        if most > 1:  # started once, warmed up (imports, first connection) before the runs
            pool = ProcessPoolExecutor(most, mp_context=QUIET_SPAWN, initializer=_quiet_sigint)
            drive_http(
                url,
                opts.model,
                Run(most, None, warm.requests * most, warm.arrivals * most),
                pool,
                most,
            )
        for r in runs:
            procs = opts.processes_for(r)
            flush_server_cache(url)  # no run finds another's (or the warm-up's) prompts cached
            before = server_steps(url)
            timings, duration = drive_http(url, opts.model, r, pool, procs)
            steps = _steps_between(before, server_steps(url))
            s = summarize(timings, duration)
            records.append(_record(opts, gpu, date, r, s))
            records[-1].extend_steps, records[-1].decode_steps, records[-1].prefix_hit_tokens = (
                steps
            )
            records[-1].error_samples = error_samples(timings)
            records[-1].server_engine = opts.engine_runner
            records[-1].client_procs = procs if pool is not None else 1
            print(f"  http   {_label(r)}: {_describe(s)}", flush=True)
            for why in records[-1].error_samples:
                print(f"    error: {why}", flush=True)
            ctrl_c.check()
    finally:
        # The server first: a load process still running a run (it ignored a Ctrl-C in its
        # bootstrap) then fails its requests at once instead of driving the whole run.
        server.stop()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    gc.collect()
    ctrl_c.check()
    config = ModelConfig.from_dict(opts.model_shape())
    roof = measure_roof(device, config)  # the server gone: the device is this process's
    for r, rec in zip(runs, records, strict=True):
        _add_limit(rec, config, r, roof)
    print(
        f"# the limits' rates: matmul {roof.tflops:.3g} TFLOP/s, copy {roof.gbps:.0f} GB/s",
        flush=True,
    )
    ctrl_c.check()
    if opts.engine:
        with _build_engine(opts) as engine:
            replay(engine, warm)
            for r, rec in zip(runs, records, strict=True):
                engine.flush_cache()  # cold, as the HTTP run was
                before = engine_steps(engine)
                timings, duration = replay(engine, r)
                steps = _steps_between(before, engine_steps(engine))
                rec.engine_extend_steps, rec.engine_decode_steps, rec.engine_prefix_hit_tokens = (
                    steps
                )
                s = summarize(timings, duration)
                rec.engine_output_tok_s = s.output_tok_s
                if rec.output_tok_s_limit:
                    rec.engine_pct_output_limit = 100 * s.output_tok_s / rec.output_tok_s_limit
                rec.engine_ttft_ms_p50 = s.ttft_ms_p50
                rec.engine_itl_ms_p50 = s.itl_ms_p50
                rec.engine_tpot_ms_p50 = s.tpot_ms_p50
                engine.flush_cache()  # the replay just cached these very prompts
                rec.engine_generate_output_tok_s = generate_tok_s(engine, r)
                rec.throughput_ratio = _ratio(rec.output_tok_s, s.output_tok_s)
                rec.generate_ratio = _ratio(rec.output_tok_s, rec.engine_generate_output_tok_s)
                rec.itl_ratio = _ratio(rec.itl_ms_p50, s.itl_ms_p50)
                if rec.ttft_ms_p50 is not None and s.ttft_ms_p50 is not None:
                    rec.ttft_overhead_ms = rec.ttft_ms_p50 - s.ttft_ms_p50
                print(f"  engine {_label(r)}: {_describe(s)}", flush=True)
                ctrl_c.check()
    print(format_table(records))
    if opts.out_dir:
        path = save_records(records, opts.out_dir, "serve")
        print(f"# saved {path}")
        if opts.plot:
            print(f"# plot {plot(records, path[: -len('.json')] + '.png')}")
    return records


def _record(opts: Options, gpu: str, date: str, r: Run, s: Summary) -> Record:
    return Record(
        model=opts.model,
        layers=int(opts.model_shape()["num_hidden_layers"]),
        gpu=gpu,
        date=date,
        workload=opts.workload,
        concurrency=r.concurrency,
        request_rate=r.request_rate,
        num_requests=len(r.requests),
        input_len_mean=statistics.fmean(len(q.prompt) for q in r.requests),
        output_len_mean=statistics.fmean(q.output_len for q in r.requests),
        **asdict(s),
    )


def _label(r: Run) -> str:
    if r.request_rate is None:
        return f"concurrency {r.concurrency:<4}"
    cap = f", cap {r.concurrency}" if r.concurrency else ""
    return f"rate {r.request_rate:g}/s{cap}"


def _describe(s: Summary) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    return (
        f"TTFT p50 {ms(s.ttft_ms_p50)} ms, ITL p50 {ms(s.itl_ms_p50)} ms, "
        f"TPOT p50 {ms(s.tpot_ms_p50)} ms, {s.output_tok_s:.0f} tok/s, "
        f"{s.tokens_per_chunk or 0:.2f} tok/chunk, {s.errors} errors"
    )


def format_table(records: Sequence[Record]) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    head = "conc  rate   ttft50  ttft99  itl50   tpot50  tok/s    %limit engine   ratio  ttft+  "
    head += "errors  prefills(http/engine)"
    lines = [head]
    for r in records:
        lines.append(
            f"{num(r.concurrency, '<5')} {num(r.request_rate, '<6g')} "
            f"{num(r.ttft_ms_p50, '7.2f')} {num(r.ttft_ms_p99, '7.2f')} "
            f"{num(r.itl_ms_p50, '7.2f')} {num(r.tpot_ms_p50, '7.2f')} "
            f"{num(r.output_tok_s, '8.0f')} {num(r.pct_output_limit, '6.1f')} "
            f"{num(r.engine_output_tok_s, '8.0f')} "
            f"{num(r.throughput_ratio, '6.3f')} {num(r.ttft_overhead_ms, '6.2f')} {r.errors:<7} "
            f"{num(r.extend_steps, 'd')}/{num(r.engine_extend_steps, 'd')}"
        )
    return "\n".join(lines)


def plot_available() -> bool:
    """Whether matplotlib, which ``--plot`` draws with, can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(records: Sequence[Record], path: str) -> str:
    """TTFT and ITL p50/p99 against request rate; output throughput against concurrency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ExecrtError(f"bench serve: {PLOT_NEEDS}") from None
    rated = sorted((r for r in records if r.request_rate), key=lambda r: r.request_rate or 0)
    closed = sorted((r for r in records if not r.request_rate), key=lambda r: r.concurrency or 0)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric in zip(axes[:2], ("ttft", "itl"), strict=True):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [getattr(r, f"{metric}_ms_{q}") for r in rated]
            ax.plot([r.request_rate for r in rated], ys, style, label=f"{metric.upper()} {q}")
        if not rated:
            ax.text(0.5, 0.5, "no --request-rate runs", ha="center", transform=ax.transAxes)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(f"{metric.upper()} against request rate")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[2]
    xs = [r.concurrency for r in closed]
    ax.plot(xs, [r.output_tok_s for r in closed], "o-", label="HTTP")
    ax.plot(xs, [r.engine_output_tok_s for r in closed], "s--", label="Engine (in-process)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput against concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    model = records[0].model if records else ""
    gpu = records[0].gpu if records else ""
    fig.suptitle(f"execrt serve: {model} on {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
