"""Chat tool calling: the request's ``tools`` for the chat template, the conversation's earlier
calls and results, and the calls the model makes, read from its text.

The model writes a call the way its template teaches it, one of two formats (the template
says which):
- ``hermes``, a template that spells ``<tool_call>`` (Qwen2.5, Qwen3, Hermes and others):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, after some text or none;
- ``json``, any other template that reads ``tools`` (Llama 3.1 and later): the whole answer is
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several separated by ``;``,
  possibly after ``<|python_tag|>``.
The answer's content is the text before the first call; the calls become
``message.tool_calls`` and the finish reason ``tool_calls``. Text that does not parse as such
calls stays content. Streaming holds back the text from where a call may begin, and sends the
calls once the choice ends.

A forced call (``tool_choice`` ``required``, or a named function) is one call written under a
JSON Schema (structured outputs): ``{"name": <one of the names>, "arguments" | "parameters":
<that function's parameters>}`` (each function's own schema, told apart by the name written
first; any object for the arguments of a function whose schema is outside the subset
``engine.json_grammar`` compiles, while the others keep theirs); in the
``hermes`` format the prompt ends with the template's ``<tool_call>`` opening, so the model
writes the object right away.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from execrt.engine.json_grammar import compile_schema
from execrt.serve.errors import APIError
from execrt.serve.text import tag_overlap

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
TOOL_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request with tools asks: ``tools`` for the template to render, the output
    read for calls in ``format``, and for a forced call the names it may call."""

    tools: tuple[dict[str, Any], ...]
    format: str = "hermes"  # how the model writes calls: "hermes" or "json"
    forced: tuple[str, ...] = ()  # tool_choice required or a named function: one call of these

    @property
    def prompt_suffix(self) -> str:
        """What the prompt ends with for a forced call (the call's opening, in ``hermes``)."""
        return OPEN + "\n" if self.forced and self.format == "hermes" else ""

    def call_schema(self) -> dict[str, Any]:
        """The JSON Schema of the forced call's object (see the module docstring)."""
        key = "arguments" if self.format == "hermes" else "parameters"

        def call(names: list[str], arguments: Any) -> dict[str, Any]:
            return {
                "type": "object",
                "properties": {"name": {"enum": names}, key: arguments},
                "required": ["name", key],
                "additionalProperties": False,
            }

        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        exact: list[dict[str, Any]] = []
        loose: list[str] = []  # the functions whose parameters are outside the subset
        for name in self.forced:
            branch = call([name], functions[name].get("parameters") or {"type": "object"})
            try:
                compile_schema(branch)
                exact.append(branch)
            except ValueError:  # any object for their arguments
                loose.append(name)
        if loose:  # one branch for them all, after the others'
            exact.append(call(loose, {"type": "object"}))
        return exact[0] if len(exact) == 1 else {"anyOf": exact}


def parse_tools(fields: Mapping[str, Any], template: Callable[[], str | None]) -> ToolPlan | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when it
    gives no tools or ``tool_choice`` is ``none`` (then nothing about tools changes).
    ``template``: the chat template's source (None: there is none), asked only for tools."""
    tools = fields.get("tools", [])
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise APIError(
            "tools must be a list of {'type': 'function', 'function': {'name': str, "
            "'description'?: str, 'parameters'?: object}}",
            param="tools",
        )
    choice = fields.get("tool_choice", "auto" if tools else "none")
    if not tools and choice != "none":
        raise APIError(
            f"tool_choice {choice!r} needs tools (a non-empty list); without tools only "
            "'none' is accepted",
            param="tool_choice",
        )
    names = [t["function"]["name"] for t in tools]
    forced = _forced(choice, names)
    parallel = fields.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(
            f"parallel_tool_calls {parallel!r} must be true or false", param="parallel_tool_calls"
        )
    if not tools or choice == "none":
        return None
    source = template()
    if source is None or "tools" not in source:
        raise APIError(
            "tools: this model's chat template does not render tools, so the model would "
            "never see them",
            param="tools",
        )
    return ToolPlan(tuple(tools), "hermes" if OPEN in source else "json", forced)


def _forced(choice: object, names: list[str]) -> tuple[str, ...]:
    """The names ``tool_choice`` forces a call of (none: not forced)."""
    if choice in TOOL_CHOICES:
        return tuple(dict.fromkeys(names)) if choice == "required" else ()
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and name is not None):
        raise APIError(
            f"tool_choice {choice!r} is unsupported (accepted: 'auto', 'none', 'required', or "
            "{'type': 'function', 'function': {'name': ...}})",
            param="tool_choice",
        )
    if name not in names:
        raise APIError(
            f"tool_choice names function {name!r}, which tools does not hold", param="tool_choice"
        )
    return (name,)


def _is_tool(tool: object) -> bool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return False
    function = tool.get("function")
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and bool(function["name"])
        and isinstance(function.get("parameters", {}), dict)
        and isinstance(function.get("description", ""), str)
    )


def template_tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's
    ``arguments`` (a JSON string in the API) decoded to an object."""
    if not isinstance(calls, list):
        raise APIError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for i, call in enumerate(calls):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise APIError(
                f"{at} must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
                "'arguments': str}}",
                param=at,
            )
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            raise APIError(f"{at}.function.arguments must be a JSON string", param=at) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def split_calls(text: str, format: str = "hermes") -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool calls)`` of a finished answer in ``format``: the text before the
    first call (None when only blank) and the calls in the API's shape. When any call does
    not parse as ``{"name": str, "arguments": object}``, the whole text is content and there
    are none."""
    if format == "json":
        return _json_calls(text)
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _CALL.finditer(text, start):
        try:
            call = _call(json.loads(match.group(1)), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].rstrip()
    return (content or None), calls


def _json_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix(PYTHON_TAG)
    if not body.startswith("{"):
        return text, []
    decoder, at, calls = json.JSONDecoder(), 0, []
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _call(value, "parameters", "arguments")
        if call is None:
            return text, []
        calls.append(call)
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


def _call(value: object, *keys: str) -> dict[str, Any] | None:
    """A call in the API's shape from ``{"name": str, key: object}`` (the first of ``keys``
    that is there; none there: no arguments), or None when ``value`` is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: object = next((value[k] for k in keys if k in value), {})
    if not isinstance(arguments, dict):
        return None
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ToolCallText:
    """A streamed answer's text with its calls held back: ``feed`` returns what may be sent as
    content now (never a part of a call, nor the start of ``<tool_call>`` that may become
    one); ``finish`` returns the rest of the content and the calls."""

    def __init__(self, format: str = "hermes", opened: str = "") -> None:
        """``opened``: what the prompt ended with of the answer (a forced call's opening),
        read as the start of its text."""
        self.format = format
        self._text = opened
        self._sent = 0  # characters of the text sent as content
        self._calling = bool(opened)  # a call has begun: nothing more is sent before the end
        self._prose = False  # json: the answer began as text, so it holds no call

    def feed(self, piece: str) -> str:
        self._text += piece
        if self._calling or not piece:
            return ""
        if self.format == "json":
            return self._feed_json()
        text = self._text
        at = text.find(OPEN, max(0, self._sent - len(OPEN)))
        if at >= 0:
            self._calling = True
            end = at
        else:  # hold back an end that may begin the marker
            end = len(text) - tag_overlap(text, OPEN)
        out = text[self._sent : max(end, self._sent)]
        self._sent = max(end, self._sent)
        return out

    def _feed_json(self) -> str:
        """A json call is the whole answer: held while the answer may begin one."""
        if not self._prose:
            start = self._text.lstrip()
            if not start or start[0] == "{" or start.startswith(PYTHON_TAG):
                self._calling = bool(start)
                return ""
            if PYTHON_TAG.startswith(start):
                return ""
            self._prose = True
        out, self._sent = self._text[self._sent :], len(self._text)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """``(content not sent yet, calls)``."""
        text = self._text
        content, calls = split_calls(text, self.format)
        if not calls:
            return text[self._sent :], []
        # The calls begin at or after what was sent; the content before them is all sent
        # but for trailing blanks, which the streamed content keeps.
        return (content or "")[self._sent :], calls
