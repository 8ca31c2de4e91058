"""Driver: one Scheduler stepped from many threads, one step at a time.

At most one thread, the driver, touches the scheduler at a time. Other threads never wait for
the scheduler itself: a change they make (add a request, abort one) is queued and applied by
the driver before its next step, or at once by the calling thread when nobody drives. A thread
waiting for its requests sleeps on a condition that the driver signals after every step, and
takes over driving when the driver leaves, so every waiting call makes progress and returns as
soon as its own requests are done (not when the driver's are).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from execrt.engine.scheduler import Scheduler


class Driver:
    """Serialises everything done to ``scheduler``; ``after_step`` runs after each step and
    each batch of queued changes (by the driving thread, the scheduler quiet)."""

    def __init__(self, scheduler: Scheduler, after_step: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self._after_step = after_step
        self._changes: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._driver: int | None = None  # the thread ident of the driving thread
        self._closing = False  # shut(): drivers stop between steps, waiters and callers raise

    @property
    def has_work(self) -> bool:
        """Requests to step or changes to apply (a snapshot: other threads may add more)."""
        return bool(self._changes) or self.scheduler.has_work

    def call(self, change: Callable[[], None]) -> None:
        """Apply ``change`` to the scheduler: now when no thread drives (exceptions then
        propagate), else by the driver before its next step."""
        with self._cond:
            self._refuse_closed()
            self._changes.append(change)
            if self._driver is not None:
                return  # the driver applies it (it re-checks the queue before leaving)
            self._driver = threading.get_ident()
        self._leave()

    def refuse_reentry(self, call: str) -> None:
        """Raise if the calling thread is the driver: an ``on_output`` callback (run by the
        thread that steps, between two steps) that would wait for a step waits for itself."""
        if self._driver == threading.get_ident():
            raise RuntimeError(
                f"engine: {call} called from the thread that is stepping the engine (an "
                "on_output callback), which would wait for itself; a callback may use "
                "submit, abort_request(s), validate and stats, or hand the call to another "
                "thread"
            )

    def drive(self, done: Callable[[], bool], *, max_steps: int | None = None) -> int:
        """Step until ``done()`` (checked before every step, without the scheduler lock) or
        ``max_steps`` steps ran; returns the steps this thread ran. While another thread
        drives, wait for it: its steps advance every queued request, ours too. A step that
        raises aborts the requests it carried (see ``Scheduler.step``) and propagates."""
        me = threading.get_ident()
        self.refuse_reentry("a call that steps or waits for a step")
        with self._cond:
            while self._driver is not None and not done() and not self._closing:
                self._cond.wait()
            if done():
                return 0
            self._refuse_closed()
            self._driver = me
        steps = 0
        try:
            while max_steps is None or steps < max_steps:
                self._apply()
                if done() or not self.scheduler.has_work:
                    break
                with self._cond:
                    self._refuse_closed()  # between two steps: the closing thread goes next
                try:
                    self.scheduler.step()
                finally:  # what the step gave, or the aborts of a step that failed
                    self._after_step()
                steps += 1
                with self._cond:
                    self._cond.notify_all()
        finally:
            self._leave()
        return steps

    def shut(self, final: Callable[[], None]) -> None:
        """Run ``final`` (the engine's release) as the driver once the driving thread, if any,
        has finished its step; from then on every call raises, and threads waiting for a step
        or stepping between two raise too, so none runs on what ``final`` released."""
        me = threading.get_ident()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._driver is not None:
                self._cond.wait()
            self._driver = me
        try:
            final()
        finally:
            with self._cond:
                self._changes.clear()  # nothing may run on a released engine
                self._driver = None
                self._cond.notify_all()

    def _refuse_closed(self) -> None:
        if self._closing:
            raise RuntimeError("engine: closed while this call was running or waiting")

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until there are requests to step or changes to apply, or ``timeout``
        seconds passed; returns whether there is work."""
        with self._cond:
            return self._cond.wait_for(lambda: self.has_work, timeout)

    def _apply(self) -> None:
        try:
            while self._changes:
                self._changes.popleft()()
        finally:
            self._after_step()

    def _leave(self) -> None:
        """Apply what other threads queued meanwhile, then stop driving and wake everyone
        waiting (one of them may take over)."""
        try:
            while True:
                with self._cond:
                    if not self._changes:
                        self._driver = None
                        self._cond.notify_all()
                        return
                self._apply()
        except BaseException:
            with self._cond:
                self._driver = None
                self._cond.notify_all()
            raise
