"""``execrt serve --tp 2`` under torchrun on CPU (gloo) when a rank fails: a stopped rank
(SIGSTOP) fails /health and new requests once a step runs past step_timeout_s, and all is
served as before when it resumes; a killed rank leaves one line on the survivor, not a wall
of tracebacks, and every process ends."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from tests.drivers import live_children
from tests.torchrun import torchrun_execrt

BODY = {"prompt": "hung", "max_tokens": 6, "temperature": 0}
#: A traceback frame of execrt's own code (torchrun's own report shows frames of torch only).
EXECRT_FRAME = re.compile(r'File "[^"]*/execrt/')

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks in Linux's /proc"),
]


@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str
    ranks: dict[int, int]  # rank -> pid
    err: list[str] = field(default_factory=list)  # torchrun's stderr, once it ended


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            environ = fh.read().split(b"\0")
    except OSError:
        return None
    ranks = [int(v[len(b"RANK=") :]) for v in environ if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@contextmanager
def torchrun_serve(
    env: dict[str, str] | None = None, torchrun: Sequence[str] = ()
) -> Iterator[Served]:
    """torchrun's two ranks serving the built-in model (``torchrun``: more of its options); at
    the end, torchrun is waited for (killed past a minute) and ``err`` holds its stderr."""
    serve = ["serve", "--tp", "2", "--port", "0", "--model", "builtin"]
    serve += ["--served-model-name", "builtin", "--device", "cpu"]
    proc = torchrun_execrt(serve, options=torchrun, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    served = Served(proc, "", {})
    try:
        ready = lines.get(timeout=240)
        assert "ready at http://127.0.0.1:" in ready, ready
        served.url = ready.split(" ready at ")[1].split()[0]
        for pid, _ in live_children(proc.pid):
            rank = _rank_of(pid)
            if rank is not None:
                served.ranks[rank] = pid
        assert sorted(served.ranks) == [0, 1], served.ranks
        yield served
    finally:
        for pid in served.ranks.values():  # a test that failed half-way may leave one stopped
            if not _gone(pid):
                os.kill(pid, signal.SIGCONT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        served.err.append(err)
    # No rank outlives torchrun.
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in served.ranks.values()):
        assert time.monotonic() < deadline, f"ranks left running: {served.ranks}"
        time.sleep(0.05)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_a_stopped_rank_fails_health_past_the_bound_and_resumes(tmp_path) -> None:
    with torchrun_serve({"EXECRT_STEP_TIMEOUT_S": "2"}) as served:
        http = httpx.Client(base_url=served.url, timeout=120)
        expected = _text(http.post("/v1/completions", json=BODY))
        assert http.get("/health").status_code == 200
        os.kill(served.ranks[1], signal.SIGSTOP)
        waiting: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: waiting.append(http.post("/v1/completions", json=BODY))
        )
        sender.start()  # rank 0's step now waits for rank 1 in its collective
        deadline = time.monotonic() + 30
        while (health := http.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health never failed"
            time.sleep(0.1)
        error = health.json()["error"]
        assert health.status_code == 503 and error["code"] == "engine_stalled", health.text
        assert re.search(r"running for \d+\.\d s, over the bound of 2 s", error["message"])
        refused = http.post("/v1/completions", json=BODY)
        assert refused.status_code == 503 and "over the bound of 2 s" in refused.text
        assert sender.is_alive() and waiting == []  # the waiting request kept its connection
        os.kill(served.ranks[1], signal.SIGCONT)
        sender.join(60)
        assert _text(waiting[0]) == expected  # as if nothing had happened
        assert http.get("/health").status_code == 200
        assert _text(http.post("/v1/completions", json=BODY)) == expected
        os.kill(served.ranks[0], signal.SIGTERM)  # the clean stop: every rank ends
        served.proc.wait(60)
    err = served.err[0]
    assert served.proc.returncode == 0, err[-3000:]
    said = [x for x in err.splitlines() if "execrt.engine.watchdog" in x]
    assert len(said) == 2, err[-3000:]  # once when it stalled, once when it ended
    assert "over the bound of 2 s" in said[0] and "EXECRT_STEP_TIMEOUT_S" in said[0]
    assert "new requests are taken again" in said[1]
    # Rank 1 served the 3 requests taken and holds no KV slot (free, or evictable in the cache).
    summary = [x for x in err.splitlines() if "rank 1 stopped with rank 0" in x]
    assert summary and "3 requests, 0 aborted" in summary[0], err[-3000:]
    free, total, cached = re.findall(r"KV slots free (\d+) of (\d+), (\d+) cached", summary[0])[0]
    assert int(free) + int(cached) == int(total), summary


def _stream_then_kill(served: Served, rank: int) -> list[str]:
    """A long streamed completion; once it decodes, SIGKILL ``rank``; the events it got."""
    body: dict[str, Any] = {"prompt": "dead", "max_tokens": 1000, "ignore_eos": True}
    events: list[str] = []
    try:
        with httpx.Client(base_url=served.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                    if len(events) == 3:
                        os.kill(served.ranks[rank], signal.SIGKILL)
    except httpx.HTTPError:  # the server stopped under it
        pass
    return events


def test_a_killed_rank_1_leaves_one_line_on_rank_0_and_every_process_ends() -> None:
    with torchrun_serve() as served:
        events = _stream_then_kill(served, 1)
        served.proc.wait(60)
    err = served.err[0]
    assert len(events) >= 3
    gone = [x for x in err.splitlines() if "is gone (a collective failed:" in x]
    assert len(gone) == 1, err[-5000:]
    assert re.search(r"rank 1 of 2 is gone \(a collective failed: [^\n]+\); stopping", gone[0])
    assert not EXECRT_FRAME.search(err), err[-5000:]  # no traceback through execrt
    assert served.proc.returncode != 0  # torchrun reports the killed rank


def test_a_killed_rank_0_leaves_one_line_on_rank_1_and_every_process_ends() -> None:
    with torchrun_serve() as served:
        _stream_then_kill(served, 0)
        served.proc.wait(60)
    err = served.err[0]
    gone = [x for x in err.splitlines() if "is gone (a collective failed:" in x]
    assert len(gone) == 1, err[-5000:]
    assert re.match(r"execrt: error: rank 1: rank 0 of 2 is gone \(a collective", gone[0])
    assert not EXECRT_FRAME.search(err), err[-5000:]


def _running(http: httpx.Client) -> int:
    found = re.search(r"^execrt:num_requests_running\S* (\S+)$", http.get("/metrics").text, re.M)
    assert found is not None
    return int(float(found.group(1)))


def _rank_lost(response: httpx.Response | str) -> None:
    """``response`` (or an SSE event's JSON) is the documented 503 of a lost rank."""
    error = orjson.loads(response if isinstance(response, str) else response.content)["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "rank_lost"), error
    assert error["message"] == (
        "a tensor-parallel rank was lost (rank 1 of 2 is gone): this server cannot serve any "
        "more requests and must be restarted"
    )


def test_a_lost_rank_is_one_documented_503_in_flight_later_and_on_health() -> None:
    # torchrun looks at its ranks once in ten minutes here: rank 0 serves on once rank 1 is
    # gone, as it does where the lost rank ran on another host, under another torchrun.
    with torchrun_serve(torchrun=["--monitor-interval", "600"]) as served:
        try:
            http = httpx.Client(base_url=served.url, timeout=60)
            long = {"prompt": "dead", "max_tokens": 1000, "ignore_eos": True}
            plain: list[httpx.Response] = []

            def post() -> None:
                plain.append(http.post("/v1/completions", json=long))

            sender = threading.Thread(target=post)
            sender.start()
            deadline = time.monotonic() + 60
            while _running(http) < 1:  # the plain request is in the engine
                assert time.monotonic() < deadline
                time.sleep(0.05)
            events = _stream_then_kill(served, 1)
            sender.join(60)
            assert plain[0].status_code == 503, plain[0].text
            _rank_lost(plain[0])
            assert len(events) > 3 and events[-1] == "data: [DONE]", events[-3:]
            _rank_lost(events[-2].removeprefix("data: "))
            later = http.post("/v1/completions", json=BODY)
            assert later.status_code == 503
            _rank_lost(later)
            health = http.get("/health")
            assert health.status_code == 503
            _rank_lost(health)
            said = plain[0].text + "".join(events) + later.text + health.text
            assert "gloo" not in said and "127.0.0.1" not in said, said
        finally:
            served.proc.terminate()  # torchrun stops rank 0 (it has not seen rank 1 end)
    gone = [x for x in served.err[0].splitlines() if "is gone (a collective failed:" in x]
    assert len(gone) == 1, served.err[0][-5000:]  # the collective's words: in the log only
