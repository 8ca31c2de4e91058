"""The prefix-cache interface: KV slots of token prefixes kept for reuse across requests.

A prefix cache is the fourth backend kind (``prefix_cache``). It sits behind ``KVMemory``:
KVMemory hands a finished or chunk-computed request's slots to the cache (``insert``), asks
it for the longest cached prefix of a new prompt (``match``), locks what running requests
read (``lock`` / ``unlock``), and has it free unlocked entries when slots run short
(``evict``). Every slot is in exactly one state: free (in the allocator), owned by one
request, or owned by the cache (protected while locked, evictable otherwise).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from execrt.core.interfaces import Capabilities


def cache_key(tokens: array[int], n: int | None = None) -> memoryview:
    """The first ``n`` (default all) of ``tokens`` (an int64 ``array``) in the form every
    cache receives its keys: a read-only memoryview, no copy. It indexes and iterates as
    ``int`` and converts to numpy without a copy, but never compares equal to a list or a
    tuple. KVMemory and the conformance suite both build keys with it."""
    view = memoryview(tokens)
    return (view if n is None else view[:n]).toreadonly()


@dataclass(frozen=True)
class PrefixCacheRequirements:
    """What KVMemory asks of its prefix cache."""

    device: str  # "cpu" or "cuda": where the slot-id tensors live
    page_size: int = 1


@dataclass(frozen=True)
class PrefixCacheCapabilities(Capabilities):
    """A prefix cache's claims. ``reuses`` False: it never matches (e.g. ``none``)."""

    kind: ClassVar[str] = "prefix_cache"
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    page_sizes: frozenset[int] = frozenset({1})
    reuses: bool = True

    def refusals(self, req: PrefixCacheRequirements) -> list[str]:
        out: list[str] = []
        self._check("device", req.device, self.devices, out)
        self._check("page size", req.page_size, self.page_sizes, out)
        return out


@dataclass(frozen=True)
class PrefixCacheInit:
    """Everything a prefix cache is built from.

    ``free_slots(slots)`` returns slot ids ``[n]`` int64 to the allocator: the only way a
    cache gives slots back (eviction, flush). ``force_miss``: keep every code path but report
    no match, to measure the cache's overhead. ``match`` then walks (and splits, and marks
    used) as usual but returns the empty match, while ``insert``, ``lock`` and ``evict`` work
    as usual. So under ``force_miss`` a caller never learns the cached slots of a prefix it
    also computed: it keeps reading its own slots, and inserts a request's KV (freeing its
    duplicates) only once nothing reads them any more, i.e. when the request finishes.
    """

    capabilities: PrefixCacheCapabilities
    device: torch.device
    free_slots: Callable[[torch.Tensor], None]
    force_miss: bool = False


@dataclass(frozen=True, eq=False)  # compared by identity: tensors have no truth value
class PrefixMatch:
    """The longest cached prefix of a key: its slots and the node to lock while they are used.

    ``slots`` is int64 ``[length]`` on the cache's device, which later changes to the cache
    never alter (a copy of the ids, or a tensor the cache never writes: one empty tensor may
    serve every empty match) and which the caller never writes into; ``node`` is
    opaque to the caller (pass it to ``lock`` / ``unlock``) and keeps naming the end of this
    match while it is locked, whatever later matches and inserts do to the cache; an empty match
    has ``length == 0`` and a node that locking is a no-op for.
    """

    slots: torch.Tensor
    node: Any

    @property
    def length(self) -> int:
        return int(self.slots.numel())


class PrefixCache(ABC):
    """Token-id prefixes -> KV slots, with lock counts and eviction.

    Contract (page size 1; every key is a read-only sequence of host token ids: KVMemory
    passes a ``memoryview`` of int64, which indexes and iterates as ``int``, slices without a
    copy and converts to a numpy array without one; compare keys as tuples or arrays, not
    with ``==`` against a list):

    - ``match(key)`` returns the longest prefix of ``key`` that is cached, and marks it used
      (for LRU). The caller decides how much of a prompt to match (never its last token).
    - ``insert(key, slots)`` records ``slots[i]`` (int64 ``[len(key)]`` on the cache's device)
      as the KV of ``key[:i+1]`` and returns ``n``, how many leading tokens of ``key`` were
      already cached before the call. The cache takes ownership of ``slots[n:]`` (it copies
      the ids: ``slots`` may be a view of the caller's row); ``slots[:n]`` stay the caller's
      (duplicates of the cached ones unless the caller got them from ``match``), and the
      caller frees the duplicates itself, after pointing its readers at the cached slots
      (a ``match`` of the same key returns them). Insert marks the key used, like match.
    - ``lock(node)`` protects the path from the root to ``node`` from eviction; ``unlock(node)``
      undoes one ``lock`` of the same node. Locks nest (counts). Unlocking a node more often
      than it was locked (a lock of a longer match through it does not count), or passing a
      node that is not in the cache (evicted, or from before ``reset``), raises ValueError.
    - ``evict(n)`` frees at least ``n`` slots of unlocked entries, least recently used leaves
      first, through ``init.free_slots``, or as many as are evictable; returns how many (more
      than ``n`` when it frees whole entries). ``evict(n <= 0)`` frees nothing.
    - ``evictable_size()`` + ``protected_size()`` == slots the cache owns; ``protected_size``
      counts the slots of every locked path once. ``cached_slots()`` lists exactly those
      slots (KVMemory's reconciliation needs to know which slots are the cache's).
    - ``reset()`` forgets everything without freeing (the caller reclaims the whole pool).

    At an engine's scale: what ``insert`` takes stays cached until ``evict`` frees it (no
    capacity of the cache's own: the engine evicts when its pool runs short); keys run to the
    context length (a path that deep: nothing recursive per token); slot ids run to the pool's
    size, past any narrow integer type (keep int64). The engine calls every method from the
    thread that steps it, never two at once, except ``evictable_size`` and
    ``protected_size``, which ``Engine.stats()`` may read from any thread (keep them plain
    counters). ``close()`` comes once the engine is done with the cache, and may come again.
    """

    def __init__(self, init: PrefixCacheInit) -> None:
        self.init = init
        self.capabilities = init.capabilities
        self.device = init.device

    @abstractmethod
    def match(self, key: Sequence[int]) -> PrefixMatch: ...

    @abstractmethod
    def insert(self, key: Sequence[int], slots: torch.Tensor) -> int: ...

    def insert_and_match(self, key: Sequence[int], slots: torch.Tensor) -> tuple[int, PrefixMatch]:
        """``insert(key, slots)``, then ``match(key)``: insert's count and the match (what a
        caller that keeps reading the key's K/V locks, and points its row at). A cache may do
        both in one walk; this default calls the two."""
        n = self.insert(key, slots)
        return n, self.match(key)

    @abstractmethod
    def lock(self, node: Any) -> None: ...

    @abstractmethod
    def unlock(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_slots: int) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def cached_slots(self) -> torch.Tensor:
        """Every slot the cache owns, locked or not: int64 ``[evictable + protected]`` on the
        cache's device, in no particular order (a copy)."""

    @abstractmethod
    def reset(self) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the cache allocated. Idempotent."""
