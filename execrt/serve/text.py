"""One choice's text as its tokens arrive: detokenized without splitting a character, held back
while it could begin a stop string, cut where one matches; and log-probabilities in the two
OpenAI shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from execrt.engine.client import Detokenizer, TextCodec, TokenLogprobs


class ChoiceText:
    """Text of one choice. ``feed`` returns what may be sent now; ``stopped`` turns True when
    a stop string matched (the text ends before it; later tokens are ignored). ``tokens``
    counts the tokens fed up to the stop. ``logprobs`` holds the log-probabilities of the
    tokens whose text is sent (``offsets``: where each token's text begins in it): a token's
    goes out with the first of its text, and those of tokens a stop string cut off never do.
    ``min_tokens``: a stop string matches only where it ends in the text of the
    ``min_tokens``-th token or a later one; it may begin earlier (as vLLM looks for stop
    strings once the output has that many tokens, in a window reaching back a stop's length
    into the text before). The text of the earlier tokens is held back as any text is while it
    could begin a stop string."""

    def __init__(
        self, detokenizer: Detokenizer, stops: tuple[str, ...] = (), min_tokens: int = 0
    ) -> None:
        self._detok = detokenizer
        self._stops = stops
        self._free = max(0, min_tokens - 1)  # tokens in whose text no stop may end
        self._held = ""  # text that may begin a stop string: not sent yet
        self._sent: list[str] = []  # every piece sent (joined on demand: appending stays O(1))
        self._sent_len = 0
        self._fed_len = 0  # the text of every token fed: sent, held, cut
        self._pending: list[tuple[int, TokenLogprobs]] = []  # (offset, lp) of text not sent
        self.tokens = 0
        self.stopped = False
        self.logprobs: list[TokenLogprobs] = []
        self.offsets: list[int] = []

    def feed(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None = None
    ) -> tuple[str, list[TokenLogprobs]]:
        """The new text to send and the log-probabilities of the tokens it begins."""
        if self.stopped:
            return "", []
        if not self._stops and logprobs is None:  # nothing to hold back: the delta at once
            self.tokens += len(token_ids)
            return self._send(self._detok.push(token_ids)), []
        out: list[str] = []
        fed = 0
        for i, token in enumerate(token_ids):  # one at a time: the stop's token ends the count
            fed += 1
            piece = self._detok.push([token])
            if logprobs is not None and i < len(logprobs):
                self._pending.append((self._fed_len, logprobs[i]))
            self._fed_len += len(piece)
            out.append(self._scan(piece, match=self.tokens + fed > self._free))
            if self.stopped:
                break
        self.tokens += fed
        return "".join(out), self._release(every=False)

    def finish(self) -> tuple[str, list[TokenLogprobs]]:
        """The text still held back, once the request ended on its own, and the
        log-probabilities of the tokens it begins."""
        if self.stopped:
            return "", []
        rest = self._scan(self._detok.flush())
        held, self._held = self._held, ""
        return rest + self._send(held), self._release(every=True)

    def _release(self, every: bool) -> list[TokenLogprobs]:
        """The pending log-probabilities of tokens whose text began in what was sent (``every``:
        all of them); after a stop string, the others are dropped."""
        n = 0
        while n < len(self._pending) and (every or self._pending[n][0] < self._sent_len):
            n += 1
        out, self._pending = self._pending[:n], [] if self.stopped else self._pending[n:]
        self.offsets += [offset for offset, _ in out]
        released = [lp for _, lp in out]
        self.logprobs += released
        return released

    def _scan(self, piece: str, match: bool = True) -> str:
        """Send what of the held text and ``piece`` cannot begin a stop string; with ``match``,
        first cut at the earliest stop string that ends in ``piece`` (one lying in the held
        text alone was there before this token could stop the output)."""
        if not self._stops or not piece:
            return self._send(piece)
        held = len(self._held)
        buffer = self._held + piece
        found = (buffer.find(s, max(0, held - len(s) + 1)) for s in self._stops) if match else ()
        hits = [i for i in found if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return self._send(buffer[: min(hits)])
        keep = max(tag_overlap(buffer, s) for s in self._stops)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return self._send(buffer[: len(buffer) - keep])

    @property
    def text(self) -> str:
        """Everything sent."""
        return "".join(self._sent)

    def _send(self, text: str) -> str:
        if text:
            self._sent.append(text)
            self._sent_len += len(text)
        return text


def tag_overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop`` (shorter than it): what
    must be held back while it may become ``stop``."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


# -- log-probabilities in the OpenAI shapes -----------------------------------------------------
def completion_logprobs(
    logprobs: Sequence[TokenLogprobs],
    codec: TextCodec,
    top: int,
    offset: int = 0,
    starts: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The legacy completions shape: parallel lists; ``text_offset`` counts from ``offset``,
    by ``starts`` (where each token's text begins in the text, from the detokenizer: a token
    of part of a character spells U+FFFD but adds nothing) or else by the tokens' texts.
    Each ``top_logprobs`` entry holds the ``top`` most likely tokens and the chosen one, so up
    to ``top + 1`` (OpenAI's and vLLM's rule: ``logprobs: 0`` lists the chosen token alone)."""
    tokens = [codec.token_text(lp.token_id) for lp in logprobs]
    if starts is not None:
        offsets = [offset + start for start in starts]
    else:
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
    tops = []
    for token, lp in zip(tokens, logprobs, strict=True):
        # Tokens of one text (bytes of a character each spell U+FFFD) share a key: the most
        # likely keeps it, and the chosen token's is its own log-probability, as
        # token_logprobs says it.
        alternatives: dict[str, float] = {}
        for t, v in lp.top[:top]:
            alternatives.setdefault(codec.token_text(t), v)
        alternatives[token] = lp.logprob
        tops.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echo_logprobs(
    prompt_ids: Sequence[int], scored: Sequence[TokenLogprobs], codec: TextCodec, top: int
) -> dict[str, Any]:
    """An echoed prompt in the completions shape: its first token has no log-probability
    (None, as its alternatives), the others ``scored``'s. Offsets are where each token's
    text begins in the detokenized prompt, as the completion's are: a token of part of a
    character begins where the character does (its own text, U+FFFD, is not in the text)."""
    detokenizer = codec.detokenizer()
    starts, length = [], 0
    for token_id in prompt_ids:
        starts.append(length)
        length += len(detokenizer.push([token_id]))
    first = codec.token_text(prompt_ids[0])
    rest = completion_logprobs(scored, codec, top, starts=starts[1 : 1 + len(scored)])
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def join_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completions-shape listings, one after the other (``then``'s offsets already
    counted past ``first``'s text)."""
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(logprobs: Sequence[TokenLogprobs], codec: TextCodec, top: int) -> dict[str, Any]:
    """The chat shape: one entry per token with its bytes and its top alternatives."""

    def entry(token_id: int, value: float) -> dict[str, Any]:
        # bytes: the token's own (OpenAI: they combine into the text where a character
        # spans tokens, which the token's text, U+FFFD there, cannot)
        text = codec.token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(codec.token_bytes(token_id))}

    return {
        "content": [
            entry(lp.token_id, lp.logprob)
            | {"top_logprobs": [entry(t, v) for t, v in lp.top[:top]]}
            for lp in logprobs
        ],
        "refusal": None,
    }
