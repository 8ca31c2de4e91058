"""RadixCache: splits, insert's cached length, lock accounting, LRU eviction, reset, force_miss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from execrt.backends.prefix_cache import radix
from execrt.backends.prefix_cache.radix import RadixCache
from execrt.core.prefix_cache import PrefixCacheCapabilities, PrefixCacheInit


class Freed:
    """The free_slots callback: records each call's slot ids."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1
        self.calls.append(slots.tolist())

    @property
    def slots(self) -> list[int]:
        return [s for call in self.calls for s in call]


def make(device: str = "cpu", force_miss: bool = False) -> tuple[RadixCache, Freed]:
    freed = Freed()
    init = PrefixCacheInit(PrefixCacheCapabilities(), torch.device(device), freed, force_miss)
    return RadixCache(init), freed


def slots(*ids: int, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


def sizes(cache: RadixCache) -> tuple[int, int]:
    return cache.evictable_size(), cache.protected_size()


# -- match and split ------------------------------------------------------------------------------
def test_match_finds_the_longest_inserted_prefix_with_its_slots() -> None:
    cache, _ = make()
    assert cache.insert([1, 2, 3, 4], slots(11, 12, 13, 14)) == 0
    m = cache.match([1, 2, 3, 4, 5])
    assert m.length == 4 and m.slots.tolist() == [11, 12, 13, 14]
    assert cache.match([9, 1]).length == 0
    assert cache.match([]).length == 0


def test_a_match_ending_inside_a_node_splits_it() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3, 4, 5, 6], slots(11, 12, 13, 14, 15, 16))
    m = cache.match([1, 2, 3, 9])
    assert m.slots.tolist() == [11, 12, 13]
    head = m.node
    assert head.key.tolist() == [1, 2, 3] and head.value.tolist() == [11, 12, 13]
    (tail,) = head.children.values()
    assert tail.key.tolist() == [4, 5, 6] and tail.value.tolist() == [14, 15, 16]
    assert tail.parent is head and head.parent is cache._root
    assert cache.match([1, 2, 3, 4, 5, 6]).slots.tolist() == [11, 12, 13, 14, 15, 16]
    assert sizes(cache) == (6, 0)  # a split moves no token between the counters


def test_a_split_node_passes_its_lock_count_to_the_new_parent() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3, 4], slots(11, 12, 13, 14))
    full = cache.match([1, 2, 3, 4]).node
    cache.lock(full)
    cache.lock(full)
    head = cache.match([1, 2]).node  # splits the locked node
    assert head.lock_ref == 2 and full.parent is head and sizes(cache) == (0, 4)
    cache.unlock(full)
    cache.unlock(full)  # the caller's node still names the end of its match
    assert head.lock_ref == 0 and sizes(cache) == (4, 0)


def test_keys_may_be_lists_tuples_numpy_arrays_or_tensors() -> None:
    cache, _ = make()
    cache.insert(np.array([1, 2, 3], dtype=np.int32), slots(5, 6, 7))
    for key in ([1, 2, 3], (1, 2, 3), np.array([1, 2, 3]), torch.tensor([1, 2, 3])):
        assert cache.match(key).slots.tolist() == [5, 6, 7]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.match([[1, 2]]), "match key must be a 1-D sequence of integer token ids"),
        (lambda c: c.match([1.5]), "match key must be a 1-D sequence of integer token ids"),
        (lambda c: c.insert([1, 2], slots(1)), r"int64 slots of shape \[2\].*got int64 \[1\]"),
        (lambda c: c.insert([1], torch.tensor([1])[:0]), r"shape \[1\]"),
        (lambda c: c.insert([1], torch.tensor([1], dtype=torch.int32)), "got int32"),
    ],
)
def test_bad_keys_and_slots_are_refused_naming_the_cache(
    call: Callable[[RadixCache], Any], message: str
) -> None:
    cache, _ = make()
    with pytest.raises(ValueError, match=f"radix prefix cache: .*{message}"):
        call(cache)


# -- insert -----------------------------------------------------------------------------------
def test_insert_returns_the_length_already_cached_and_takes_only_the_rest() -> None:
    cache, freed = make()
    assert cache.insert([1, 2, 3], slots(11, 12, 13)) == 0
    assert cache.insert([1, 2, 3, 4, 5], slots(21, 22, 23, 24, 25)) == 3
    assert cache.insert([1, 2, 9], slots(31, 32, 33)) == 2  # diverges inside [1, 2, 3]
    assert cache.insert([1, 2], slots(41, 42)) == 2  # all cached: nothing taken
    assert cache.insert([], slots()) == 0
    assert sizes(cache) == (6, 0)  # 3 + 2 + 1 tokens, never a duplicate
    assert cache.match([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 24, 25]
    assert cache.match([1, 2, 9]).slots.tolist() == [11, 12, 33]
    assert freed.calls == []  # duplicates are the caller's to free


def test_insert_keeps_copies_not_the_callers_tensor() -> None:
    cache, _ = make()
    row = torch.tensor([0, 11, 12, 13, 0])
    key = np.array([1, 2, 3])
    cache.insert(key, row[1:4])  # a view of a request's row, as KVMemory passes it
    row.fill_(-1)
    key[:] = 7
    assert cache.match([1, 2, 3]).slots.tolist() == [11, 12, 13]
    got = cache.match([1, 2, 3]).slots
    got.fill_(-2)  # and a match result is the caller's own copy
    assert cache.match([1, 2, 3]).slots.tolist() == [11, 12, 13]


# -- locks ----------------------------------------------------------------------------------------
def test_lock_moves_the_path_from_evictable_to_protected_and_nests() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3, 4, 5], slots(1, 2, 3, 4, 5))
    cache.insert([1, 2, 3, 7], slots(1, 2, 3, 6))
    node = cache.match([1, 2, 3, 4, 5]).node
    cache.lock(node)
    assert sizes(cache) == (1, 5)  # [7] stays evictable
    cache.lock(node)
    assert sizes(cache) == (1, 5)
    cache.unlock(node)
    assert sizes(cache) == (1, 5)
    cache.unlock(node)
    assert sizes(cache) == (6, 0)


def test_the_empty_match_locks_nothing_and_the_root_is_always_locked() -> None:
    cache, _ = make()
    cache.insert([1], slots(1))
    empty = cache.match([5])
    assert empty.node is cache._root and cache._root.lock_ref == 1
    cache.lock(empty.node)
    cache.unlock(empty.node)
    cache.unlock(empty.node)  # a no-op, however often
    assert sizes(cache) == (1, 0)


def test_unlock_without_lock_and_foreign_nodes_are_refused() -> None:
    cache, _ = make()
    cache.insert([1, 2], slots(1, 2))
    node = cache.match([1, 2]).node
    with pytest.raises(ValueError, match="unlock of a node that is not locked"):
        cache.unlock(node)
    other, _ = make()
    other.insert([1], slots(1))
    for bad in (object(), other.match([1]).node):
        with pytest.raises(ValueError, match="not in this tree"):
            cache.lock(bad)
    cache.evict(2)
    with pytest.raises(ValueError, match=r"not in this tree \(evicted"):
        cache.lock(node)
    assert sizes(cache) == (0, 0)


# -- eviction -------------------------------------------------------------------------------------
def test_eviction_takes_least_recently_used_leaves_first_and_whole_nodes() -> None:
    cache, freed = make()
    cache.insert([1, 1, 1], slots(11, 12, 13))
    cache.insert([2, 2], slots(21, 22))
    cache.insert([3, 3, 3, 3], slots(31, 32, 33, 34))
    cache.match([1, 1, 1, 5])  # [1, 1, 1] is now the most recently used
    assert cache.evict(1) == 2 and freed.calls == [[21, 22]]  # a whole node: more than asked
    assert cache.evict(3) == 4 and freed.calls[-1] == [31, 32, 33, 34]
    assert cache.evict(1) == 3 and freed.calls[-1] == [11, 12, 13]
    assert cache.evict(5) == 0 and sizes(cache) == (0, 0)


def test_a_match_ending_inside_a_node_uses_only_the_matched_part() -> None:
    cache, freed = make()
    cache.insert([1, 1, 1], slots(11, 12, 13))
    cache.insert([2, 2], slots(21, 22))
    cache.match([1, 1])  # [1, 1] newest; the unmatched [1] keeps the oldest time
    assert cache.evict(1) == 1 and freed.calls == [[13]]
    assert cache.evict(1) == 2 and freed.calls[-1] == [21, 22]
    assert cache.evict(1) == 2 and freed.calls[-1] == [11, 12]  # a parent after its leaves


def test_insert_counts_as_use() -> None:
    cache, freed = make()
    cache.insert([1], slots(1))
    cache.insert([2], slots(2))
    cache.insert([1], slots(9))  # already cached, but used
    cache.evict(1)
    assert freed.slots == [2]


def test_one_evict_frees_every_node_in_one_call_and_parents_after_children() -> None:
    cache, freed = make()
    cache.insert([1, 2, 3], slots(1, 2, 3))
    cache.insert([1, 2, 4], slots(5, 6, 7))  # [1, 2] -> {[3], [4]}
    assert cache.evict(100) == 4
    (call,) = freed.calls
    assert sorted(call) == [1, 2, 3, 7] and set(call[-2:]) == {1, 2}  # the parent last
    assert cache.match([1, 2]).length == 0 and cache._nodes == 0


def test_eviction_never_touches_a_locked_path() -> None:
    cache, freed = make()
    cache.insert([1, 2, 3, 4], slots(1, 2, 3, 4))
    cache.insert([1, 2, 5], slots(1, 2, 5))
    cache.insert([6], slots(6))
    node = cache.match([1, 2, 3, 4]).node
    cache.lock(node)
    cache.match([6])  # [6] is newer than the locked leaf, and still goes first
    assert cache.evict(100) == 2 and sorted(freed.slots) == [5, 6]
    assert cache.match([1, 2, 3, 4]).length == 4 and sizes(cache) == (0, 4)
    cache.unlock(node)
    assert cache.evict(100) == 4 and sizes(cache) == (0, 0)


def test_evict_of_nothing_frees_nothing() -> None:
    cache, freed = make()
    cache.insert([1], slots(1))
    assert cache.evict(0) == 0 and cache.evict(-3) == 0 and freed.calls == []


def test_stale_heap_entries_are_compacted() -> None:
    cache, _ = make()
    for first in range(50):
        cache.insert([first, 1], slots(2 * first + 1, 2 * first + 2))
    for _ in range(20):
        for first in range(50):
            cache.match([first, 1])  # each touch queues the leaf again
    assert len(cache._heap) <= 2 * cache._nodes + 64
    assert cache.evict(100) == 100


def test_cached_slots_lists_every_owned_slot_locked_or_not() -> None:
    cache, _ = make()
    assert cache.cached_slots().tolist() == []
    cache.insert([1, 2, 3], slots(11, 12, 13))
    cache.insert([1, 2, 4, 5], slots(21, 22, 24, 25))  # a split: [1, 2] keeps 11, 12
    cache.lock(cache.match([1, 2, 3]).node)
    listed = cache.cached_slots()
    assert listed.dtype == torch.int64 and sorted(listed.tolist()) == [11, 12, 13, 24, 25]
    cache.evict(10)  # the unlocked [4, 5] goes
    assert sorted(cache.cached_slots().tolist()) == [11, 12, 13]


# -- reset, close, force_miss ---------------------------------------------------------------------
def test_reset_forgets_everything_without_freeing_and_refuses_old_nodes() -> None:
    cache, freed = make()
    cache.insert([1, 2], slots(1, 2))
    node = cache.match([1, 2]).node
    cache.lock(node)
    cache.reset()
    assert freed.calls == [] and sizes(cache) == (0, 0) and cache.match([1, 2]).length == 0
    with pytest.raises(ValueError, match="from before"):
        cache.unlock(node)
    assert cache.evict(10) == 0
    cache.close()
    cache.close()
    assert sizes(cache) == (0, 0)


def test_force_miss_runs_the_tree_but_reports_no_match() -> None:
    cache, freed = make(force_miss=True)
    assert cache.insert([1, 2, 3], slots(1, 2, 3)) == 0
    cache.insert([4, 5], slots(4, 5))
    m = cache.match([1, 2, 3])
    assert m.length == 0 and m.slots.dtype == torch.int64 and m.node is cache._root
    assert cache.insert([1, 2, 3, 6], slots(7, 8, 9, 6)) == 3  # insert works as usual
    cache.match([1, 2])  # splits and touches [1, 2, 3] as a real match would
    assert cache._nodes == 4  # [4, 5], [1, 2], [3], [6]
    assert cache.evict(1) == 2 and freed.calls == [[4, 5]]  # the match touched [1, 2, ...]
    assert sizes(cache) == (4, 0)


# -- cost -----------------------------------------------------------------------------------------
def test_match_and_insert_cost_grows_with_the_key_not_the_cache(monkeypatch) -> None:
    """A cache of ~300k tokens: a match compares once per node on its path (vectorised),
    covering no more tokens than the key has."""
    cache, _ = make()
    rng = np.random.default_rng(0)
    system = rng.integers(0, 50_000, 2048).tolist()
    slot = 1
    for group in range(16):
        shared = system + [group] + rng.integers(0, 50_000, 1024).tolist()
        for _ in range(16):
            key = shared + rng.integers(0, 50_000, 128).tolist()
            slot += len(key)
            cache.insert(key, torch.arange(slot - len(key), slot))
    assert cache.evictable_size() > 2048 + 16 * (1024 + 16 * 128)  # > 300k tokens cached

    compared: list[int] = []
    real = radix.first_mismatch

    def counting(a: np.ndarray, b: np.ndarray) -> int:
        compared.append(a.size)
        return real(a, b)

    monkeypatch.setattr(radix, "first_mismatch", counting)
    query = system + [3] + rng.integers(0, 50_000, 1024).tolist()
    assert cache.match(query).length == 2049  # system prompt and group token
    assert len(compared) <= 3 and sum(compared) <= len(query)
    compared.clear()
    assert cache.insert(query, torch.arange(len(query))) == 2049
    assert len(compared) <= 3 and sum(compared) <= len(query)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_slots_stay_on_the_cuda_device() -> None:
    cache, freed = make("cuda")
    cache.insert([1, 2, 3], slots(1, 2, 3, device="cuda"))
    m = cache.match([1, 2])
    assert m.slots.is_cuda and m.slots.tolist() == [1, 2]
    with pytest.raises(ValueError, match="insert slots are on cpu"):
        cache.insert([5], slots(5))
    assert cache.evict(10) == 3 and sorted(freed.slots) == [1, 2, 3]
