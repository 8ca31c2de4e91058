"""The HTTP side of the step watchdog: while the engine's step has run past step_timeout_s,
/health answers 503 saying so and new requests get that 503 instead of waiting behind it,
while the requests already in the engine go on; once the step ends, all is as before."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import pytest

from execrt.engine.watchdog import StepClock, StepWatchdog, StepWatched
from tests.serve.fakes import FakeClient, asgi_client

BOUND_S = 2.0


class FakeTime:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@dataclass
class WatchedClient(StepWatched, FakeClient):
    """The fake engine, its steps timed by ``clock`` on a fake time (the test moves it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.time = FakeTime()
        self.clock = StepClock(now=self.time)
        self._watchdog = StepWatchdog(self.clock, BOUND_S, poll_s=60)

    def close(self) -> None:
        super().close()
        self._close_watchdog()

    def hang(self, seconds: float) -> None:
        """A step begins and runs ``seconds`` (it ends with ``self.clock.__exit__``)."""
        self.clock.__enter__()
        self.time.now += seconds


@pytest.fixture
def watched():  # type: ignore[no-untyped-def]
    client = WatchedClient(tick=0.02)
    yield client
    client.close()


BODY = {"prompt": "a", "max_tokens": 4}


def _stall_message(response: httpx.Response, running: str) -> str:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "engine_stalled")
    assert f"running for {running} s, over the bound of 2 s (step_timeout_s)" in error["message"]
    return str(error["message"])


def test_health_fails_past_the_bound_and_recovers_when_the_step_ends(watched) -> None:
    async def go() -> None:
        async with asgi_client(watched) as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
            watched.hang(1.5)  # a slow step, within the bound
            assert (await http.get("/health")).status_code == 200
            watched.time.now += 1.0
            _stall_message(await http.get("/health"), "2.5")
            assert (await http.head("/health")).status_code == 503  # load balancers' probe
            watched.clock.__exit__()
            assert (await http.get("/health")).status_code == 200

    asyncio.run(go())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", BODY),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4}),
        ("/flush_cache", None),
    ],
)
def test_a_new_request_gets_the_503_instead_of_waiting(watched, path: str, body: object) -> None:
    async def go() -> None:
        async with asgi_client(watched) as http:
            watched.hang(10.0)
            _stall_message(await http.post(path, json=body), "10.0")
            assert watched.submitted == []  # never queued behind the hung step
            watched.clock.__exit__()
            if body is not None:  # the same request is served again
                assert (await http.post(path, json=body)).status_code == 200

    asyncio.run(go())


def test_requests_already_in_the_engine_are_kept_and_finish(watched) -> None:
    async def go() -> None:
        async with asgi_client(watched) as http:
            waiting = asyncio.ensure_future(
                http.post("/v1/completions", json={"prompt": "a", "max_tokens": 60})
            )
            while not watched.submitted:
                await asyncio.sleep(0.005)
            watched.hang(5.0)
            _stall_message(await http.get("/health"), "5.0")
            _stall_message(await http.post("/v1/completions", json=BODY), "5.0")
            assert not waiting.done()  # 60 ticks: it was in the engine through the stall
            watched.clock.__exit__()
            answer = await waiting
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            assert (choice["finish_reason"], len(choice["text"])) == ("length", 60)
            assert watched.aborted == []  # nothing was cancelled

    asyncio.run(go())


def test_a_client_without_a_watchdog_is_never_stalled() -> None:
    client = FakeClient()

    async def go() -> None:
        async with asgi_client(client) as http:
            assert (await http.get("/health")).status_code == 200

    try:
        asyncio.run(go())
    finally:
        client.close()
