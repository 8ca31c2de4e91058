"""The load side of the serving benchmark: requests, runs (closed loop or Poisson arrivals),
streaming clients over HTTP, the same runs through the Engine's request API, and the numbers
(TTFT, ITL, TPOT, throughput) as SGLang's bench_serving and vllm bench serve define them."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from execrt.core.schedule import SamplingParams
from execrt.engine import Engine
from execrt.engine.client import RequestOutput


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class Run:
    """One load pattern: a closed loop of ``concurrency`` clients, or Poisson arrivals."""

    concurrency: int | None
    request_rate: float | None
    requests: tuple[Request, ...]
    arrivals: tuple[float, ...]  # seconds from the start (all 0 for a closed loop)


@dataclass
class Timing:
    """One request as a client saw it."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival time of each chunk with tokens
    tokens: int = 0
    done: float | None = None
    error: str | None = None


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


# -- clients over HTTP ---------------------------------------------------------------------------
async def stream_completion(
    client: Any, url: str, model: str, req: Request, timing: Timing
) -> None:
    """One streamed completion through ``client`` (httpx), stamped into ``timing``."""
    import orjson

    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    timing.error = str(chunk["error"])
                elif chunk.get("usage"):
                    timing.tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    timing.chunks.append(now)
        timing.done = time.perf_counter()
    except Exception as exc:  # a failed request is counted, the run goes on
        timing.error = f"{type(exc).__name__}: {exc}"


async def drive_http(url: str, model: str, run: Run) -> tuple[list[Timing], float]:
    """``run`` against the server at ``url``: its timings and how long it took."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None)
    timings: list[Timing] = []
    gate = asyncio.Semaphore(run.concurrency or len(run.requests))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()

        async def send(req: Request, at: float) -> None:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                timing = Timing(time.perf_counter())
                timings.append(timing)
                await stream_completion(client, url, model, req, timing)

        await asyncio.gather(*(send(r, a) for r, a in zip(run.requests, run.arrivals, strict=True)))
        return timings, time.perf_counter() - start


# -- the same arrivals through the Engine ----------------------------------------------------------
def replay(engine: Engine, run: Run) -> tuple[list[Timing], float]:
    """``run`` through ``engine.submit`` / ``step`` in this thread: the engine's own numbers."""
    todo = deque(zip(run.requests, run.arrivals, strict=True))
    timings: list[Timing] = []
    live = 0

    def sink(timing: Timing) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:
            nonlocal live
            now = time.perf_counter()
            if out.token_ids:
                timing.chunks.append(now)
                timing.tokens += len(out.token_ids)
            if out.finished:
                timing.done, timing.error, live = now, out.error, live - 1

        return on_output

    start = time.perf_counter()
    while todo or live:
        now = time.perf_counter() - start
        while todo and todo[0][1] <= now and (run.concurrency is None or live < run.concurrency):
            req, _ = todo.popleft()
            timing = Timing(time.perf_counter())
            timings.append(timing)
            live += 1
            params = SamplingParams(max_new_tokens=req.output_len, temperature=0, ignore_eos=True)
            engine.submit(req.prompt, params, on_output=sink(timing))
        if not engine.step() and todo:
            time.sleep(max(0.0, min(0.01, todo[0][1] - (time.perf_counter() - start))))
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
