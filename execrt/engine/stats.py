"""The engine's load as numbers: KV slots, queues, prefix-cache counters.

Each figure comes through one small accessor, so that where it is read from (``worker.memory``
and, with a prefix cache, the cache) changes in one place.
"""

from __future__ import annotations

from execrt.core.schedule import Req
from execrt.engine.client import EngineStats
from execrt.engine.scheduler import Scheduler


def kv_slot_counts(scheduler: Scheduler) -> tuple[int, int, int]:
    """``(total, free, cached)`` KV slots; cached ones are held by the prefix cache only and no
    running request reads them (evictable: a request could reclaim them)."""
    memory = scheduler.memory
    return memory.total_slots, memory.free_slots, memory.evictable_slots


def prefix_cache_counters(scheduler: Scheduler) -> tuple[int, int]:
    """``(hit tokens, queried tokens)`` of the prefix cache since start: prompt tokens found
    cached at admission, and all prompt tokens admitted (again after a retraction)."""
    return scheduler.stats.prefix_hit_tokens, scheduler.stats.prefix_query_tokens


def cached_prompt_tokens(req: Req) -> int:
    """Prompt tokens of ``req`` served from the prefix cache (0 without one)."""
    return req.cached_tokens


def engine_stats(scheduler: Scheduler) -> EngineStats:
    """A snapshot of ``scheduler``'s load; safe to read from any thread (each figure is read
    once, so figures taken during a step may be a step apart)."""
    total, free, cached = kv_slot_counts(scheduler)
    hits, queries = prefix_cache_counters(scheduler)
    running, waiting = len(scheduler.running), len(scheduler.waiting)
    if waiting and _prefilling(scheduler):  # a chunked prefill under way runs, as in vLLM
        running, waiting = running + 1, waiting - 1
    return EngineStats(
        kv_slots_total=total,
        kv_slots_free=free,
        kv_slots_cached=cached,
        requests_running=running,
        requests_waiting=waiting,
        prefix_hit_tokens=hits,
        prefix_query_tokens=queries,
        retractions=scheduler.stats.retractions,
        steps=scheduler.stats.steps,
        extend_steps=scheduler.stats.extend_steps,
    )


def _prefilling(scheduler: Scheduler) -> bool:
    """Whether the head of ``waiting`` holds KV: a prefill chunked over steps, part done (the
    only waiting request that can; read from another thread, the queue may empty meanwhile)."""
    try:
        head = scheduler.waiting[0]
    except IndexError:
        return False
    return scheduler.memory.holds(head)
