"""``response_format="json_object"`` through the engine: the built-in model (random weights, a
byte-level tokenizer) writes only prefixes of one JSON object, ends when it is complete, and
its constrained requests leave the others' tokens alone."""

from __future__ import annotations

import json
import os

import pytest
import torch

from execrt.core.schedule import SamplingParams
from execrt.engine import Engine
from execrt.engine import json_grammar as J
from execrt.models.tokenizer import token_bytes

OBJ = J.JSON_OBJECT  # JSON mode's grammar: any object

PROMPTS = [[104, 105], [123, 34, 97], [1, 2, 3, 4, 5], [88] * 9, [32], [200, 201, 202]]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    with Engine(device="cpu", max_running_requests=8) as e:
        assert e.tokenizer is not None
        yield e


def _builtin_bytes() -> list[bytes | None]:
    with Engine(device="cpu") as e:
        return token_bytes(e.tokenizer)


BYTES = _builtin_bytes()  # the built-in vocabulary: 256 one-byte tokens, then special ones
ID = {data: i for i, data in enumerate(BYTES) if data is not None}
# Random weights would write strings for hundreds of tokens: these biases make the model
# close what it opens, so that most objects complete within the budget.
CLOSING = {ID[b'"']: 9.0, ID[b"}"]: 7.0, ID[b"1"]: 4.0}


def _json(tokens: list[int], eos: set[int]) -> tuple[bytes, bool]:
    """The output's bytes and whether it ended with an end token."""
    ended = bool(tokens) and tokens[-1] in eos
    body = tokens[:-1] if ended else tokens
    parts = [BYTES[t] for t in body]
    assert all(p is not None for p in parts), body
    return b"".join(parts), ended  # type: ignore[arg-type]


def _params(seed: int, **kw: object) -> SamplingParams:
    base = dict(
        max_new_tokens=48, temperature=1.0, seed=seed, response_format="json_object",
        logit_bias=CLOSING,
    )  # fmt: skip
    return SamplingParams(**(base | kw))  # type: ignore[arg-type]


def test_every_output_is_a_json_object_prefix_and_the_ended_ones_parse(engine) -> None:  # type: ignore[no-untyped-def]
    eos = set(engine.model_config.eos_token_ids)
    results = engine.generate(PROMPTS * 2, [_params(seed) for seed in range(12)])
    ended = 0
    for r in results:
        assert r.error is None
        text, stopped = _json(r.token_ids, eos)
        state = OBJ.walk(OBJ.start, text)
        assert state is not None, text  # never off the grammar
        if stopped:
            assert r.finish_reason == "stop" and OBJ.complete(state)
            assert isinstance(json.loads(text), dict), text
            ended += 1
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == 48
    assert ended >= 6, "the biases close most objects within 48 tokens"


def test_greedy_and_unbiased_outputs_stay_on_the_grammar(engine) -> None:  # type: ignore[no-untyped-def]
    eos = set(engine.model_config.eos_token_ids)
    params = [_params(0, temperature=0.0), _params(1, logit_bias=()), _params(2, top_k=3)]
    for r in engine.generate(PROMPTS[:3], params):
        text, stopped = _json(r.token_ids, eos)
        assert OBJ.walk(OBJ.start, text) is not None
        assert not stopped or isinstance(json.loads(text), dict)
        assert text.lstrip().startswith(b"{")


def test_constrained_requests_leave_the_others_tokens_alone(engine) -> None:  # type: ignore[no-untyped-def]
    plain = [SamplingParams(max_new_tokens=20, temperature=0.8, seed=s) for s in range(3)]
    alone = engine.generate(PROMPTS[:3], plain)
    mixed = engine.generate(PROMPTS[:3] * 2, plain + [_params(s) for s in range(3)])
    assert [r.token_ids for r in mixed[:3]] == [r.token_ids for r in alone]
    again = engine.generate(PROMPTS[:3], [_params(s) for s in range(3)])
    assert [r.token_ids for r in mixed[3:]] == [r.token_ids for r in again]


def test_overlap_changes_no_constrained_token() -> None:
    params = [_params(s) for s in range(4)]
    tokens = {}
    for overlap in (False, True):
        with Engine(device="cpu", overlap_schedule=overlap) as e:
            tokens[overlap] = [r.token_ids for r in e.generate(PROMPTS[:4], params)]
    assert tokens[True] == tokens[False]


def test_refusals_name_the_reason(engine, checkpoint) -> None:  # type: ignore[no-untyped-def]
    bad = engine.generate(PROMPTS[:2], [_params(0, min_tokens=3), _params(0, response_format="x")])
    assert "min_tokens 3 unsupported with response_format 'json_object'" in (bad[0].error or "")
    supported = "(supported: text, json_object, json_schema)"
    assert f"response_format 'x' unsupported {supported}" in (bad[1].error or "")
    with Engine(checkpoint("dense-tied-hd64"), device="cpu") as e:  # no tokenizer.json
        (r,) = e.generate([PROMPTS[0]], [_params(0)])
    assert r.finish_reason == "error" or r.error, r
    assert "needs the model's tokenizer.json" in (r.error or "")


SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "color": {"enum": ["red", "blue"]},
        "ok": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["n", "color", "ok"],
    "additionalProperties": False,
}


SCHEMA_AY = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
)
NO_SPACE = {ID[w]: -100.0 for w in (b" ", b"\n", b"\t", b"\r")}


@pytest.mark.parametrize("stop", [b'"', b"Q", b"\n"])
def test_stop_tokens_neither_cut_the_object_nor_follow_it(engine, stop: bytes) -> None:  # type: ignore[no-untyped-def]
    """A stop token the grammar takes inside the object (a quote) is not drawn there; after
    the object only a stop token of no text or whitespace ends it (one of other text would
    follow the object in the answer): a "stop" answer parses. A mixed-workload audit had
    ``{"`` and ``{"a":"y"}Q`` end with "stop"."""
    bias = {ID[stop]: 10.0} | (NO_SPACE if stop != b"\n" else {})
    for fmt, schema in (("json_object", ""), ("json_schema", SCHEMA_AY)):
        r = engine.generate(
            [1, 2, 3],
            SamplingParams(
                max_new_tokens=24, temperature=0, response_format=fmt, json_schema=schema,
                stop_token_ids=(ID[stop],), logit_bias=bias,
            ),
        )  # fmt: skip
        assert r.finish_reason in ("stop", "length"), r
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict), r.text
            if stop == b"\n":  # a clean end: it may close the object
                assert r.token_ids[-1] in (ID[stop], *engine.model_config.eos_token_ids)
            else:
                assert ID[stop] not in r.token_ids, r.token_ids


def test_json_schema_answers_follow_the_schema(engine) -> None:  # type: ignore[no-untyped-def]
    from tests.engine.test_json_schema import valid

    eos = set(engine.model_config.eos_token_ids)
    grammar = J.compile_schema(SCHEMA)
    # End numbers and strings soon, and no whitespace: random weights would spend the budget
    bias = {ID[b"}"]: 6.0, ID[b","]: 6.0, ID[b'"']: 6.0, ID[b" "]: -100.0, ID[b"\n"]: -100.0}
    params = [
        _params(seed, response_format="json_schema", json_schema=json.dumps(SCHEMA),
                logit_bias=bias)
        for seed in range(8)
    ]  # fmt: skip
    stopped = 0
    for r in engine.generate(PROMPTS[:4] * 2, params):
        assert r.error is None, r.error
        text, ended = _json(r.token_ids, eos)
        assert grammar.walk(grammar.start, text) is not None, text
        if ended:
            value = json.loads(text)
            assert valid(value, SCHEMA, SCHEMA) and set(value) >= {"n", "color", "ok"}, value
            stopped += 1
    assert stopped >= 4
    (bad,) = engine.generate(
        [PROMPTS[0]], [_params(0, response_format="json_schema", json_schema='{"type": "array"}')]
    )
    assert "response_format json_schema: the root must be an object" in (bad.error or "")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", ["on", "off"])
def test_gpu_json_mode_and_schemas_keep_to_the_grammar(fused: str) -> None:
    """On the GPU (masks cached on the device, a decode graph's batch drawn after its replay,
    the fused draw or torch's): the same checks as on the CPU, for both response formats."""
    grammar = J.compile_schema(SCHEMA)
    bias = {ID[b"}"]: 6.0, ID[b","]: 6.0, ID[b'"']: 6.0, ID[b" "]: -100.0, ID[b"\n"]: -100.0}
    schema = dict(response_format="json_schema", json_schema=json.dumps(SCHEMA), logit_bias=bias)
    params = [_params(s) for s in range(4)] + [_params(s, **schema) for s in range(4)]
    with Engine(device="cuda", fused_kernels=fused) as e:
        eos = set(e.model_config.eos_token_ids)
        results = e.generate(PROMPTS[:4] * 2, params)
        again = e.generate(PROMPTS[:4] * 2, params)  # cached masks, on the device now
    assert [r.token_ids for r in results] == [r.token_ids for r in again]
    for i, r in enumerate(results):
        text, ended = _json(r.token_ids, eos)
        g = J.JSON_OBJECT if i < 4 else grammar
        assert g.walk(g.start, text) is not None, text
        assert not ended or isinstance(json.loads(text), dict)


@pytest.fixture(scope="module")
def thinking_checkpoint(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The built-in model with its two chat markers renamed <think> and </think> (ids 257 and
    258, non-special): a reasoning model's vocabulary."""
    import shutil

    from execrt.models.builtin import builtin_model_path

    path = tmp_path_factory.mktemp("thinking")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(builtin_model_path(), name), path / name)
    spec = json.loads(open(os.path.join(builtin_model_path(), "tokenizer.json")).read())
    for token in spec["added_tokens"]:
        new = {"<|im_start|>": "<think>", "<|im_end|>": "</think>"}.get(token["content"])
        if new is not None:
            token["content"], token["special"] = new, False
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return str(path)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_reasoning_answer_writes_its_object_after_its_reasoning(
    thinking_checkpoint, parser
) -> None:  # type: ignore[no-untyped-def]
    think, done = 257, 258
    bias = {ID[b"}"]: 4.0, ID[b'"']: 4.0, think: 2.0, done: 6.0}  # reason a little, then close
    params = [_params(s, logit_bias=bias, reasoning=parser, max_new_tokens=64) for s in range(6)]
    with Engine(thinking_checkpoint, device="cpu") as e:
        assert e.tokenizer.token_to_id("</think>") == done
        eos = set(e.model_config.eos_token_ids)
        spelled = token_bytes(e.tokenizer)
        results = e.generate(PROMPTS, params)
    objects = reasoned = 0
    for r in results:
        assert r.error is None, r.error
        ids = r.token_ids
        if parser == "qwen3" and (not ids or ids[0] != think):
            answer = ids  # it did not reason: the object from the first token
        elif done in ids:
            answer = ids[ids.index(done) + 1 :]
            reasoned += 1
        else:
            continue  # still reasoning at the limit
        ended = bool(answer) and answer[-1] in eos
        # (</think> is text here, not special: the object's strings may hold it)
        text = b"".join(spelled[t] for t in (answer[:-1] if ended else answer))  # type: ignore[misc]
        assert OBJ.walk(OBJ.start, text) is not None, text
        objects += ended and isinstance(json.loads(text), dict)
    assert objects >= 2 and reasoned >= 1
    with Engine(device="cpu") as plain:  # the built-in vocabulary has no <think>
        refused = plain.validate(PROMPTS[0], _params(0, reasoning="qwen3"))
        (r,) = plain.generate([PROMPTS[0]], [_params(0, reasoning="qwen3")])
    # Refused up front, as every request a model cannot serve (it was queued, then aborted)
    assert refused is not None and "needs <think> and </think> as single tokens" in refused
    assert (r.finish_reason, r.error) == ("error", refused)
