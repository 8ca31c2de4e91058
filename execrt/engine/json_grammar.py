"""The grammar of JSON mode and structured outputs (``response_format`` ``json_object`` and
``json_schema``): which bytes keep a request's output a prefix of one JSON object. Torch-free
(the HTTP side checks schemas with it); ``engine.structured`` turns it into token masks.

A ``Grammar`` is a byte-level pushdown recognizer of RFC 8259 JSON whose root is an object,
compiled from a JSON Schema (``compile_schema``; ``JSON_OBJECT`` is any object, OpenAI's JSON
mode). Its states are immutable and hashable: ``(mode, frames, aux, node, acc)``, ``frames``
the open objects and arrays (with the keys an object has and the items an array has),
``node`` the schema node of the value expected, ``acc`` the bytes of a key or of an enum value
so far.

Strings must be valid UTF-8 (what Python's decoder accepts), so that byte-level vocabularies
cannot split a character into an invalid sequence. Keys of a schema's object and enum values
are matched as ``json.dumps`` spells them (no other escapes), and a closed object's keys
(no additional properties) come in the schema's order, skipping no required one, as OpenAI's
structured outputs write them. Not checked: numbers' range, and
duplicate keys outside a schema's properties. Runs of whitespace between tokens are cut at
``MAX_WHITESPACE`` bytes and nesting at ``MAX_DEPTH``, so that a model cannot loop on either;
once the object closes only the tokens that end the request may follow.

The JSON Schema subset (what OpenAI's structured outputs and Pydantic's models use): ``type``
(a name or a list), ``properties``, ``required``, ``additionalProperties`` (false, true or a
schema), ``items``, ``minItems``, ``maxItems``, ``enum``, ``const``, ``anyOf``/``oneOf``
(branches told apart by a value's first byte, except objects: several object branches are
told apart as their keys and the keys' enum values arrive, the way discriminated unions
are), ``$ref`` to ``#/$defs/...`` or
``#/definitions/...`` (recursion allowed), and the annotations (``title``, ``description``,
``default``, ``examples``, ...). Any other keyword is refused by name rather than ignored.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_WHITESPACE = 32  # consecutive whitespace bytes outside strings
MAX_DEPTH = 32  # nested objects and arrays

# Modes. The first eight allow whitespace (``aux`` counts the run).
ROOT, VALUE, ARRAY_FIRST, OBJECT_FIRST, KEY, COLON, AFTER, DONE = range(8)
# aux bit 0: a key; bit 6: its bytes go to acc (to look it up). STRING: bits 1-2 the UTF-8
# continuation bytes still due, bits 3-5 the range of the next one (_CONTINUATION);
# UNICODE: bits 1-3 the hex digits left.
STRING, ESCAPE, UNICODE = 8, 9, 10
MINUS, ZERO, INT, DOT, FRAC, EXP_MARK, EXP_SIGN, EXP = range(11, 19)  # aux 1: integers only
LITERAL = 19  # true, false, null; aux: literal * 8 + bytes matched
CHOICE = 20  # one of the node's enum values; acc: its bytes so far
KEY_CHOICE = 21  # a key of an object without additional properties; acc: its bytes so far
_KEY, _ACC = 1, 64
_LITERALS = (b"true", b"false", b"null")
_WHITESPACE = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_NUMBER_END = frozenset({ZERO, INT, FRAC, EXP})  # a number may end here
#: The bytes a UTF-8 continuation may take: any, then after E0, ED, F0 and F4 (no overlong
#: forms, no surrogates, nothing past U+10FFFF: what Python's decoder accepts)
_CONTINUATION = ((0x80, 0xBF), (0xA0, 0xBF), (0x80, 0x9F), (0x90, 0xBF), (0x80, 0x8F))
#: What ends a run of string bytes that keep a STRING state as it is.
STRING_SPECIAL = frozenset([0x22, 0x5C, *range(0x20), *range(0x80, 0x100)])
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
#: The first bytes of a value of each type.
_FIRST = {
    "object": b"{", "array": b"[", "string": b'"', "number": b"-0123456789",
    "integer": b"-0123456789", "boolean": b"tf", "null": b"n",
}  # fmt: skip

#: A frame: ("o", node, (keys it has, the object schemas it may still be, the key whose value
#: is being read)) or ("a", node, items it has).
Frame = tuple[str, int, Any]
#: (mode, frames, aux, node, acc)
JsonState = tuple[int, tuple[Frame, ...], int, int, bytes]


@dataclass(frozen=True)
class Node:
    """One schema: the types a value may have, what an object and an array of it hold, or
    the enum values (``choices``, as ``json.dumps`` spells them) it may be."""

    types: frozenset[str] = TYPES
    properties: Mapping[bytes, int] = field(default_factory=dict)  # key (as spelled) -> node
    required: frozenset[bytes] = frozenset()
    additional: int | None = 0  # node of other keys' values; None: no other key
    items: int = 0
    min_items: int = 0
    max_items: int | None = None
    choices: tuple[bytes, ...] = ()
    #: an object that is one of these object schemas (anyOf of objects): told apart as its
    #: keys and their enum values arrive
    branches: tuple[int, ...] = ()

    def first_bytes(self) -> frozenset[int]:
        return frozenset(b for t in self.types for b in _FIRST[t])


ANY = Node()


class Grammar:
    """JSON values of a compiled schema (``nodes[root]``, an object schema)."""

    def __init__(self, nodes: Sequence[Node], root: int) -> None:
        self.nodes = list(nodes)
        self.root = root
        self.start: JsonState = (ROOT, (), 0, root, b"")
        self._choice_first = [frozenset(c[0] for c in n.choices) for n in self.nodes]
        # The value node of a key several object schemas share, by their value nodes.
        self._unions: dict[tuple[int, ...], int] = {}

    def walk(self, state: JsonState | None, data: bytes) -> JsonState | None:
        """The state after every byte of ``data`` (None once any is refused)."""
        for byte in data:
            if state is None:
                return None
            state = self.step(state, byte)
        return state

    def step(self, state: JsonState, byte: int) -> JsonState | None:
        """The state after ``byte``, or None if no value of the schema has the bytes so far
        as a prefix."""
        mode, frames, aux, node, acc = state
        if mode == STRING:
            return self._string(frames, aux, acc, byte)
        if mode == ESCAPE or mode == UNICODE:
            return self._escape(mode, frames, aux, acc, byte)
        if mode == KEY_CHOICE:
            return self._key_choice(frames, acc, byte)
        if mode == CHOICE:
            return self._choice(frames, node, acc, byte)
        if mode >= MINUS:
            return self._number_or_literal(mode, frames, aux, byte)
        if mode == DONE:  # the object is whole: only the tokens that end the request
            return None
        if byte in _WHITESPACE:
            return (mode, frames, aux + 1, node, acc) if aux < MAX_WHITESPACE else None
        if mode == ROOT:
            return self._value((), node, byte) if byte == 0x7B else None
        if mode == OBJECT_FIRST or mode == KEY:
            if byte == 0x22:
                return self._key(frames)
            return self._close(frames) if mode == OBJECT_FIRST and byte == 0x7D else None
        if mode == COLON:
            return (VALUE, frames, 0, node, b"") if byte == 0x3A else None
        if mode == AFTER:
            return self._after(frames, byte)
        if mode == ARRAY_FIRST and byte == 0x5D:
            return self._close(frames)
        if mode == VALUE or mode == ARRAY_FIRST:
            return self._value(frames, node, byte)
        return None

    # -- objects and arrays ---------------------------------------------------------------------
    def _value(self, frames: tuple[Frame, ...], node: int, byte: int) -> JsonState | None:
        """The first byte of a value of ``node``."""
        if frames and frames[-1][0] == "a":  # one more item in the array
            kind, array, count = frames[-1]
            limit = self.nodes[array].max_items
            if limit is not None and count >= limit:
                return None
            frames = (*frames[:-1], (kind, array, count + 1))
        n = self.nodes[node]
        if byte in self._choice_first[node]:
            return (CHOICE, frames, 0, node, bytes([byte]))
        types = n.types
        if byte == 0x22:
            return (STRING, frames, 0, -1, b"") if "string" in types else None
        if byte == 0x7B or byte == 0x5B:
            if len(frames) >= MAX_DEPTH:
                return None
            if byte == 0x7B:
                if "object" not in types:
                    return None
                frame: Frame = ("o", node, (frozenset(), n.branches or (node,), None))
                return (OBJECT_FIRST, (*frames, frame), 0, -1, b"")
            if "array" not in types:
                return None
            return (ARRAY_FIRST, (*frames, ("a", node, 0)), 0, n.items, b"")
        if byte == 0x2D or byte in _DIGITS:
            if not types & {"number", "integer"}:
                return None
            integer = int("number" not in types)
            return (
                MINUS if byte == 0x2D else ZERO if byte == 0x30 else INT,
                frames,
                integer,
                -1,
                b"",
            )
        for i, word in enumerate(_LITERALS):
            if byte == word[0] and ("null" if i == 2 else "boolean") in types:
                return (LITERAL, frames, i * 8 + 1, -1, b"")
        return None

    def _takes(self, schema: int, done: frozenset[bytes], key: bytes) -> int | None:
        """The value node of ``key`` next in an object of ``schema`` that has ``done``, or
        None: a property once, and in a closed object (no additional properties) in the
        order of its properties (as OpenAI's structured outputs write them), skipping no
        required one."""
        n = self.nodes[schema]
        value = n.properties.get(key)
        if value is None:
            return n.additional
        if key in done:
            return None
        if n.additional is None:  # in order, and no required key skipped
            order = list(n.properties)
            at = order.index(key)
            if any(order.index(k) > at for k in done if k in n.properties):
                return None
            if any(order.index(k) < at for k in n.required - done):
                return None
        return value

    def _next_keys(
        self, done: frozenset[bytes], schemas: tuple[int, ...]
    ) -> tuple[set[bytes], bool]:
        """The declared keys that may come next in an object that may still be any of
        ``schemas``, and whether any other key may."""
        keys: set[bytes] = set()
        free = False
        for schema in schemas:
            n = self.nodes[schema]
            free = free or n.additional is not None
            keys |= {k for k in n.properties if self._takes(schema, done, k) is not None}
        return keys, free

    def _key(self, frames: tuple[Frame, ...]) -> JsonState | None:
        """An object's opening quote of a key."""
        done, schemas, _ = frames[-1][2]
        keys, free = self._next_keys(done, schemas)
        if free:  # any key: read as a string, kept for the lookup where one is needed
            lookup = len(schemas) > 1 or bool(self.nodes[schemas[0]].properties)
            return (STRING, frames, _KEY | (_ACC if lookup else 0), -1, b"")
        return (KEY_CHOICE, frames, 0, -1, b"") if keys else None

    def _key_done(self, frames: tuple[Frame, ...], key: bytes | None) -> JsonState | None:
        """A key closed: on to its value (``key`` None: not looked up, any key's value)."""
        kind, obj, (done, schemas, _) = frames[-1]
        if key is None:  # one schema, no properties: any key
            value = self.nodes[schemas[0]].additional
            return None if value is None else (COLON, frames, 0, value, b"")
        takes = [(schema, self._takes(schema, done, key)) for schema in schemas]
        kept = [(schema, value) for schema, value in takes if value is not None]
        if not kept:
            return None
        values = tuple(dict.fromkeys(value for _, value in kept))
        value = values[0] if len(values) == 1 else self._union(values)
        if value is None:  # the schemas' values cannot be told apart: the first one's
            kept = [(schema, v) for schema, v in kept if v == values[0]]
            value = values[0]
        if any(key in self.nodes[schema].properties for schema, _ in kept):
            done = done | {key}
        has = (done, tuple(schema for schema, _ in kept), key)
        return (COLON, (*frames[:-1], (kind, obj, has)), 0, value, b"")

    def _key_choice(self, frames: tuple[Frame, ...], acc: bytes, byte: int) -> JsonState | None:
        done, schemas, _ = frames[-1][2]
        more = acc + bytes([byte])
        keys, _ = self._next_keys(done, schemas)
        if any(k.startswith(more) for k in keys):
            return (KEY_CHOICE, frames, 0, -1, more)
        return self._key_done(frames, acc) if byte == 0x22 and acc in keys else None

    def _after(self, frames: tuple[Frame, ...], byte: int) -> JsonState | None:
        """After a value inside an object or an array."""
        kind, node, has = frames[-1]
        if kind == "o":
            if byte == 0x2C:
                keys, free = self._next_keys(has[0], has[1])
                return (KEY, frames, 0, -1, b"") if keys or free else None
            return self._close(frames) if byte == 0x7D else None
        n = self.nodes[node]
        if byte == 0x2C:  # another item, if the array may hold one
            full = n.max_items is not None and has >= n.max_items
            return None if full else (VALUE, frames, 0, n.items, b"")
        return self._close(frames) if byte == 0x5D else None

    def _union(self, values: tuple[int, ...]) -> int | None:
        """One node for the values several object schemas give a key (None: they cannot be
        told apart by their first bytes), made once."""
        made = self._unions.get(values)
        if made is None:
            try:
                made = merge_union([self.nodes[v] for v in values], values, self._add, "")
            except ValueError:
                made = -1
            self._unions[values] = made
        return None if made < 0 else made

    def _add(self, node: Node) -> int:
        self.nodes.append(node)
        self._choice_first.append(frozenset(c[0] for c in node.choices))
        return len(self.nodes) - 1

    def _narrowed(self, frames: tuple[Frame, ...], value: bytes) -> tuple[Frame, ...]:
        """The innermost object told apart by the enum value it just got for a key."""
        if not frames or frames[-1][0] != "o":
            return frames
        kind, obj, (done, schemas, key) = frames[-1]
        if key is None or len(schemas) < 2:
            return frames
        kept = []
        for schema in schemas:
            node = self.nodes[schema].properties.get(key, self.nodes[schema].additional)
            n = self.nodes[node] if node is not None else None
            if n is not None and (value in n.choices or value[0] in n.first_bytes()):
                kept.append(schema)
        return (*frames[:-1], (kind, obj, (done, tuple(kept) or schemas, None)))

    def _close(self, frames: tuple[Frame, ...]) -> JsonState | None:
        """The closing bracket of the innermost object or array, if it may close here."""
        kind, node, has = frames[-1]
        if kind == "o" and not any(self.nodes[s].required <= has[0] for s in has[1]):
            return None
        if kind == "a" and has < self.nodes[node].min_items:
            return None
        rest = frames[:-1]
        return (AFTER, rest, 0, -1, b"") if rest else (DONE, (), 0, -1, b"")

    # -- scalars ----------------------------------------------------------------------------------
    def _string(
        self, frames: tuple[Frame, ...], aux: int, acc: bytes, byte: int
    ) -> JsonState | None:
        """A byte inside a string: UTF-8, with quotes and control bytes escaped."""
        flags, due = aux & (_KEY | _ACC), (aux >> 1) & 3
        more = acc + bytes([byte]) if aux & _ACC else acc
        if due:
            lo, hi = _CONTINUATION[(aux >> 3) & 7]
            return (STRING, frames, flags | (due - 1) << 1, -1, more) if lo <= byte <= hi else None
        if byte < 0x80:
            if byte == 0x22:  # the closing quote
                if not aux & _KEY:
                    return (AFTER, frames, 0, -1, b"")
                return self._key_done(frames, acc if aux & _ACC else None)
            if byte == 0x5C:
                return (ESCAPE, frames, flags, -1, more)
            return None if byte < 0x20 else (STRING, frames, flags, -1, more)
        if 0xC2 <= byte <= 0xDF:
            return (STRING, frames, flags | 1 << 1, -1, more)
        if 0xE0 <= byte <= 0xEF:
            first = 1 if byte == 0xE0 else 2 if byte == 0xED else 0
            return (STRING, frames, flags | 2 << 1 | first << 3, -1, more)
        if 0xF0 <= byte <= 0xF4:
            first = 3 if byte == 0xF0 else 4 if byte == 0xF4 else 0
            return (STRING, frames, flags | 3 << 1 | first << 3, -1, more)
        return None  # a continuation byte without a lead, or no UTF-8 lead at all

    @staticmethod
    def _escape(
        mode: int, frames: tuple[Frame, ...], aux: int, acc: bytes, byte: int
    ) -> JsonState | None:
        flags = aux & (_KEY | _ACC)
        more = acc + bytes([byte]) if aux & _ACC else acc
        if mode == ESCAPE:
            if byte in _ESCAPES:
                return (STRING, frames, flags, -1, more)
            return (UNICODE, frames, flags | 4 << 1, -1, more) if byte == 0x75 else None
        if byte not in _HEX:
            return None
        left = ((aux >> 1) & 7) - 1
        return (STRING if left == 0 else UNICODE, frames, flags | left << 1, -1, more)

    def _choice(
        self, frames: tuple[Frame, ...], node: int, acc: bytes, byte: int
    ) -> JsonState | None:
        more = acc + bytes([byte])
        choices = self.nodes[node].choices
        if any(c.startswith(more) for c in choices):
            return (CHOICE, frames, 0, node, more)
        if acc not in choices:
            return None
        return self.step((AFTER, self._narrowed(frames, acc), 0, -1, b""), byte)

    def _number_or_literal(
        self, mode: int, frames: tuple[Frame, ...], aux: int, byte: int
    ) -> JsonState | None:
        if mode == LITERAL:
            word, matched = _LITERALS[aux >> 3], aux & 7
            if byte != word[matched]:
                return None
            if matched + 1 == len(word):
                return (AFTER, frames, 0, -1, b"")
            return (LITERAL, frames, aux + 1, -1, b"")
        digit = byte in _DIGITS
        if mode == MINUS:
            return (ZERO if byte == 0x30 else INT, frames, aux, -1, b"") if digit else None
        if mode == DOT:
            return (FRAC, frames, aux, -1, b"") if digit else None
        if mode == EXP_MARK:
            if byte == 0x2B or byte == 0x2D:
                return (EXP_SIGN, frames, aux, -1, b"")
            return (EXP, frames, aux, -1, b"") if digit else None
        if mode == EXP_SIGN:
            return (EXP, frames, aux, -1, b"") if digit else None
        if digit and mode != ZERO:  # INT, FRAC, EXP go on (no digit after a leading zero)
            return (mode, frames, aux, -1, b"")
        if byte == 0x2E and mode in (ZERO, INT) and not aux:
            return (DOT, frames, aux, -1, b"")
        if (byte == 0x65 or byte == 0x45) and mode in (ZERO, INT, FRAC) and not aux:
            return (EXP_MARK, frames, aux, -1, b"")
        if mode in _NUMBER_END:  # the number ended: this byte comes after the value
            return self.step((AFTER, frames, 0, -1, b""), byte)
        return None

    @staticmethod
    def complete(state: JsonState | None) -> bool:
        """Whether the bytes so far are one whole object."""
        return state is not None and state[0] == DONE

    @staticmethod
    def free_string(state: JsonState) -> bool:
        """Inside a string whose printable-ASCII bytes leave the state as it is."""
        return state[0] == STRING and state[2] & ~_KEY == 0


# -- compiling a JSON Schema --------------------------------------------------------------------
#: Keywords that describe and do not constrain.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
     "readOnly", "writeOnly", "$defs", "definitions"}
)  # fmt: skip
_KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
     "enum", "const", "anyOf", "oneOf", "$ref"}
)  # fmt: skip


def compile_schema(schema: Any) -> Grammar:
    """The grammar of ``schema`` (a JSON Schema whose root is an object). Raises ValueError
    naming what is unsupported or inconsistent."""
    return _Compiler(schema).grammar()


class _Compiler:
    def __init__(self, schema: Any) -> None:
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema: the schema must be an object, got {schema!r}")
        self.schema = schema
        self.nodes: list[Node] = [ANY]
        self.refs: dict[str, int] = {}

    def grammar(self) -> Grammar:
        root = self.node(self.schema, "#")
        n = self.nodes[root]
        if "object" not in n.types or n.choices:
            raise ValueError("json_schema: the root must be an object schema ('type': 'object')")
        self.nodes[root] = Node(
            frozenset({"object"}), n.properties, n.required, n.additional, n.items,
            n.min_items, n.max_items, branches=n.branches,
        )  # fmt: skip
        return Grammar(self.nodes, root)

    def node(self, schema: Any, where: str) -> int:
        if schema is True or schema == {}:
            return 0
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema: {where} must be a schema object, got {schema!r}")
        unknown = sorted(set(schema) - _KEYWORDS - _ANNOTATIONS)
        if unknown:
            raise ValueError(
                f"json_schema: keyword {unknown[0]!r} at {where} unsupported (supported: "
                f"{', '.join(sorted(_KEYWORDS))}, and annotations)"
            )
        if "$ref" in schema:
            if set(schema) - _ANNOTATIONS != {"$ref"}:
                raise ValueError(f"json_schema: $ref at {where} with other keywords unsupported")
            return self.ref(schema["$ref"], where)
        branches = schema.get("anyOf", schema.get("oneOf"))
        if branches is not None:
            if not isinstance(branches, list) or not branches:
                raise ValueError(f"json_schema: anyOf at {where} must be a non-empty list")
            others = set(schema) - _ANNOTATIONS - {"anyOf", "oneOf"}
            if others:
                raise ValueError(
                    f"json_schema: anyOf at {where} with {sorted(others)[0]!r} unsupported"
                )
            return self.union(
                [self.node(b, f"{where}/anyOf/{i}") for i, b in enumerate(branches)], where
            )
        return self.add(self.one(schema, where))

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def ref(self, ref: Any, where: str) -> int:
        if ref in self.refs:
            return self.refs[ref]
        prefix = next((p for p in ("#/$defs/", "#/definitions/") if str(ref).startswith(p)), None)
        defs = self.schema.get(prefix[2:-1]) if prefix else None
        name = str(ref)[len(prefix) :] if prefix else ""
        if not isinstance(defs, dict) or name not in defs:
            raise ValueError(
                f"json_schema: $ref {ref!r} at {where} unsupported (only #/$defs/<name> and "
                "#/definitions/<name> of this schema)"
            )
        self.refs[ref] = slot = self.add(ANY)  # placeholder: a recursive ref finds it
        self.nodes[slot] = self.nodes[self.node(defs[name], ref)]
        return slot

    def one(self, schema: Mapping[str, Any], where: str) -> Node:
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            if not isinstance(values, list) or not values:
                raise ValueError(f"json_schema: enum at {where} must be a non-empty list")
            choices = tuple(dict.fromkeys(_spelled(v) for v in values))
            return Node(types=frozenset(), choices=choices)
        kind = schema.get("type", sorted(TYPES))
        types = frozenset(
            [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else ()
        )
        if not types or not types <= TYPES:
            raise ValueError(
                f"json_schema: type {kind!r} at {where} unsupported (supported: "
                f"{', '.join(sorted(TYPES))}, or a list of them)"
            )
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"json_schema: properties at {where} must be an object")
        properties = {
            _spelled(k)[1:-1]: self.node(v, f"{where}/properties/{k}") for k, v in props.items()
        }
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise ValueError(f"json_schema: required at {where} must be a list of names")
        extra = schema.get("additionalProperties", True)
        additional = None if extra is False else self.node(extra, f"{where}/additionalProperties")
        missing = [k for k in required if _spelled(k)[1:-1] not in properties]
        if missing and additional is None:
            raise ValueError(
                f"json_schema: required {missing[0]!r} at {where} is not among its properties "
                "and additionalProperties is false: no object could match"
            )
        if missing:
            raise ValueError(
                f"json_schema: required {missing[0]!r} at {where} without a property schema "
                "unsupported"
            )
        items = self.node(schema.get("items", True), f"{where}/items")
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if not _count(lo) or not (hi is None or _count(hi) and hi >= lo):
            raise ValueError(f"json_schema: minItems {lo!r} / maxItems {hi!r} at {where} invalid")
        return Node(
            types, properties, frozenset(_spelled(k)[1:-1] for k in required), additional,
            items, lo, hi,
        )  # fmt: skip

    def union(self, branches: list[int], where: str) -> int:
        """One node for the branches (see ``merge_union``)."""
        if any(b == 0 for b in branches):
            return 0
        return merge_union([self.nodes[b] for b in branches], tuple(branches), self.add, where)


def merge_union(
    nodes: list[Node], ids: tuple[int, ...], add: Callable[[Node], int], where: str
) -> int:
    """One node for ``anyOf`` branches (``nodes``, numbered ``ids``), added with ``add``: a
    value is told apart by its first byte (objects are the exception: several object branches
    make a node whose object is one of them, told apart as its keys arrive). Raises
    ValueError for two branches of another same type, or enum values that begin as a type
    does."""
    types: set[str] = set()
    picked: dict[str, Node] = {}
    objects: list[int] = []
    choices: list[bytes] = []
    for n, i in zip(nodes, ids, strict=True):
        if "object" in n.types:
            objects += n.branches or (i,)
        for t in n.types - {"object"}:
            kind = "number" if t == "integer" else t
            if kind in picked and picked[kind] is not n:
                raise ValueError(
                    f"json_schema: anyOf at {where or '#'} has two branches of type {t!r} "
                    "(only objects may share a type)"
                )
            picked[kind] = n
        types |= n.types
        choices += n.choices
    merged = Node(frozenset(types), choices=tuple(dict.fromkeys(choices)))
    clash = {c[0] for c in merged.choices} & merged.first_bytes()
    if clash:
        raise ValueError(
            f"json_schema: anyOf at {where or '#'} mixes enum values and types that begin "
            f"alike ({bytes(sorted(clash))!r})"
        )
    arr = picked.get("array", ANY)
    if len(objects) == 1:  # one object schema: its own fields
        obj = next(n for n, i in zip(nodes, ids, strict=True) if i in objects)
        return add(
            Node(
                merged.types, obj.properties, obj.required, obj.additional, arr.items,
                arr.min_items, arr.max_items, merged.choices,
            )
        )  # fmt: skip
    return add(
        Node(
            merged.types, items=arr.items, min_items=arr.min_items, max_items=arr.max_items,
            choices=merged.choices, branches=tuple(dict.fromkeys(objects)),
        )
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def schema_grammar(text: str) -> Grammar:
    """The grammar of a JSON Schema given as JSON text (``SamplingParams.json_schema``),
    compiled once per text. Raises ValueError naming what is wrong."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"json_schema is not valid JSON ({exc})") from None
    return compile_schema(schema)


def _spelled(value: Any) -> bytes:
    """A value as ``json.dumps`` writes it, compactly (how a schema's keys and enum values must
    appear)."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema: value {value!r} is not JSON ({exc})") from None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: Any JSON object: JSON mode.
JSON_OBJECT = compile_schema({"type": "object"})
