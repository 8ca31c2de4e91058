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


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_partial_prefill_let_go_waits_instead_of_being_prefilled_and_let_go_again(
    dense, overlap
) -> None:
    # Each request needs 60 + 61 - 1 = 120 slots: the cache holds one at a time. The second is
    # admitted in chunks beside the first until the first's decodes need those slots, and is
    # let go; it must then wait for the first to finish, not be prefilled again into the
    # slots the first grows into (and let go again at the next decode, some 20 times here).
    params = SamplingParams(max_new_tokens=61, temperature=0, ignore_eos=True)
    prompts = [[(11 * i + 7 * j) % 300 + 1 for j in range(60)] for i in range(2)]
    with Engine(dense, device="cpu") as engine:
        alone = [engine.generate(p, params).token_ids for p in prompts]
    results, start, end, stats = _run(
        dense, prompts, params, kv_cache_tokens=120, prefix_cache="none", overlap_schedule=overlap
    )
    assert [r.token_ids for r in results] == alone
    assert stats.retractions <= 1 and sum(r.num_retractions for r in results) <= 1
    assert stats.extend_steps <= 3
    assert end == start


def test_overlapped_decodes_sample_at_each_requests_own_step(dense) -> None:
    # The steady state reuses the previous batch's sampling rows with steps + 1 on the device
    # (nothing staged per request); whatever path built a batch, each row's step must be the
    # request's output length so far, tokens in flight included, or seeded draws would shift.
    prompts = [[5, 17, 33, 2, 90], [250, 3, 77], [9] * 11, [4, 4]]
    params = [
        SamplingParams(max_new_tokens=12, temperature=0.7, seed=1, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=7, temperature=1.0, top_k=20, seed=11, ignore_eos=True),
    ]
    with Engine(dense, device="cpu", overlap_schedule=True) as engine:
        worker = engine.worker
        launch = worker.forward_batch_generation
        seen: list[tuple[list[int], list[int], int]] = []

        def checked(batch):  # type: ignore[no-untyped-def]
            info = batch.sampling_info
            if batch.mode.is_decode() and not info.all_greedy:
                want = [len(r.output_ids) + r.num_pending for r in batch.reqs]
                seen.append((info.steps.tolist(), want, info.seeds.data_ptr()))
            return launch(batch)

        worker.forward_batch_generation = checked
        got = engine.generate(prompts, params)
    assert [len(r.token_ids) for r in got] == [12, 5, 9, 7]
    assert seen and all(steps == want for steps, want, _ in seen)
    # The steady state ran: consecutive decodes shared their staged rows (same seeds tensor).
    assert any(a[2] == b[2] for a, b in zip(seen, seen[1:], strict=False))


def test_token_sinks_get_their_requests_tokens_and_are_dropped_when_done(dense) -> None:
    with Engine(dense, device="cpu") as engine:
        got: list[object] = []
        rid = engine.submit([5, 17, 33], GREEDY, on_output=got.append)
        (req,) = list(engine.scheduler.sinks)  # the submitted request has a sink
        assert req.rid == rid
        while engine.has_work:
            engine.step()
        assert engine.scheduler.sinks == {}  # finished: no sink left behind
        ids = [t for out in got for t in out.token_ids]  # type: ignore[attr-defined]
        assert ids == engine.generate([5, 17, 33], GREEDY).token_ids
