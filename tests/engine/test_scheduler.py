"""Continuous batching under KV pressure, chunked prefill, stop conditions, bad requests."""

from __future__ import annotations

import json
import shutil

import pytest

from execrt.core.schedule import SamplingParams
from execrt.engine import Engine

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[3 + i, 40 + 2 * i, 7, 90 + i, 11, 5 * i + 1, 60, 2 + i] for i in range(12)]


def _run(path, prompts, params=GREEDY, **config):
    with Engine(path, device="cpu", **config) as engine:
        memory = engine.worker.memory
        start = memory.available_slots, memory.available_rows
        results = engine.generate(prompts, params)
        end = memory.available_slots, memory.available_rows
        return results, start, end, engine.scheduler.stats


@pytest.fixture(scope="module")
def dense(checkpoint):
    return checkpoint("dense-tied-hd64")


@pytest.fixture(scope="module")
def reference(dense):
    """Each prompt generated alone, with room to spare."""
    with Engine(dense, device="cpu") as engine:
        return [engine.generate(p, GREEDY).token_ids for p in PROMPTS]


def test_three_times_more_requests_than_fit_all_finish_correctly(dense, reference) -> None:
    # 12 requests x 20 tokens = 240 KV slots wanted; 80 exist, so retraction must happen.
    results, start, end, stats = _run(dense, PROMPTS, kv_cache_tokens=80, max_running_requests=8)
    assert [r.token_ids for r in results] == reference
    assert all(r.finish_reason == "length" and len(r.token_ids) == 12 for r in results)
    assert stats.retractions > 0
    assert end == start  # every slot and row came back


def test_chunked_prefill_matches_a_single_prefill(dense, reference) -> None:
    results, start, end, stats = _run(dense, PROMPTS[:3], max_prefill_tokens=3)
    assert [r.token_ids for r in results] == reference[:3]
    assert stats.extend_steps >= 8  # 24 prompt tokens in chunks of 3
    assert end == start


def test_bad_requests_get_errors_and_the_others_are_served(dense, reference) -> None:
    prompts = [PROMPTS[0], [], [5, 384], [-1, 2], list(range(1, 300)), PROMPTS[1], PROMPTS[2]]
    params = [
        GREEDY,
        GREEDY,
        GREEDY,
        GREEDY,
        GREEDY,
        SamplingParams(max_new_tokens=0),
        SamplingParams(top_p=0.0),
    ]
    results, start, end, _ = _run(dense, prompts, params)
    assert results[0].token_ids == reference[0] and results[0].error is None
    errors = [r.error for r in results[1:]]
    assert "empty prompt" in errors[0]
    assert "token id 384 out of range (vocab size 384)" in errors[1]
    assert "token id -1 out of range" in errors[2]
    assert "leaves no room in the context of 256" in errors[3]
    assert "max_new_tokens 0 must be an integer >= 1" in errors[4]
    assert "top_p 0.0 must be in (0, 1]" in errors[5]
    assert all(r.finish_reason == "error" and r.token_ids == [] for r in results[1:])
    assert end == start


def test_stop_tokens_eos_and_context_limit(dense, reference, tmp_path) -> None:
    first, third = reference[0][0], reference[0][2]
    stop = SamplingParams(
        max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(third,)
    )
    results, *_ = _run(dense, [PROMPTS[0]], stop)
    assert results[0].finish_reason == "stop" and results[0].token_ids[-1] == third
    assert len(results[0].token_ids) == reference[0].index(third) + 1

    eos_model = tmp_path / "eos"
    shutil.copytree(dense, eos_model)
    cfg = json.loads((eos_model / "config.json").read_text())
    cfg["eos_token_id"] = first
    (eos_model / "config.json").write_text(json.dumps(cfg))
    results, *_ = _run(
        str(eos_model), [PROMPTS[0]], SamplingParams(max_new_tokens=12, temperature=0)
    )
    assert results[0].finish_reason == "stop" and results[0].token_ids == [first]
    results, *_ = _run(str(eos_model), [PROMPTS[0]], GREEDY)  # ignore_eos
    assert results[0].token_ids == reference[0]

    results, *_ = _run(dense, [PROMPTS[0]], GREEDY, context_len=12)
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 12 - len(
        PROMPTS[0]
    )


def test_a_request_larger_than_the_whole_cache_is_aborted_not_hung(dense, reference) -> None:
    long_prompt = list(range(1, 41))
    results, start, end, _ = _run(dense, [long_prompt, PROMPTS[0]], kv_cache_tokens=24)
    assert results[0].finish_reason == "abort" and "KV slots" in results[0].error
    assert results[1].token_ids == reference[0]
    assert end == start


def test_requests_that_fit_alone_all_complete_with_their_own_greedy_tokens(dense) -> None:
    # Prompt + max_new_tokens - 1 slots each (19 and 12..29 here); the caches below hold any
    # one of them but not all at once, so they take turns through retraction.
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    twins = [[1] * 8, [2] * 8]
    mixed = [[(7 * i + 3 * j) % 300 + 1 for j in range(n)] for i, n in enumerate((3, 14, 6, 20, 9))]
    with Engine(dense, device="cpu") as engine:
        alone = [engine.generate(p, params).token_ids for p in twins + mixed]
    results, start, end, stats = _run(
        dense, twins, params, kv_cache_tokens=17, max_running_requests=2
    )
    assert [r.finish_reason for r in results] == ["length"] * 2
    assert [r.token_ids for r in results] == alone[:2]
    assert end == start and stats.retractions > 0
    results, start, end, stats = _run(
        dense, mixed, params, kv_cache_tokens=30, max_running_requests=4, max_prefill_tokens=8
    )
    assert [r.finish_reason for r in results] == ["length"] * 5
    assert [r.token_ids for r in results] == alone[2:]
    assert end == start and stats.retractions > 0
