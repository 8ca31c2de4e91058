"""ThreadedEngineClient: the EngineClient of an Engine owned by one thread of this process.

The engine thread builds the Engine, then loops: take the commands queued since the last step
(blocking while the engine has no work), apply them (submit, abort), run one step. Under
torchrun the loop runs on every rank: rank 0 takes the commands from its queue and broadcasts
them over a gloo group before applying them, the other ranks (``follow``) apply what they
receive, so every rank runs the same schedule; a ``stop`` command ends every rank's loop.
A rank that goes away fails the others' next collective: their loops end with one
``RankLostError`` line. Rank 0's rounds (commands shared, step run) are timed for the step
watchdog (``step_timeout_s``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from execrt.core.config import RuntimeConfig
from execrt.core.errors import RequestError
from execrt.core.parallel import ParallelState, RankLostError, rank_lost
from execrt.core.schedule import SamplingParams
from execrt.engine.client import (
    BackgroundEngineClient,
    EngineRequest,
    EngineStats,
    OutputHolder,
    RequestOutput,
    deliver,
)
from execrt.engine.codec import model_info, text_codec
from execrt.engine.engine import Engine
from execrt.engine.scheduler import describe_exception, describe_load_failure
from execrt.engine.watchdog import StepClock, StepWatchdog, StepWatched

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
#: ("submit", EngineRequest) | ("abort", request_id, reason) | ("flush", key) | ("stop",)
Command = tuple[Any, ...]
#: How long a rank waits for rank 0's next command: an idle server sends none for hours.
IDLE_TIMEOUT = datetime.timedelta(days=30)


# -- the command loop, on every rank -----------------------------------------------------------
class CommandChannel:
    """Rank 0's commands of each step, broadcast to every rank over a dedicated gloo group
    (CPU objects, whatever the model's own backend; a timeout long enough to idle)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.world = ParallelState.from_process_group()
        self.rank = self.world.rank

    def share(self, commands: list[Command]) -> list[Command]:
        """Rank 0's ``commands`` on every rank. Raises RankLostError when a rank is gone."""
        box: list[Any] = [commands if self.rank == 0 else None]
        try:
            self._dist.broadcast_object_list(box, src=0, group=self.group)
        except Exception as exc:
            lost = rank_lost(exc, self.world)
            if lost is None:
                raise
            raise lost from exc
        return list(box[0])


@dataclass
class LoopSummary:
    """What one rank's command loop did."""

    requests: int = 0
    aborted: int = 0
    steps: int = 0
    failed_steps: int = 0


def run_commands(
    engine: Engine,
    take: Callable[[bool], list[Command]] | None,
    channel: CommandChannel | None,
    sinks: dict[str, Sink] | None = None,
    after_step: Callable[[], None] | None = None,
    flushed: Callable[[int, bool], None] | None = None,
    clock: StepClock | None = None,
) -> LoopSummary:
    """Apply commands and step until a ``stop`` command. ``take(block)`` gives the commands
    queued since the last call (rank 0; ``block``: wait for one); without it, the commands
    come from rank 0 through ``channel``. ``sinks`` (rank 0) receive each request's outputs;
    ``after_step`` runs after each round of commands and step; ``flushed(key, ok)`` gets the
    result of each ``("flush", key)`` command (the prefix cache emptied between steps);
    ``clock`` times each round from its commands taken to its step's end, for the step
    watchdog. A step that fails aborts its requests and the loop goes on, unless a rank is
    gone (a collective failed): then RankLostError ends the loop, as it does from the
    channel."""
    rids: dict[str, int] = {}
    summary = LoopSummary()

    def submit(request: EngineRequest) -> None:
        sink = sinks.pop(request.request_id, None) if sinks is not None else None

        def on_output(out: RequestOutput) -> None:
            if out.finished:
                rids.pop(request.request_id, None)
            if sink is not None:
                sink(out)

        try:
            sp = SamplingParams(**request.sampling)
            rids[request.request_id] = engine.submit(
                request.prompt_ids,
                sp,
                on_output=on_output,
                top_logprobs=request.top_logprobs,
                prompt_logprobs=request.prompt_logprobs,
            )
            summary.requests += 1
        except (RequestError, TypeError) as exc:  # check() passed: only a racing change
            on_output(RequestOutput([], finish_reason="error", error=str(exc)))

    aborts: dict[str, list[int]] = {}  # a round's aborts by reason, applied together

    def abort_all() -> None:
        # One pass over the queues for a round's aborts: one per request rescanned them all,
        # and a client that left with thousands of queued choices stalled every other
        # request for a time growing with the square of their number.
        for reason, ids in aborts.items():
            engine.abort_requests(ids, reason)
            summary.aborted += len(ids)
        aborts.clear()

    while True:
        commands = take(not engine.has_work) if take is not None else []
        with clock if clock is not None else contextlib.nullcontext():
            if channel is not None:
                commands = channel.share(commands)
            for command in commands:
                if command[0] == "stop":
                    return summary
                if command[0] == "submit":
                    submit(command[1])
                elif command[0] == "abort":
                    rid = rids.get(command[1])
                    if rid is not None:
                        aborts.setdefault(command[2], []).append(rid)
                elif command[0] == "flush":
                    abort_all()  # what was aborted before the flush is freed before it
                    engine.flush_cache()
                    ok = engine.worker.memory.cached_slots == 0  # else requests read some
                    if flushed is not None:
                        flushed(command[1], ok)
            abort_all()
            try:
                if engine.step():
                    summary.steps += 1
            except Exception as exc:
                # The step's requests were aborted with the error (their last outputs say
                # so); the others are consistent and go on, unless a rank is gone.
                lost = rank_lost(exc, engine.parallel)
                if lost is not None:
                    raise lost from exc
                logger.exception("engine thread: a step failed; the requests in it were aborted")
                summary.failed_steps += 1
        if after_step is not None:
            after_step()


def follow(engine: Engine) -> LoopSummary:
    """A rank other than 0: run rank 0's commands until it stops (serving nothing). Raises
    RankLostError (one line for the user) when another rank is gone."""
    return run_commands(engine, None, CommandChannel())


def step_bound(engine: Engine) -> float | None:
    """``engine``'s ``step_timeout_s`` on its device, in seconds (None: no bound, as for a
    stand-in without a config, such as the bench's ``PacedEngine``)."""
    config: RuntimeConfig | None = getattr(engine, "config", None)
    if config is None:
        return None
    return config.step_timeout(engine.worker.limits.device.type)


# -- the client --------------------------------------------------------------------------------
class ThreadedEngineClient(StepWatched, BackgroundEngineClient):
    """Builds an Engine with ``build()`` on its own thread and serves it from there.

    ``ready()`` turns True once built; ``load_error()`` says why building failed. ``name`` is
    the model name front ends report (default: the checkpoint's directory or file name).
    ``stalled()`` says when a step has run past the engine's ``step_timeout_s``.
    """

    def __init__(self, build: Callable[[], Engine], *, name: str | None = None) -> None:
        super().__init__()
        self._build = build
        self._name = name
        self._engine: Engine | None = None
        self._commands: deque[Command] = deque()
        self._cond = threading.Condition()
        self._sinks: dict[str, Sink] = {}
        self._outputs: list[tuple[OutputHolder, RequestOutput]] = []  # of this step
        self._live: dict[str, OutputHolder] = {}  # submitted, not finished
        self.summary: LoopSummary | None = None
        self._thread = threading.Thread(target=self._main, name="execrt-engine", daemon=True)
        self._thread.start()

    # -- the engine thread -----------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine = self._build()
        except BaseException as exc:
            self._error = describe_load_failure(exc)
            self._loaded.set()
            return
        try:
            channel = CommandChannel() if engine.parallel.world_size > 1 else None
            info, text = model_info(engine, self._name), text_codec(engine)
        except BaseException as exc:
            self._error = describe_exception(exc)
            engine.close()
            self._loaded.set()
            return
        self._engine = engine
        clock, bound = None, step_bound(engine)
        if bound is not None:
            clock = StepClock()
            self._watchdog = StepWatchdog(clock, bound)
        self._loaded_with(info, text, engine.limits)  # ready from here on
        self._loaded.set()
        try:
            self.summary = run_commands(
                engine,
                self._take,
                channel,
                self._sinks,
                after_step=self._deliver,
                flushed=self.flushed,
                clock=clock,
            )
        except BaseException as exc:
            if isinstance(exc, RankLostError):  # one line: the collective's stack says no more
                logger.error("engine thread: %s", exc)
                logger.debug("the failed collective:", exc_info=exc.__cause__)
                self._error = f"the engine failed: {exc}"
                self._lost = exc.lost  # before the outputs: a front end reads it with them
            else:
                logger.exception("engine thread: the engine failed; requests are no longer served")
                self._error = f"the engine failed: {describe_exception(exc)}"
            self._deliver()
            for holder in list(self._live.values()):  # nobody waits for an answer forever
                holder.put(RequestOutput([], finish_reason="error", error=self._error))
            if self._lost is None:  # a lost rank was said in one line: no traceback
                raise
        finally:
            self._close_watchdog()
            engine.close()

    def _deliver(self) -> None:
        if self._outputs:
            outputs, self._outputs = self._outputs, []
            deliver(outputs)

    def _take(self, block: bool) -> list[Command]:
        with self._cond:
            while block and not self._commands:
                self._cond.wait()
            taken = list(self._commands)
            self._commands.clear()
            return taken

    def _queue(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _has_prefix_cache(self) -> bool:
        assert self._engine is not None
        return self._engine.worker.memory.prefix_cache is not None

    def _send_flush(self, key: int) -> bool:
        self._queue(("flush", key))
        return True

    # -- EngineClient (the rest: BackgroundEngineClient) ---------------------------------------
    def submit(self, request: EngineRequest, holder: OutputHolder) -> None:
        rid = request.request_id

        def sink(out: RequestOutput) -> None:  # outputs go out together after each step
            self._outputs.append((holder, out))
            if out.finished:
                self._live.pop(rid, None)

        self._live[rid] = holder
        self._sinks[rid] = sink
        self._queue(("submit", request))

    def abort(self, request_id: str, reason: str) -> None:
        self._queue(("abort", request_id, reason))

    def stats(self) -> EngineStats:
        assert self._engine is not None, "stats() before ready()"
        return self._engine.stats()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the engine thread (every rank's loop under torchrun) and close the engine.
        While the model is still loading, returns at once (the thread is a daemon)."""
        self._queue(("stop",))
        if self._loaded.is_set():
            self._thread.join(timeout)
