"""The step watchdog (engine/watchdog.py, the step_timeout_s key): a step past its bound is
said at once and logged once, with its end; the bound comes from the config (Engine keyword,
EXECRT_STEP_TIMEOUT_S, TOML), auto by device; the engine clients time the serving loop's
steps, across processes too."""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from execrt.core.config import RuntimeConfig
from execrt.core.errors import ConfigError
from execrt.engine.client import EngineRequest, OutputHolder, RequestOutput
from execrt.engine.engine import Engine
from execrt.engine.process import ProcessEngineClient
from execrt.engine.threaded import ThreadedEngineClient
from execrt.engine.watchdog import StepClock, StepWatchdog, overdue_message

WATCHDOG_LOG = "execrt.engine.watchdog"


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _wait_until(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


# -- the clock and the watchdog ------------------------------------------------------------------
def test_a_step_is_overdue_past_the_bound_only_while_it_runs() -> None:
    now = FakeTime()
    clock = StepClock(now=now)
    watchdog = StepWatchdog(clock, 2.0, poll_s=60)
    try:
        assert clock.running_for() == 0.0 and watchdog.overdue() is None  # no step
        with clock:
            now.now += 1.5
            assert clock.running_for() == 1.5
            assert watchdog.overdue() is None  # within the bound
            now.now += 1.0
            message = watchdog.overdue()
            assert message is not None
            assert "running for 2.5 s, over the bound of 2 s (step_timeout_s)" in message
        assert watchdog.overdue() is None  # it ended
        now.now += 100.0
        assert watchdog.overdue() is None  # idle for long is no stall
    finally:
        watchdog.close()


def test_the_watchdog_logs_a_stalled_step_once_and_its_end(caplog) -> None:
    now = FakeTime()
    clock = StepClock(now=now)
    caplog.set_level(logging.WARNING, logger=WATCHDOG_LOG)
    watchdog = StepWatchdog(clock, 5.0, poll_s=0.005)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == WATCHDOG_LOG]

    try:
        with clock:
            now.now += 4.0
            time.sleep(0.1)  # many polls within the bound: nothing said
            assert lines() == []
            now.now += 3.0
            _wait_until(lambda: len(lines()) == 1)
            time.sleep(0.1)  # many polls past it: said once
        _wait_until(lambda: len(lines()) == 2)
        time.sleep(0.05)
    finally:
        watchdog.close()
    stalled, ended = lines()
    assert "running for 7.0 s, over the bound of 5 s" in stalled
    assert "EXECRT_STEP_TIMEOUT_S" in stalled and "inf for none" in stalled  # how to change it
    assert "ended after about 7.0 s; new requests are taken again" in ended


def test_the_end_of_a_stalled_step_is_said_before_the_next_poll_or_at_close(caplog) -> None:
    # The end was said by the thread's next poll only: a server stopped (or asked for its
    # health) within a poll of the step's end never said it (a flaky torchrun serve test).
    caplog.set_level(logging.WARNING, logger=WATCHDOG_LOG)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == WATCHDOG_LOG]

    for ask_first in (True, False):
        caplog.clear()
        now = FakeTime()
        clock = StepClock(now=now)
        watchdog = StepWatchdog(clock, 2.0, poll_s=3600)  # the thread never looks
        try:
            with clock:
                now.now += 3.0
                assert watchdog.overdue() is not None
            if ask_first:  # a /health: told at once that it ended, and says so
                assert watchdog.overdue() is None
                assert len(lines()) == 2
        finally:
            watchdog.close()
        assert len(lines()) == 2 and "new requests are taken again" in lines()[1]


def test_a_watchdog_needs_a_positive_bound() -> None:
    with pytest.raises(ValueError, match="bound_s must be > 0, got 0"):
        StepWatchdog(StepClock(), 0.0)


# -- the config key ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, -0.5, math.nan])
def test_a_bad_step_timeout_is_a_config_error_naming_the_value(bad: float) -> None:
    with pytest.raises(ConfigError) as info:
        RuntimeConfig(step_timeout_s=bad)
    message = str(info.value)
    assert "step_timeout_s must be >= 0" in message and f"got {float(bad)}" in message
    assert "0 = auto: 300 s on CUDA, none elsewhere; inf = no bound" in message


def test_the_step_timeout_comes_from_the_environment_and_toml(tmp_path: Path) -> None:
    env = {"EXECRT_STEP_TIMEOUT_S": "2.5"}
    assert RuntimeConfig.load(environ=env).step_timeout_s == 2.5
    with pytest.raises(ConfigError, match=r"EXECRT_STEP_TIMEOUT_S\): step_timeout_s='soon'"):
        RuntimeConfig.load(environ={"EXECRT_STEP_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match=r"environment EXECRT_STEP_TIMEOUT_S\).*got -3.0"):
        RuntimeConfig.load(environ={"EXECRT_STEP_TIMEOUT_S": "-3"})
    with pytest.raises(ConfigError, match="step_timeout_s=True has type bool"):
        RuntimeConfig(step_timeout_s=True)  # type: ignore[arg-type]
    toml = tmp_path / "execrt.toml"
    toml.write_text("step_timeout_s = inf\n")
    assert RuntimeConfig.load(file=toml, environ={}).step_timeout("cuda") is None


@pytest.mark.parametrize(
    ("value", "cpu", "cuda"),
    [(0.0, None, 300.0), (7, 7.0, 7.0), (0.25, 0.25, 0.25), (math.inf, None, None)],
)
def test_the_bound_is_auto_by_device(value: float, cpu: float | None, cuda: float | None) -> None:
    config = RuntimeConfig(step_timeout_s=value)
    assert (config.step_timeout("cpu"), config.step_timeout("cuda")) == (cpu, cuda)


# -- the engine clients time their steps ------------------------------------------------------
def _gated(gate: threading.Event, **config: object) -> Engine:
    """The built-in engine whose steps wait while ``gate`` is clear (a hung collective)."""
    engine = Engine("builtin", device="cpu", **config)
    step = engine.step

    def gated_step() -> bool:
        gate.wait()
        return step()

    engine.step = gated_step  # type: ignore[method-assign]
    return engine


def _wait_finished(holder: OutputHolder, timeout: float = 60.0) -> RequestOutput:
    deadline = time.monotonic() + timeout
    merged: RequestOutput | None = None
    while merged is None or not merged.finished:
        out = holder.take()
        if out is not None and merged is None:
            merged = out
        elif out is not None and merged is not None:
            merged.token_ids += out.token_ids
            merged.finish_reason, merged.error = out.finish_reason, out.error
        assert time.monotonic() < deadline, "no finished output"
        time.sleep(0.01)
    return merged


def _request(rid: str) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], {"max_new_tokens": 4, "temperature": 0})


def test_the_thread_client_says_a_step_stalled_and_serves_on_once_it_ends(caplog) -> None:
    caplog.set_level(logging.WARNING, logger=WATCHDOG_LOG)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == WATCHDOG_LOG]

    gate = threading.Event()
    gate.set()
    client = ThreadedEngineClient(functools.partial(_gated, gate, step_timeout_s=1.0))
    try:
        assert client.wait_ready(120), client.load_error()
        first = OutputHolder()
        client.submit(_request("a"), first)
        expected = _wait_finished(first).token_ids
        assert client.stalled() is None
        gate.clear()  # the next step hangs
        waiting = OutputHolder()
        client.submit(_request("b"), waiting)
        _wait_until(lambda: client.stalled() is not None)
        assert "over the bound of 1 s (step_timeout_s)" in (client.stalled() or "")
        assert waiting.take() is None  # still waiting: nothing cancelled it
        _wait_until(lambda: len(said()) == 1)
        assert "over the bound of 1 s" in said()[0] and "EXECRT_STEP_TIMEOUT_S" in said()[0]
        gate.set()
        assert _wait_finished(waiting).token_ids == expected  # what it would have been
        assert client.stalled() is None
        stats = client.stats()
        assert stats.requests_running == stats.requests_waiting == 0
        assert stats.kv_slots_free + stats.kv_slots_cached == stats.kv_slots_total
        _wait_until(lambda: len(said()) == 2)
        assert "new requests are taken again" in said()[1]
    finally:
        gate.set()
        client.close()


def test_no_bound_on_cpu_by_default() -> None:
    client = ThreadedEngineClient(functools.partial(Engine, "builtin", device="cpu"))
    try:
        assert client.wait_ready(120), client.load_error()
        assert client._watchdog is None and client.stalled() is None
    finally:
        client.close()


def _gated_by_file(gate: str, **config: object) -> Engine:
    """The built-in engine (in the engine process) whose steps wait while ``gate`` exists."""
    torch.set_num_threads(1)  # idle torch threads spin: the cores are shared with the test
    engine = Engine("builtin", device="cpu", **config)
    step = engine.step

    def gated_step() -> bool:
        while os.path.exists(gate):
            time.sleep(0.01)
        return step()

    engine.step = gated_step  # type: ignore[method-assign]
    return engine


@pytest.mark.slow
def test_the_process_client_reads_the_engine_process_step_clock(tmp_path: Path) -> None:
    gate = tmp_path / "hang"
    build = functools.partial(_gated_by_file, str(gate), step_timeout_s=0.5)
    client = ProcessEngineClient(build, name="builtin")
    try:
        assert client.wait_ready(120), client.load_error()
        assert client.stalled() is None
        gate.touch()
        waiting = OutputHolder()
        client.submit(_request("a"), waiting)
        _wait_until(lambda: client.stalled() is not None)
        assert "over the bound of 0.5 s" in (client.stalled() or "")
        gate.unlink()
        out = _wait_finished(waiting)
        assert out.finish_reason == "length" and len(out.token_ids) == 4
        _wait_until(lambda: client.stalled() is None)
    finally:
        if gate.exists():
            gate.unlink()
        client.close()


def test_the_message_names_the_time_and_the_bound() -> None:
    assert overdue_message(12.34, 10.0) == (
        "the engine step has been running for 12.3 s, over the bound of 10 s "
        "(step_timeout_s): a TP rank or the device may be hung; new requests are refused "
        "until the step ends"
    )
