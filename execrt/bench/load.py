"""The load side of the serving benchmark: the same runs (closed loop or Poisson arrivals) as
the HTTP clients of ``http_load`` make them, through the Engine's request API, and the numbers
(TTFT, ITL, TPOT, throughput) as SGLang's bench_serving and vllm bench serve define them."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from execrt.bench.http_load import Run, Timing
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine
from execrt.engine.client import RequestOutput


@dataclass
class Summary:
    """One run as the clients saw it."""

    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    itl_ms_p50: float | None
    itl_ms_p99: float | None
    tpot_ms_p50: float | None
    e2e_ms_p50: float | None
    request_s: float
    output_tok_s: float
    duration_s: float
    errors: int
    tokens_per_chunk: float | None  # > 1: the server merged steps (it fell behind)


# -- the same arrivals through the Engine ----------------------------------------------------------
def replay(engine: Engine, run: Run) -> tuple[list[Timing], float]:
    """``run`` through ``engine.submit`` / ``step`` in this thread: the engine's own numbers.

    Requests go in between steps, but each is stamped as sent when the HTTP clients would
    have sent it: at its arrival, or (closed loop, or a capped rate) when a client became
    free, the moment an earlier request finished, if that came later. So time a request
    waits for the step boundary counts in its TTFT here as it does through HTTP, where the
    engine takes new requests between steps too."""
    todo = deque(enumerate(zip(run.requests, run.arrivals, strict=True)))
    timings: list[Timing] = []
    live = 0
    freed: deque[float] = deque()  # when each free client became free, oldest first

    def sink(timing: Timing) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:
            nonlocal live
            now = time.perf_counter()
            if out.token_ids:
                timing.chunks.append(now)
                timing.tokens += len(out.token_ids)
            if out.finished:
                timing.done, timing.error, live = now, out.error, live - 1
                freed.append(now)

        return on_output

    start = time.perf_counter()
    freed.extend([start] * (run.concurrency or 0))
    while todo or live:
        now = time.perf_counter() - start
        while todo and todo[0][1][1] <= now and (run.concurrency is None or live < run.concurrency):
            i, (req, at) = todo.popleft()
            sent = start + at
            if run.concurrency is not None:
                sent = max(sent, freed.popleft())
            timing = Timing(sent, index=i)
            timings.append(timing)
            live += 1
            params = SamplingParams(max_new_tokens=req.output_len, temperature=0, ignore_eos=True)
            engine.submit(req.prompt, params, on_output=sink(timing))
        if not engine.step() and todo:
            time.sleep(max(0.0, min(0.01, todo[0][1][1] - (time.perf_counter() - start))))
    return timings, time.perf_counter() - start


def generate_tok_s(engine: Engine, run: Run) -> float:
    prompts = [r.prompt for r in run.requests]
    params = [
        SamplingParams(max_new_tokens=r.output_len, temperature=0, ignore_eos=True)
        for r in run.requests
    ]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / seconds


# -- numbers ------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(timings: Sequence[Timing], duration: float) -> Summary:
    ok = [t for t in timings if t.error is None and t.done is not None and t.chunks]
    ttft = [(t.chunks[0] - t.sent) * 1e3 for t in ok]
    itl = [(b - a) * 1e3 for t in ok for a, b in zip(t.chunks, t.chunks[1:], strict=False)]
    tpot = [
        (t.done - t.chunks[0]) * 1e3 / (t.tokens - 1)  # type: ignore[operator]
        for t in ok
        if t.tokens > 1
    ]
    e2e = [(t.done - t.sent) * 1e3 for t in ok]  # type: ignore[operator]
    tokens = sum(t.tokens for t in ok)
    chunks = sum(len(t.chunks) for t in ok)
    return Summary(
        ttft_ms_p50=percentile(ttft, 50),
        ttft_ms_p99=percentile(ttft, 99),
        itl_ms_p50=percentile(itl, 50),
        itl_ms_p99=percentile(itl, 99),
        tpot_ms_p50=percentile(tpot, 50),
        e2e_ms_p50=percentile(e2e, 50),
        request_s=len(ok) / duration if duration else 0.0,
        output_tok_s=tokens / duration if duration else 0.0,
        duration_s=duration,
        errors=len(timings) - len(ok),
        tokens_per_chunk=tokens / chunks if chunks else None,
    )


def error_samples(timings: Sequence[Timing], most: int = 3) -> list[str]:
    """Why the first ``most`` failed requests of a run failed (as ``summarize`` counts them)."""
    out = []
    for t in timings:
        if t.error is not None:
            out.append(t.error[:300])
        elif t.done is None:
            out.append("the stream did not end")
        elif not t.chunks:
            out.append("no chunk with tokens")
        if len(out) == most:
            break
    return out
