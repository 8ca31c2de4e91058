"""Structured outputs (``response_format="json_schema"``): the schema's grammar against an
independent validator of the same JSON Schema subset, on generated instances, mutated ones
and what sampling from the token masks writes; refusals by keyword; the engine end to end."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from execrt.core.schedule import SamplingParams
from execrt.engine import json_grammar as J
from execrt.engine import structured as S
from execrt.engine.limits import RequestLimits

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
        "role": {"enum": ["admin", "user", 'guest "q"']},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
    "$defs": {
        "Pet": {
            "type": "object",
            "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
            "required": ["kind"],
            "additionalProperties": False,
        }
    },
}
OPEN = {  # additional keys allowed, one of them typed; nested arrays with counts
    "type": "object",
    "properties": {"id": {"type": ["integer", "string"]}},
    "additionalProperties": {"type": "array", "items": {"type": "number"}, "minItems": 1},
    "title": "Open",
}
TREE = {  # recursion through $defs
    "$ref": "#/$defs/Node",
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2},
            },
            "required": ["v"],
            "additionalProperties": False,
        }
    },
}
UNION = {  # objects told apart by a discriminator (Pydantic's discriminated unions)
    "type": "object",
    "properties": {
        "shape": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                    "required": ["kind", "r"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "rect"}, "w": {"type": "integer"},
                        "h": {"type": "integer"},
                    },
                    "required": ["kind", "w"],
                    "additionalProperties": False,
                },
                {"type": "null"},
            ]
        },
        "all": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2},
    },
    "required": ["shape"],
    "additionalProperties": False,
    "$defs": {
        "Item": {
            "anyOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                 "additionalProperties": False},
                {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"],
                 "additionalProperties": False},
            ]
        }
    },
}  # fmt: skip
SCHEMAS = {
    "person": PERSON, "open": OPEN, "tree": TREE, "union": UNION, "any-object": {"type": "object"}
}  # fmt: skip


# -- an independent validator and generator of the subset ---------------------------------------
def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    while isinstance(schema, dict) and "$ref" in schema:
        schema = root["$defs"][schema["$ref"].split("/")[-1]]
    return schema


def valid(value: Any, schema: Any, root: dict[str, Any]) -> bool:
    schema = _resolve(schema, root)
    if schema is True or schema == {} or set(schema) <= {"title", "description"}:
        return True
    if "anyOf" in schema:
        return any(valid(value, b, root) for b in schema["anyOf"])
    if "enum" in schema or "const" in schema:
        options = schema.get("enum", [schema.get("const")])
        return any(type(value) is type(o) and value == o for o in options)
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    checks = {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
    }
    if not any(checks[k] for k in kinds):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        if not set(schema.get("required", [])) <= set(value):
            return False
        for k, v in value.items():
            sub = props.get(k, extra)
            if sub is False or not valid(v, sub, root):
                return False
    if isinstance(value, list):
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", 10**9)
        items = schema.get("items", True)
        return lo <= len(value) <= hi and all(valid(v, items, root) for v in value)
    return True


def generate(schema: Any, root: dict[str, Any], rng: random.Random, depth: int = 0) -> Any:
    schema = _resolve(schema, root)
    if schema is True or schema == {}:
        return rng.choice([1, "x", None, [2.5], {"k": True}])
    if "anyOf" in schema:
        return generate(rng.choice(schema["anyOf"]), root, rng, depth)
    if "enum" in schema or "const" in schema:
        return rng.choice(schema.get("enum", [schema.get("const")]))
    kinds = schema["type"]
    kind = rng.choice([kinds] if isinstance(kinds, str) else kinds)
    if kind == "object":
        props = schema.get("properties", {})
        out = {}
        for k, sub in props.items():
            if k in schema.get("required", []) or (rng.random() < 0.5 and depth < 3):
                out[k] = generate(sub, root, rng, depth + 1)
        extra = schema.get("additionalProperties", True)
        if extra is not False and rng.random() < 0.5:
            out[f"x{rng.randrange(99)}"] = generate(extra, root, rng, depth + 1)
        return out
    if kind == "array":
        lo = schema.get("minItems", 0)
        hi = min(schema.get("maxItems", 3), lo + 3) if depth < 3 else lo
        return [
            generate(schema.get("items", True), root, rng, depth + 1)
            for _ in range(rng.randint(lo, hi))
        ]
    return {
        "string": lambda: rng.choice(["", "a b", "é\n", 'q"']),
        "integer": lambda: rng.randint(-50, 50),
        "number": lambda: rng.choice([0.5, -3, 1e-7, 42]),
        "boolean": lambda: rng.random() < 0.5,
        "null": lambda: None,
    }[kind]()


def _dump(value: Any, rng: random.Random) -> bytes:
    separators = rng.choice([None, (",", ":"), (", ", ": ")])
    return json.dumps(
        value, indent=rng.choice([None, 2]), separators=separators, ensure_ascii=False
    ).encode()


def _accepts(grammar: J.Grammar, text: bytes) -> bool:
    return grammar.complete(grammar.walk(grammar.start, text))


def _valid_text(text: bytes, schema: dict[str, Any]) -> bool:
    try:
        value = json.loads(text.decode("utf-8"), parse_constant=lambda c: 1 / 0)
    except (ValueError, ZeroDivisionError):
        return False
    return isinstance(value, dict) and valid(value, schema, schema)


# -- the grammar ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_instances_are_accepted_prefix_by_prefix(name: str) -> None:
    schema = SCHEMAS[name]
    grammar = J.compile_schema(schema)
    rng = random.Random(name)
    for _ in range(200):
        value = generate(schema, schema, rng)
        assert valid(value, schema, schema), value
        text = _dump(value, rng)
        state = grammar.start
        for i, byte in enumerate(text):
            state = grammar.step(state, byte)  # type: ignore[arg-type]
            assert state is not None, (text, i)
        assert grammar.complete(state), text


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_mutated_instances_agree_with_the_validator(name: str) -> None:
    schema = SCHEMAS[name]
    grammar = J.compile_schema(schema)
    rng = random.Random(f"{name}-mutations")
    alphabet = b'{}[]:,"0123456789-.eEtrufalsn xyzagekid'
    seen = {True: 0, False: 0}
    for _ in range(400):
        text = json.dumps(
            generate(schema, schema, rng), separators=(",", ":"), ensure_ascii=False
        ).encode()
        assert _accepts(grammar, text), text
        for _ in range(rng.choice([1, 2])):
            i = rng.randrange(len(text))
            cut = rng.choice([0, 1])  # replace a byte, or drop it
            text = text[:i] + (b"" if cut else bytes([rng.choice(alphabet)])) + text[i + 1 :]
        ours = _accepts(grammar, text)
        assert ours == _valid_text(text, schema), text
        seen[ours] += 1
    assert seen[False] and (seen[True] or name == "union")  # (its mutations all break it)


def test_a_union_of_objects_is_told_apart_by_its_keys_and_their_enum_values() -> None:
    g = J.compile_schema(UNION)
    assert _accepts(g, b'{"shape":{"kind":"circle","r":2.5}}')
    assert _accepts(g, b'{"shape":{"kind":"rect","w":2},"all":[{"a":1},{"b":true}]}')
    for bad in [
        b'{"shape":{"kind":"circle","w":2}}',  # a rect's key after a circle's kind
        b'{"shape":{"kind":"rect","w":2.5}}',  # the rect's w is an integer
        b'{"shape":{"kind":"rect","r":1}}',
        b'{"shape":{"kind":"rect"}}',  # its required w
        b'{"shape":{"kind":"oval"}}',
        b'{"shape":null,"all":[{"a":true}]}',
    ]:
        assert not _accepts(g, bad), bad
    state = g.walk(g.start, b'{"shape":{"kind":"circle",')
    assert state is not None
    assert g.walk(state, b'"r"') is not None and g.walk(state, b'"w"') is None


def test_specific_refusals_of_a_schema_s_grammar() -> None:
    g = J.compile_schema(PERSON)
    good = b'{"name":"Al","age":3,"pet":{"kind":"cat"},"role":"admin"}'
    assert _accepts(g, good)
    # keys of a closed object come in the schema's order (as OpenAI writes them)
    assert not _accepts(g, b'{"name":"Al","age":3,"role":"admin","pet":{"kind":"cat"}}')
    assert g.walk(g.start, b'{"age"') is None, "a required key (name) would be skipped"
    for bad in [
        b'{"name":"Al","age":3}',  # a required key missing
        b'{"name":"Al","age":3.5,"role":"user"}',  # not an integer
        b'{"name":"Al","age":3,"role":"root"}',  # not in the enum
        b'{"name":"Al","age":3,"role":"user","x":1}',  # no other keys
        b'{"name":"Al","name":"B","age":3,"role":"user"}',  # a key twice
        b'{"name":"Al","age":3,"role":"user","tags":["a","b","c","d"]}',  # maxItems
        b'{"name":"Al","age":3,"role":"user","pet":{"kind":"dog"}}',  # const
        b'{"name":"Al","age":3,"role":"user","pet":"cat"}',  # neither branch
        b'{"nam":"Al","age":3,"role":"user"}',
    ]:
        assert not _accepts(g, bad), bad
    # a key's prefix that no property has is refused at its first wrong byte
    assert g.walk(g.start, b'{"nax') is None and g.walk(g.start, b'{"na') is not None
    # nothing may follow a closed object's last property
    full = b'{"name":"A","age":1,"height":1,"tags":[],"pet":null,"role":"user","ok":true'
    assert g.walk(g.start, full + b",") is None and _accepts(g, full + b"}")


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}, "'pattern'"),
        ({"type": "string"}, "the root must be an object"),
        ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "$ref 'http://x/y'"),
        (
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "string", "title": "another"},
                ]
            },
            "two branches of type 'string'",
        ),  # fmt: skip
        ({"type": "object", "required": ["a"], "additionalProperties": False}, "no object"),
        ({"type": "object", "properties": {"a": {"type": "date"}}}, "type 'date'"),
        (
            {
                "type": "object",
                "properties": {"a": {"anyOf": [{"enum": ["x"]}, {"type": "string"}]}},
            },
            "begin alike",
        ),  # fmt: skip
        ([1], "must be an object"),
    ],
)
def test_unsupported_schemas_are_refused_by_name(schema: Any, needle: str) -> None:
    with pytest.raises(ValueError, match="json_schema") as info:
        J.compile_schema(schema)
    assert needle in str(info.value)
    limits = RequestLimits(vocab_size=10, context_len=10, kv_slots_total=10)
    sp = SamplingParams(response_format="json_schema", json_schema=json.dumps(schema))
    (problem,) = limits.params_problems(sp)
    assert problem.startswith("response_format json_schema:") and needle in problem


def test_json_schema_goes_with_its_response_format() -> None:
    assert "goes with response_format 'json_schema'" in " ".join(
        SamplingParams(response_format="json_schema").problems()
    )
    assert SamplingParams(json_schema="{}").problems()
    assert not SamplingParams(response_format="json_schema", json_schema="{}").problems()
    limits = RequestLimits(vocab_size=10, context_len=10, kv_slots_total=10)
    sp = SamplingParams(response_format="json_schema", json_schema="{nope")
    assert "json_schema is not valid JSON" in limits.params_problems(sp)[0]


@pytest.mark.parametrize("name", [*SCHEMAS, "bounded"])
def test_every_state_reached_can_go_on_or_is_complete(name: str) -> None:
    """Random byte walks: no state the grammar accepts is a dead end (a mask with nothing in
    it would end the request with a broken object)."""
    schema = SCHEMAS.get(name) or {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"enum": [1, 12]}, "maxItems": 2},
                       "b": {"type": "array", "minItems": 2, "maxItems": 2}},
        "required": ["a"],
        "additionalProperties": False,
    }  # fmt: skip
    grammar = J.compile_schema(schema)
    rng = random.Random(name)
    for _ in range(150):
        state = grammar.start
        text = b""
        for _ in range(80):
            nexts = [b for b in range(256) if grammar.step(state, b) is not None]
            if grammar.complete(state):
                assert not nexts
                assert _valid_text(text, schema), text
                break
            assert nexts, (text, state)
            quiet = [b for b in nexts if b not in b" \t\r\n"] or nexts
            byte = rng.choice(quiet)
            text += bytes([byte])
            state = grammar.step(state, byte)  # type: ignore[assignment]


# -- masks ---------------------------------------------------------------------------------------
VOCAB = [
    b"{", b"}", b"[", b"]", b":", b",", b'"', b" ", b"\n", b'{"', b'":', b'",', b'"}', b'"]',
    b"name", b"age", b"role", b"pet", b"tags", b"ok", b"height", b"na", b"me", b"admin", b"user",
    b"guest", b' \\"q\\"', b"kind", b"cat", b"lives", b"true", b"false", b"null", b"0", b"1",
    b"12", b"-", b".", b"5", b"e", b"a", b"b", b"x", b"v", b"kids", b"id", b"\\n", b'"name":',
    b"shape", b"kind", b"circle", b"rect", b"r", b"w", b"h", b"all",
]  # fmt: skip
EOS = len(VOCAB)


def test_masks_equal_a_walk_of_every_token_and_sampling_writes_valid_instances() -> None:
    index = S.JsonIndex(VOCAB, EOS + 1)
    for name in ("person", "tree", "open", "union"):
        schema = SCHEMAS[name]
        grammar = J.compile_schema(schema)
        rng = random.Random(name)
        written = 0
        for _ in range(150):
            c = S.JsonConstraint(index, [EOS], grammar)
            out = b""
            for _ in range(150):
                allowed = c.allowed()
                state = c.state
                want = torch.tensor(
                    [grammar.walk(state, t) is not None for t in VOCAB] + [grammar.complete(state)]
                )
                if not want.any():
                    want[EOS] = True  # the vocabulary cannot go on: the end
                assert torch.equal(allowed, want), (name, state)
                ids = allowed.nonzero().flatten().tolist()
                token = EOS if EOS in ids and rng.random() < 0.7 else rng.choice(ids)
                if token == EOS:
                    break
                out += VOCAB[token]
                c.advance(token)
            if c.complete:
                assert _valid_text(out, schema), out
                written += 1
        assert written >= 3, name
