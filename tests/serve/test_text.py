"""ChoiceText: stop strings on detokenized text (held back, cut, never shown) and UTF-8 pieces
never split, over random token chunkings, with the built-in byte-level tokenizer; the
completions shape of log-probabilities."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from execrt.engine.client import TokenLogprobs
from execrt.engine.codec import _Detokenizer
from execrt.models.builtin import build_tokenizer
from execrt.serve.text import ChoiceText, completion_logprobs, echo_logprobs

TOKENIZER = build_tokenizer()
ALPHABET = "abé✓日🎉 \n"


def run(
    text: str, stops: tuple[str, ...], cuts: list[int], min_tokens: int = 0
) -> tuple[list[str], ChoiceText]:
    ids = TOKENIZER.encode(text).ids
    choice = ChoiceText(_Detokenizer(TOKENIZER), stops, min_tokens)
    pieces, start = [], 0
    for cut in sorted({min(c, len(ids)) for c in cuts} | {len(ids)}):
        piece, _ = choice.feed(ids[start:cut])
        pieces.append(piece)
        start = cut
    pieces.append(choice.finish()[0])
    return pieces, choice


def first_stop(text: str, stops: list[str], min_tokens: int) -> tuple[int, int] | None:
    """(end, start) of the first stop to complete as the text arrives (the earlier start on a
    tie) among those completed by the ``min_tokens``-th token or a later one (one token per
    byte here): a stop may begin in the text of earlier tokens."""
    found = []
    for stop in stops:
        start = text.find(stop)
        while start >= 0 and len(text[: start + len(stop)].encode()) < min_tokens:
            start = text.find(stop, start + 1)
        if start >= 0:
            found.append((start + len(stop), start))
    return min(found, default=None)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(ALPHABET, min_size=1, max_size=24),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 80), max_size=8),
    min_tokens=st.sampled_from([0, 0, 1, 2, 3, 5, 9]),
)
def test_output_is_the_text_up_to_the_first_stop(text, stops, cuts, min_tokens) -> None:
    pieces, choice = run(text, tuple(stops), cuts, min_tokens)
    match = first_stop(text, stops, min_tokens)
    expected = text[: match[1]] if match else text
    assert "".join(pieces) == expected == choice.text
    assert choice.stopped == bool(match)
    if not min_tokens:
        assert not any(s in choice.text for s in stops)
    assert not any("\ufffd" in p for p in pieces)  # a character is never split
    # Tokens are counted up to the one that completed the match (one per byte here).
    assert choice.tokens == len(text[: match[0]].encode() if match else text.encode())


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(ALPHABET, min_size=1, max_size=24),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 80), max_size=8),
)
def test_logprobs_are_those_of_the_tokens_the_text_begins_with_their_offsets(
    text, stops, cuts
) -> None:
    """A token's log-probability goes out with the first of its text, at its offset; the
    tokens a stop string cut off have none (one token per byte: a character's later bytes
    add no text and share its offset)."""
    ids = TOKENIZER.encode(text).ids
    logprobs = [TokenLogprobs(t, -float(i)) for i, t in enumerate(ids)]
    choice = ChoiceText(_Detokenizer(TOKENIZER), tuple(stops))
    sent, start, released = "", 0, []
    for cut in sorted({min(c, len(ids)) for c in cuts} | {len(ids)}):
        piece, lps = choice.feed(ids[start:cut], logprobs[start:cut])
        sent, start, released = sent + piece, cut, released + lps
        assert len(choice.offsets) == len(choice.logprobs) == len(released)
        assert all(offset < len(sent) for offset in choice.offsets)  # their text is out
    piece, lps = choice.finish()
    sent, released = sent + piece, released + lps
    assert released == choice.logprobs
    begins = [len(text.encode()[:i].decode(errors="ignore")) for i in range(len(ids))]
    kept = [i for i in range(len(ids)) if begins[i] < len(sent)]
    if not choice.stopped:
        kept = list(range(len(ids)))
    assert [lp.logprob for lp in released] == [-float(i) for i in kept]
    assert choice.offsets == [begins[i] for i in kept]


def test_a_stop_that_begins_before_the_min_tokens_th_token_and_ends_in_it_stops() -> None:
    """As vLLM: from the ``min_tokens``-th token on, a stop string matches where it ends in
    the new text, wherever it begins (here in the text of the first token)."""
    ids = TOKENIZER.encode("xyz").ids  # one token per letter
    choice = ChoiceText(_Detokenizer(TOKENIZER), ("xy",), min_tokens=2)
    assert [choice.feed([t])[0] for t in ids] == ["", "", ""]
    assert choice.stopped and choice.text == "" and choice.tokens == 2
    # One that ends before the min_tokens-th token is no stop, and is sent once it cannot be.
    choice = ChoiceText(_Detokenizer(TOKENIZER), ("xy",), min_tokens=3)
    assert [choice.feed([t])[0] for t in ids] == ["", "xy", "z"]
    assert not choice.stopped and choice.finish()[0] == "" and choice.text == "xyz"


def test_a_possible_stop_prefix_is_held_back_until_it_cannot_match() -> None:
    ids = TOKENIZER.encode("abcab").ids
    choice = ChoiceText(_Detokenizer(TOKENIZER), ("abd",))
    assert [choice.feed([t])[0] for t in ids] == ["", "", "abc", "", ""]
    assert choice.finish()[0] == "ab" and choice.text == "abcab"


def test_later_tokens_after_a_stop_are_ignored() -> None:
    choice = ChoiceText(_Detokenizer(TOKENIZER), ("c",))
    assert choice.feed(TOKENIZER.encode("abcd").ids)[0] == "ab"
    assert choice.stopped and choice.tokens == 3
    assert choice.feed(TOKENIZER.encode("xyz").ids) == ("", []) and choice.finish()[0] == ""


class _Letters:
    """A codec whose token i spells the i-th lowercase letter."""

    def token_text(self, token_id: int) -> str:
        return chr(ord("a") + token_id)

    def detokenizer(self) -> _Spelled:
        return _Spelled(self)


class _Spelled:
    """Each token's text as it comes (a codec of whole characters)."""

    def __init__(self, codec: _Letters) -> None:
        self.codec = codec

    def push(self, token_ids: list[int]) -> str:
        return "".join(self.codec.token_text(t) for t in token_ids)


def test_completion_top_logprobs_hold_the_chosen_token_too() -> None:
    # OpenAI: "up to logprobs+1 elements"; vLLM lists the chosen token beside the top ones, so
    # a sampled token outside the top stays visible, and logprobs 0 lists it alone.
    chosen_outside = TokenLogprobs(3, -4.0, ((0, -0.1), (1, -2.5)))
    chosen_on_top = TokenLogprobs(0, -0.1, ((0, -0.1), (1, -2.5)))
    listing = completion_logprobs([chosen_outside, chosen_on_top], _Letters(), top=2)
    assert listing["top_logprobs"] == [
        {"a": -0.1, "b": -2.5, "d": -4.0},
        {"a": -0.1, "b": -2.5},
    ]
    alone = completion_logprobs([chosen_outside, chosen_on_top], _Letters(), top=0)
    assert alone["top_logprobs"] == [{"d": -4.0}, {"a": -0.1}]
    echoed = echo_logprobs([2, 3], [chosen_outside], _Letters(), top=1)
    assert echoed["top_logprobs"] == [None, {"a": -0.1, "d": -4.0}]
    assert echoed["tokens"] == ["c", "d"] and echoed["text_offset"] == [0, 1]


class _Bytes(_Letters):
    """Tokens 4-6 are bytes of one character: each spells U+FFFD alone."""

    def token_text(self, token_id: int) -> str:
        return "\ufffd" if token_id >= 4 else super().token_text(token_id)


def test_the_chosen_tokens_top_logprobs_entry_is_its_own_where_texts_collide() -> None:
    # Byte tokens that all read U+FFFD share one key: the last (least likely) overwrote the
    # others, so top_logprobs[i][tokens[i]] differed from token_logprobs[i] (15 of 16 steps).
    sampled = TokenLogprobs(5, -1.2, ((0, -0.5), (4, -0.9), (5, -1.2), (6, -3.0)))
    greedy = TokenLogprobs(4, -0.9, ((4, -0.9), (6, -1.0), (0, -2.0)))
    listing = completion_logprobs([sampled, greedy], _Bytes(), top=4)
    assert listing["top_logprobs"] == [{"a": -0.5, "\ufffd": -1.2}, {"\ufffd": -0.9, "a": -2.0}]
    columns = (listing[k] for k in ("tokens", "token_logprobs", "top_logprobs"))
    for token, value, tops in zip(*columns, strict=True):
        assert tops[token] == value


def test_echoed_prompt_offsets_begin_where_each_tokens_character_does() -> None:
    # The prompt's offsets counted each byte token's U+FFFD as a character: "é👋x" gave
    # [0, 1, 2, 3, 4, 5, 6] for its 7 byte tokens, x at 6 although it sits at 2.
    from execrt.engine.codec import TokenizerCodec

    codec = TokenizerCodec(TOKENIZER, None)
    text = "é👋x"
    ids = codec.encode(text, add_special_tokens=False)
    scored = [TokenLogprobs(t, -1.0, ((t, -1.0),)) for t in ids[1:]]
    offsets = echo_logprobs(ids, scored, codec, top=1)["text_offset"]
    assert offsets == [0, 0, 1, 1, 1, 1, 2]  # é is 2 bytes, 👋 4, x 1
    assert codec.decode(ids) == text


def test_chat_logprob_bytes_join_into_the_text_where_characters_span_tokens() -> None:
    # OpenAI: "bytes ... useful where characters are represented by multiple tokens and their
    # byte representations must be combined". Each piece of an emoji decodes to U+FFFD alone.
    from execrt.engine.codec import TokenizerCodec
    from execrt.serve.text import chat_logprobs

    codec = TokenizerCodec(TOKENIZER, None)
    text = "a😀東 b"
    ids = codec.encode(text, add_special_tokens=False)
    listing = chat_logprobs([TokenLogprobs(t, -1.0, ((t, -1.0),)) for t in ids], codec, 1)
    entries = listing["content"]
    assert "\ufffd" in [e["token"] for e in entries]  # what the text alone spells
    assert bytes(b for e in entries for b in e["bytes"]).decode() == text
    tops = [t for e in entries for t in e["top_logprobs"]]
    assert bytes(b for t in tops for b in t["bytes"]).decode() == text
    assert pickle.loads(pickle.dumps(codec)).token_bytes(ids[1]) == "😀".encode()[:1]
