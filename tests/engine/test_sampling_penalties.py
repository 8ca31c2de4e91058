"""Repetition, frequency and presence penalties, min_p and min_tokens through the engine,
against a transformers loop on the same checkpoint that applies them by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from execrt import Engine, SamplingParams
from execrt.core.sampler import Sampler, SamplingBatchInfo
from tests.checkpoints import build_hf_model
from tests.engine.test_engine import graph_and_eager_tokens

pytest.importorskip("transformers")

NAME = "dense-tied-hd64"
PROMPTS = [[5, 17, 33, 2, 90, 44, 12, 7, 7, 7, 81], [250, 3, 77], [9] * 13 + [100, 101], [4, 4]]
TOKENS = 10


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    return build_hf_model(NAME)


def penalized(logits: torch.Tensor, sp: SamplingParams, prompt: list[int], out: list[int]):  # type: ignore[no-untyped-def]
    """One row's logits after the penalties, written out token by token (fp64)."""
    got = logits.double().clone()
    for token in set(prompt) | set(out):
        value = float(got[token])
        rp = sp.repetition_penalty
        got[token] = value / rp if value > 0 else value * rp
    for token in set(out):
        got[token] -= sp.frequency_penalty * out.count(token) + sp.presence_penalty
    return got


def oracle(hf, prompt: list[int], sp: SamplingParams) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' next-token logits, penalised by hand; greedy, or the sampler's draw from
    the hand-penalised (and ``min_p``-filtered) logits for a sampled row."""
    out: list[int] = []
    for step in range(sp.max_new_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        row = penalized(logits, sp, prompt, out)
        if sp.greedy:
            out.append(int(row.argmax()))
            continue
        probs = torch.softmax(row / sp.temperature, dim=-1)
        row[probs < sp.min_p * probs.max()] = -math.inf
        info = SamplingBatchInfo(
            temperatures=torch.tensor([float(sp.temperature)]),
            top_ks=torch.tensor([sp.top_k]),
            top_ps=torch.tensor([float(sp.top_p)]),
            seeds=torch.tensor([sp.seed]),
            steps=torch.tensor([step]),
            all_greedy=False,
        )
        out.append(int(Sampler.sample_torch(row.float()[None], info)[0]))
    return out


PARAMS = [
    SamplingParams(max_new_tokens=TOKENS, temperature=0, ignore_eos=True, repetition_penalty=1.6),
    SamplingParams(
        max_new_tokens=TOKENS,
        temperature=0,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.8,
    ),
    SamplingParams(
        max_new_tokens=TOKENS,
        temperature=0.9,
        seed=5,
        ignore_eos=True,
        repetition_penalty=0.7,  # < 1 favours what was seen
        frequency_penalty=-0.5,
        min_p=0.2,
    ),
    SamplingParams(max_new_tokens=TOKENS, temperature=0, ignore_eos=True),  # none
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_penalties_and_min_p_match_a_transformers_loop(checkpoint, hf, overlap) -> None:  # type: ignore[no-untyped-def]
    """Every request of one batch gets its own penalties over its own tokens, the token in
    flight under overlap scheduling included."""
    with Engine(checkpoint(NAME), device="cpu", overlap_schedule=overlap) as engine:
        built = []
        schedule = engine.scheduler._schedule_overlapped

        def overlapped():  # type: ignore[no-untyped-def]
            batch = schedule()
            built.append(batch is not None and batch.sampling_info.penalties is not None)
            return batch

        engine.scheduler._schedule_overlapped = overlapped  # type: ignore[method-assign]
        results = engine.generate(PROMPTS, PARAMS)
        # Penalised decodes were built while the step before them ran (the token in flight
        # counted on the device), not after waiting for it.
        assert any(built) == overlap
        memory = engine.worker.memory
        assert memory.available_slots == memory.total_slots
    for prompt, sp, result in zip(PROMPTS, PARAMS, results, strict=True):
        assert result.token_ids == oracle(hf, prompt, sp), sp
    plain = results[3].token_ids
    # The penalties changed something (the oracle could otherwise match by accident).
    assert len(set(results[0].token_ids)) > len(set(plain)) or results[0].token_ids != plain


def test_the_oracle_sees_the_penalties(hf) -> None:  # type: ignore[no-untyped-def]
    """The checkpoint's greedy run repeats tokens, so the repetition penalty has work."""
    plain = oracle(hf, PROMPTS[2], PARAMS[3])
    assert len(set(plain)) < len(plain)
    assert oracle(hf, PROMPTS[2], PARAMS[0]) != plain


def test_min_tokens_holds_back_stop_tokens_and_eos(checkpoint) -> None:  # type: ignore[no-untyped-def]
    runs = {}
    for overlap in (True, False):
        with Engine(checkpoint(NAME), device="cpu", overlap_schedule=overlap) as engine:
            greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
            free = engine.generate(PROMPTS[0], greedy).token_ids
            # Every token the free run samples stops the request: without min_tokens it ends
            # after one token; with it, not before the fifth.
            stops = tuple(free)
            short = engine.generate(
                PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=stops)
            )
            assert short.token_ids == free[:1] and short.finish_reason == "stop"
            held = [
                engine.generate(
                    PROMPTS[0],
                    SamplingParams(
                        max_new_tokens=12, temperature=0, stop_token_ids=stops, min_tokens=n
                    ),
                )
                for n in (3, 5)
            ]
            for n, result in zip((3, 5), held, strict=True):
                assert len(result.token_ids) > n and not set(result.token_ids[:n]) & set(stops)
                # Past min_tokens a stop token ends it again (the bans end with the n-th token).
                assert result.finish_reason == "stop" and result.token_ids[-1] in stops
            # min_tokens == max_new_tokens: the whole budget, whatever it samples.
            full = engine.generate(
                PROMPTS[1], SamplingParams(max_new_tokens=6, temperature=0.8, seed=2, min_tokens=6)
            )
            assert len(full.token_ids) == 6 and full.finish_reason == "length"
            runs[overlap] = [r.token_ids for r in (*held, full)]
    assert runs[True] == runs[False]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"repetition_penalty": 0}, "repetition_penalty 0 must be a finite number > 0"),
        ({"repetition_penalty": math.inf}, "repetition_penalty inf"),
        ({"frequency_penalty": 2.5}, "frequency_penalty 2.5 must be in [-2, 2]"),
        ({"presence_penalty": math.nan}, "presence_penalty nan must be in [-2, 2]"),
        ({"min_p": 1.5}, "min_p 1.5 must be in [0, 1]"),
        ({"min_tokens": 20, "max_new_tokens": 8}, "min_tokens 20 must be in 0..max_new_tokens (8)"),
        ({"min_tokens": -1}, "min_tokens -1 must be in 0..max_new_tokens"),
        ({"min_tokens": 2.0}, "min_tokens 2.0 has type float (accepted: int)"),
        ({"frequency_penalty": True}, "frequency_penalty True has type bool"),
    ],
)
def test_a_bad_value_is_refused_by_name_and_the_engine_keeps_serving(kwargs, needle) -> None:  # type: ignore[no-untyped-def]
    with Engine("builtin", device="cpu") as engine:
        bad = engine.generate([5, 6], SamplingParams(**kwargs))
        assert bad.finish_reason == "error" and needle in (bad.error or ""), bad.error
        ok = engine.generate([5, 6], SamplingParams(max_new_tokens=2, temperature=0))
        assert len(ok.token_ids) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_penalised_batches_are_drawn_after_the_graph_replay() -> None:
    """Decode graphs sample inside the replay from the parameter tensors alone; a batch with
    penalties, min_p or min_tokens must be drawn again from its adjusted logits: the same
    tokens with graphs as without."""
    params = [
        SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(
            max_new_tokens=8, temperature=0.9, seed=3, ignore_eos=True, presence_penalty=1.0
        ),
        SamplingParams(max_new_tokens=8, temperature=0.9, seed=4, min_p=0.3, min_tokens=8),
    ]
    tokens = graph_and_eager_tokens([[5, 6, 7], [8, 9], [10, 11, 12, 13]], params)
    assert len(tokens[2]) == 8  # min_tokens: the whole budget


def test_stop_ids_outside_the_vocabulary_are_no_trouble_for_min_tokens() -> None:
    """Stop ids past the vocabulary are accepted (never sampled: a tokenizer's added tokens
    may lie there); the min_tokens bans skip them instead of indexing the logits with them. A
    negative id names no token and is refused."""
    with Engine("builtin", device="cpu") as engine:
        vocab = engine.model_config.vocab_size
        sp = SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=(vocab + 5,))
        out = engine.generate([5, 6, 7], replace(sp, min_tokens=3))
        assert out.finish_reason == "length" and len(out.token_ids) == 4
        bad = engine.generate([5, 6, 7], replace(sp, stop_token_ids=(vocab + 5, -3)))
        assert bad.finish_reason == "error"
        assert "stop_token_ids token id -3 unsupported (token ids >= 0)" in (bad.error or "")
