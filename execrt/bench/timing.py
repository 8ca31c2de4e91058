"""Timing repeated work: generate differences, back-to-back steps, per-step profiles, limits."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import math
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch

from execrt.bench.common import median_us, release_memory


@dataclass(frozen=True)
class StepProfile:
    """Averages over ``steps`` calls, measured with torch.profiler on (which adds overhead)."""

    steps: int
    kernels_per_step: float  # kernels the GPU ran (memcpy / memset excluded)
    launch_calls_per_step: float  # host launch API calls: kernels and graphs
    graph_launches_per_step: float
    gpu_busy_ms_per_step: float  # union of GPU activity intervals
    wall_ms_per_step: float
    # Host time per step: the forward path's from a step started on an idle GPU (profiler
    # off); a whole generate's from cProfile, waits for the GPU excluded (profiler on).
    host_us_per_step: float | None = None
    # True: every count but host_us_per_step is (run of 1 + steps) - (run of 1), over
    # steps, so a generate's prefill cancels as in difference_timing (profile_difference);
    # the host time stays a whole generate's.
    by_difference: bool = False

    @property
    def gpu_busy_pct(self) -> float:
        return (
            100 * self.gpu_busy_ms_per_step / self.wall_ms_per_step
            if self.wall_ms_per_step
            else 0.0
        )

    def describe(self) -> str:
        host = "" if self.host_us_per_step is None else f", host {self.host_us_per_step:.0f} us"
        if self.host_us_per_step is not None and self.host_us_per_step <= 0:
            host += " (noise: a difference of two runs at or below 0)"
        return (
            f"{self.kernels_per_step:.0f} kernels/step, {self.launch_calls_per_step:.0f} launch "
            f"calls/step ({self.graph_launches_per_step:.0f} graph), GPU busy "
            f"{self.gpu_busy_ms_per_step:.3f} of {self.wall_ms_per_step:.3f} ms wall "
            f"({self.gpu_busy_pct:.0f}%, profiler on"
            f"{', by difference' if self.by_difference else ''}){host}"
        )


def profile_steps(
    step: Callable[[], object], steps: int, device: torch.device, trace_path: str | None = None
) -> StepProfile:
    """Run ``step`` ``steps`` times under torch.profiler (save a Chrome trace when asked),
    then time the host's part of a step (:func:`host_us_per_call`) with the profiler off."""

    def run() -> None:
        for _ in range(steps):
            step()

    report = profile_run(run, steps, device, trace_path)
    return dataclasses.replace(report, host_us_per_step=host_us_per_call(step, steps, device))


def host_us_per_call(step: Callable[[], object], calls: int, device: torch.device) -> float:
    """Median µs until ``step()`` returns, each call started on an idle device: the host's
    own work and launches (a sync inside the step shows up as the device's time)."""
    samples = []
    for _ in range(calls):
        synchronize(device)
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    synchronize(device)
    return statistics.median(samples) * 1e6


def profile_run(
    run: Callable[[], object], steps: int, device: torch.device, trace_path: str | None = None
) -> StepProfile:
    """Profile one call of ``run`` that performs ``steps`` steps (e.g. a whole generate)."""
    events, wall = _profiled(run, device, trace_path)
    on_gpu = _on_gpu(events)
    kernels = [e for e in on_gpu if not e.name.startswith(("Memcpy", "Memset"))]
    launches = [e for e in events if "LaunchKernel" in e.name or "GraphLaunch" in e.name]
    graphs = [e for e in launches if "GraphLaunch" in e.name]
    busy_us = _busy_us(on_gpu)
    return StepProfile(
        steps=steps,
        kernels_per_step=len(kernels) / steps,
        launch_calls_per_step=len(launches) / steps,
        graph_launches_per_step=len(graphs) / steps,
        gpu_busy_ms_per_step=busy_us / steps / 1e3,
        wall_ms_per_step=wall / steps * 1e3,
    )


def profile_difference(
    run: Callable[[int], object],
    steps: int,
    device: torch.device,
    trace_path: str | None = None,
    base: int = 1,
) -> StepProfile:
    """Profile ``run(base)`` and ``run(base + steps)`` (e.g. generates of that many new tokens)
    and report their difference per step: the decode steps alone, the prefill and any per-call
    cost cancelled, as :func:`difference_timing` with the same ``base`` cancels them from the
    wall clock. So the GPU busy time per step is comparable with a timed step. The trace is
    the longer run's."""
    short = profile_run(lambda: run(base), 1, device)
    full = profile_run(lambda: run(base + steps), 1, device, trace_path)

    def per_step(name: str) -> float:
        return float(getattr(full, name) - getattr(short, name)) / steps

    return StepProfile(
        steps=steps,
        kernels_per_step=per_step("kernels_per_step"),
        launch_calls_per_step=per_step("launch_calls_per_step"),
        graph_launches_per_step=per_step("graph_launches_per_step"),
        gpu_busy_ms_per_step=per_step("gpu_busy_ms_per_step"),
        wall_ms_per_step=per_step("wall_ms_per_step"),
        by_difference=True,
    )


def _profiled(
    run: Callable[[], object],
    device: torch.device,
    trace_path: str | None = None,
    host: bool = True,
) -> tuple[list[Any], float]:
    """torch.profiler's events of one ``run()`` (CPU, and CUDA on a GPU) and its seconds.
    ``host=False`` records only the GPU's activity where there is one (a long run's host ops
    would be millions of events)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] if host or not cuda else []
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        synchronize(device)
        wall = time.perf_counter() - start
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return list(prof.events()), wall


def _on_gpu(events: Sequence[Any]) -> list[Any]:
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA]


def _busy_us(events: Sequence[Any]) -> float:
    """µs the GPU was busy with ``events`` (overlaps counted once)."""
    return union_length([(e.time_range.start, e.time_range.end) for e in events])


@dataclass(frozen=True)
class KernelShare:
    name: str  # the kernel's name, cut before its arguments and template parameters
    ms: float  # its total GPU time
    calls: int
    pct: float  # of the GPU's busy time
    #: the busy time it alone adds: the part of each call past the end of every earlier-started
    #: span (a kernel launched early under PDL, waiting on the one ahead, adds only its tail).
    #: The kernels' critical_ms sum to the busy time.
    critical_ms: float = 0.0


@dataclass(frozen=True)
class KernelProfile:
    """Where the GPU's time went over one profiled ``run()``: kernels by total time."""

    wall_s: float  # with the profiler on
    gpu_busy_s: float  # union of GPU activity intervals
    kernels: list[KernelShare]  # the ``top`` by time, most first
    others_ms: float  # the rest together
    #: ms the GPU sat idle in each tenth of the span from its first activity to its last
    #: (where in the run the host held it up: a prefill phase at the start, a tail at the end)
    idle_ms_by_tenth: list[float] = dataclasses.field(default_factory=list)
    #: the longest idle gaps, longest first: what ran on the GPU either side of each, and
    #: (``host=True``) the host's ops that overlapped it most
    gaps: list[IdleGap] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        lines = [
            f"GPU busy {self.gpu_busy_s:.3f} of {self.wall_s:.3f} s wall (profiler on); kernels "
            "by GPU time:",
            f"  {'ms':>9} {'crit ms':>9} {'%busy':>6} {'calls':>8}  kernel",
        ]
        if self.idle_ms_by_tenth:
            lines.insert(
                1,
                "GPU idle (ms) in each tenth of its active span: "
                + " ".join(f"{ms:.0f}" for ms in self.idle_ms_by_tenth),
            )
        for k in self.kernels:
            lines.append(f"  {k.ms:9.1f} {k.critical_ms:9.1f} {k.pct:6.1f} {k.calls:8d}  {k.name}")
        if self.others_ms:
            lines.append(f"  {self.others_ms:9.1f} {'':>6} {'':>8}  (the rest)")
        if self.gaps:
            lines.append("longest GPU idle gaps (at ms into the span: ms, kernel before -> after):")
            for g in self.gaps:
                host = f"; host: {', '.join(g.host)}" if g.host else ""
                lines.append(f"  {g.at_ms:9.2f}: {g.ms:7.3f}  {g.before} -> {g.after}{host}")
        return "\n".join(lines)


@dataclass(frozen=True)
class IdleGap:
    """One stretch with nothing running on the GPU."""

    at_ms: float  # its start, from the GPU's first activity
    ms: float
    before: str  # the kernel (or copy) that ended last before it
    after: str  # the one that started it again
    #: the host's ops that overlapped it most, as "name ms" (none without host events)
    host: list[str] = dataclasses.field(default_factory=list)


def short_kernel_name(name: str, width: int = 72) -> str:
    """``name`` cut at its argument list or template parameters, at most ``width`` characters."""
    for mark in ("(", "<"):
        head = name.split(mark, 1)[0].strip()
        if head:
            name = head
    name = name.removeprefix("void ")
    return name if len(name) <= width else name[: width - 3] + "..."


def profile_kernels(
    run: Callable[[], object],
    device: torch.device,
    top: int = 15,
    *,
    gaps: int = 0,
    host: bool = False,
    trace_path: str | None = None,
) -> KernelProfile:
    """Profile one ``run()`` and rank its GPU work (kernels, copies) by total time. ``gaps``:
    report that many of the longest idle gaps; ``host``: record the host's ops too and name
    those that overlapped each gap (costly over a long run); ``trace_path``: write the chrome
    trace there."""
    events, wall = _profiled(run, device, trace_path, host=host)
    on_gpu = _on_gpu(events)
    busy_us = _busy_us(on_gpu)
    named = [(e.time_range.start, e.time_range.end, short_kernel_name(e.name)) for e in on_gpu]
    time_us: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for start, end, name in named:
        time_us[name] += end - start
        calls[name] += 1
    ranked = time_us.most_common()
    critical = critical_path_us(named)
    shares = [
        KernelShare(
            name, us / 1e3, calls[name], 100 * us / busy_us if busy_us else 0.0,
            critical.get(name, 0.0) / 1e3,
        )
        for name, us in ranked[:top]
    ]  # fmt: skip
    others = sum(us for _, us in ranked[top:]) / 1e3
    idle = [us / 1e3 for us in idle_by_slice([(start, end) for start, end, _ in named], 10)]
    ops = []
    if host:  # the host's ops: every event that is not the GPU's
        gpu = set(map(id, on_gpu))
        ops = [(e.time_range.start, e.time_range.end, e.name) for e in events if id(e) not in gpu]
    found = longest_gaps([(a, b, short_kernel_name(n, 40)) for a, b, n in named], gaps, ops)
    return KernelProfile(wall, busy_us / 1e6, shares, others, idle, found)


def longest_gaps(
    spans: Sequence[tuple[float, float, str]],
    count: int,
    host_ops: Sequence[tuple[float, float, str]] = (),
    per_gap: int = 3,
) -> list[IdleGap]:
    """The ``count`` longest stretches (µs in, ms out) that no span of ``spans`` (start, end,
    name) covers, longest first, each with the spans either side and the ``per_gap`` host
    ops (start, end, name) that overlap it most."""
    if not spans or count < 1:
        return []
    ordered = sorted(spans)
    first = ordered[0][0]
    found = sorted(_uncovered(ordered), key=lambda g: g[0] - g[1])
    out = []
    for lo, hi, before, after in found[:count]:
        overlap: dict[str, float] = {}
        for a, b, name in host_ops:
            if a < hi and b > lo:
                overlap[name] = overlap.get(name, 0.0) + min(b, hi) - max(a, lo)
        busiest = sorted(overlap.items(), key=lambda kv: -kv[1])[:per_gap]
        out.append(
            IdleGap(
                (lo - first) / 1e3, (hi - lo) / 1e3, before, after,
                [f"{name} {us / 1e3:.3f}" for name, us in busiest],
            )
        )  # fmt: skip
    return out


class HostProfile(NamedTuple):
    hotspots: list[tuple[str, float]]  # (where, µs per step), most first
    host_us_per_step: float  # every function's own time but waits for the device


#: cProfile entries that are the host waiting (for the GPU, a copy, a thread), not working
WAITS = ("synchronize", "wait", "sleep")
#: cProfile entries that are the timing harness's own, not the engine's: ``gc_paused``
#: collects before every timed call (8 ms, which read as 7-8 ms "per step" of a 32-step
#: generate at 0.6B on the H200, 20x the steps' real host time)
HARNESS = ("gc.collect",)


def _own_times(run: Callable[[], object]) -> dict[str, float]:
    """Seconds of each Python function's own time (cProfile ``tottime``: callees excluded)
    over one ``run()``, the harness's entries (``HARNESS``) left out."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        run()
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    own: dict[str, float] = {}
    for (path, line, name), (_, _, tottime, _, _) in stats.items():
        if not any(h in name for h in HARNESS):
            where = f"{os.path.basename(path)}:{line}({name})"
            own[where] = own.get(where, 0.0) + tottime
    return own


def host_hotspots(
    run: Callable[[], object],
    steps: int,
    top: int = 12,
    base: Callable[[], object] | None = None,
) -> HostProfile:
    """The Python functions where ``run`` spends its own host time, as (where, µs per step),
    most first (cProfile ``tottime``: time in the function itself, callees excluded), and
    their sum per step without the functions that wait (``WAITS``); the harness's own
    entries (``HARNESS``) are left out of both. With ``base`` (the same work without the
    ``steps``, e.g. a generate of one token against one of ``1 + steps``) each function's
    time is the difference of the two runs, so what both share (a prefill) cancels, as
    :func:`profile_difference` cancels it on the GPU."""
    own = _own_times(run)
    if base is not None:
        less = _own_times(base)
        own = {where: t - less.get(where, 0.0) for where, t in own.items()}
    rows = sorted(((where, t / steps * 1e6) for where, t in own.items()), key=lambda r: -r[1])
    working = sum(us for where, us in rows if not any(w in where for w in WAITS))
    return HostProfile(rows[:top], working)


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``intervals``, overlaps counted once."""
    return sum(critical_path_us([(lo, hi, "") for lo, hi in intervals]).values(), 0.0)


def critical_path_us(spans: Sequence[tuple[float, float, str]]) -> dict[str, float]:
    """Per name, the covered time its spans (start, stop, name) add past the end of every span
    that started before them: busy time attributed once, to the span that extended it. The
    values sum to ``union_length`` of the spans."""
    ordered = sorted(spans)
    added: collections.defaultdict[str, float] = collections.defaultdict(float)
    for (_, _, name), us in zip(ordered, span_critical_us(ordered), strict=True):
        if us:
            added[name] += us
    return dict(added)


def span_critical_us(ordered: Sequence[tuple[float, float, str]]) -> list[float]:
    """Per span of ``ordered`` (start, stop, name; in start order), the covered time it adds
    past the end of every span before it (0 for a span inside them)."""
    out, end = [], -math.inf
    for start, stop, _ in ordered:
        out.append(max(0.0, stop - max(start, end)))
        end = max(end, stop)
    return out


def idle_by_slice(intervals: Sequence[tuple[float, float]], slices: int) -> list[float]:
    """The idle time (not covered by ``intervals``) in each of ``slices`` equal parts of the
    span from the first start to the last end; [] without intervals."""
    if not intervals:
        return []
    ordered = sorted(((start, stop, None) for start, stop in intervals), key=lambda s: s[:2])
    lo, hi = ordered[0][0], max(stop for _, stop, _ in ordered)
    width = (hi - lo) / slices or 1.0
    idle = [0.0] * slices
    for end, start, _, _ in _uncovered(ordered):
        # the gap [end, start) is idle: share it among the slices it crosses
        while start > end:
            k = min(slices - 1, int((end - lo) / width))
            boundary = lo + (k + 1) * width
            step = min(start, boundary) if k < slices - 1 and boundary > end else start
            idle[k] += step - end
            end = step
    return idle


def _uncovered(ordered: Sequence[tuple[float, float, T]]) -> Iterator[tuple[float, float, T, T]]:
    """The stretches that no span of ``ordered`` (start, stop, label; sorted) covers, in order:
    (gap start, gap end, the label of the span that ended last before it, of the one after)."""
    end, before = ordered[0][1], ordered[0][2]
    for start, stop, label in ordered[1:]:
        if start > end:
            yield end, start, before, label
        if stop >= end:
            end, before = stop, label


@dataclass
class StepTiming:
    """One decode-step time from the difference of two generates."""

    step_s: float | None  # None when noise swamped the difference
    prefill_s: float  # the 1-token generate
    note: str = ""


def difference_timing(
    generate_s: Callable[[int, int], float], steps: int, reps: int, base: int = 1
) -> StepTiming:
    """Step time = the median over ``reps`` pairs of (t(base + S new tokens) - t(base)) / S,
    the two generates of a pair timed back to back, after a warm-up; ``generate_s(new_tokens,
    reps)`` times one generate (the best of ``reps``). Pairs, not the best of each series: a
    drift of the machine's speed between two series (clocks, a neighbour, a first slow call)
    would go into the difference, and one pair's jitter (the prefill's, which both generates
    repeat) does not move a median of three. ``base`` > 1 also cancels any per-call cost that
    t(1) lacks (e.g. a compiled peer's graph re-recording). ``prefill_s`` is the best t(1)."""
    generate_s(base + steps if base > 1 else 2, 1)  # warm-up: JIT, autotuning, first touch
    starts, diffs = [], []
    for _ in range(max(1, reps)):
        start = generate_s(base, 1)
        diffs.append((generate_s(base + steps, 1) - start) / steps)
        starts.append(start)
    prefill = min(starts) if base == 1 else generate_s(1, reps)
    step = statistics.median(diffs)
    if step <= 0:
        return StepTiming(None, prefill, f"noise: t({base + steps}) <= t({base}) tokens")
    return StepTiming(step, prefill)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage, then keep the collector off inside the block (as ``timeit`` does). A
    collection that lands in one timed run and not in the other is noise in a difference of
    two runs, and the prefill of a large batch allocates enough to set one off."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def gc_timer() -> Iterator[list[float]]:
    """Yields ``[seconds]``: the time Python's garbage collector spends in collections
    inside the block (a collection pauses the host, and so a GPU the host keeps fed)."""
    total = [0.0]
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            total[0] += time.perf_counter() - started.pop()

    gc.callbacks.append(callback)
    try:
        yield total
    finally:
        gc.callbacks.remove(callback)


@contextlib.contextmanager
def jit_compiles() -> Iterator[list[tuple[str, float]]]:
    """Yields a list that gains ``(kernel and argument types, seconds)`` for every Triton JIT
    compilation inside the block (a disk-cache load counts: it is a miss in memory). A timed
    run that compiles times the compiler, and the GPU waits for it. Any hooks already set
    keep being called; without Triton the list stays empty."""
    found: list[tuple[str, float]] = []
    try:
        from triton import knobs
    except ImportError:
        yield found
        return
    runtime = knobs.runtime
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    started: list[float] = []

    def on_miss(**kwargs: Any) -> bool | None:
        started.append(time.perf_counter())
        return before(**kwargs) if before else None

    def on_compiled(**kwargs: Any) -> bool | None:
        took = time.perf_counter() - started.pop() if started else 0.0
        found.append((str(kwargs.get("repr", "?")), took))
        return after(**kwargs) if after else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_compiled
    try:
        yield found
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after


T = TypeVar("T")


def timed_call(run: Callable[[], T], device: torch.device) -> tuple[float, T]:
    """``(seconds, result)`` of one ``run()`` between device synchronisations, with the
    garbage collector collected first and off inside (:func:`gc_paused`)."""
    with gc_paused():
        synchronize(device)
        start = time.perf_counter()
        result = run()
        synchronize(device)
        return time.perf_counter() - start, result


def step_seconds(step: Callable[[], object], iters: int, reps: int, device: torch.device) -> float:
    """Median over ``reps`` of the seconds per ``step()``, ``iters`` steps back to back."""
    synchronize(device)
    if device.type == "cuda":
        return median_us(step, iters, reps) / 1e6
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            step()
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


class TimeLimitExceeded(BaseException):
    """Raised by the alarm; a BaseException so that no ``except Exception`` swallows it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeLimitExceeded in the block after ``seconds`` (SIGALRM: main thread only;
    elsewhere the block runs unlimited)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeLimitExceeded(f"exceeded the time limit of {seconds:.0f} s")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: Datasheet dense (no sparsity) bf16 tensor-core TFLOP/s by GPU name, most specific first:
#: what "fraction of peak" means in NVIDIA's and FlashAttention's reports. The measured
#: matmul (:func:`matmul_tflops`) is what cuBLAS reaches at the clocks of the run.
DENSE_BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM
    ("H200", 989.4),
    ("H20", 148.0),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
)


def dense_bf16_peak_tflops(device_name: str) -> float | None:
    """The datasheet dense bf16 peak of a GPU named ``device_name``, None if not listed."""
    name = device_name.upper()
    for key, tflops in DENSE_BF16_PEAK_TFLOPS:
        if key.upper() in name:
            return tflops
    return None


#: The run's peak matmul: 8192^3 (1.1 TFLOP, about 1.5 ms on an H200).
MATMUL_N = 8192


def run_peak_tflops(device: torch.device) -> float:
    """The dense matmul rate a benchmark holds its FLOPs against, timed now: an
    ``MATMUL_N``-cube in bf16 on CUDA, a 128-cube in fp32 on CPU (a smoke run's size); its
    buffers are freed before an engine sizes its KV pool."""
    tflops = matmul_tflops(device, n=MATMUL_N if device.type == "cuda" else 128)
    release_memory()
    return tflops


def matmul_tflops(device: torch.device, n: int = MATMUL_N, iters: int = 10, reps: int = 5) -> float:
    """The dense matmul rate of ``device`` now, TFLOP/s: an ``n``-cube product (2·n³ FLOP) in
    bf16 on CUDA (fp32 on CPU, whose bf16 matmul is emulated), median of ``reps``."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=g)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=g)
    c = torch.empty(n, n, dtype=dtype, device=device)
    for _ in range(3):  # cuBLAS heuristics, clocks
        torch.mm(a, b, out=c)
    seconds = step_seconds(lambda: torch.mm(a, b, out=c), iters, reps, device)
    return 2 * n**3 / seconds / 1e12
