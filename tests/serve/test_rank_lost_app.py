"""The HTTP side of a lost tensor-parallel rank: the requests in flight, later ones and /health
all get one documented 503 (``rank_lost``) saying the server must be restarted, never the
collective's own words (gloo's addresses and source paths), which stay in the server's log;
a request that fails for any other reason is still a 500 with the engine's message."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
import pytest

from execrt.engine.client import RequestOutput
from tests.serve.fakes import FakeClient, asgi_client

#: What a step's requests end with when gloo's collective failed (the scheduler's abort).
GLOO = (
    "step failed: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:22955"
)
BODY = {"prompt": "a", "max_tokens": 60}


@dataclass
class LosingClient(FakeClient):
    """The fake engine, which ``lose()`` stops as ThreadedEngineClient stops when a rank is
    gone: no longer ready, ``rank_lost()`` set, every live request ended with the step's
    error."""

    lost: str | None = None

    def lose(self) -> None:
        self.lost, self.is_ready = "rank 1 of 2 is gone", False
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for r in live:
            r.holder.put(RequestOutput([], finish_reason="abort", error=GLOO))

    def rank_lost(self) -> str | None:
        return self.lost

    def load_error(self) -> str | None:
        return None if self.lost is None else f"the engine failed: {GLOO}"


@pytest.fixture
def client() -> Iterator[LosingClient]:
    fake = LosingClient(tick=0.02)
    yield fake
    fake.close()


def _rank_lost(error: dict[str, object]) -> None:
    assert (error["type"], error["code"]) == ("service_unavailable", "rank_lost"), error
    assert error["message"] == (
        "a tensor-parallel rank was lost (rank 1 of 2 is gone): this server cannot serve any "
        "more requests and must be restarted"
    )


def test_requests_in_flight_later_ones_and_health_get_the_rank_lost_503(client) -> None:
    async def go() -> None:
        async with asgi_client(client) as http:
            plain = asyncio.ensure_future(http.post("/v1/completions", json=BODY))
            stream_body = BODY | {"stream": True}
            events: list[str] = []

            async def read_stream() -> None:
                async with http.stream("POST", "/v1/completions", json=stream_body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line.removeprefix("data: "))

            streamed = asyncio.ensure_future(read_stream())
            while len(client.submitted) < 2 or client.steps < 3:  # both have tokens
                await asyncio.sleep(0.005)
            client.lose()
            answer = await plain
            await streamed
            assert answer.status_code == 503, answer.text
            _rank_lost(answer.json()["error"])
            assert "choices" in orjson.loads(events[0])  # it was streaming
            assert events[-1] == "[DONE]" and "error" in orjson.loads(events[-2])
            _rank_lost(orjson.loads(events[-2])["error"])
            later = await http.post("/v1/completions", json=BODY)
            assert later.status_code == 503
            _rank_lost(later.json()["error"])
            health = await http.get("/health")
            assert health.status_code == 503
            _rank_lost(health.json()["error"])
            said = answer.text + "".join(events) + later.text + health.text
            assert "gloo" not in said and "127.0.0.1" not in said

    asyncio.run(go())


def test_any_other_failure_of_a_request_is_still_a_500_with_its_message(client) -> None:
    async def go() -> None:
        async with asgi_client(client) as http:
            failed = await http.post("/v1/completions", json={"prompt": "q", "max_tokens": 4})
            assert failed.status_code == 500
            error = failed.json()["error"]
            assert (error["type"], error["message"]) == (
                "server_error",
                "step failed: RuntimeError: boom",
            )
            assert (await http.get("/health")).status_code == 200

    asyncio.run(go())
