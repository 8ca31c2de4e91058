"""JSON mode (``response_format: {"type": "json_object"}``): the tokens that keep a request's
output a prefix of one JSON object, step by step.

``JsonState`` is a byte-level pushdown recognizer of RFC 8259 JSON whose root must be an
object (OpenAI's JSON mode), immutable and hashable: ``(mode, stack, aux)``. ``JsonIndex``
holds a vocabulary's token bytes in a trie and answers, for a state, which token ids may come
next (a boolean mask over the model's vocabulary, cached per state: a state reached again
costs a dictionary lookup). ``JsonConstraint`` is one request's progress, and adds the tokens
that end it once the object is complete. Inside a string,
where most of an answer's tokens fall, every token free of quotes, backslashes and control
bytes is allowed without a walk; only the others are checked.

Strings must be valid UTF-8 (what Python's decoder accepts), so that byte-level vocabularies
cannot split a character into an invalid sequence. Not checked, as in other servers' JSON
modes: numbers' range, and duplicate keys. Runs of whitespace between tokens are
cut at ``MAX_WHITESPACE`` bytes and nesting at ``MAX_DEPTH``, so that a model cannot loop on
either; once the object closes only whitespace and the end-of-sequence tokens may follow.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

MAX_WHITESPACE = 32  # consecutive whitespace bytes outside strings
MAX_DEPTH = 32  # nested objects and arrays
CACHE_STATES = 512  # masks kept per index (a mask is one byte per vocabulary entry)

# Modes. The first eight allow whitespace (``aux`` counts the run).
ROOT, VALUE, ARRAY_FIRST, OBJECT_FIRST, KEY, COLON, AFTER, DONE = range(8)
# aux bit 0: a key. STRING: bits 1-2 the UTF-8 continuation bytes still due, bits 3-5 the
# range of the next one (_CONTINUATION); UNICODE: aux >> 1 hex digits left.
STRING, ESCAPE, UNICODE = 8, 9, 10
MINUS, ZERO, INT, DOT, FRAC, EXP_MARK, EXP_SIGN, EXP = range(11, 19)
LITERAL = 19  # aux: literal * 8 + bytes matched
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
_STRING_SPECIAL = frozenset([0x22, 0x5C, *range(0x20), *range(0x80, 0x100)])

#: (mode, stack of "o"/"a", aux)
JsonState = tuple[int, str, int]
START: JsonState = (ROOT, "", 0)


def step(state: JsonState, byte: int) -> JsonState | None:
    """The state after ``byte``, or None if no JSON object has the bytes so far as prefix."""
    mode, stack, aux = state
    if mode == STRING:
        return _string(stack, aux, byte)
    if mode == ESCAPE:
        if byte in _ESCAPES:
            return (STRING, stack, aux)
        return (UNICODE, stack, aux | 8) if byte == 0x75 else None  # \u: 4 hex digits
    if mode == UNICODE:
        if byte not in _HEX:
            return None
        left = (aux >> 1) - 1
        return (STRING, stack, aux & 1) if left == 0 else (UNICODE, stack, (aux & 1) | left << 1)
    if mode >= MINUS:
        return _number_or_literal(mode, stack, aux, byte)
    if byte in _WHITESPACE:
        return (mode, stack, aux + 1) if aux < MAX_WHITESPACE else None
    if mode == ROOT:
        return (OBJECT_FIRST, "o", 0) if byte == 0x7B else None
    if mode == OBJECT_FIRST or mode == KEY:
        if byte == 0x22:
            return (STRING, stack, 1)
        return _close(stack) if mode == OBJECT_FIRST and byte == 0x7D else None
    if mode == COLON:
        return (VALUE, stack, 0) if byte == 0x3A else None
    if mode == AFTER:
        top = stack[-1]
        if byte == 0x2C:
            return (KEY, stack, 0) if top == "o" else (VALUE, stack, 0)
        if byte == (0x7D if top == "o" else 0x5D):
            return _close(stack)
        return None
    if mode == ARRAY_FIRST and byte == 0x5D:
        return _close(stack)
    if mode == VALUE or mode == ARRAY_FIRST:
        return _value(stack, byte)
    return None  # DONE: only whitespace


def _string(stack: str, aux: int, byte: int) -> JsonState | None:
    """A byte inside a string: UTF-8, with quotes and control bytes escaped."""
    key, due = aux & 1, (aux >> 1) & 3
    if due:
        lo, hi = _CONTINUATION[aux >> 3]
        return (STRING, stack, key | (due - 1) << 1) if lo <= byte <= hi else None
    if byte < 0x80:
        if byte == 0x22:  # the closing quote
            return (COLON, stack, 0) if key else (AFTER, stack, 0)
        if byte == 0x5C:
            return (ESCAPE, stack, key)
        return None if byte < 0x20 else (STRING, stack, key)
    if 0xC2 <= byte <= 0xDF:
        return (STRING, stack, key | 1 << 1)
    if 0xE0 <= byte <= 0xEF:
        first = 1 if byte == 0xE0 else 2 if byte == 0xED else 0
        return (STRING, stack, key | 2 << 1 | first << 3)
    if 0xF0 <= byte <= 0xF4:
        first = 3 if byte == 0xF0 else 4 if byte == 0xF4 else 0
        return (STRING, stack, key | 3 << 1 | first << 3)
    return None  # a continuation byte without a lead, or no UTF-8 lead at all


def _close(stack: str) -> JsonState:
    rest = stack[:-1]
    return (AFTER, rest, 0) if rest else (DONE, "", 0)


def _value(stack: str, byte: int) -> JsonState | None:
    """The first byte of a value."""
    if byte == 0x22:
        return (STRING, stack, 0)
    if byte == 0x7B or byte == 0x5B:
        if len(stack) >= MAX_DEPTH:
            return None
        return (OBJECT_FIRST, stack + "o", 0) if byte == 0x7B else (ARRAY_FIRST, stack + "a", 0)
    if byte == 0x2D:
        return (MINUS, stack, 0)
    if byte in _DIGITS:
        return (ZERO if byte == 0x30 else INT, stack, 0)
    for i, word in enumerate(_LITERALS):
        if byte == word[0]:
            return (LITERAL, stack, i * 8 + 1)
    return None


def _number_or_literal(mode: int, stack: str, aux: int, byte: int) -> JsonState | None:
    if mode == LITERAL:
        word, matched = _LITERALS[aux >> 3], aux & 7
        if byte != word[matched]:
            return None
        return (AFTER, stack, 0) if matched + 1 == len(word) else (LITERAL, stack, aux + 1)
    digit = byte in _DIGITS
    if mode == MINUS:
        return (ZERO if byte == 0x30 else INT, stack, 0) if digit else None
    if mode == DOT:
        return (FRAC, stack, 0) if digit else None
    if mode == EXP_MARK:
        if byte == 0x2B or byte == 0x2D:
            return (EXP_SIGN, stack, 0)
        return (EXP, stack, 0) if digit else None
    if mode == EXP_SIGN:
        return (EXP, stack, 0) if digit else None
    if digit and mode != ZERO:  # INT, FRAC, EXP go on (no digit after a leading zero)
        return (mode, stack, 0)
    if byte == 0x2E and mode in (ZERO, INT):
        return (DOT, stack, 0)
    if (byte == 0x65 or byte == 0x45) and mode in (ZERO, INT, FRAC):
        return (EXP_MARK, stack, 0)
    if mode in _NUMBER_END:  # the number ended: this byte comes after the value
        return step((AFTER, stack, 0), byte)
    return None


def walk(state: JsonState | None, data: bytes) -> JsonState | None:
    """The state after every byte of ``data`` (None once any is refused)."""
    for byte in data:
        if state is None:
            return None
        state = step(state, byte)
    return state


def complete(state: JsonState | None) -> bool:
    """Whether the bytes so far are one whole JSON object (whitespace after it allowed)."""
    return state is not None and state[0] == DONE


class JsonIndex:
    """A vocabulary for JSON mode: ``token_bytes[id]`` (None: a token never allowed, e.g. a
    special one) and the model's ``vocab_size`` (ids past the tokenizer's are never allowed).
    Used by one scheduler thread; masks are CPU bool tensors shared between requests
    (read-only)."""

    def __init__(self, token_bytes: Sequence[bytes | None], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.token_bytes = list(token_bytes)[:vocab_size]
        # The trie: children[node] maps a byte to a node, ids[node] the tokens ending there.
        self._children: list[dict[int, int]] = [{}]
        self._ids: list[list[int]] = [[]]
        plain = torch.zeros(vocab_size, dtype=torch.bool)
        self._string_special: list[tuple[int, bytes]] = []  # (id, bytes from its first special)
        for token, data in enumerate(self.token_bytes):
            if not data:
                continue
            node = 0
            for byte in data:
                nxt = self._children[node].get(byte)
                if nxt is None:
                    nxt = self._children[node][byte] = len(self._children)
                    self._children.append({})
                    self._ids.append([])
                node = nxt
            self._ids[node].append(token)
            first = next((i for i, b in enumerate(data) if b in _STRING_SPECIAL), -1)
            if first < 0:
                plain[token] = True
            else:
                self._string_special.append((token, data[first:]))
        self._string_plain = plain
        self._cache: OrderedDict[JsonState, torch.Tensor] = OrderedDict()

    def mask(self, state: JsonState | None) -> torch.Tensor:
        """``[vocab_size]`` bool: the tokens whose bytes may follow ``state`` (none after a
        refused state). Cached: do not modify it."""
        if state is None:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        cached = self._cache.get(state)
        if cached is not None:
            self._cache.move_to_end(state)
            return cached
        if state[0] == STRING and state[2] >> 1 == 0:  # (no UTF-8 continuation due)
            out = self._string_mask(state)
        else:
            out = self._trie_mask(state)
        self._cache[state] = out
        if len(self._cache) > CACHE_STATES:
            self._cache.popitem(last=False)
        return out

    def advance(self, state: JsonState | None, token: int) -> JsonState | None:
        """The state after ``token``'s bytes."""
        data = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        return walk(state, data) if data else None

    def _string_mask(self, state: JsonState) -> torch.Tensor:
        """Inside a string (between characters) every token of printable ASCII without a
        quote or backslash keeps the state; the others are walked from their first other
        byte."""
        out = self._string_plain.clone()
        for token, rest in self._string_special:
            if walk(state, rest) is not None:
                out[token] = True
        return out

    def _trie_mask(self, state: JsonState) -> torch.Tensor:
        """Walk the trie from ``state``, pruning at the first byte refused."""
        allowed: list[int] = []
        children, ids = self._children, self._ids
        todo = [(0, state)]
        while todo:
            node, at = todo.pop()
            for byte, child in children[node].items():
                nxt = step(at, byte)
                if nxt is None:
                    continue
                allowed.extend(ids[child])
                if children[child]:
                    todo.append((child, nxt))
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        if allowed:
            out[allowed] = True
        return out


class JsonConstraint:
    """One request's JSON mode: the tokens allowed now, and the state after each token.

    ``ends``: the token ids that end the request (EOS, stop tokens): allowed once the object is
    complete, and only they then (whitespace aside); also the way out when a token left the
    grammar (which the masks prevent) or the vocabulary cannot go on."""

    def __init__(self, index: JsonIndex, ends: Iterable[int]) -> None:
        self.index = index
        self.ends = sorted({i for i in ends if 0 <= i < index.vocab_size})
        if not self.ends:
            raise ValueError(
                "response_format 'json_object' needs an end-of-sequence or stop token in the "
                "vocabulary (the model declares none)"
            )
        self._ends_mask = torch.zeros(index.vocab_size, dtype=torch.bool)
        self._ends_mask[self.ends] = True
        self.state: JsonState | None = START

    def allowed(self) -> torch.Tensor:
        state = self.state
        grammar = self.index.mask(state)
        if state is not None and state[0] == DONE:
            return grammar | self._ends_mask
        if not bool(grammar.any()):  # off the grammar, or a vocabulary that cannot go on
            logger.warning("JSON mode: no token continues state %r; only the end now", state)
            return self._ends_mask
        return grammar

    def advance(self, token: int) -> None:
        if token in self.ends:
            return
        before = self.state
        self.state = self.index.advance(before, token)
        if before is not None and self.state is None:
            logger.warning("JSON mode: token %d left the grammar; only the end now", token)

    @property
    def complete(self) -> bool:
        return complete(self.state)
