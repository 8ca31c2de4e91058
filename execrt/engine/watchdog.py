"""The step watchdog of a served engine: a step in flight past ``step_timeout_s`` (a hung TP
rank, a stuck kernel) is said at once to the front end, which then fails ``/health`` and
refuses new requests, and once in a log line; plain Python (no torch), as the seam is.

A hung collective cannot be cancelled, so nothing is stopped here: the requests already in the
engine wait for the step, and everything is as before once it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: How to change the bound, as the log line says it.
HOW_TO_CHANGE = "step_timeout_s (EXECRT_STEP_TIMEOUT_S) sets the bound in seconds, inf for none"


class _Cell:
    """A float ``value`` shared by the threads of one process."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class StepClock:
    """When the serving loop's step in flight began: the loop marks each step (``with clock:``),
    a watchdog on another thread reads it, or in another process when ``cell`` is shared
    memory (``multiprocessing``'s ``RawValue("d")``; any object with a float ``value``). The
    value is 0 while no step runs; ``now`` is ``time.monotonic``, one clock for every process
    of the machine."""

    def __init__(self, cell: Any = None, now: Callable[[], float] = time.monotonic) -> None:
        self.cell = cell if cell is not None else _Cell()
        self.now = now

    def __enter__(self) -> StepClock:
        self.cell.value = self.now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cell.value = 0.0

    @property
    def started(self) -> float:
        """When the step in flight began (0.0: none runs)."""
        return float(self.cell.value)

    def running_for(self) -> float:
        """Seconds the step in flight has run (0.0: none runs)."""
        started = self.started
        return max(0.0, self.now() - started) if started else 0.0


def overdue_message(running_s: float, bound_s: float) -> str:
    """What ``/health`` and a refused request say of a step past its bound."""
    return (
        f"the engine step has been running for {running_s:.1f} s, over the bound of "
        f"{bound_s:g} s (step_timeout_s): a TP rank or the device may be hung; new requests "
        "are refused until the step ends"
    )


class StepWatchdog:
    """Watches ``clock`` against ``bound_s`` seconds. ``overdue()`` tells at once whether the
    step in flight has run past the bound. One warning is logged when a step is first seen
    past it (by ``overdue()`` or by a daemon thread of the watchdog's own that looks every
    ``poll_s``), naming the bound and how to change it, and one line when that step ends.
    ``close()`` stops the thread."""

    def __init__(self, clock: StepClock, bound_s: float, *, poll_s: float | None = None) -> None:
        if not bound_s > 0:
            raise ValueError(f"step watchdog: bound_s must be > 0, got {bound_s}")
        self.clock = clock
        self.bound_s = bound_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.01, bound_s / 4))
        self._lock = threading.Lock()
        self._reported = 0.0  # the start of the step logged as overdue (0.0: none)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="execrt-watchdog", daemon=True)
        self._thread.start()

    def overdue(self) -> str | None:
        """Why no new request should wait behind the engine now (its step has run past the
        bound), or None."""
        self._say_if_ended()
        started, now = self.clock.started, self.clock.now()
        if not started or now - started <= self.bound_s:
            return None
        message = overdue_message(now - started, self.bound_s)
        with self._lock:
            first, self._reported = self._reported != started, started
        if first:
            logger.warning("engine: %s (%s)", message, HOW_TO_CHANGE)
        return message

    def close(self) -> None:
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._say_if_ended()  # a stop within a poll of the step's end still says it

    def _say_if_ended(self) -> None:
        """The line for a step logged as overdue that has ended since, once (whoever looks
        first: the thread, a caller of ``overdue()``, ``close()``)."""
        started, now = self.clock.started, self.clock.now()
        with self._lock:
            reported = self._reported
            if not reported or started == reported:
                return
            self._reported = 0.0
        logger.warning(
            "engine: the step that ran past step_timeout_s ended after about %.1f s; "
            "new requests are taken again",
            now - reported,
        )

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            self.overdue()


class StepWatched:
    """An engine client whose serving loop a StepWatchdog may watch: it sets ``_watchdog``
    once the engine is built with a bound, and closes it with ``_close_watchdog``."""

    _watchdog: StepWatchdog | None = None

    def stalled(self) -> str | None:
        """Why the engine takes no new request although it is ready: its step in flight has
        run past ``step_timeout_s`` (None: it has not, or no bound is set)."""
        watchdog = self._watchdog
        return watchdog.overdue() if watchdog is not None else None

    def _close_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
