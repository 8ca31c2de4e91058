"""Running the app under uvicorn on a socket bound first (so port 0 works), and saying once,
in one line, where it serves when the model is ready."""

from __future__ import annotations

import contextlib
import gc
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from execrt.engine.client import EngineClient
from execrt.serve.app import LiveJobs, create_app

#: How long a thread may keep the GIL while another waits for it. With the engine on a thread
#: (--engine thread), after each GPU step the engine thread needs it back at once to launch the
#: next step, while the HTTP thread may be busy writing chunks: CPython's default, 5 ms, can
#: leave the GPU idle that long per step. (With the engine in its own process, the server's
#: other threads are brief: the output reader before the event loop takes over, to_thread.)
SWITCH_INTERVAL_S = 0.001
#: The cyclic collector's thresholds. Serving churns through small objects (a few dozen per SSE
#: chunk: events, dicts, bytes, futures), nearly all freed by reference counting; at CPython's
#: default (700 net allocations) the collector ran every few chunks, and its full collections
#: walked the whole heap (FastAPI, pydantic, uvicorn: and with ``--engine thread`` the model).
#: On CPU over a paced engine at 256 streams it took 10-15% of the server's time and its pauses
#: delayed new requests (TTFT p50 355 ms, 0.79 of the engine's pace; with this and
#: ``settle_heap``: 109-145 ms, 0.88-0.92).
GC_THRESHOLDS = (20_000, 10, 10)


def tune_interpreter() -> None:
    """Settings of a serving process (engine thread and HTTP thread in one interpreter)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.set_threshold(*GC_THRESHOLDS)


def settle_heap() -> None:
    """Once the server is ready: collect once, then keep everything alive now (modules, the
    app, a thread engine's model) out of every later collection (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto
    # says TCP (they inherit the listener's). Without it Nagle holds each small write (the
    # first SSE chunk after the headers) until the client ACKs the last one, and a client on
    # a kept-alive connection delays that ACK by up to 40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


#: What a request still running when the server is told to stop ends with (an error event
#: on a stream, a 500 otherwise), and what a request arriving then gets (a 503).
SHUTTING_DOWN = "the server is shutting down"
#: How long uvicorn waits for connections once every job was aborted (they end within a step
#: or two); past it, it cancels them.
GRACEFUL_SHUTDOWN_S = 10


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGINT / SIGTERM also aborts what the app still runs:
    uvicorn alone waits for every answer to run its course (a long stream: minutes)."""

    def __init__(self, config: uvicorn.Config, jobs: LiveJobs) -> None:
        super().__init__(config)
        self.jobs = jobs
        self.stopped_by: int | None = None  # the first signal that told it to stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.stopped_by is None:
            self.stopped_by = sig
        super().handle_exit(sig, frame)
        self.jobs.close(SHUTTING_DOWN)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn raises the signals it caught again once it has shut down, so a server that
        # stopped cleanly on SIGTERM would end killed by it (status 143) and on SIGINT with a
        # KeyboardInterrupt (130); being told to stop is how a server ends: serve() returns 0.
        with super().capture_signals():
            yield
            self._captured_signals.clear()


class UvicornServer:
    """The app over ``client`` under uvicorn on ``sock``: ``run()`` in this thread (signals
    handled, returns after a graceful shutdown) or ``start()`` in a background one."""

    def __init__(
        self,
        client: EngineClient,
        sock: socket.socket,
        *,
        log_level: str = "warning",
        reasoning_parser: str = "none",
        generation_config: str = "auto",
    ) -> None:
        self.client = client
        self.sock = sock
        self.url = url_of(sock)
        app = create_app(
            client, close_client=True, reasoning_parser=reasoning_parser,
            generation_config=generation_config,
        )  # fmt: skip
        self.jobs: LiveJobs = app.state.jobs
        config = uvicorn.Config(
            app, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
        )
        self.server = _Server(config, self.jobs)
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self) -> UvicornServer:
        self._thread = threading.Thread(target=self.run, name="execrt-http", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("serve: uvicorn stopped while starting")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.jobs.close(SHUTTING_DOWN)
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)


def serve(
    client: EngineClient,
    host: str,
    port: int,
    *,
    announce: Callable[[str], None] | None = None,
    log_level: str = "warning",
    reasoning_parser: str = "none",
    generation_config: str = "auto",
) -> int:
    """Serve until interrupted; ``announce`` gets one line with the URL once the model is
    ready (and the sampling defaults it applies, if any). Returns 0 (stopped after it was
    ready), 2 when the model failed to load (one line on stderr says why), or 128 + the
    signal's number when SIGINT or SIGTERM stopped it before it was ready (130 for Ctrl-C, as
    any command interrupted before it did its work; the same as a Ctrl-C during the imports
    before the server starts)."""
    server = UvicornServer(
        client, bind(host, port), log_level=log_level, reasoning_parser=reasoning_parser,
        generation_config=generation_config,
    )  # fmt: skip
    tune_interpreter()
    status = 0
    announced = threading.Event()

    def watch() -> None:
        nonlocal status
        ready = client.wait_ready()
        while not server.server.started and not server.server.should_exit:
            time.sleep(0.01)
        if ready:
            announced.set()
            settle_heap()
            info = client.model_info()
            line = f"execrt serve: {info.name} ready at {server.url} (OpenAI API under /v1)"
            if generation_config == "auto" and info.sampling_defaults:
                shown = ", ".join(f"{k} {v}" for k, v in info.sampling_defaults)
                line += (
                    f"; the model's sampling defaults: {shown} (--generation-config none: OpenAI's)"
                )
            (announce or _print)(line)
        elif client.load_error() is not None:
            print(f"execrt: error: {client.load_error()}", file=sys.stderr, flush=True)
            status = 2
            server.server.should_exit = True
        # else: stopped while loading (Ctrl-C, SIGTERM): closed, nothing failed, nothing to say

    threading.Thread(target=watch, name="execrt-ready", daemon=True).start()
    server.run()
    stopped_by = server.server.stopped_by
    if status == 0 and stopped_by is not None and not announced.is_set():
        return 128 + stopped_by
    return status


def _print(line: str) -> None:
    print(line, flush=True)
