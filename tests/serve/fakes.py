"""A torch-free EngineClient for the HTTP side's tests: letters for tokens, one token per tick."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import execrt.engine.client as seam
from execrt.engine.client import EngineRequest, OutputHolder, RequestOutput

A = ord("a")
FAIL = ord("q") - A  # a prompt starting with "q" fails in the engine


class LetterCodec(seam.TextCodec):
    """Token t is the letter ``chr(97 + t)``; a chat prompt is its messages' letters."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text.isalpha() or not text.islower():
            raise ValueError(f"letters only, got {text!r}")
        return [ord(c) - A for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(A + t % 26) for t in token_ids)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def detokenizer(self) -> seam.Detokenizer:
        codec = self

        class _D(seam.Detokenizer):
            def push(self, token_ids: Sequence[int]) -> str:
                return codec.decode(token_ids)

            def flush(self) -> str:
                return ""

        return _D()

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        **modes: bool,
    ) -> tuple[list[int], tuple[int, ...]]:
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ValueError("chat template: bad role")
        # Each template variable set true prefixes its first letter (what a test can see).
        flags = "".join(k[0] for k, v in sorted((template_kwargs or {}).items()) if v is True)
        text = flags + "".join(m["content"] for m in messages)
        return self.encode(text), (25,)  # "z" ends a turn


@dataclass
class _Live:
    request: EngineRequest
    holder: OutputHolder
    last: int
    made: int = 0


@dataclass
class FakeClient(seam.EngineClient):
    """Each request continues the alphabet from its prompt's last letter, one token per tick
    (``tick`` seconds) for every live request; stops at ``max_new_tokens`` or at token 25
    ("z") when it is a stop token."""

    is_ready: bool = True
    tick: float = 0.002
    context_len: int = 64
    submitted: list[EngineRequest] = field(default_factory=list)
    aborted: list[tuple[str, str]] = field(default_factory=list)
    closed: bool = False
    steps: int = 0  # ticks that gave tokens (each submit counts as an extend step)
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()  # the "checkpoint's"

    def __post_init__(self) -> None:
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.closed:
            time.sleep(self.tick)
            with self._lock:
                live = list(self._live.values())
            self.steps += bool(live)
            for r in live:
                token = (r.last + 1) % 26
                r.last, r.made = token, r.made + 1
                lp = [seam.TokenLogprobs(token, -0.5, ((token, -0.5), (0, -2.0)))]
                out = RequestOutput([token], lp if r.request.top_logprobs is not None else None)
                if r.made == 1 and r.request.prompt_logprobs is not None:
                    # each prompt token but the first at -1.0, with itself and "a" on top
                    out.prompt_logprobs = [
                        seam.TokenLogprobs(t, -1.0, ((t, -1.0), (0, -3.0)))
                        for t in r.request.prompt_ids[1:]
                    ]
                sp = r.request.sampling
                stop = token in sp.get("stop_token_ids", ())
                if r.request.prompt_ids[0] == FAIL:  # the engine fails after one token
                    out.finish_reason, out.error = "abort", "step failed: RuntimeError: boom"
                if out.finished or stop or r.made >= sp["max_new_tokens"]:
                    out.finish_reason = out.finish_reason or ("stop" if stop else "length")
                    out.prompt_tokens = len(r.request.prompt_ids)
                    with self._lock:
                        self._live.pop(r.request.request_id, None)
                r.holder.put(out)

    def ready(self) -> bool:
        return self.is_ready

    def load_error(self) -> str | None:
        return None

    def model_info(self) -> seam.ModelInfo:
        return seam.ModelInfo("fake", self.context_len, 26, True, True, self.sampling_defaults)

    def text(self) -> seam.TextCodec:
        return LetterCodec()

    def check(self, request: EngineRequest) -> str | None:
        sp = request.sampling
        if isinstance(sp.get("temperature"), (int, float)) and sp["temperature"] < 0:
            return f"temperature {sp['temperature']!r} must be a finite number >= 0"
        if len(request.prompt_ids) >= self.context_len:
            return (
                f"prompt of {len(request.prompt_ids)} tokens leaves no room in the context "
                f"of {self.context_len}"
            )
        return None

    def submit(self, request: EngineRequest, holder: OutputHolder) -> None:
        self.submitted.append(request)
        with self._lock:
            self._live[request.request_id] = _Live(request, holder, request.prompt_ids[-1])

    def abort(self, request_id: str, reason: str) -> None:
        self.aborted.append((request_id, reason))
        with self._lock:
            live = self._live.pop(request_id, None)
        if live is not None:
            live.holder.put(RequestOutput([], finish_reason="abort", error=reason))

    def stats(self) -> seam.EngineStats:
        with self._lock:
            running = len(self._live)
        extend = len(self.submitted)
        return seam.EngineStats(
            100, 100 - running, 0, running, 0, 0, 0, 0, self.steps + extend, extend
        )

    def close(self) -> None:
        self.closed = True


# -- a scripted answer (tool calls, reasoning) ---------------------------------------------------
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


class ScriptCodec(LetterCodec):
    """Token t is character ``CHARS[t]``; the chat template is one that renders tools; the
    last conversation and template variables it saw are kept for the test."""

    seen: dict[str, Any] = {}
    template = "{% if tools %}{{ tools | tojson }} <tool_call>{...}</tool_call>{% endif %}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [CHARS.index(c) for c in text if c in CHARS]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(CHARS[t] for t in token_ids)

    def tokenizer_info(self) -> dict[str, Any]:
        return {"chat_template": self.template}

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        **modes: bool,
    ) -> tuple[list[int], tuple[int, ...]]:
        ScriptCodec.seen = {"messages": list(messages), "variables": dict(template_kwargs or {})}
        return self.encode("hi"), ()


@dataclass
class ScriptClient(FakeClient):
    """Every request answers ``script`` (one character per token) in two outputs, then
    stops."""

    script: str = ""

    def _run(self) -> None:  # one output per request: the whole script
        while not self.closed:
            time.sleep(self.tick)
            with self._lock:
                live = list(self._live.values())
                self._live.clear()
            for r in live:
                ids = ScriptCodec().encode(self.script)
                half = len(ids) // 2
                r.holder.put(RequestOutput(ids[:half]))
                time.sleep(self.tick)
                done = RequestOutput(ids[half:], finish_reason="stop")
                done.prompt_tokens = len(r.request.prompt_ids)
                r.holder.put(done)

    def model_info(self) -> seam.ModelInfo:
        return seam.ModelInfo("fake", 4096, len(CHARS), True, True)

    def text(self) -> seam.TextCodec:
        return ScriptCodec()


def asgi_client(client: FakeClient) -> Any:
    """An ``httpx.AsyncClient`` on the app over ``client``, in process (no socket)."""
    import httpx

    from execrt.serve.app import create_app

    transport = httpx.ASGITransport(app=create_app(client))
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30)
