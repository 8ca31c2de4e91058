"""What soaking a running server turned up: how it exits when told to stop, and what a request
too long for the whole KV cache is told."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType

import pytest
from fastapi.testclient import TestClient

import execrt.engine.client as seam
from execrt.engine.client import EngineRequest
from execrt.engine.limits import RequestLimits
from execrt.serve.app import create_app
from execrt.serve.server import UvicornServer, bind
from tests.serve.fakes import FakeClient


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_server_stopped_by_a_signal_returns_instead_of_raising_it_again(sig: int) -> None:
    # uvicorn raised the signal again once it had shut down: `execrt serve` then ended killed
    # by SIGTERM (status 143; `docker stop` reads a failure) or with a KeyboardInterrupt (130)
    # after a clean shutdown. A handler of this test stands in for the default one, which
    # would end pytest itself.
    assert threading.current_thread() is threading.main_thread()  # uvicorn's handlers
    raised_again: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        raised_again.append(signum)

    before = {s: signal.signal(s, record) for s in (signal.SIGTERM, signal.SIGINT)}
    client = FakeClient()
    server = UvicornServer(client, bind("127.0.0.1", 0))

    def stop_when_started() -> None:
        while not server.server.started:
            time.sleep(0.01)
        os.kill(os.getpid(), sig)

    threading.Thread(target=stop_when_started, daemon=True).start()
    try:
        server.run()  # returns after the graceful shutdown
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert raised_again == []
    assert client.closed  # the shutdown ran


@dataclass
class SmallCacheClient(FakeClient):
    """Validates as the engine does, over a KV cache smaller than the context."""

    context_len: int = 4096
    kv_slots: int = 256

    def model_info(self) -> seam.ModelInfo:
        return seam.ModelInfo("fake", self.context_len, 26, True, True, (), self.kv_slots)

    def check(self, request: EngineRequest) -> str | None:
        limits = RequestLimits(26, self.context_len, self.kv_slots)
        return limits.check(request.prompt_ids, request.sampling, request.top_logprobs)


CHAT = {"messages": [{"role": "user", "content": "a" * 300}]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # without max_tokens, chat fills what the cache leaves: at least one token
        ("/v1/chat/completions", CHAT, "messages"),
        ("/v1/completions", {"prompt": "a" * 300, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "a" * 300, "max_tokens": 0, "echo": True}, "prompt"),
    ],
)
def test_a_prompt_the_whole_kv_cache_cannot_hold_is_named_not_max_tokens(
    path: str, body: dict[str, object], param: str
) -> None:
    # It was "request needs up to 300 KV slots (prompt 300 + max_completion_tokens 1 - 1 ...)
    # ... lower max_completion_tokens": a field the client never sent, and that no value
    # makes fit.
    client = SmallCacheClient()
    with TestClient(create_app(client)) as http:
        response = http.post(path, json=body)
    client.close()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    message = error["message"]
    # In OpenAI's words and code (clients tell an overflow by them), the limit being
    # max_model_len (256 slots + 1); the engine's sizing hint after it.
    assert error["code"] == "context_length_exceeded", error
    assert message.startswith(
        f"This model's maximum context length is 257 tokens. However, your {param} resulted "
        "in 300 tokens, which leaves no room for a completion (prompt of 300 tokens needs more "
        "KV slots than the whole cache holds (256)"
    ), message
    assert "shorten the prompt" in message and "max_" not in message
    assert "raise kv_cache_tokens (EXECRT_KV_CACHE_TOKENS) to at least 300" in message
