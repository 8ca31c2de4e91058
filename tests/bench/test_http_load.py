"""The serving benchmark's load generator (h11 over kept-alive connections, in this process or
split over load processes) against a real uvicorn over a paced engine, and the in-process
replay: both must put the same requests in at the same times (arrivals, concurrency)."""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor

import pytest

from execrt.bench.http_load import Request, Run, Timing, drive_http, shares
from execrt.bench.load import replay, summarize
from execrt.bench.paced_engine import PacedEngine
from execrt.engine.threaded import ThreadedEngineClient
from execrt.serve.server import UvicornServer, bind

STEP_S = 0.004


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    client = ThreadedEngineClient(functools.partial(PacedEngine, STEP_S, context_len=256))
    assert client.wait_ready(60), client.load_error()
    server = UvicornServer(client, bind("127.0.0.1", 0)).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def pool(url: str) -> Iterator[ProcessPoolExecutor]:
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as executor:
        # Started and warmed up (spawned, imports, a first connection) before any test times
        # through it, as `bench serve` does: a spawn pool starts its processes on demand, and
        # a cold one can miss a run's common start by seconds on a loaded machine.
        drive_http(url, "paced", Run(2, None, _requests(2), (0.0,) * 2), executor, 2)
        yield executor


def _requests(count: int, out: int = 5) -> tuple[Request, ...]:
    return tuple(Request([1 + i, 2, 3], out + i % 3) for i in range(count))


def _max_in_flight(timings: Sequence[Timing]) -> int:
    edges = sorted([(t.sent, 1) for t in timings] + [(t.done or t.sent, -1) for t in timings])
    most = live = 0
    for _, d in edges:
        live += d
        most = max(most, live)
    return most


def test_shares_split_every_request_once_and_keep_the_concurrency() -> None:
    run = Run(5, None, _requests(11), (0.0,) * 11)
    parts = shares(run, 3)
    assert sorted(i for _, idx in parts for i in idx) == list(range(11))
    assert [r.concurrency for r, _ in parts] == [2, 2, 1]
    assert all(r.requests is run.requests for r, _ in parts)  # indices point into the run
    assert len(shares(Run(2, None, _requests(11), (0.0,) * 11), 8)) == 2  # a stream each
    uncapped = shares(Run(None, 4.0, _requests(4), (0.0, 0.1, 0.2, 0.3)), 8)
    assert [idx for _, idx in uncapped] == [[0], [1], [2], [3]]
    assert all(r.concurrency is None for r, _ in uncapped)


@pytest.mark.parametrize("processes", [1, 2])
def test_closed_loop_counts_every_token_and_holds_the_concurrency(url, pool, processes) -> None:
    run = Run(4, None, _requests(12), (0.0,) * 12)
    timings, seconds = drive_http(url, "paced", run, pool, processes)
    assert [t.index for t in timings] == list(range(12))
    assert all(t.error is None for t in timings), [t.error for t in timings]
    assert [t.tokens for t in timings] == [r.output_len for r in run.requests]
    # Streamed: each chunk stamped after the request was sent, and responses come in pieces
    # (a busy machine merges some steps' tokens into one chunk, so how many is not fixed; a
    # server that buffered whole responses would give one chunk each).
    assert all(0 < len(t.chunks) <= t.tokens and t.chunks[0] > t.sent for t in timings)
    assert any(len(t.chunks) > 1 for t in timings)
    assert _max_in_flight(timings) == 4
    s = summarize(timings, seconds)
    assert s.errors == 0 and s.itl_ms_p50 is not None
    # Tokens come no faster than the paced engine makes them (a loaded machine only slows them).
    assert s.itl_ms_p50 >= 0.5 * STEP_S * 1e3


def test_the_replay_and_http_put_requests_in_at_the_same_times(url, pool) -> None:
    # Arrivals off the replay engine's 60 ms step boundaries: the replay submits between steps
    # but must stamp each request when a client would have sent it, as the HTTP clients do.
    arrivals = (0.0, 0.013, 0.031, 0.077, 0.121, 0.2)
    run = Run(None, 20.0, _requests(6, out=3), arrivals)
    http, _ = drive_http(url, "paced", run, pool, 2)
    replayed, _ = replay(PacedEngine(0.06), run)
    for timings, tolerance in ((http, 0.015), (replayed, 0.002)):
        start = min(t.sent for t in timings)
        sent = [t.sent - start for t in sorted(timings, key=lambda t: t.index)]
        assert sent == pytest.approx(arrivals, abs=tolerance)
    assert all(t.chunks[0] - t.sent > 0.02 for t in replayed[1:3])  # waited for the boundary
    # A closed loop: a request is sent when an earlier one finished, never more in flight.
    closed = Run(3, None, _requests(9), (0.0,) * 9)
    timings = replay(PacedEngine(STEP_S), closed)[0]
    assert _max_in_flight(timings) == 3
    done = sorted(t.done for t in timings if t.done is not None)
    assert sorted(t.sent for t in timings)[3:] == pytest.approx(done[:6], abs=1e-9)


def test_an_error_status_is_a_failed_request_and_the_run_goes_on(url) -> None:
    bad = Request([1] * 300, 4)  # beyond the context of 256: 400
    run = Run(2, None, (bad, *_requests(2)), (0.0,) * 3)
    timings, _ = drive_http(url, "paced", run)
    assert timings[0].error is not None and timings[0].error.startswith("HTTP 400")
    assert "context" in timings[0].error
    assert [t.error for t in timings[1:]] == [None, None]
    assert drive_http("http://127.0.0.1:1", "paced", Run(1, None, _requests(1), (0.0,)))[0][
        0
    ].error.startswith("ConnectionRefusedError")
