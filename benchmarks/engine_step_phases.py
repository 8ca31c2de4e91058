"""Where the host's time goes in one decode step of ``Engine.generate``, phase by phase, and
whether the host or the device sets the pace.

The engine runs a benchmark model shape with random weights (as ``execrt bench decode`` does)
on the device. Each scheduler step is split into its phases, timed on the host with
``perf_counter`` around the scheduler's and the worker's own methods (no profiler, so nothing
is inflated): scheduling the overlapped decode, building the ForwardBatch, the forward launch
(graph replay and its input copies), the sampler's launch, starting the token copy, waiting
for the previous step's tokens, and the per-request bookkeeping. The phases of the steps of a
generate of 1 + S tokens less those of a generate of 1 token are the decode steps' (the
prefill cancels), divided by S.

Reading it: when ``wait`` is a large part of the step, the host waits for the device and the
step is the device's time; when ``wait`` is near zero the device waits for the host, and the
other phases are what to cut. ``--sync-debug`` also runs the long generate under
``torch.cuda.set_sync_debug_mode("warn")`` and prints each synchronising call's stack once.

``--prefill``: the prefill phase of ``execrt bench throughput`` instead (its 256 prompts,
one new token each, the engine's defaults): the phases of the whole generate, per extend
step, and the GPU's busy and idle time under torch.profiler. With extends the host processes
step N before it schedules step N+1, so the device idles for that step's bookkeeping,
scheduling and launch; this mode says how long.

Usage: ``PYTHONPATH=$PWD python benchmarks/engine_step_phases.py [--model qwen3-0.6b]
[--bs 1 8 128] [--ctx 512] [--steps 32] [--temperature 0] [--sync-debug] [--eager]
[--prefill]``
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from execrt.bench.models import RandomWeightsLoader, model_config
from execrt.bench.throughput import draw_workload
from execrt.bench.timing import profile_kernels, timed_call
from execrt.core import staging
from execrt.core.batch import ForwardBatch
from execrt.core.model_runner import ModelRunner
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine
from execrt.engine.scheduler import Scheduler

#: (owner, method, phase): the methods timed, each under its phase's name. Nested phases
#: (the worker's parts inside ``launch``) are reported beside their parent, not subtracted.
PHASES: list[tuple[Any, str, str]] = [
    (Scheduler, "_schedule_overlapped", "schedule (overlapped)"),
    (Scheduler, "_schedule", "schedule (after wait)"),
    (Scheduler, "_launch", "launch"),
    (ForwardBatch, "init_new", "  ForwardBatch.init_new"),
    (ModelRunner, "forward", "  ModelRunner.forward"),
    (ModelRunner, "sample", "  ModelRunner.sample"),
    (staging.DeviceToHost, "start", "  token copy start"),
    (Scheduler, "_process", "process (wait + bookkeeping)"),
    (staging.HostCopy, "tolist", "  wait for tokens"),
]


@contextlib.contextmanager
def timed_phases(totals: dict[str, float], calls: collections.Counter[str]) -> Iterator[None]:
    """Wrap each method of PHASES to add its seconds to ``totals[phase]`` while inside."""
    saved: list[tuple[Any, str, Any]] = []
    for owner, name, phase in PHASES:
        raw = owner.__dict__[name]
        static = isinstance(raw, (staticmethod, classmethod))
        fn = raw.__func__ if static else raw

        def wrapped(*args: Any, _fn: Callable[..., Any] = fn, _p: str = phase, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                totals[_p] += time.perf_counter() - start
                calls[_p] += 1

        new: Any = type(raw)(wrapped) if static else wrapped
        saved.append((owner, name, raw))
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, raw in saved:
            setattr(owner, name, raw)


def _params(n: int, tokens: int | list[int], temperature: float) -> list[SamplingParams]:
    """Parameters of ``n`` requests of ``tokens`` new tokens each (or the i-th of a list)."""
    counts = tokens if isinstance(tokens, list) else [tokens] * n
    return [
        SamplingParams(max_new_tokens=m, temperature=temperature, ignore_eos=True) for m in counts
    ]


def generate_phases(
    engine: Engine, prompts: list[list[int]], tokens: int | list[int], temperature: float
) -> tuple[float, dict[str, float], collections.Counter[str]]:
    params = _params(len(prompts), tokens, temperature)
    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    engine.flush_cache()
    device = engine.worker.limits.device
    with timed_phases(totals, calls):
        seconds, _ = timed_call(lambda: engine.generate(prompts, params), device)
    return seconds, totals, calls


def sync_debug_report(run: Callable[[], object]) -> list[tuple[int, str]]:
    """Each distinct stack at which torch warned of a synchronising call, with its count."""
    seen: collections.Counter[str] = collections.Counter()
    previous = warnings.showwarning

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        stack = "".join(traceback.format_stack(limit=14)[:-2])
        seen[f"{message}\n{stack}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous
    return [(n, where) for where, n in seen.most_common()]


def print_syncs(run: Callable[[], object]) -> None:
    """``sync_debug_report`` of ``run``: the count, and the eight most frequent stacks."""
    found = sync_debug_report(run)
    print(f"  synchronising calls (sync debug mode): {sum(n for n, _ in found)}")
    for n, where in found[:8]:
        print(f"  --- {n}x\n{where}")


def prefill_phases(
    model: str,
    layers: int | None,
    temperature: float,
    reps: int,
    sync_debug: bool,
    full: bool = False,
) -> None:
    """The prefill phase of ``bench throughput``'s workload, phase by phase (see the module
    docstring); ``full``: the whole workload (its output lengths), not one token each. Timed
    with the garbage collector off (``timed_call``), unlike ``bench throughput``."""
    config = model_config(model, layers)
    workload = draw_workload()
    prompts = workload.prompts
    tokens: int | list[int] = workload.max_tokens if full else 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine(loader=RandomWeightsLoader(config, 0), device=device, seed=0)
    with engine:
        generate_phases(engine, prompts, tokens, temperature)  # warm-up
        runs = [generate_phases(engine, prompts, tokens, temperature) for _ in range(reps)]
        seconds, totals, calls = min(runs, key=lambda r: r[0])
        stats = engine.scheduler.stats
        extends, steps = stats.extend_steps // (reps + 1), stats.steps // (reps + 1)
        size = sum(map(len, prompts))
        print(f"\n# {model} {'workload' if full else 'prefill'}: {len(prompts)} prompts, {size} "
              f"tokens, {extends} extend steps of {steps}: {seconds * 1e3:.1f} ms (best of "
              f"{reps}: {', '.join(f'{r[0] * 1e3:.1f}' for r in runs)})")  # fmt: skip
        for _, _, phase in PHASES:
            n = calls[phase]
            per = totals[phase] / max(n, 1) * 1e3
            print(f"  {phase:<32} {totals[phase] * 1e3:8.1f} ms  {n:4d} calls  {per:7.2f} ms/call")
        if torch.cuda.is_available():
            params = _params(len(prompts), tokens, temperature)

            def run() -> None:
                engine.flush_cache()
                engine.generate(prompts, params)

            print(profile_kernels(run, engine.worker.limits.device).describe())
            if sync_debug:
                print_syncs(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 128])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--sync-debug", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefill", action="store_true", help="bench throughput's prefill phase")
    ap.add_argument("--full", action="store_true", help="with --prefill: the whole workload")
    args = ap.parse_args()
    if args.prefill:
        prefill_phases(
            args.model, args.layers, args.temperature, args.reps, args.sync_debug, args.full
        )  # fmt: skip
        return
    config = model_config(args.model, args.layers)
    sizes = sorted(set(args.bs))
    graph = {} if args.eager else {"cuda_graph_bs": ",".join(map(str, sizes))}
    engine = Engine(
        loader=RandomWeightsLoader(config, 0),
        device=args.device,
        graph_backend="none" if args.eager else "full_cuda_graph",
        max_running_requests=max(sizes),
        kv_cache_tokens=max(sizes) * (args.ctx + args.steps + 16),
        context_len=args.ctx + args.steps + 16,
        max_prefill_tokens=max(args.ctx, 16384),
        overlap_schedule=not args.no_overlap,
        seed=0,
        **graph,
    )
    vocab = int(config["vocab_size"])
    with engine:
        for bs in sizes:
            gen = torch.Generator().manual_seed(bs)
            prompts = torch.randint(0, vocab, (bs, args.ctx), generator=gen).tolist()
            generate_phases(engine, prompts, 2, args.temperature)  # warm-up
            best: dict[int, tuple[float, dict[str, float], collections.Counter[str]]] = {}
            for tokens in (1, 1 + args.steps):
                for _ in range(args.reps):
                    run = generate_phases(engine, prompts, tokens, args.temperature)
                    if tokens not in best or run[0] < best[tokens][0]:
                        best[tokens] = run
            (t1, p1, c1), (tn, pn, cn) = best[1], best[1 + args.steps]
            s = args.steps
            print(f"\n# {args.model} bs {bs} ctx {args.ctx}: step {(tn - t1) / s * 1e6:.0f} us "
                  f"(generate by difference, best of {args.reps})")  # fmt: skip
            for _, _, phase in PHASES:
                us = (pn[phase] - p1[phase]) / s * 1e6
                n = (cn[phase] - c1[phase]) / s
                print(f"  {phase:<32} {us:8.0f} us/step  {n:5.2f} calls/step")
            outer = [p for _, _, p in PHASES if not p.startswith(" ")]
            rest = (tn - t1) - sum(pn[p] - p1[p] for p in outer)
            print(f"  {'elsewhere (driver, delivery)':<32} {rest / s * 1e6:8.0f} us/step")
            if args.sync_debug and torch.cuda.is_available():
                params = _params(len(prompts), 1 + s, args.temperature)
                print_syncs(functools.partial(engine.generate, prompts, params))


if __name__ == "__main__":
    main()
