"""The prefix cache through the engine: the same outputs as without it, cached_tokens across chat
turns, flush_cache and stats, and every slot back after errors, aborts and abandoned streams
(the tests run with the KV ownership map on)."""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch

from execrt.core.schedule import Req, SamplingParams
from execrt.engine import Engine
from execrt.engine.scheduler import SchedulerStats
from tests.engine.test_engine_errors import _fail_on_call

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# Small enough that requests take turns: retraction and eviction both happen.
CONFIG: dict[str, Any] = dict(
    device="cpu", kv_cache_tokens=2048, max_running_requests=16, max_prefill_tokens=256
)
VOCAB = 384  # tests/checkpoints.py


@pytest.fixture(scope="module")
def tiny(checkpoint: Callable[[str], str]) -> str:
    return checkpoint("dense-tiny-ctx1k")


def radix_tree_workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` requests on a random tree of prompts: each extends the root or an earlier prompt
    by 0..256 tokens (or repeats one) and generates 1..256 (mostly few, so that a CPU runs it
    in seconds); greedy and seeded sampling alternate."""
    rng = random.Random(seed)
    nodes = [[rng.randrange(2, VOCAB) for _ in range(64)]]
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    for i in range(n):
        if i and rng.random() < 0.15:  # the same prompt again: the same tokens computed twice
            prompt = list(rng.choice(prompts))
        else:
            grow = rng.randrange(0, 257) if rng.random() < 0.25 else rng.randrange(0, 33)
            prompt = (rng.choice(nodes) + [rng.randrange(2, VOCAB) for _ in range(grow)])[:600]
            nodes.append(prompt)
        prompts.append(prompt)
        new = rng.randrange(1, 257) if rng.random() < 0.1 else rng.randrange(1, 17)
        temp, seed_i = (0.0, None) if i % 2 else (0.8, i)
        params.append(SamplingParams(new, temperature=temp, seed=seed_i, ignore_eos=True))
    return prompts, params


@dataclass
class Run:
    tokens: list[list[int]]
    cached: list[int]  # cached_tokens per request
    stats: SchedulerStats
    evicted: int  # slots the cache evicted for reservations


def assert_nothing_held(engine: Engine) -> None:
    """No request holds a slot, a lock or a row; the cache's slots are all evictable."""
    memory = engine.worker.memory
    memory.check()
    assert memory.owned_slots == 0 and memory.available_rows == memory.total_rows
    assert memory.available_slots == memory.total_slots, "a lock or a slot was left"
    assert not engine.scheduler.has_work


def run(path: str, prompts: list[list[int]], params: list[SamplingParams], **config: Any) -> Run:
    with Engine(path, **(CONFIG | config)) as engine:
        cache = engine.worker.memory.prefix_cache
        evicted = [0]
        if cache is not None:
            evict = cache.evict

            def counting(n: int) -> int:
                freed = evict(n)
                evicted[0] += freed
                return freed

            cache.evict = counting  # type: ignore[method-assign, assignment]
        results = engine.generate(prompts, params)
        assert_nothing_held(engine)
        engine.flush_cache()
        assert engine.worker.memory.free_slots == engine.worker.memory.total_slots
        return Run(
            [r.token_ids for r in results],
            [r.cached_tokens for r in results],
            engine.scheduler.stats,
            evicted[0],
        )


def test_outputs_with_the_cache_are_token_identical_to_outputs_without_it(tiny: str) -> None:
    prompts, params = radix_tree_workload(200)
    off = run(tiny, prompts, params, prefix_cache="none", overlap_schedule=False)
    assert off.stats.retractions > 0, "the workload must press the KV cache"
    assert off.stats.prefix_query_tokens == off.stats.prefix_hit_tokens == 0  # nothing looked up
    for overlap, force_miss in [(False, False), (True, False), (True, True)]:
        on = run(
            tiny, prompts, params, overlap_schedule=overlap, prefix_cache_force_miss=force_miss
        )
        differ = [i for i, (a, b) in enumerate(zip(on.tokens, off.tokens, strict=True)) if a != b]
        assert not differ, f"overlap {overlap}, force_miss {force_miss}: requests {differ[:8]}"
        assert on.stats.retractions > 0 and on.evicted > 0
        if force_miss:
            assert on.stats.prefix_hit_tokens == 0 and not any(on.cached)
        else:  # most of the tree is found cached
            assert on.stats.prefix_hit_tokens > on.stats.prefix_query_tokens // 3
            assert on.stats.extend_steps < off.stats.extend_steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["auto", "triton"])
def test_on_a_gpu_the_cache_changes_few_outputs_and_holds_nothing_after(
    checkpoint: Callable[[str], str], attention: str
) -> None:
    # On the GPU a warm prefix computes the rest on top of cached K/V in another reduction
    # order, so a near-tie greedy or seeded draw may flip (fp32 keeps that rare). Head dim
    # 64: the GPU kernels do not serve the CPU model's 16.
    tiny = checkpoint("dense-tiny-ctx1k-hd64")
    prompts, params = radix_tree_workload(200)
    gpu = dict(device="cuda", dtype="float32", attention_backend=attention)
    off = run(tiny, prompts, params, prefix_cache="none", **gpu)
    for overlap in (False, True):
        on = run(tiny, prompts, params, overlap_schedule=overlap, **gpu)
        same = sum(a == b for a, b in zip(on.tokens, off.tokens, strict=True))
        assert same >= 0.95 * len(prompts), f"overlap {overlap}: {same} of {len(prompts)} agree"
        assert on.stats.prefix_hit_tokens > on.stats.prefix_query_tokens // 3 and on.evicted > 0


def test_each_chat_turn_finds_the_previous_turn_cached(tiny: str) -> None:
    rng = random.Random(1)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    with Engine(tiny, device="cpu") as engine:
        prompt = [rng.randrange(2, VOCAB) for _ in range(80)]
        previous: list[int] = []
        answer: list[int] = []
        for turn in range(5):
            result = engine.generate(prompt, params)
            if turn == 0:
                assert result.cached_tokens == 0
            else:  # the previous prompt and answer but the answer's last token (no K/V)
                assert result.cached_tokens >= len(previous) - 1
                assert result.cached_tokens == len(previous) + len(answer) - 1
            previous, answer = prompt, result.token_ids
            prompt = prompt + answer + [rng.randrange(2, VOCAB) for _ in range(40)]
        assert_nothing_held(engine)


def test_flush_cache_frees_every_slot_no_running_request_reads(tiny: str) -> None:
    prompts, params = radix_tree_workload(12, seed=2)
    with Engine(tiny, device="cpu") as engine:
        engine.generate(prompts, params)
        stats = engine.stats()
        total, cached = stats.kv_slots_total, stats.kv_slots_cached
        assert cached > 0 and stats.kv_slots_free + cached == total and stats.kv_usage == 0
        assert stats.prefix_query_tokens >= stats.prefix_hit_tokens > 0
        assert stats.requests_running == stats.requests_waiting == 0
        # A request mid-generation reads its prefix: flushing leaves that locked path alone.
        reader = engine.scheduler
        long = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
        req = Req(10_000, prompts[0] + [7, 8, 9], long)
        reader.add(req)
        reader.step()  # admitted on prompts[0]'s cached prefix, prefilled the rest
        assert engine.worker.memory.cached_tokens(req) >= len(prompts[0])
        assert engine.stats().requests_running == 1
        flushed = engine.flush_cache()
        assert 0 < flushed < cached and engine.stats().kv_slots_cached == 0
        assert engine.worker.memory.cached_slots >= len(prompts[0])  # the locked path
        assert engine.stats().kv_usage > 0
        reader.abort([req], "done")
        assert engine.flush_cache() > 0 and engine.flush_cache() == 0
        stats = engine.stats()
        assert stats.kv_slots_free == total and stats.kv_slots_cached == 0


def test_prefix_cache_none_builds_no_cache_and_the_report_says_which(tiny: str) -> None:
    with Engine(tiny, device="cpu", prefix_cache="none") as engine:
        assert engine.worker.memory.prefix_cache is None and engine.flush_cache() == 0
        assert "prefix_cache: requested 'none' -> none" in engine.resolution.describe()
        result = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
        assert result.cached_tokens == 0 and engine.stats().kv_slots_cached == 0
    with Engine(tiny, device="cpu") as engine:
        assert "prefix_cache: requested 'radix' -> radix" in engine.resolution.describe()


# -- errors, aborts, abandoned streams ---------------------------------------------------------
@pytest.fixture(scope="module")
def shared_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    return radix_tree_workload(24, seed=3)


@pytest.fixture(scope="module")
def clean_tokens(tiny: str, shared_workload: Any) -> list[list[int]]:
    return run(tiny, *shared_workload, kv_cache_tokens=512).tokens


@pytest.mark.parametrize(
    "where, call", [("forward", 9), ("cache_prefix", 2), ("admit", 5), ("release", 3)]
)
def test_a_step_that_fails_leaves_no_slot_lock_or_row_behind(
    tiny: str, shared_workload: Any, clean_tokens: list[list[int]], where: str, call: int
) -> None:
    with Engine(tiny, **(CONFIG | {"kv_cache_tokens": 512})) as engine:
        owner = engine.worker.model_runner if where == "forward" else engine.worker.memory
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(owner, where, _fail_on_call(call, getattr(owner, where), RuntimeError("x")))
            with pytest.raises(RuntimeError, match="x"):
                engine.generate(*shared_workload)
        assert_nothing_held(engine)
        again = engine.generate(*shared_workload)  # on whatever the failed call cached
        assert [r.token_ids for r in again] == clean_tokens
        assert_nothing_held(engine)


@pytest.fixture(scope="module")
def builtin() -> Iterator[Engine]:
    with Engine("builtin", device="cpu") as engine:
        yield engine


def test_an_abandoned_stream_gives_back_its_slots_and_leaves_its_prefix_cached(
    builtin: Engine,
) -> None:
    long = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    text = "a system prompt that many requests share, long enough to be worth caching"
    first = builtin.generate(text + " and one question", long)
    assert first.cached_tokens == 0
    gen = cast(Generator[str, None, None], builtin.stream(text + " and another", long))
    next(gen)  # admitted on the shared prefix, now decoding
    memory = builtin.worker.memory
    assert memory.cached_slots - memory.evictable_slots > 0  # its prefix is locked
    gen.close()
    assert_nothing_held(builtin)
    again = builtin.generate(text + " and one question", long)
    assert again.token_ids == first.token_ids and again.cached_tokens > len(text) // 2


def test_aborting_requests_that_share_a_prefix_frees_only_what_they_own(tiny: str) -> None:
    prompts, params = radix_tree_workload(16, seed=4)
    with Engine(tiny, device="cpu") as engine:
        engine.generate(prompts[:4], params[:4])  # cache part of the tree
        sched = engine.scheduler
        reqs = [Req(1000 + i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        for r in reqs:
            sched.add(r)
        for _ in range(6):
            sched.step()
        assert any(engine.worker.memory.cached_tokens(r) for r in reqs)
        sched.abort(reqs, "caller gave up")
        assert all(r.finished for r in reqs)
        assert_nothing_held(engine)
        assert engine.worker.memory.cached_slots > 0  # the tree survives the aborts


def test_an_fp8_cache_reuses_its_prefixes_as_stored_token_for_token(tiny: str) -> None:
    """A cached fp8 prefix is read back as the bytes a cold prefill stores and reads (the
    K/V writer quantizes once, attention reads the cache), so cache-on equals cache-off."""
    prompts, params = radix_tree_workload(80, seed=1)
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    off = run(tiny, prompts, params, prefix_cache="none", overlap_schedule=False, **fp8)
    on = run(tiny, prompts, params, **fp8)
    differ = [i for i, (a, b) in enumerate(zip(on.tokens, off.tokens, strict=True)) if a != b]
    assert not differ, f"requests {differ[:8]}"
    assert on.stats.prefix_hit_tokens > on.stats.prefix_query_tokens // 3
