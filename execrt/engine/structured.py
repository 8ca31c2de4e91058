"""JSON mode and structured outputs as token masks: ``JsonIndex`` holds a vocabulary's token
bytes in a trie and answers, for a ``json_grammar.Grammar`` state, which token ids may come
next (a boolean mask over the model's vocabulary, cached per state on the host and, for the
GPU, on the device: a state reached again costs a dictionary lookup). ``JsonConstraint`` is
one request's progress, and adds the tokens that end it once the object is complete. Inside a
free string, where most of an answer's tokens fall, every token of printable ASCII without a
quote or backslash is allowed without a walk; only the others are checked. The grammar, its
JSON Schema subset and its limits: ``execrt/engine/json_grammar.py``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from execrt.engine.json_grammar import DONE, JSON_OBJECT, STRING_SPECIAL, Grammar, JsonState

logger = logging.getLogger(__name__)

#: What a bug in the grammar would raise: it ends the request it concerns, not the others.
_GRAMMAR_FAULTS = (KeyError, IndexError, TypeError, ValueError, AssertionError, RecursionError)

CACHE_STATES = 512  # masks kept per index (a mask is one byte per vocabulary entry)
DEVICE_CACHE_STATES = 256  # of them also kept on the GPU (38 MB at a 151k vocabulary)


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
            first = next((i for i, b in enumerate(data) if b in STRING_SPECIAL), -1)
            if first < 0:
                plain[token] = True
            else:
                self._string_special.append((token, data[first:]))
        self._string_plain = plain
        self._cache: OrderedDict[tuple[Grammar, JsonState], torch.Tensor] = OrderedDict()
        #: Device copies of cached masks: a state seen again moves nothing to the GPU.
        self._on_device: OrderedDict[tuple[Grammar, JsonState, torch.device], torch.Tensor] = (
            OrderedDict()
        )

    def mask(
        self,
        state: JsonState | None,
        grammar: Grammar = JSON_OBJECT,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """``[vocab_size]`` bool: the tokens whose bytes may follow ``state`` of ``grammar``
        (none after a refused state), on ``device`` (None: the host). Cached: do not modify
        it."""
        if device is None or device.type == "cpu" or state is None:
            host = self._host_mask(state, grammar)
            return host if device is None else host.to(device, non_blocking=True)
        key = (grammar, state, device)
        cached = self._on_device.get(key)
        if cached is not None:
            self._on_device.move_to_end(key)
            return cached
        out = self._on_device[key] = self._host_mask(state, grammar).to(device, non_blocking=True)
        if len(self._on_device) > DEVICE_CACHE_STATES:
            self._on_device.popitem(last=False)
        return out

    def _host_mask(self, state: JsonState | None, grammar: Grammar) -> torch.Tensor:
        if state is None:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        key = (grammar, state)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        if grammar.free_string(state):
            out = self._string_mask(state, grammar)
        else:
            out = self._trie_mask(state, grammar)
        self._cache[key] = out
        if len(self._cache) > CACHE_STATES:
            self._cache.popitem(last=False)
        return out

    def advance(
        self, state: JsonState | None, token: int, grammar: Grammar = JSON_OBJECT
    ) -> JsonState | None:
        """The state after ``token``'s bytes."""
        data = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        return grammar.walk(state, data) if data else None

    def _string_mask(self, state: JsonState, grammar: Grammar) -> torch.Tensor:
        """Inside a free string (between characters) every token of printable ASCII without
        a quote or backslash keeps the state; the others are walked from their first other
        byte."""
        out = self._string_plain.clone()
        for token, rest in self._string_special:
            if grammar.walk(state, rest) is not None:
                out[token] = True
        return out

    def _trie_mask(self, state: JsonState, grammar: Grammar) -> torch.Tensor:
        """Walk the trie from ``state``, pruning at the first byte refused."""
        allowed: list[int] = []
        children, ids = self._children, self._ids
        step = grammar.step
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


@dataclass(frozen=True)
class Reasoning:
    """A reasoning model's answer before its object (``--reasoning-parser``): free text from
    the ``open_id`` token (or from the start, ``inside_first``) to the ``close_id`` token."""

    open_id: int
    close_id: int
    inside_first: bool = False  # deepseek_r1: the answer reasons from its first token


class JsonConstraint:
    """One request's JSON mode or schema: the tokens allowed now, and the state after each.

    ``ends``: the token ids that end the request (EOS, stop tokens): never drawn inside the
    object (a stop token the grammar would take there, a quote or a newline, would end it half
    written); once it is complete, those whose text is nothing or JSON whitespace end it (a
    stop token of other text would follow the object in the answer: allowed only where no
    end is clean); also the way out when a token left the grammar (which the masks prevent) or
    the vocabulary cannot go on."""

    def __init__(
        self,
        index: JsonIndex,
        ends: Iterable[int],
        grammar: Grammar = JSON_OBJECT,
        reasoning: Reasoning | None = None,
    ) -> None:
        self.index = index
        self.grammar = grammar
        #: Before the object, the answer's reasoning (free text): "opening" (it may begin
        #: with the opening token), "thinking" (until the closing token), then "object".
        self.reasoning = reasoning
        self.phase = "object"
        if reasoning is not None:
            self.phase = "thinking" if reasoning.inside_first else "opening"
        self.ends = sorted({i for i in ends if 0 <= i < index.vocab_size})
        if not self.ends:
            raise ValueError(
                "response_format needs an end-of-sequence or stop token in the vocabulary to "
                "end the object (the model declares none)"
            )
        self._ends = torch.tensor(self.ends, dtype=torch.int64)
        self._end_mask = torch.zeros(index.vocab_size, dtype=torch.bool)
        self._end_mask[self._ends] = True
        spelt = index.token_bytes
        clean = [i for i in self.ends if i >= len(spelt) or _adds_no_text(spelt[i])]
        self._closing = torch.tensor(clean or self.ends, dtype=torch.int64)
        self.state: JsonState | None = grammar.start

    def allowed(self, device: torch.device | None = None) -> torch.Tensor:
        """``[vocab_size]`` bool on ``device`` (None: the host): the tokens allowed now. A
        fault of the grammar ends this request (its end tokens only), not the batch."""
        try:
            return self._allowed(device)
        except _GRAMMAR_FAULTS:
            logger.exception("JSON mode: the grammar failed in state %r", self.state)
            self.state, self.phase = None, "object"
            return self._allowed(device)

    def _allowed(self, device: torch.device | None) -> torch.Tensor:
        if self.phase == "thinking":
            return torch.ones(self.index.vocab_size, dtype=torch.bool, device=device)
        if self.phase == "opening":
            assert self.reasoning is not None
            out = self.index.mask(self.grammar.start, self.grammar).clone()
            out[self.reasoning.open_id] = True
            return out if device is None else out.to(device, non_blocking=True)
        state = self.state
        host = self.index.mask(state, self.grammar)  # cached: checking it moves nothing
        if state is not None and state[0] != DONE:
            if bool(host[self._ends].any()):  # a stop token the grammar takes: not here
                host = host & ~self._end_mask
                if bool(host.any()):
                    return host if device is None else host.to(device, non_blocking=True)
            elif bool(host.any()):
                return self.index.mask(state, self.grammar, device)
            # off the grammar, or a vocabulary that cannot go on
            logger.warning("JSON mode: no token continues state %r; only the end now", state)
        out = torch.zeros(self.index.vocab_size, dtype=torch.bool)
        if state is not None and state[0] == DONE:
            out |= host
            out[self._closing] = True
        else:
            out[self._ends] = True
        return out if device is None else out.to(device, non_blocking=True)

    def advance(self, token: int) -> None:
        try:
            self._advance(token)
        except _GRAMMAR_FAULTS:
            logger.exception("JSON mode: the grammar failed on token %d", token)
            self.state, self.phase = None, "object"

    def _advance(self, token: int) -> None:
        if self.phase == "opening":  # reasoning opens now, or never (then this token is
            assert self.reasoning is not None  # the object's first)
            self.phase = "thinking" if token == self.reasoning.open_id else "object"
            if self.phase == "thinking":
                return
        elif self.phase == "thinking":
            assert self.reasoning is not None
            if token == self.reasoning.close_id:
                self.phase = "object"
            return
        if token in self.ends:
            return
        before = self.state
        self.state = self.index.advance(before, token, self.grammar)
        if before is not None and self.state is None:
            logger.warning("JSON mode: token %d left the grammar; only the end now", token)

    @property
    def complete(self) -> bool:
        return Grammar.complete(self.state)


def _adds_no_text(data: bytes | None) -> bool:
    """Whether a token ends a JSON answer cleanly: no text (a special token) or whitespace."""
    return not data or not data.strip(b" \t\n\r")
