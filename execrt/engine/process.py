"""ProcessEngineClient: the EngineClient of an Engine that runs in a process of its own.

The front end (the HTTP server) and the engine then hold different interpreter locks: the
engine's step loop (scheduling, kernel launches) never waits for the front end's JSON, SSE
and detokenizing, nor the front end for a step.

- The engine process is spawned (``multiprocessing``'s spawn context: the front end never
  initialises CUDA), with SIGINT ignored from its first moment (QUIET_SPAWN: Ctrl-C is the
  front end's), builds the Engine with ``build`` (a picklable callable), then sends once
  what the front end needs to serve without it: the ``ModelInfo``, the ``TextCodec``
  (tokenizer and chat template), the ``RequestLimits`` that ``check`` validates against, and
  whether there is a prefix cache. Then it runs ``run_commands``, the loop the engine thread
  of ``ThreadedEngineClient`` runs.
- Commands (submit, abort, flush, stop) go to it over one pipe, written by a writer thread
  from a queue: a caller never blocks on the pipe. The event loop that calls ``submit`` and
  ``abort`` is also the one that reads the outputs; had it blocked on a full command pipe
  while the engine blocked on a full output pipe (a burst of thousands of aborts or long
  prompts during a busy step), each would have waited for the other for good.
- After each round of commands and step, ONE message comes back over a second pipe with that
  step's outputs of every request and the engine's stats; a reader thread in the front end
  hands them to their holders with ``deliver`` (one wake-up of the event loop per step).
- The engine marks when each round begins and ends in a double of shared memory, which the
  front end's step watchdog reads (``stalled()``): a step stuck past ``step_timeout_s`` sends
  no message, so only memory the front end reads itself can tell.
- The engine process exiting for any reason (a crash, a kill, a failed loop) ends the reader's
  pipe: every live request then gets an error output, and ``load_error()`` says what happened.
  ``close()`` stops the engine (it closes the Engine), joins the process and the reader, and
  closes both pipes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.context
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as mp_wait
from typing import TYPE_CHECKING, Any

from execrt.engine.client import (
    BackgroundEngineClient,
    EngineRequest,
    EngineStats,
    OutputHolder,
    RequestOutput,
    deliver,
)
from execrt.engine.watchdog import StepClock, StepWatchdog, StepWatched

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from execrt.engine.engine import Engine
    from execrt.engine.threaded import Command

logger = logging.getLogger(__name__)

#: One request's output on the wire: (request id, token ids, finish reason, error,
#: prompt tokens, cached tokens, retractions, log-probabilities).
Packed = tuple[Any, ...]
#: Bytes a pipe buffers (Linux: F_SETPIPE_SZ, up to /proc/sys/fs/pipe-max-size): the engine
#: writes a step's outputs without waiting while the front end is busy for a few steps.
PIPE_BYTES = 1 << 20
#: The most messages one pump reads before the event loop that runs it gets its turn back.
PUMP_MESSAGES = 64


def _pack(rid: str, out: RequestOutput) -> Packed:
    return (
        rid,
        out.token_ids,
        out.finish_reason,
        out.error,
        out.prompt_tokens,
        out.cached_tokens,
        out.num_retractions,
        out.logprobs,
        out.prompt_logprobs,
    )


def _merge_steps(steps: list[list[Packed]]) -> list[Packed]:
    """Several steps' outputs as one: each request's tokens joined, its last state kept."""
    merged: dict[str, list[Any]] = {}
    for packed in steps:
        for p in packed:
            m = merged.get(p[0])
            if m is None:
                merged[p[0]] = list(p)
                continue
            m[1] = m[1] + p[1]
            m[2], m[3], m[6] = p[2], p[3], p[6]  # finish reason, error, retractions
            m[4], m[5] = p[4] or m[4], p[5] or m[5]  # prompt and cached tokens
            if p[7] is not None:
                m[7] = (m[7] or []) + p[7]
            if p[8] is not None:  # sent once
                m[8] = p[8]
    return [tuple(m) for m in merged.values()]


def _widen(conn: Connection) -> None:
    """Let ``conn``'s pipe buffer a few steps of outputs (where the OS allows)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)  # Linux only
    if setsize is None:
        return
    for size in (PIPE_BYTES, PIPE_BYTES // 4):
        try:
            fcntl.fcntl(conn.fileno(), setsize, size)
            return
        except OSError:  # above pipe-max-size for an unprivileged process
            continue


# -- spawning without Ctrl-C in the bootstrap ----------------------------------------------------
@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored in this process while the block runs, restored after. Only the main
    thread may set a handler: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        # None: a handler set outside Python; the default is the closest to restore.
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


class QuietStartProcess(multiprocessing.context.SpawnProcess):
    """A spawned process that starts with SIGINT ignored. Ctrl-C in a terminal reaches the
    whole process group: a child still in its bootstrap (a new interpreter importing torch,
    unpickling its target) would die of it with a traceback of its own, before its target
    could set a handler. CPython installs its KeyboardInterrupt handler at startup only
    where SIGINT is at its default, and an ignored signal stays ignored across exec, so the
    parent ignores SIGINT for the moment of the start (about 15 ms; a Ctrl-C then is lost:
    blocking it instead would not hold it back, since torch's own threads take it). The
    parent then decides how its children stop; a target that wants Ctrl-C sets a handler."""

    def start(self) -> None:
        with sigint_ignored():
            super().start()


class QuietSpawnContext(multiprocessing.context.SpawnContext):
    """The spawn context whose processes start as QuietStartProcess (also as an executor's
    ``mp_context``: its workers, started from the main thread, start the same way)."""

    Process = QuietStartProcess


QUIET_SPAWN = QuietSpawnContext()


# -- the engine process ---------------------------------------------------------------------------
def engine_main(
    build: Callable[[], Engine],
    commands: Connection,
    outputs: Connection,
    name: str | None,
    step_started: Any = None,
) -> None:
    """The engine process: build, say what the front end needs, run the command loop (timing
    its rounds in ``step_started``, shared with the front end, where a bound is set)."""
    from execrt.engine.codec import model_info, text_codec
    from execrt.engine.scheduler import describe_exception, describe_load_failure
    from execrt.engine.threaded import run_commands, step_bound

    # Ctrl-C in a terminal reaches the whole process group: the front end decides (it sends
    # "stop" once its HTTP side drained), so the engine does not die under running requests.
    # Already ignored since the start (QuietStartProcess) unless started off the main thread.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = build()
    except BaseException as exc:
        _send_quietly(outputs, ("error", describe_load_failure(exc)))
        return
    try:
        bound = step_bound(engine)
        ready = (
            "ready",
            model_info(engine, name),
            text_codec(engine),
            engine.limits,
            engine.worker.memory.prefix_cache is not None,
            bound,
            engine.stats(),
        )
    except BaseException as exc:
        engine.close()
        _send_quietly(outputs, ("error", describe_exception(exc)))
        return
    sinks: dict[str, Callable[[RequestOutput], None]] = {}
    step: list[Packed] = []
    last_stats: list[EngineStats] = [ready[-1]]
    front_end_gone = [False]  # its pipe broke: stop at the next round

    def send(message: Any) -> None:
        try:
            outputs.send(message)
        except (OSError, ValueError):
            front_end_gone[0] = True

    def sink_of(rid: str) -> Callable[[RequestOutput], None]:
        return lambda out: step.append(_pack(rid, out))

    def take(block: bool) -> list[Command]:
        taken: list[Command] = []
        if front_end_gone[0]:
            return [("stop",)]
        try:
            if block:
                taken.append(commands.recv())
            while commands.poll():
                taken.append(commands.recv())
        except (EOFError, OSError):  # the front end is gone: nobody reads the outputs
            taken.append(("stop",))
        for command in taken:
            if command[0] == "submit":
                rid = command[1].request_id
                sinks[rid] = sink_of(rid)
        return taken

    def after_step() -> None:
        stats = engine.stats()
        if not step and stats == last_stats[0]:
            return  # nothing new: do not wake the front end
        last_stats[0] = stats
        packed = step.copy()
        step.clear()
        send(("step", packed, stats))

    def flushed(key: int, ok: bool) -> None:
        send(("flushed", key, ok))

    clock = StepClock(step_started) if bound is not None and step_started is not None else None
    try:
        outputs.send(ready)
        summary = run_commands(engine, take, None, sinks, after_step, flushed, clock)
        _send_quietly(outputs, ("stopped", summary))
    except BaseException as exc:
        logger.exception("engine process: the engine failed; requests are no longer served")
        _send_quietly(outputs, ("failed", f"the engine failed: {describe_exception(exc)}"))
    finally:
        engine.close()


def _send_quietly(conn: Connection, message: Any) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):  # the front end is gone
        pass


# -- the front end's handle -----------------------------------------------------------------------
class ProcessEngineClient(StepWatched, BackgroundEngineClient):
    """Starts the engine process at once; ``ready()`` turns True when it has built the Engine,
    ``load_error()`` says why it could not (or why it stopped serving later), ``stalled()``
    when a step has run past the engine's ``step_timeout_s``.

    ``build`` runs in the engine process, so it must pickle: a module-level function or a
    ``functools.partial`` of one (``functools.partial(Engine, config=config)``). ``name`` is
    the model name front ends report (default: the checkpoint's directory or file name).
    """

    def __init__(self, build: Callable[[], Engine], *, name: str | None = None) -> None:
        super().__init__()
        ctx = QUIET_SPAWN  # Ctrl-C is the front end's to handle, from the engine's first moment
        child_commands, self._commands = ctx.Pipe(duplex=False)
        self._outputs, child_outputs = ctx.Pipe(duplex=False)
        for conn in (self._commands, self._outputs):
            _widen(conn)
        self._pending: queue.SimpleQueue[Command | None] = queue.SimpleQueue()  # to the writer
        self._lock = threading.Lock()  # _live and _gone, between callers and the reader
        self._live: dict[str, OutputHolder] = {}
        self._gone = False  # the engine process ended: no output will come
        self._ending = False  # _ended() ran or runs
        self._closing = False
        self._closed = False
        self._stats: EngineStats | None = None
        self._prefix_cache = False  # the engine has one (it says so when ready)
        self.summary: Any = None  # the engine loop's LoopSummary, once it stopped
        self._step_started = ctx.RawValue("d", 0.0)  # the engine's StepClock
        self.process = ctx.Process(
            target=engine_main,
            args=(build, child_commands, child_outputs, name, self._step_started),
            name="execrt-engine",
            daemon=True,  # never outlives the front end's interpreter
        )
        try:
            self.process.start()
        except Exception as exc:  # e.g. ``build`` does not pickle
            for conn in (child_commands, self._commands, self._outputs, child_outputs):
                conn.close()
            raise TypeError(
                f"ProcessEngineClient: cannot start the engine process with build={build!r} "
                f"(it must pickle: a module-level function or a functools.partial of one): {exc}"
            ) from exc
        child_commands.close()  # the engine's ends: the reader sees EOF once the engine exits
        child_outputs.close()
        self._wake_r, self._wake_w = os.pipe()  # wakes the reader thread to hand over
        self._loop: asyncio.AbstractEventLoop | None = None  # reads the outputs, if any
        self._done = threading.Event()  # set once the pipe ended and the live requests failed
        self._reader = self._start_reader()
        self._writer = threading.Thread(
            target=self._write, name="execrt-engine-writer", daemon=True
        )
        self._writer.start()

    # -- reading the engine's messages -------------------------------------------------------------
    # A thread reads them until the front end's event loop takes over (``serve_on``): then the
    # loop reads them itself when the pipe is readable, so no second thread of this process
    # competes with the loop for the interpreter lock at every step.
    def _read(self) -> None:
        """The reader thread: until the pipe ends, or ``serve_on`` wakes it to hand over."""
        try:
            while True:
                ready = mp_wait([self._outputs, self._wake_r])
                if self._wake_r in ready:
                    os.read(self._wake_r, 64)
                    return  # the event loop reads from here on
                if not self._pump():
                    return
        except BaseException:  # a bug here must still fail the live requests
            logger.exception("engine client: the output reader failed")
            self._ended()

    def _pump(self) -> bool:
        """Handle the messages the pipe holds now (at most ``PUMP_MESSAGES``: an event loop
        that reads them gets its turn between pumps); False once the pipe ended (the engine
        exited). Steps read together reach the holders as one: a front end that fell behind
        catches up at the cost of one step, not of every step it missed."""
        steps: list[list[Packed]] = []
        try:
            for _ in range(PUMP_MESSAGES):
                if not self._outputs.poll():
                    break
                message = self._outputs.recv()
                if message[0] == "step":
                    steps.append(message[1])
                    self._stats = message[2]
                    continue
                if steps:  # what came before it comes first
                    self._on_steps(steps)
                    steps = []
                self._handle(message)
        except (EOFError, OSError):
            if steps:
                self._on_steps(steps)
            if self._loop is not None:  # off the event loop: the ending may wait for a join
                self._loop.remove_reader(self._outputs.fileno())
                threading.Thread(target=self._ended, name="execrt-engine-end").start()
            else:
                self._ended()
            return False
        if steps:
            self._on_steps(steps)
        return True

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            _, info, text, limits, self._prefix_cache, bound, self._stats = message
            if bound is not None:
                self._watchdog = StepWatchdog(StepClock(self._step_started), bound)
            self._loaded_with(info, text, limits)
            self._loaded.set()
        elif kind == "flushed":
            self.flushed(message[1], message[2])
        elif kind == "stopped":
            self.summary = message[1]
        elif kind in ("error", "failed"):
            self._error = message[1]

    def _on_steps(self, steps: list[list[Packed]]) -> None:
        packed = steps[0] if len(steps) == 1 else _merge_steps(steps)
        if not packed:
            return
        outputs = []
        live = self._live
        with self._lock:
            for rid, ids, finish, error, prompt, cached, retractions, lps, prompt_lps in packed:
                holder = live.pop(rid, None) if finish is not None else live.get(rid)
                if holder is not None:
                    out = RequestOutput(
                        ids, lps, finish, error, prompt, cached, retractions, prompt_lps
                    )
                    outputs.append((holder, out))
        deliver(outputs)

    def _ended(self) -> None:
        """The engine process is gone: whoever still waits gets an error. Runs once."""
        with self._lock:
            if self._ending:
                return
            self._ending = True
        if self._error is None and not self._closing:
            self.process.join(30)  # its pipe closed as it exited: the code comes at once
            code = self.process.exitcode
            how = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
            self._error = f"the engine process exited unexpectedly ({how})"
        why = self._error or "the engine was closed"
        self._step_started.value = 0.0  # a step it died in is no step in flight
        with self._lock:
            self._gone = True
            live, self._live = list(self._live.values()), {}
        deliver([(h, RequestOutput([], finish_reason="error", error=why)) for h in live])
        for future in list(self._flushes.values()):
            if not future.done():
                future.set_exception(RuntimeError(why))
        self._flushes.clear()
        self._loaded.set()
        self._done.set()

    def serve_on(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Read the engine's outputs on ``loop`` (the running loop: call this on its thread)
        until ``serve_on(None)`` gives the reading back to a thread of the client."""
        if self._closed or self._done.is_set() or loop is self._loop:
            return
        fd = self._outputs.fileno()
        if loop is not None:
            if self._loop is not None:
                self._loop.remove_reader(fd)
            else:  # the thread stops reading, then the loop starts
                os.write(self._wake_w, b"x")
                self._reader.join()
            self._loop = loop
            loop.add_reader(fd, self._pump)
        else:
            assert self._loop is not None
            self._loop.remove_reader(fd)
            self._loop = None
            self._reader = self._start_reader()

    def _start_reader(self) -> threading.Thread:
        thread = threading.Thread(target=self._read, name="execrt-engine-reader", daemon=True)
        thread.start()
        return thread

    def _send(self, command: Command) -> bool:
        """Queue ``command`` for the writer thread (never blocks); False once the engine
        process is gone or the client closed."""
        if self._gone or self._closed:
            return False
        self._pending.put(command)
        return True

    def _write(self) -> None:
        """The writer thread: the queued commands into the pipe, in order, until ``None``
        (``close``) or the pipe breaks (the engine process is gone: the reader says so)."""
        while True:
            command = self._pending.get()
            if command is None:
                return
            try:
                self._commands.send(command)
            except (OSError, ValueError):
                return

    def _has_prefix_cache(self) -> bool:
        return self._prefix_cache

    def _send_flush(self, key: int) -> bool:
        return not self._gone and self._send(("flush", key))

    # -- EngineClient (the rest: BackgroundEngineClient) ---------------------------------------
    def ready(self) -> bool:
        return super().ready() and not self._gone

    def submit(self, request: EngineRequest, holder: OutputHolder) -> None:
        with self._lock:
            gone = self._gone
            if not gone:
                self._live[request.request_id] = holder
        if gone:
            why = self._error or "the engine was closed"
            holder.put(RequestOutput([], finish_reason="error", error=why))
        else:  # should the engine be gone by now, the reader fails the request
            self._send(("submit", request))

    def abort(self, request_id: str, reason: str) -> None:
        self._send(("abort", request_id, reason))

    def stats(self) -> EngineStats:
        """The engine's stats as of its last round of commands or step (pushed with each)."""
        assert self._stats is not None, "stats() before ready()"
        return self._stats

    def close(self, timeout: float = 60.0) -> None:
        """Stop the engine process (it closes the Engine first) and join it and the reader;
        a process still loading the model is terminated. Idempotent."""
        if self._closed:
            return
        self._closing = True
        if self.process.is_alive():
            if self._loaded.is_set():
                self._send(("stop",))
                self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
        # The pipe ends as the process exits: whoever reads it fails what is still live (an
        # event loop that reads it may have stopped: then nobody does).
        if not self._done.wait(timeout if self._loop is None else min(timeout, 5.0)):
            self._ended()
        if self._loop is None:
            self._reader.join(timeout)
        self._close_watchdog()
        self._pending.put(None)
        self._writer.join(timeout)  # the process is gone: a blocked send has failed
        self._commands.close()
        self._outputs.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._closed = True
