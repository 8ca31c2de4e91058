"""``--reasoning-parser``: a chat answer's <think> part as ``reasoning_content``, whole and
streamed, with tools, and nothing changed without it or for completions."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import orjson
import pytest

from execrt.serve.app import create_app
from execrt.serve.reasoning import ReasoningText
from tests.serve.fakes import ScriptClient
from tests.serve.test_app import events
from tests.serve.test_tools import CALL, TOOLS, USER

THINK = "<think>\nThe user asks; let me think.\n</think>\n\nIt is sunny."


def split(parser: str, text: str, rng: random.Random | None = None) -> tuple[str, str]:
    """``text`` through a ReasoningText, whole or in random pieces: (reasoning, content)."""
    r = ReasoningText(parser)
    out: list[tuple[str, str]] = []
    at = 0
    while at < len(text):
        step = len(text) if rng is None else rng.randint(1, 5)
        out.append(r.feed(text[at : at + step]))
        at += step
    out.append(r.finish())
    return "".join(x for x, _ in out), "".join(y for _, y in out)


@pytest.mark.parametrize(
    ("parser", "text", "want"),
    [
        ("qwen3", THINK, ("\nThe user asks; let me think.\n", "It is sunny.")),
        ("qwen3", "It is sunny.", ("", "It is sunny.")),  # thinking off
        ("qwen3", "  <thin and more", ("", "  <thin and more")),  # not the tag after all
        ("qwen3", "<think>still thinking", ("still thinking", "")),
        ("qwen3", "<think>a</thi", ("a</thi", "")),  # a tag cut short is text
        ("deepseek_r1", "Reasoning here.</think>\n\nAnswer.", ("Reasoning here.", "Answer.")),
        ("deepseek_r1", THINK, ("\nThe user asks; let me think.\n", "It is sunny.")),
        ("deepseek_r1", "no end tag", ("no end tag", "")),
    ],
)
def test_reasoning_and_content_however_the_text_is_cut(
    parser: str, text: str, want: tuple[str, str]
) -> None:
    assert split(parser, text) == want
    rng = random.Random(5)
    for _ in range(30):
        assert split(parser, text, rng) == want


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning parser 'r2'"):
        ReasoningText("r2")
    client = ScriptClient()
    with pytest.raises(ValueError, match="accepted: none, qwen3, deepseek_r1"):
        create_app(client, reasoning_parser="r2")
    client.close()


def post(client: ScriptClient, parser: str, path: str, body: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        app = create_app(client, reasoning_parser=parser)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post(path, content=orjson.dumps(body))

    return asyncio.run(go())


def test_a_chat_answer_has_its_reasoning_apart(script) -> None:  # type: ignore[no-untyped-def]
    script.script = THINK
    r = post(script, "qwen3", "/v1/chat/completions", {"messages": USER})
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "It is sunny."
    assert message["reasoning_content"] == "\nThe user asks; let me think.\n"
    plain = post(script, "none", "/v1/chat/completions", {"messages": USER})
    assert plain.json()["choices"][0]["message"] == {"role": "assistant", "content": THINK}
    # Completions are text: no parser applies.
    text = post(script, "qwen3", "/v1/completions", {"prompt": "hi", "max_tokens": 90})
    assert text.json()["choices"][0]["text"] == THINK


def test_streamed_reasoning_comes_before_the_content(script) -> None:  # type: ignore[no-untyped-def]
    script.script = THINK
    r = post(script, "qwen3", "/v1/chat/completions", {"messages": USER, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in events(r)]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning == "\nThe user asks; let me think.\n" and content == "It is sunny."
    last_reasoning = max(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    first_content = min(i for i, d in enumerate(deltas) if d.get("content"))
    assert last_reasoning < first_content


def test_reasoning_then_a_tool_call(script) -> None:  # type: ignore[no-untyped-def]
    script.script = "<think>I need the weather.</think>\n\n" + CALL
    body = {"messages": USER, "tools": TOOLS}
    choice = post(script, "qwen3", "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "I need the weather."
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_format_applies_after_the_reasoning(script) -> None:  # type: ignore[no-untyped-def]
    """With a reasoning parser, a chat request's response_format reaches the engine with the
    parser as ``reasoning`` (the object comes after the thinking); without one, or on
    completions, nothing is added."""
    script.script = '<think>\nhm\n</think>\n\n{"a": 1}'
    fmt = {"type": "json_object"}
    r = post(script, "qwen3", "/v1/chat/completions", {"messages": USER, "response_format": fmt})
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": '{"a": 1}', "reasoning_content": "\nhm\n"}
    assert script.submitted[-1].sampling["reasoning"] == "qwen3"
    for parser, path, body in [
        ("none", "/v1/chat/completions", {"messages": USER, "response_format": fmt}),
        ("qwen3", "/v1/completions", {"prompt": "hi", "response_format": fmt}),
        ("qwen3", "/v1/chat/completions", {"messages": USER}),
    ]:
        post(script, parser, path, body)
        assert "reasoning" not in script.submitted[-1].sampling
