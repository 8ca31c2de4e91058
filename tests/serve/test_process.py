"""ProcessEngineClient's own lifecycle (what the HTTP tests of test_server.py do not reach): a
model that fails to load, an engine process that dies under running requests, close() leaving
no process, thread or pipe behind, and validation without the engine equal to the engine's."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from execrt.engine.client import EngineRequest, OutputHolder, RequestOutput
from execrt.engine.engine import Engine
from execrt.engine.process import ProcessEngineClient


def _builtin() -> Engine:
    torch.set_num_threads(1)  # idle torch threads spin: the cores are shared with this process
    return Engine("builtin", device="cpu")


def _left_behind(client: ProcessEngineClient) -> list[object]:
    """The client's engine process, reader and writer threads, where still running."""
    mine = (client._reader, client._writer)
    alive: list[object] = [t for t in threading.enumerate() if t in mine]
    return alive + [p for p in multiprocessing.active_children() if p is client.process]


def _wait_finished(holder: OutputHolder, timeout: float = 60.0) -> RequestOutput:
    deadline = time.monotonic() + timeout
    merged: RequestOutput | None = None
    while True:
        out = holder.take()
        if out is not None:
            if merged is None:
                merged = out
            else:
                merged.token_ids += out.token_ids
                merged.finish_reason, merged.error = out.finish_reason, out.error
            if merged.finished:
                return merged
        assert time.monotonic() < deadline, "no finished output"
        time.sleep(0.01)


def test_a_model_that_fails_to_load_is_the_load_error_and_leaves_nothing(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    client = ProcessEngineClient(functools.partial(Engine, missing, device="cpu"))
    assert not client.wait_ready(120)
    assert "is not a directory or a .gguf file" in (client.load_error() or "")
    assert not client.ready()
    client.close()
    assert client.process.exitcode == 0  # it said why and returned
    assert _left_behind(client) == []


@pytest.fixture(scope="module")
def client():  # type: ignore[no-untyped-def]
    c = ProcessEngineClient(_builtin, name="builtin")
    assert c.wait_ready(120), c.load_error()
    yield c
    c.close()


def test_the_front_end_validates_as_the_engine_does(client) -> None:
    with Engine("builtin", device="cpu") as engine:
        cases = [
            ([1, 2, 3], {"max_new_tokens": 4}, None),
            ([1, 2, 3], {"max_new_tokens": 0, "temperature": -1}, None),
            ([10**6], {"max_new_tokens": 4}, None),
            ([1] * 2048, {"max_new_tokens": 4}, None),
            ([], {"max_new_tokens": 4}, None),
            ([1, 2], {"max_new_tokens": 4}, 21),
            ([1, 2], {"max_new_tokens": 10**9}, None),
            ([1, 2], {"max_new_tokens": 4, "nonsense": 1}, None),
        ]
        for ids, sampling, top in cases:
            request = EngineRequest("x", ids, sampling, top)
            assert client.check(request) == engine.limits.check(ids, sampling, top)
        assert client.check(EngineRequest("x", [1, 2, 3], {"max_new_tokens": 4})) is None
        assert "must be an integer >= 1" in (
            client.check(EngineRequest("x", [1], {"max_new_tokens": 0})) or ""
        )
        assert client.model_info().context_len == engine.worker.limits.context_len
        assert client.text().encode("hello") == engine.tokenizer.encode("hello").ids


def test_an_abort_frees_the_slots_in_the_engine_process(client) -> None:
    baseline = client.stats()
    holder = OutputHolder()
    request = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
    client.submit(EngineRequest("long", [5, 6, 7], request), holder)
    deadline = time.monotonic() + 60
    while client.stats().requests_running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.abort("long", "the client disconnected")
    out = _wait_finished(holder)
    assert (out.finish_reason, out.error) == ("abort", "the client disconnected")
    assert len(out.token_ids) < 1000
    deadline = time.monotonic() + 30
    while True:  # slots back to free, or cached only (the prefix cache keeps the prompt)
        s = client.stats()
        if s.kv_slots_free + s.kv_slots_cached == baseline.kv_slots_free + baseline.kv_slots_cached:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.01)
    assert s.requests_running == 0


def test_close_stops_the_engine_and_leaves_no_process_thread_or_pipe() -> None:
    # A client of its own: with pytest-xdist the module's tests run on several workers, so
    # what the module's client did depends on which of them ran here.
    client = ProcessEngineClient(_builtin, name="builtin")
    assert client.wait_ready(120), client.load_error()
    aborted = OutputHolder()
    long = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
    client.submit(EngineRequest("long", [5, 6, 7], long), aborted)
    client.abort("long", "the client disconnected")
    assert _wait_finished(aborted).finish_reason == "abort"
    holder = OutputHolder()
    client.submit(EngineRequest("r", [1, 2], {"max_new_tokens": 3, "temperature": 0}), holder)
    assert _wait_finished(holder).finish_reason == "length"
    pid = client.process.pid
    client.close()
    client.close()  # idempotent
    assert client.process.exitcode == 0  # stopped by its loop, the engine closed
    assert client.summary is not None  # what its loop did
    assert (client.summary.requests, client.summary.aborted) == (2, 1)
    assert _left_behind(client) == []
    assert client._commands.closed and client._outputs.closed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie
    late = OutputHolder()
    client.submit(EngineRequest("late", [1], {"max_new_tokens": 1}), late)
    assert late.take() == RequestOutput([], finish_reason="error", error="the engine was closed")


def test_an_engine_process_that_dies_fails_every_live_request() -> None:
    client = ProcessEngineClient(_builtin)
    try:
        assert client.wait_ready(120), client.load_error()
        holders = [OutputHolder() for _ in range(3)]
        sampling = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
        for i, holder in enumerate(holders):
            client.submit(EngineRequest(f"r{i}", [5, 6, i], sampling), holder)
        deadline = time.monotonic() + 60
        while holders[0].timing.first_token is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(client.process.pid, signal.SIGKILL)  # an OOM kill, a segfault in a kernel
        for holder in holders:
            out = _wait_finished(holder)
            assert out.finish_reason == "error"
            assert out.error == "the engine process exited unexpectedly (signal 9)"
        assert not client.ready() and client.load_error() == out.error
        late = OutputHolder()  # a request after the fact is refused at once
        client.submit(EngineRequest("late", [1], sampling), late)
        assert late.take() == RequestOutput([], finish_reason="error", error=out.error)
    finally:
        client.close()
    assert _left_behind(client) == []


def test_commands_never_block_the_caller_on_a_full_pipe() -> None:
    # The event loop that submits and aborts is the one that reads the engine's outputs: a
    # send that blocked on a full command pipe, while the engine blocked on a full output
    # pipe, hung the server for good (a client leaving with thousands of queued choices).
    client = ProcessEngineClient(functools.partial(time.sleep, 600))  # reads no command
    try:
        start = time.monotonic()
        for i in range(40_000):  # about 2.5 MB of aborts: more than a pipe holds
            client.abort(f"request-{i}", "the client disconnected")
        assert time.monotonic() - start < 20
    finally:
        client.close()
    assert _left_behind(client) == []


def test_close_while_loading_terminates_the_engine_process() -> None:
    # A model that takes forever to load.
    client = ProcessEngineClient(functools.partial(time.sleep, 600))  # type: ignore[arg-type]
    assert not client.wait_ready(0.5)
    client.close()
    assert not client.process.is_alive() and client.process.exitcode == -signal.SIGTERM
    assert _left_behind(client) == [] and not client.ready()


ORPHAN_PROBE = r"""
import functools, sys, time
from execrt.bench.paced_engine import PacedEngine
from execrt.engine.process import ProcessEngineClient

if __name__ == "__main__":
    client = ProcessEngineClient(functools.partial(PacedEngine, 0.002))
    assert client.wait_ready(120), client.load_error()
    print(client.process.pid, flush=True)
    time.sleep(600)  # killed meanwhile
"""


def test_an_engine_process_does_not_outlive_a_killed_front_end(tmp_path) -> None:
    probe = tmp_path / "front_end.py"
    probe.write_text(ORPHAN_PROBE)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    front = subprocess.Popen(
        [sys.executable, str(probe)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": root},
    )
    try:
        engine_pid = int(front.stdout.readline())  # type: ignore[union-attr]
        assert _running(engine_pid)
        front.kill()  # no close(), no atexit: the engine sees its command pipe end
        front.wait(30)
        deadline = time.monotonic() + 30
        while _running(engine_pid):
            assert time.monotonic() < deadline, "the engine process outlived its front end"
            time.sleep(0.05)
    finally:
        if front.poll() is None:
            front.kill()


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed parent's child is reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_build_that_does_not_pickle_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="it must pickle"):
        ProcessEngineClient(lambda: _builtin())
