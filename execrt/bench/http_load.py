"""The HTTP side of the serving benchmark's load: streamed completions over kept-alive
HTTP/1.1 connections, parsed with h11 (what uvicorn itself parses with), in this process or
split over several load processes. No torch here: a load process imports only this.

Why not an HTTP client library: the load generator must not be what limits the numbers it
reports. httpx (httpcore) walks its whole connection pool on every request it queues and
every response it releases: with 256 streams that cost ~1 ms of CPU per SSE chunk on a
laptop core, so the load fell behind the server and TTFT measured the client's queue.
SGLang's bench_serving uses aiohttp in one process; here each connection is a pair of
asyncio streams with its own h11 state (tens of microseconds per chunk), and a run with many
streams is split over load processes (``processes``) so that no single event loop carries
them all. Timestamps are ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for all
processes of the machine), each chunk stamped when the read that brought it returned.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

#: How long the load processes are given to be ready at a run's start (they are warm).
START_DELAY_S = 0.25


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
    index: int = -1  # the request's place in its Run


class _Connection:
    """One kept-alive HTTP/1.1 connection: asyncio streams and h11's state of it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import h11

        self.reader, self.writer = reader, writer
        self.http = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        self.writer.close()


class _Pool:
    """Idle connections to one server, reused while the server keeps them alive."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"load: url {url!r} must be http://host:port")
        self.host, self.port = parts.hostname, parts.port
        self.authority = parts.netloc
        self.idle: list[_Connection] = []

    async def get(self) -> _Connection:
        if self.idle:
            return self.idle.pop()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        return _Connection(reader, writer)  # asyncio set TCP_NODELAY on it

    def put(self, conn: _Connection) -> None:
        import h11

        http = conn.http
        if http.our_state is h11.DONE and http.their_state is h11.DONE:
            http.start_next_cycle()
            self.idle.append(conn)
        else:  # the server closes it, or the response was not read to its end
            conn.close()

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


def completion_body(model: str, req: Request) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _on_event(event: bytes, now: float, timing: Timing) -> None:
    """One server-sent event (its lines, without the blank line that ended it)."""
    import orjson

    for line in event.splitlines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = orjson.loads(line[6:])
        if "error" in chunk:
            timing.error = str(chunk["error"])
        elif chunk.get("usage"):
            timing.tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0]["text"]:
            timing.chunks.append(now)


async def stream_completion(pool: _Pool, model: str, req: Request, timing: Timing) -> None:
    """One streamed completion over a connection of ``pool``, stamped into ``timing``."""
    import h11
    import orjson

    body = orjson.dumps(completion_body(model, req))
    conn: _Connection | None = None
    try:
        conn = await pool.get()
        http = conn.http
        head = h11.Request(
            method="POST",
            target="/v1/completions",
            headers=[
                ("Host", pool.authority),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
            ],
        )
        conn.writer.write(
            http.send(head) + http.send(h11.Data(data=body)) + http.send(h11.EndOfMessage())
        )
        status, pending, now = 0, b"", time.perf_counter()
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                data = await conn.reader.read(1 << 16)
                now = time.perf_counter()
                http.receive_data(data)  # b"": the server closed; h11 says what that means
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                pending += bytes(event.data)
                if status != 200:
                    continue
                *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
                for e in events:
                    _on_event(e, now, timing)
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection mid-response")
        if status != 200:
            timing.error = f"HTTP {status}: {pending[:200]!r}"
        timing.done = time.perf_counter()
    except Exception as exc:  # a failed request is counted, the run goes on
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        if conn is not None:
            pool.put(conn)


async def drive(
    url: str, model: str, run: Run, indices: Sequence[int] | None = None, start: float = 0.0
) -> tuple[list[Timing], float]:
    """``run`` (its requests at ``indices``, default all) against the server at ``url``, from
    ``start`` (a perf_counter time; default now): the timings and when the last one ended."""
    pool = _Pool(url)
    picked = range(len(run.requests)) if indices is None else indices
    gate = asyncio.Semaphore(run.concurrency or len(picked) or 1)
    timings: list[Timing] = []
    start = max(start, time.perf_counter())
    delay = start - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)

    async def send(i: int) -> None:
        delay = start + run.arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            timing = Timing(time.perf_counter(), index=i)
            timings.append(timing)
            await stream_completion(pool, model, run.requests[i], timing)

    try:
        await asyncio.gather(*(send(i) for i in picked))
    finally:
        pool.close()
    return timings, time.perf_counter()


def shares(run: Run, processes: int) -> list[tuple[Run, list[int]]]:
    """``run`` split over ``processes`` load processes: request i to process i % processes,
    and the concurrency cap divided among them (its sum kept). Returns (sub-run, indices)."""
    out: list[tuple[Run, list[int]]] = []
    n = min(processes, len(run.requests)) or 1
    if run.concurrency is not None:
        n = min(n, run.concurrency)
    for p in range(n):
        indices = list(range(p, len(run.requests), n))
        cap = None
        if run.concurrency is not None:
            cap = run.concurrency // n + (1 if p < run.concurrency % n else 0)
        share = Run(cap, run.request_rate, run.requests, run.arrivals)
        out.append((share, indices))
    return out


def _drive_share(url: str, model: str, run: Run, indices: list[int], start: float) -> Any:
    """A load process's part of a run (runs there: its own event loop)."""
    return asyncio.run(drive(url, model, run, indices, start))


def drive_http(
    url: str, model: str, run: Run, executor: Executor | None = None, processes: int = 1
) -> tuple[list[Timing], float]:
    """``run`` against the server at ``url``: its timings (in the order of the requests) and
    how long it took. ``processes`` > 1 splits it over ``executor``'s load processes."""
    if processes <= 1 or executor is None:
        start = time.perf_counter()
        timings, end = asyncio.run(drive(url, model, run, None, start))
    else:
        start = time.perf_counter() + START_DELAY_S
        futures = [
            executor.submit(_drive_share, url, model, share, indices, start)
            for share, indices in shares(run, processes)
        ]
        results = [f.result() for f in futures]
        timings = [t for part, _ in results for t in part]
        end = max(e for _, e in results)
    timings.sort(key=lambda t: t.index)
    return timings, end - start
