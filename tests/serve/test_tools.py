"""Chat tool calling: the calls read from the model's text (whole and streamed), the tools given
to the template, earlier calls and results in the conversation, and what is refused."""

from __future__ import annotations

import functools
import json
import random
from typing import Any

import pytest

from execrt.serve.errors import APIError
from execrt.serve.tools import ToolCallText, parse_tools, split_calls
from tests.serve.fakes import ScriptCodec
from tests.serve.test_app import call, events

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>"
)
TWO = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
USER = [{"role": "user", "content": "weather?"}]


# -- reading calls from text ----------------------------------------------------------------------
def test_calls_and_the_content_before_them_are_split() -> None:
    content, calls = split_calls("Let me look.\n" + TWO)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert split_calls(CALL)[0] is None  # no content at all


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        CALL + "<tool_call>{broken</tool_call>",  # one bad call: none of them
    ],
)
def test_text_that_is_not_calls_stays_content(text: str) -> None:
    assert split_calls(text) == (text, [])


def test_a_call_cut_before_its_closing_tag_still_parses() -> None:
    _, calls = split_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert [c["function"]["name"] for c in calls] == ["f"]


def stream_in_pieces(
    stream: ToolCallText, text: str, rng: random.Random
) -> tuple[list[str], str, list[dict[str, Any]]]:
    """``text`` fed in random pieces of 1-6 characters: what each feed sent, then finish()."""
    sent, at = [], 0
    while at < len(text):
        step = rng.randint(1, 6)
        sent.append(stream.feed(text[at : at + step]))
        at += step
    return (sent, *stream.finish())


@pytest.mark.parametrize(
    "text", ["Sure, one moment.\n" + TWO, "plain answer < with a bracket <tool"]
)
def test_streamed_text_sends_no_part_of_a_call_however_it_is_cut(text: str) -> None:
    rng = random.Random(7)
    for _ in range(50):
        sent, rest, calls = stream_in_pieces(ToolCallText(), text, rng)
        content, want = split_calls(text)
        streamed = "".join(sent)
        assert "<tool_call" not in streamed and "<tool" not in streamed or not want
        if want:
            assert (streamed + rest).rstrip() == content
            assert [c["function"] for c in calls] == [c["function"] for c in want]
        else:
            assert streamed + rest == text and calls == []


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"tools": [{"type": "function"}]}, "tools", "tools must be a list of"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "must be a list"),
        (
            {"tools": TOOLS, "tool_choice": "always"},
            "tool_choice",
            "tool_choice 'always' is unsupported (accepted: 'auto', 'none', 'required', or",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "tool_choice names function 'f', which tools does not hold",
        ),
        (
            {"tools": TOOLS, "parallel_tool_calls": "no"},
            "parallel_tool_calls",
            "parallel_tool_calls 'no' must be",
        ),
    ],
)
def test_bad_tool_fields_are_named(fields: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(APIError) as info:
        parse_tools(fields, lambda: "{{ tools }}")
    assert needle in info.value.message and info.value.param == param


def test_tools_need_a_template_that_renders_them() -> None:
    with pytest.raises(APIError, match="does not render tools"):
        parse_tools({"tools": TOOLS}, lambda: "{{ messages }}")
    with pytest.raises(APIError, match="does not render tools"):
        parse_tools({"tools": TOOLS}, lambda: None)
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, lambda: None) is None
    assert parse_tools({"tools": []}, lambda: None) is None
    plan = parse_tools({"tools": TOOLS}, lambda: "{{ tools }}")
    assert plan is not None and list(plan.tools) == TOOLS and plan.format == "json"


TIME = {"type": "function", "function": {"name": "get_time"}}
ODD = {  # parameters outside the structured-output subset
    "type": "function",
    "function": {"name": "odd", "parameters": {"type": "object", "minProperties": 1}},
}
ODD2 = {  # a keyword outside the subset deeper in
    "type": "function",
    "function": {
        "name": "odd2",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "format": "tz"}}},
    },
}
STRICT = {  # only a city: no other key
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_a_forced_call_s_schema() -> None:
    from execrt.engine.json_grammar import compile_schema

    tags = "{{ tools }} <tool_call>"
    plan = parse_tools({"tools": [*TOOLS, TIME], "tool_choice": "required"}, lambda: tags)
    assert plan is not None and plan.forced == ("get_weather", "get_time")
    assert plan.prompt_suffix == "<tool_call>\n"
    schema = plan.call_schema()  # one branch per function, told apart by the name first
    assert [b["properties"]["name"] for b in schema["anyOf"]] == [
        {"enum": ["get_weather"]}, {"enum": ["get_time"]}
    ]  # fmt: skip
    both = compile_schema(schema)
    weather = b'{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert both.complete(both.walk(both.start, weather))
    assert both.complete(both.walk(both.start, b'{"name": "get_time", "arguments": {}}'))
    assert both.walk(both.start, b'{"name": "get_weather", "arguments": {"city": 1') is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = parse_tools({"tools": [*TOOLS, TIME], "tool_choice": named}, lambda: "{{ tools }}")
    assert plan is not None and plan.forced == ("get_weather",) and plan.prompt_suffix == ""
    exact = plan.call_schema()  # json format: "parameters", the function's own schema
    assert exact["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    grammar = compile_schema(exact)
    ok = b'{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert grammar.complete(grammar.walk(grammar.start, ok))
    assert grammar.walk(grammar.start, b'{"name": "get_time"') is None
    odd = {"tools": [ODD], "tool_choice": {"type": "function", "function": {"name": "odd"}}}
    plan = parse_tools(odd, lambda: tags)
    assert plan is not None and plan.call_schema()["properties"]["arguments"] == {"type": "object"}
    plan = parse_tools({"tools": [ODD, ODD2], "tool_choice": "required"}, lambda: tags)
    assert plan is not None  # every function outside the subset: the names, any arguments
    assert plan.call_schema() == {
        "type": "object",
        "properties": {"name": {"enum": ["odd", "odd2"]}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def test_a_function_outside_the_subset_leaves_the_others_their_schemas() -> None:
    from execrt.engine.json_grammar import compile_schema

    tags = "{{ tools }} <tool_call>"
    plan = parse_tools({"tools": [ODD, STRICT, ODD2], "tool_choice": "required"}, lambda: tags)
    assert plan is not None
    schema = plan.call_schema()  # the strict function's own branch; one any-object branch
    branches = schema["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [
        {"enum": ["get_weather"]}, {"enum": ["odd", "odd2"]}
    ]  # fmt: skip
    assert branches[0]["properties"]["arguments"] == STRICT["function"]["parameters"]
    assert branches[1]["properties"]["arguments"] == {"type": "object"}
    grammar = compile_schema(schema)
    walk = functools.partial(grammar.walk, grammar.start)
    assert grammar.complete(walk(b'{"name": "get_weather", "arguments": {"city": "Oslo"}}'))
    assert walk(b'{"name": "get_weather", "arguments": {"city": "Oslo", "') is None
    assert walk(b'{"name": "get_weather", "arguments": {"type"') is None
    assert grammar.complete(walk(b'{"name": "odd", "arguments": {"type": "object"}}'))
    assert grammar.complete(walk(b'{"name": "odd2", "arguments": {}}'))
    assert walk(b'{"name": "get_time"') is None
    named = {"type": "function", "function": {"name": "get_weather"}}  # json format
    plan = parse_tools({"tools": [STRICT, ODD], "tool_choice": named}, lambda: "{{ tools }}")
    assert plan is not None
    assert plan.call_schema()["properties"]["parameters"] == STRICT["function"]["parameters"]


def test_a_forced_call_is_written_under_its_schema_and_answered_as_a_call(script) -> None:  # type: ignore[no-untyped-def]
    script.script = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        body = {"messages": USER, "tools": TOOLS, "tool_choice": named, "stream": stream}
        r = call(script, "POST", "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [e["choices"][0] for e in events(r) if e["choices"]]
            assert not any(c["delta"].get("content") for c in chunks)
            (tool_call,) = next(
                c["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["delta"]
            )
            assert chunks[-1]["finish_reason"] == "tool_calls"
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            (tool_call,) = choice["message"]["tool_calls"]
        assert tool_call["function"]["name"] == "get_weather"
        assert json.loads(tool_call["function"]["arguments"]) == {"city": "Oslo"}
    request = script.submitted[-1]
    codec = ScriptCodec()
    assert codec.decode(request.prompt_ids).endswith("<tool_call>\n")  # the call is opened
    sampling = request.sampling
    assert sampling["response_format"] == "json_schema"
    assert json.loads(sampling["json_schema"])["properties"]["name"] == {"enum": ["get_weather"]}
    both = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    r = call(
        script, "POST", "/v1/chat/completions", both | {"response_format": {"type": "json_object"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_a_forced_call_keeps_a_function_s_schema_next_to_one_outside_the_subset(script) -> None:  # type: ignore[no-untyped-def]
    from execrt.engine.json_grammar import schema_grammar

    script.script = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    body = {"messages": USER, "tools": [STRICT, ODD2], "tool_choice": "required"}
    r = call(script, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Oslo"}
    sampling = script.submitted[-1].sampling
    assert sampling["response_format"] == "json_schema"
    grammar = schema_grammar(sampling["json_schema"])  # what the engine writes the call under
    walk = functools.partial(grammar.walk, grammar.start)
    assert grammar.complete(walk(script.script.encode()))
    # get_weather's additionalProperties false holds; odd2's arguments are any object
    assert walk(b'{"name": "get_weather", "arguments": {"type": "object"') is None
    assert walk(b'{"name": "get_weather", "arguments": {"city": "Oslo", "unit"') is None
    assert grammar.complete(walk(b'{"name": "odd2", "arguments": {"tz": 1, "x": [true]}}'))


# -- through the app ------------------------------------------------------------------------------
def test_a_call_is_answered_as_tool_calls(script) -> None:  # type: ignore[no-untyped-def]
    script.script = "Checking.\n" + CALL
    r = call(script, "POST", "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    (tool_call,) = message["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert ScriptCodec.seen["variables"]["tools"] == TOOLS  # the template got them


def test_without_tools_or_with_tool_choice_none_the_text_is_content(script) -> None:  # type: ignore[no-untyped-def]
    script.script = CALL
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = call(script, "POST", "/v1/chat/completions", {"messages": USER} | extra)
        choice = r.json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": CALL}
        assert choice["finish_reason"] == "stop"
        assert "tools" not in ScriptCodec.seen["variables"]


def test_a_streamed_call_comes_whole_after_the_content(script) -> None:  # type: ignore[no-untyped-def]
    script.script = "Checking.\n" + TWO
    body = {"messages": USER, "tools": TOOLS, "stream": True}
    chunks = events(call(script, "POST", "/v1/chat/completions", body))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content.rstrip() == "Checking." and "<tool" not in content
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and [c["index"] for c in calls[0]] == [0, 1]
    assert [c["function"]["name"] for c in calls[0]] == ["get_weather", "get_time"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_earlier_calls_and_their_results_reach_the_template(script) -> None:  # type: ignore[no-untyped-def]
    script.script = "It is 18 C in Paris."
    arguments = json.dumps({"city": "Paris"})
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    r = call(script, "POST", "/v1/chat/completions", {"messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "It is 18 C in Paris."
    seen = ScriptCodec.seen["messages"]
    assert seen[1]["content"] == "" and seen[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},  # decoded: templates write it with tojson
    }
    assert seen[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    ("message", "needle"),
    [
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
            "messages[0].tool_calls[0] must be",
        ),
        (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
            },
            "arguments must be a JSON string",
        ),
        ({"role": "tool", "content": "x", "tool_call_id": 3}, "tool_call_id 3 must be a string"),
    ],
)
def test_bad_tool_messages_are_400s(script, message, needle) -> None:  # type: ignore[no-untyped-def]
    r = call(script, "POST", "/v1/chat/completions", {"messages": [message]})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_the_openai_client_reads_the_calls_whole_and_streamed(script) -> None:  # type: ignore[no-untyped-def]
    """A real client over a real socket: the openai package's types accept the answer, and
    its streamed deltas add up to the same calls."""
    openai = pytest.importorskip("openai")
    from execrt.serve.server import UvicornServer, bind

    script.script = "Checking.\n" + TWO
    server = UvicornServer(script, bind("127.0.0.1", 0)).start()
    try:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        got = api.chat.completions.create(model="fake", messages=USER, tools=TOOLS)
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        names = [c.function.name for c in choice.message.tool_calls or []]
        assert names == ["get_weather", "get_time"]
        stream = api.chat.completions.create(model="fake", messages=USER, tools=TOOLS, stream=True)
        streamed: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in stream:
            delta = chunk.choices[0].delta
            for tc in delta.tool_calls or []:
                entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [streamed[i]["name"] for i in sorted(streamed)] == names
        assert json.loads(streamed[0]["arguments"]) == {"city": "Paris", "unit": "c"}
    finally:
        server.stop()


def test_tools_render_as_transformers_renders_them() -> None:
    """Our Jinja renderer and transformers' apply_chat_template give one text for a template
    that reads ``tools`` and an assistant turn's ``tool_calls`` (arguments as an object)."""
    transformers = pytest.importorskip("transformers")
    from execrt.models.builtin import build_tokenizer
    from execrt.models.tokenizer import ChatTemplate

    source = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
        "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        '{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
        '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}'
        "</{{ m.role }}>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = USER + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    ours = ChatTemplate(source).render(messages, variables={"tools": TOOLS})
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    theirs = tok.apply_chat_template(
        messages, tools=TOOLS, chat_template=source, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs and '"arguments": {"a": 1}' in ours and "get_weather" in ours


# -- the json format (Llama 3.1 and later) --------------------------------------------------------
JSON_CALLS = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "arguments": {}}'
)


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "\n "])
def test_json_calls_are_the_whole_answer(prefix: str) -> None:
    content, calls = split_calls(prefix + JSON_CALLS, "json")
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny.",
        'Here: {"name": "f", "parameters": {}}',  # text first: not a call
        '{"name": "f", "parameters": {}} and more',
        '{"city": "Paris"}',  # JSON, but not a call
        '{"name": "f", "parameters": {"a": 1}',  # cut short
    ],
)
def test_json_text_that_is_not_calls_stays_content(text: str) -> None:
    assert split_calls(text, "json") == (text, [])


@pytest.mark.parametrize(
    "text", [JSON_CALLS, "<|python_tag|>" + JSON_CALLS, "Sunny, 18 C.", "  {not a call"]
)
def test_json_streams_prose_at_once_and_holds_a_call_whole(text: str) -> None:
    rng = random.Random(3)
    for _ in range(20):
        sent, rest, calls = stream_in_pieces(ToolCallText("json"), text, rng)
        content, want = split_calls(text, "json")
        if want:
            assert "".join(sent) == rest == "" and len(calls) == len(want)
        else:
            assert "".join(sent) + rest == text and not calls
            if text[0] not in " {":
                assert sent[0]  # prose goes out with its first piece


def test_a_template_without_tool_call_tags_reads_json_calls(script, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(ScriptCodec, "template", "{% if tools %}{{ tools | tojson }}{% endif %}")
    script.script = JSON_CALLS
    r = call(script, "POST", "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    names = [c["function"]["name"] for c in choice["message"]["tool_calls"]]
    assert names == ["get_weather", "get_time"]


def test_reasoning_effort_reaches_the_template_and_a_bad_one_is_a_400(script) -> None:  # type: ignore[no-untyped-def]
    script.script = "ok"
    body = {"messages": USER, "reasoning_effort": "low"}
    assert call(script, "POST", "/v1/chat/completions", body).status_code == 200
    assert ScriptCodec.seen["variables"] == {"reasoning_effort": "low"}
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}}  # the explicit one wins
    call(script, "POST", "/v1/chat/completions", body | kwargs)
    assert ScriptCodec.seen["variables"] == {"reasoning_effort": "high"}
    r = call(script, "POST", "/v1/chat/completions", body | {"reasoning_effort": "max"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    assert "supported: none, minimal, low, medium, high" in r.text
    r = call(script, "POST", "/v1/completions", {"prompt": "a", "reasoning_effort": "low"})
    assert r.status_code == 400 and "'reasoning_effort' is unsupported" in r.text
