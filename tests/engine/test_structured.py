"""JSON mode's recognizer against Python's json module, and its token masks against a
brute-force walk of every token."""

from __future__ import annotations

import json
import random

import pytest
import torch

from execrt.engine import json_grammar as J
from execrt.engine import structured as S

OBJ = J.JSON_OBJECT  # JSON mode's grammar: any object


def _parses_to_object(text: bytes) -> bool:
    def refuse(name: str) -> None:
        raise ValueError(name)

    try:  # strict UTF-8, as the recognizer's strings
        return isinstance(json.loads(text.decode("utf-8"), parse_constant=refuse), dict)
    except ValueError:
        return False


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-(10**6), 10**6)
    if kind == 2:
        return rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-8, 8)
    if kind in (3, 4):
        return "".join(
            rng.choice('ab "\\/\n\t\u00e9\u4e2d\U0001f600x') for _ in range(rng.randrange(6))
        )
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        f"k{i}{rng.random():.3}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))
    }


def _random_object(rng: random.Random) -> bytes:
    obj = {f"key{i}": _random_value(rng) for i in range(rng.randrange(5))}
    indent = rng.choice([None, 2, "\t"])
    separators = rng.choice([None, (",", ":"), (", ", ": ")])
    return json.dumps(
        obj, indent=indent, separators=separators, ensure_ascii=rng.random() < 0.5
    ).encode()


def test_every_prefix_of_a_json_object_is_accepted_and_the_whole_is_complete() -> None:
    rng = random.Random(0)
    for _ in range(300):
        text = _random_object(rng)
        state: J.JsonState | None = OBJ.start
        for i, byte in enumerate(text):
            assert state is not None and not OBJ.complete(state), (text, i)
            state = OBJ.step(state, byte)
        assert OBJ.complete(state), text
        assert OBJ.walk(state, b" ") is None, "nothing follows: the request ends"
        assert OBJ.walk(state, b"x") is None and OBJ.walk(state, b"{}") is None


@pytest.mark.parametrize(
    "text",
    [b"[]", b'"a"', b"1", b"{,}", b'{"a"}', b'{"a":}', b'{"a":01}', b'{"a":1.}', b'{"a":-}',
     b'{"a":tru}', b'{"a":1,}', b'{"a":"\x01"}', b'{"a":"\\q"}', b'{"a":"\\u12G4"}', b"{}x",
     b'{"a":[1,]}', b'{"a":[1}', b'{"a":{]}', b"{'a':1}", b'{"a":+1}', b'{"a":.5}',
     b'{"a":1e}', b'{"a":NaN}', b'{"a" 1}', b'{1:2}', b'{"a":1 "b":2}'],
)  # fmt: skip
def test_what_json_refuses_is_refused(text: bytes) -> None:
    assert not _parses_to_object(text)
    assert not OBJ.complete(OBJ.walk(OBJ.start, text))


def test_fuzzed_texts_agree_with_the_json_module() -> None:
    """Random ASCII texts from JSON's alphabet: complete exactly when json.loads gives a dict
    (whitespace runs and depth below the recognizer's limits)."""
    rng = random.Random(1)
    alphabet = b'{}[]:,"\\ 0123456789-+.eEtrufalsn\nxu'
    agree = complete = 0
    for _ in range(20000):
        text = bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 14)))
        ours = OBJ.complete(OBJ.walk(OBJ.start, text))
        assert ours == _parses_to_object(text), text
        agree += 1
        complete += ours
    for text in (_random_object(rng) for _ in range(200)):  # and valid ones, mutated
        for _ in range(3):
            i = rng.randrange(len(text))
            mutated = text[:i] + bytes([rng.choice(alphabet)]) + text[i + 1 :]
            assert OBJ.complete(OBJ.walk(OBJ.start, mutated)) == _parses_to_object(mutated), mutated
    assert complete > 0 and agree == 20000


@pytest.mark.parametrize(
    ("text", "valid"),
    [("é", True), ("中", True), ("😀", True), ("\U0010ffff", True)]
    + [(bad, False) for bad in (b"\x80", b"\xc0\xaf", b"\xc3", b"\xe0\x80\x80",
                                b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80",
                                b"\xe4\xb8", b"\xff")],
)  # fmt: skip
def test_strings_are_utf8(text: str | bytes, valid: bool) -> None:
    data = text.encode() if isinstance(text, str) else text
    state = OBJ.walk(OBJ.start, b'{"a":"' + data + b'"}')
    assert OBJ.complete(state) is valid
    assert _parses_to_object(b'{"a":"' + data + b'"}') is valid


def test_whitespace_runs_and_depth_are_bounded() -> None:
    state = OBJ.walk(OBJ.start, b"{" + b" " * J.MAX_WHITESPACE)
    assert state is not None and OBJ.step(state, 0x20) is None and OBJ.step(state, 0x7D) is not None
    deep = OBJ.walk(OBJ.start, b'{"a":' + b"[" * (J.MAX_DEPTH - 1))
    assert deep is not None and OBJ.step(deep, 0x5B) is None and OBJ.step(deep, 0x5D) is not None


# -- masks -------------------------------------------------------------------------------------
VOCAB = [
    b"{", b"}", b"[", b"]", b":", b",", b'"', b" ", b"\n", b"  ", b"\n  ", b'{"', b'":', b'",',
    b'"}', b'"]', b"},", b"}]", b"]}", b"true", b"false", b"null", b"tr", b"ue", b"0", b"1",
    b"12", b"-", b".", b"5e", b"+3", b"e", b"E", b"abc", b"a b", b"\\", b'\\"', b"\\n", b"\\u",
    b"00e9", b"\xc3\xa9", b"\xe4", b"\xb8\xad", b'": "', b'", "', b'"a":', b"x}", b'1"', b"\t",
    b"\x01", None, b"",
]  # fmt: skip
EOS = len(VOCAB)


def _index(vocab_size: int = EOS + 3) -> S.JsonIndex:
    return S.JsonIndex(VOCAB + [None], vocab_size)


def _brute_force(state: J.JsonState, vocab_size: int) -> torch.Tensor:
    out = torch.zeros(vocab_size, dtype=torch.bool)
    for token, data in enumerate(VOCAB):
        out[token] = bool(data) and OBJ.walk(state, data) is not None
    out[EOS] = OBJ.complete(state)
    if not out.any():  # the toy vocabulary cannot go on: the constraint ends the request
        out[EOS] = True
    return out


def test_masks_equal_a_walk_of_every_token_in_every_state_reached() -> None:
    index, rng = _index(), random.Random(2)
    states = {OBJ.start}
    for _ in range(60):
        text = _random_object(rng)
        state = OBJ.start
        for byte in text:
            state = OBJ.step(state, byte)  # type: ignore[arg-type]
            states.add(state)  # type: ignore[arg-type]
    for state in states:
        want = _brute_force(state, index.vocab_size)
        c = S.JsonConstraint(index, [EOS])
        c.state = state
        assert torch.equal(c.allowed(), want), state
        assert torch.equal(c.allowed(), want), "the cached mask"
    assert not index.mask(OBJ.start)[EOS:].any(), "ids past the tokenizer's never"


def test_sampling_from_the_masks_gives_json_objects() -> None:
    index = _index()
    done = 0
    for seed in range(200):
        rng = random.Random(seed)
        c = S.JsonConstraint(index, [EOS])
        out = b""
        for _ in range(80):
            allowed = c.allowed().nonzero().flatten().tolist()
            assert allowed, c.state
            token = EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)
            if token == EOS:
                break
            out += VOCAB[token]  # type: ignore[operator]
            c.advance(token)
        else:
            continue
        assert c.complete and _parses_to_object(out), out
        done += 1
    assert done > 20


def test_a_token_off_the_grammar_leaves_only_eos() -> None:
    index = _index()
    c = S.JsonConstraint(index, [EOS, 10_000])  # an id past the vocabulary is no end
    c.advance(VOCAB.index(b"}"))  # not allowed first
    assert c.state is None and c.allowed().nonzero().flatten().tolist() == [EOS]
    with pytest.raises(ValueError, match="end-of-sequence or stop token"):
        S.JsonConstraint(index, [10_000])


def test_a_reasoning_answer_thinks_freely_then_writes_the_object() -> None:
    index = _index(EOS + 3)
    think, done = EOS + 1, EOS + 2  # <think>, </think>
    brace, close = VOCAB.index(b"{"), VOCAB.index(b"}")
    qwen = S.JsonConstraint(index, [EOS], reasoning=S.Reasoning(think, done))
    first = qwen.allowed()
    assert first[think] and first[brace] and not first[close] and not first[done]
    qwen.advance(think)
    assert qwen.allowed().all(), "inside the reasoning any token"
    for token in (close, VOCAB.index(b"abc"), think):
        qwen.advance(token)
    assert qwen.phase == "thinking" and qwen.state == OBJ.start
    qwen.advance(done)
    assert qwen.phase == "object" and not qwen.allowed()[close] and qwen.allowed()[brace]
    for token in (brace, close):
        qwen.advance(token)
    assert qwen.complete and qwen.allowed().nonzero().flatten().tolist() == [EOS]
    plain = S.JsonConstraint(index, [EOS], reasoning=S.Reasoning(think, done))
    plain.advance(brace)  # no reasoning: the object from the first token
    assert plain.phase == "object" and not plain.allowed()[think]
    r1 = S.JsonConstraint(index, [EOS], reasoning=S.Reasoning(think, done, inside_first=True))
    assert r1.allowed().all()
    r1.advance(VOCAB.index(b"x}"))
    r1.advance(done)
    assert r1.phase == "object" and r1.state == OBJ.start


def test_token_bytes_reads_byte_level_and_sentencepiece_spellings() -> None:
    """What JSON mode walks: each token's bytes as the text holds them, special tokens none."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from execrt.models.tokenizer import token_bytes

    byte_level = Tokenizer(
        models.BPE({"\u0120hello": 0, "\u010a": 1, "{": 2, "\u00c3\u00a9": 3}, [])
    )
    byte_level.decoder = decoders.ByteLevel()
    byte_level.add_special_tokens([AddedToken("<|end|>", special=True)])
    byte_level.add_tokens([AddedToken("<tool_call>", special=False)])
    assert token_bytes(byte_level) == [b" hello", b"\n", b"{", "é".encode(), None, b"<tool_call>"]
    piece = Tokenizer(models.BPE({"\u2581hello": 0, "<0x0A>": 1, "<0xC3>": 2, "\u00e9": 3}, []))
    piece.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    assert token_bytes(piece) == [b" hello", b"\n", b"\xc3", "é".encode()]


def test_a_fault_of_the_grammar_ends_only_its_request(monkeypatch, caplog) -> None:
    index = _index()
    c = S.JsonConstraint(index, [EOS])

    def broken(*args: object) -> None:
        raise KeyError("bug")

    monkeypatch.setattr(J.Grammar, "step", broken)
    c.advance(VOCAB.index(b"{"))
    assert c.state is None and "the grammar failed on token" in caplog.text
    assert c.allowed().nonzero().flatten().tolist() == [EOS]
    other = S.JsonConstraint(S.JsonIndex(VOCAB + [None], EOS + 3), [EOS])  # nothing cached
    assert other.allowed().nonzero().flatten().tolist() == [EOS]
    assert "the grammar failed in state" in caplog.text
