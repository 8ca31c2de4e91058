"""The HTTP front end's own cost, on CPU, without a model: can it carry N streams at one token
per engine step?

The server process runs the real app under uvicorn over the real engine client
(``--engine process``, what ``execrt serve`` uses, or ``thread``) whose engine is a
``PacedEngine``: no model, every ``--step-ms`` one token for every running request. The load
generator (this process) opens ``--streams`` streamed completions on raw sockets read by one
selector (no HTTP client library: it only counts bytes, so it costs little beside the server)
and reports:

- delivered tokens/s against the engine's pace (streams / step): below 1, the front end (or the
  machine: see server_cpu) falls behind;
- tokens per SSE chunk: 1 while the front end sends every step; more when it fell behind (the
  steps it missed reach each stream as one chunk);
- TTFT p50 of one request at a time over one kept-alive connection (from sending the request
  to the first read with text: one step of the engine and the front end's handoffs both
  ways), and of the streams (their first read with text); ITL p50 (gaps between reads that
  brought chunks);
- the server process's CPU (all its threads, from /proc) per second and per chunk: the figure
  that holds on a shared machine, where wall-clock rates depend on the neighbours.

    python benchmarks/serve_frontend.py                       # 1, 32, 256 streams, 2 ms steps
    python benchmarks/serve_frontend.py --streams 256 --profile 25   # + the server's hot spots
    python benchmarks/serve_frontend.py --engine thread --text tokenizer
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import selectors
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from execrt.bench.http_load import Request, Run, drive_http


# -- the server process -------------------------------------------------------------------------
def _server(args: argparse.Namespace, pipe: Any) -> None:
    from execrt.bench.paced_engine import PacedEngine
    from execrt.engine.process import ProcessEngineClient
    from execrt.engine.threaded import ThreadedEngineClient
    from execrt.serve.server import UvicornServer, bind, settle_heap, tune_interpreter

    tune_interpreter()
    kwargs: dict[str, Any] = {}
    if args.text == "tokenizer":
        import tokenizers

        from execrt.models.builtin import builtin_model_path

        path = os.path.join(builtin_model_path(), "tokenizer.json")
        kwargs = {"tokenizer": tokenizers.Tokenizer.from_file(path), "vocab_size": 256}
    build = functools.partial(PacedEngine, args.step_ms / 1e3, **kwargs)
    client: Any
    if args.engine == "process":
        client = ProcessEngineClient(build, name="paced")
    else:
        client = ThreadedEngineClient(build, name="paced")
    server = UvicornServer(client, bind("127.0.0.1", 0))
    client.wait_ready(60)
    settle_heap()  # as execrt serve does once ready
    pipe.send((server.url, os.getpid()))
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # CPU time: the machine may be shared
        profiler.enable()
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if profiler is not None:
        import pstats

        profiler.disable()
        print("\n# server hot spots (own CPU time, the event loop thread)", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)


# -- the load (this process) ---------------------------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_ttft(url: str) -> tuple[float, float]:
    """The server's own TTFT histogram: (sum of seconds, count)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("execrt:time_to_first_token_seconds_"):
            name, value = line.split(" ")
            values[name.rsplit("_", 1)[1]] = float(value)
    return values.get("sum", 0.0), values.get("count", 0.0)


@dataclass
class StreamResult:
    tokens: int = 0
    chunks: int = 0
    gaps: list[float] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)
    sent: float = 0.0
    first: float | None = None  # the first read with a chunk that has tokens
    last: float | None = None


def _load(url: str, streams: int, tokens: int) -> tuple[list[StreamResult], float, float]:
    """``streams`` streamed completions at once, read with one selector (cheaper than any
    asyncio client: the load must cost little beside the server on a small machine). Returns
    the results, the wall time and this process's CPU time."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = orjson.dumps(
        {
            "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
    )
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    selector = selectors.DefaultSelector()
    cpu, start = time.process_time(), time.perf_counter()
    results = []
    for _ in range(streams):
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        result = StreamResult(sent=time.perf_counter())
        sock.sendall(request)
        sock.setblocking(False)
        results.append(result)
        selector.register(sock, selectors.EVENT_READ, result)
    open_ = streams
    while open_:
        for key, _ in selector.select():
            sock, result = key.fileobj, key.data
            piece = sock.recv(1 << 16)  # type: ignore[union-attr]
            if not piece:
                selector.unregister(sock)
                sock.close()  # type: ignore[union-attr]
                open_ -= 1
                continue
            result.pieces.append(piece)
            if b"data: " in piece:
                now = time.perf_counter()
                if result.last is not None:
                    result.gaps.append(now - result.last)
                elif b'"text":"' in piece:
                    result.first = now
                result.last = now
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    selector.close()
    for result in results:
        data = b"".join(result.pieces)
        result.chunks = data.count(b"data: ") - 2  # minus the usage chunk and [DONE]
        usage = data.rfind(b'"completion_tokens":')
        if usage >= 0:
            result.tokens = int(data[usage + 20 :].split(b",", 1)[0])
        result.pieces = []
    return results, seconds, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", default="1,32,256", help="comma-separated (default: 1,32,256)")
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream (default: 200)")
    p.add_argument("--step-ms", type=float, default=2.0, help="engine step (default: 2 ms)")
    p.add_argument(
        "--text",
        choices=["ids", "tokenizer"],
        default="ids",
        help="token ids as text (as bench serve) or the built-in tokenizer (default: ids)",
    )
    p.add_argument(
        "--engine",
        choices=["process", "thread"],
        default="process",
        help="where the paced engine runs, as execrt serve --engine (default: process)",
    )
    p.add_argument(
        "--ttft-requests", type=int, default=40, help="one-at-a-time requests for TTFT (40)"
    )
    p.add_argument("--profile", type=int, default=0, help="print the server's N hottest functions")
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(args, child))
    server.start()
    url, pid = parent.recv()
    time.sleep(0.5)
    print(
        f"# front end over a paced engine ({args.engine}): {args.step_ms} ms steps, "
        f"{args.tokens} tokens a stream, text: {args.text}"
    )
    try:
        _load(url, 4, 10)  # warm-up
        before = _server_ttft(url)
        # One kept-alive connection, as a real client holds it (a new connection each time
        # hid Nagle's delay: Linux acknowledges at once while a connection is new).
        probe = Run(
            1,
            None,
            (Request([1, 2, 3, 4, 5, 6, 7, 8], 2),) * args.ttft_requests,
            (0.0,) * args.ttft_requests,
        )
        timings, _ = drive_http(url, "paced", probe)
        after = _server_ttft(url)
        firsts = sorted(t.chunks[0] - t.sent for t in timings if t.chunks)
        if firsts:
            p50 = statistics.median(firsts) * 1e3
            inside = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3
            print(
                f"# TTFT of one request at a time: p50 {p50:.3f} ms over {len(firsts)}, of which "
                f"the front end's handoffs (p50 - one step): {p50 - args.step_ms:.3f} ms; "
                f"inside the server (the app's arrival to the first token there, mean): "
                f"{inside:.3f} ms"
            )
        print(
            "streams  tok/s    engine_tok/s  ratio  tok/chunk  ttft_p50_ms  itl_p50_ms  "
            "server_cpu  us_cpu/chunk  client_cpu"
        )
        for n in (int(s) for s in args.streams.split(",") if s.strip()):
            cpu0 = _cpu_seconds(pid)
            results, seconds, client_cpu = _load(url, n, args.tokens)
            cpu = _cpu_seconds(pid) - cpu0
            tokens = sum(r.tokens for r in results)
            chunks = sum(r.chunks for r in results)
            ideal = n / (args.step_ms / 1e3)
            gaps = [g for r in results for g in r.gaps]
            itl = statistics.median(gaps) * 1e3 if gaps else float("nan")
            firsts = [r.first - r.sent for r in results if r.first is not None]
            ttft = statistics.median(firsts) * 1e3 if firsts else float("nan")
            assert tokens == n * args.tokens, (tokens, n * args.tokens)
            print(
                f"{n:<8} {tokens / seconds:<8.0f} {ideal:<13.0f} {tokens / seconds / ideal:<6.3f} "
                f"{tokens / max(chunks, 1):<10.2f} {ttft:<12.3f} {itl:<11.3f} "
                f"{cpu / seconds:<11.2f} {cpu / max(chunks, 1) * 1e6:<13.1f} "
                f"{client_cpu / seconds:.2f}",
                flush=True,
            )
    finally:
        import signal

        os.kill(server.pid, signal.SIGINT)
        server.join(60)


if __name__ == "__main__":
    main()
