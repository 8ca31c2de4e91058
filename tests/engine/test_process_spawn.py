"""QUIET_SPAWN (engine/process.py): processes that start with SIGINT ignored, so a Ctrl-C to
the whole process group cannot interrupt their bootstrap, while the parent keeps its own."""

from __future__ import annotations

import signal
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import pytest

from execrt.engine.process import QUIET_SPAWN, sigint_ignored


@pytest.fixture(autouse=True)
def interruptible() -> Any:
    """This process with Python's own SIGINT handler, as a command has it (a pytest-xdist
    worker ignores SIGINT: the tests would pass without QUIET_SPAWN, and fail on the parent)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint_ignored(conn: Any = None) -> bool:
    """Whether SIGINT is ignored in the calling process (sent on ``conn`` too, if given)."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if conn is not None:
        conn.send(ignored)
    return ignored


def test_a_child_starts_ignoring_sigint_and_the_parent_keeps_its_handler() -> None:
    handler = signal.getsignal(signal.SIGINT)
    parent, child = QUIET_SPAWN.Pipe()
    process = QUIET_SPAWN.Process(target=_sigint_ignored, args=(child,))
    process.start()
    assert parent.recv() is True  # set by no code of the child: inherited at exec
    process.join(60)
    assert process.exitcode == 0
    assert signal.getsignal(signal.SIGINT) is handler and not _sigint_ignored()


def test_sigint_ignored_does_nothing_off_the_main_thread() -> None:
    def inside() -> bool:
        with sigint_ignored():  # signal.signal would raise ValueError there
            return _sigint_ignored()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(inside).result() is False
    with sigint_ignored():
        assert _sigint_ignored()
    assert not _sigint_ignored()


def test_an_executor_over_it_starts_workers_ignoring_sigint() -> None:
    with ProcessPoolExecutor(1, mp_context=QUIET_SPAWN) as pool:
        assert pool.submit(_sigint_ignored).result(60) is True
