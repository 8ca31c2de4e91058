"""KeyboardInterrupt at any point of a step, through a real Engine: nothing leaks (issue 30 C).

After each interrupted ``generate`` every KV slot and request row is free again (or, for
slots, held by the prefix cache and evictable), nothing is queued, and the next call gives
the tokens of a clean run. The interrupt may land in the prefix cache's calls too: inside a
chunk's hand-over to the cache, a finished request's, or an eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from execrt.core.schedule import SamplingParams
from execrt.core.staging import HostToDevice
from execrt.engine import Engine

PARAMS = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=4, temperature=0.9, seed=3)
PROMPTS = [[5, 9, 13, 2, 40], [7, 7, 1], [100, 3, 8, 21, 64, 9, 30]]
# 7..11 KV slots each (prompt + max_new_tokens - 1), 16 in the cache, prefill chunks of 6:
# chunked prefills, retractions (3 per call) and finishes all happen, so an interrupt can
# land in any of them.
CONFIG: dict[str, Any] = dict(
    device="cpu", kv_cache_tokens=16, max_running_requests=3, max_prefill_tokens=6
)


class Flaky:
    """Wraps a callable; its ``at``-th call raises KeyboardInterrupt instead."""

    def __init__(self, fn: Callable[..., Any], at: int) -> None:
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.fn(*args, **kwargs)


class FlakyStager:
    """A HostToDevice whose ``at``-th copy (of ints or of floats) raises KeyboardInterrupt."""

    def __init__(self, stager: HostToDevice, at: int) -> None:
        self.stager, self.device = stager, stager.device
        self.copy = Flaky(lambda copy, values: copy(values), at)

    def __call__(self, values: Any) -> Any:
        return self.copy(self.stager, values)

    def floats(self, values: Any) -> Any:
        return self.copy(self.stager.floats, values)


#: Every call on a step's path an interrupt may hit: (owner, attribute) on the engine.
POINTS: dict[str, Callable[[Engine], tuple[Any, str]]] = {
    "alloc": lambda e: (e.worker.memory.allocator, "alloc"),
    "free": lambda e: (e.worker.memory.allocator, "free"),
    "row_alloc": lambda e: (e.worker.memory.req_to_token_pool, "alloc"),
    "row_free": lambda e: (e.worker.memory.req_to_token_pool, "free"),
    "write_rows": lambda e: (e.worker.memory.req_to_token_pool, "write_tokens"),
    "release": lambda e: (e.worker.memory, "release"),
    "stager": lambda e: (e.worker.memory, "stager"),
    "forward": lambda e: (e.worker.model_runner, "forward"),
    "sample": lambda e: (e.worker.model_runner, "sample"),
    "finish": lambda e: (e.scheduler, "_check_finished"),
    "cache_prefix": lambda e: (e.worker.memory, "cache_prefix"),
    "admit": lambda e: (e.worker.memory, "admit"),
    "insert": lambda e: (e.worker.memory.prefix_cache, "insert"),
    "match": lambda e: (e.worker.memory.prefix_cache, "match"),
    "lock": lambda e: (e.worker.memory.prefix_cache, "lock"),
    "unlock": lambda e: (e.worker.memory.prefix_cache, "unlock"),
    "evict": lambda e: (e.worker.memory.prefix_cache, "evict"),
}


@pytest.fixture(scope="module")
def dense(checkpoint: Callable[[str], str]) -> str:
    return checkpoint("dense-tied-hd64")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(request: pytest.FixtureRequest, dense: str) -> Iterator[Engine]:
    with Engine(dense, overlap_schedule=request.param, **CONFIG) as e:
        yield e


@pytest.fixture(scope="module")
def clean(dense: str) -> list[list[int]]:
    with Engine(dense, **CONFIG) as e:
        return [r.token_ids for r in e.generate(PROMPTS + PROMPTS[:1], _params())]


def _params() -> list[SamplingParams]:
    return [PARAMS] * len(PROMPTS) + [SEEDED]


def assert_clean(engine: Engine) -> None:
    memory = engine.worker.memory
    memory.check()
    assert memory.owned_slots == 0, "slots leaked"
    assert memory.available_slots == memory.total_slots, "slots leaked or a lock left"
    assert memory.available_rows == memory.total_rows, "rows leaked"
    assert not engine.scheduler.has_work and engine.scheduler.finished == []


def interrupted_generate(engine: Engine, point: str, at: int) -> bool:
    """``generate`` with the ``at``-th call of ``point`` interrupted; True if it was."""
    owner, name = POINTS[point](engine)
    original = getattr(owner, name)
    flaky = FlakyStager(original, at) if point == "stager" else Flaky(original, at)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, name, flaky)
        try:
            engine.generate(PROMPTS + PROMPTS[:1], _params())
        except KeyboardInterrupt:
            return True
    return False


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_an_interrupt_while_a_finished_request_is_freed_leaks_nothing(
    dense: str, clean: list[list[int]], overlap: bool
) -> None:
    # Issue 30 C, exactly: the cache is roomy (no retraction), so the first free is that of
    # a finished request, and it raises KeyboardInterrupt. The request was already marked
    # finished, so the abort path skipped it: its slots and row were lost for good.
    with Engine(dense, device="cpu", kv_cache_tokens=64, overlap_schedule=overlap) as engine:
        assert interrupted_generate(engine, "free", 1)
        assert_clean(engine)
        again = engine.generate(PROMPTS + PROMPTS[:1], _params())
        assert [r.token_ids for r in again] == clean
        assert engine.scheduler.stats.retractions == 0
        assert_clean(engine)
        engine.flush_cache()
        assert engine.worker.memory.free_slots == engine.worker.memory.total_slots


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(point=st.sampled_from(sorted(POINTS)), at=st.integers(1, 16))
def test_an_interrupt_anywhere_in_a_step_leaves_nothing_behind(
    engine: Engine, clean: list[list[int]], point: str, at: int
) -> None:
    hit = interrupted_generate(engine, point, at)
    event(f"{point}: {'interrupted' if hit else 'ran through'}")
    assert_clean(engine)
    again = engine.generate(PROMPTS + PROMPTS[:1], _params())
    assert [r.token_ids for r in again] == clean
    assert_clean(engine)
