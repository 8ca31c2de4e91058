"""The prefix-cache suite's harness: a slot ledger (fake allocator), a naive reference, a driver.

The ledger hands out slots first..first + total - 1 (0 is the padding slot; ``first`` is 1 but
where a test wants ids no narrow integer type holds) and knows who owns each one: free,
a request, or the cache. The reference is a dict of every cached prefix (a token tuple) to the
slot of its last token, kept from what the cache did (what insert took, what it freed). The
session drives a cache like KVMemory does (match + lock, allocate the rest, insert on finish,
free duplicates, unlock) and checks every step against both.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from execrt.core.prefix_cache import PrefixCache, PrefixMatch, cache_key

FREE, REQUEST, CACHE = "free", "request", "cache"
Key = tuple[int, ...]


def shown(items: Sequence[int], limit: int = 12) -> str:
    """``items`` for a message: whole when short, else the first few and the count (a
    1,500-token key would bury the message)."""
    items = list(items)
    if len(items) <= limit:
        return str(items)
    return f"[{', '.join(map(str, items[: limit // 2]))}, ... ({len(items):,} in all)]"


def engine_key(key: Sequence[int]) -> memoryview:
    """``key`` as KVMemory hands keys to a cache (``cache_key``: a read-only memoryview over
    int64, which never compares equal to a list or a tuple)."""
    return cache_key(array("q", key))


class SlotLedger:
    """A fake KV slot allocator that raises on any ownership violation by the cache.

    ``free_slots`` is the cache's only way to give slots back: each slot must be cache-owned
    (or one being handed over by the insert that is running), never slot 0, never free.
    """

    def __init__(self, total: int, device: torch.device, first: int = 1) -> None:
        if first < 1:
            raise ValueError(
                f"harness: slot 0 is the padding slot; first must be >= 1, got {first}"
            )
        self.total = total
        self.device = device
        self.owner = dict.fromkeys(range(first, first + total), FREE)
        self.counts = Counter({FREE: total, REQUEST: 0, CACHE: 0})
        self._free = list(range(first + total - 1, first - 1, -1))  # pop(): ascending ids
        self.freed: list[int] = []  # slots the cache freed, since the session last read them
        self.handing: set[int] = set()  # slots passed to the insert in progress

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        self._move(out, REQUEST)
        return out

    def release(self, slots: Sequence[int]) -> None:
        """A request frees slots it owns (duplicates, or everything on abort)."""
        for s in slots:
            assert self.owner[s] == REQUEST, f"harness: slot {s} is {self.owner[s]}"
        self._move(slots, FREE)
        self._free.extend(slots)

    def take(self, slots: Sequence[int]) -> None:
        """The cache took ``slots`` (the part of an insert past what was cached)."""
        self._move([s for s in slots if self.owner[s] == REQUEST], CACHE)

    def free_slots(self, slots: torch.Tensor) -> None:
        """The callback the cache is built with."""
        if slots.dtype != torch.int64 or slots.dim() != 1:
            raise AssertionError(
                f"free_slots got {slots.dtype} {list(slots.shape)}, expected int64 [n]"
            )
        if slots.device.type != self.device.type:
            raise AssertionError(f"free_slots got slots on {slots.device}, not {self.device}")
        ids = slots.tolist()
        if len(set(ids)) != len(ids):
            raise AssertionError(f"free_slots: one call frees a slot twice: {sorted(ids)}")
        for s in ids:
            state = self.owner.get(s)
            if s == 0:
                raise AssertionError("free_slots: slot 0 (the padding slot) is never the cache's")
            if state == FREE:
                raise AssertionError(f"free_slots: double free of slot {s}")
            if state == REQUEST and s not in self.handing:
                raise AssertionError(f"free_slots: slot {s} belongs to a request, not the cache")
            if state is None:
                raise AssertionError(f"free_slots: slot {s} was never handed out")
        self._move(ids, FREE)
        self._free.extend(ids)
        self.freed.extend(ids)

    def _move(self, slots: Sequence[int], state: str) -> None:
        for s in slots:
            self.counts[self.owner[s]] -= 1
            self.owner[s] = state
        self.counts[state] += len(slots)


@dataclass
class Reference:
    """The naive model: every cached prefix -> the slot of its last token (inserted first)."""

    cached: dict[Key, int] = field(default_factory=dict)
    prefix_of: dict[int, Key] = field(default_factory=dict)  # slot -> its prefix
    locks: Counter[Key] = field(default_factory=Counter)  # locked (matched) prefixes
    children: Counter[Key] = field(default_factory=Counter)  # prefix -> its cached extensions

    def longest(self, key: Key) -> int:
        n = 0
        while n < len(key) and key[: n + 1] in self.cached:
            n += 1
        return n

    def slots(self, key: Key, n: int) -> list[int]:
        return [self.cached[key[: i + 1]] for i in range(n)]

    def took(self, key: Key, slots: Sequence[int], n: int) -> None:
        for i in range(n, len(key)):
            self.cached[key[: i + 1]] = slots[i]
            self.prefix_of[slots[i]] = key[: i + 1]
            self.children[key[:i]] += 1

    def protected(self) -> set[Key]:
        return {key[:i] for key in self.locks for i in range(1, len(key) + 1)}

    def forget(self, slot: int) -> Key:
        prefix = self.prefix_of.pop(slot)
        del self.cached[prefix]
        self.children[prefix[:-1]] -= 1
        return prefix


@dataclass(eq=False)  # requests are told apart by identity (a match's tensors never compare)
class Running:
    """A request in flight: its key, its match, and the slots it reads. Its first ``cached``
    tokens are the cache's (matched, then handed over chunk by chunk) under the lock of
    ``node``; the rest of ``row`` it owns."""

    key: Key
    match: PrefixMatch
    row: list[int]  # [len(key)]: the cache's slots, then the request's own
    cached: int = field(init=False)
    node: Any = field(init=False)

    def __post_init__(self) -> None:
        self.cached, self.node = self.match.length, self.match.node


class Session:
    """Drives a cache as KVMemory would and checks every step (raises AssertionError)."""

    def __init__(
        self, cache: PrefixCache, ledger: SlotLedger, *, reuses: bool, force_miss: bool
    ) -> None:
        self.cache, self.ledger = cache, ledger
        self.reuses, self.force_miss = reuses, force_miss
        self.ref = Reference()
        self.running: list[Running] = []
        self.log: list[str] = []

    # -- operations -----------------------------------------------------------------------------
    def match(self, key: Key) -> PrefixMatch:
        self.log.append(f"match {shown(key)}")
        m = self.cache.match(engine_key(key))
        self.check_match(key, m)
        self.settle_frees("match")
        return m

    def begin(self, key: Key) -> Running | None:
        """Match and lock, then allocate the rest (evicting first if short); None if it
        does not fit even then."""
        m = self.match(key)
        self.log.append(f"begin {shown(key)} (matched {m.length})")
        self.cache.lock(m.node)
        self.lock_ref(key[: m.length], +1)
        need = len(key) - m.length
        short = need - self.ledger.counts[FREE]
        if short > 0:
            self.evict(short)
        own = self.ledger.alloc(need)
        if own is None:
            self.cache.unlock(m.node)
            self.lock_ref(key[: m.length], -1)
            self.check("begin (rejected)")
            return None
        req = Running(key, m, m.slots.tolist() + own)
        self.running.append(req)
        self.check("begin")
        return req

    def cache_prefix(self, req: Running, length: int) -> None:
        """As KVMemory after a prefill chunk: hand the first ``length`` tokens of a running
        request to the cache with ``insert_and_match``, point its row at the cached slots,
        free its duplicates and move its lock to the match's node. A no-op where KVMemory
        does nothing: tokens already cached, ``force_miss``, a cache that never reuses."""
        start = req.cached
        if self.force_miss or not self.reuses or length <= start:
            return
        key = req.key[:length]
        self.log.append(f"cache_prefix {shown(req.key)} {length}")
        expected = self.ref.longest(key)
        n, m = self._handing_over(
            req.row[start:length],
            req.row[:length],
            lambda t: self.cache.insert_and_match(engine_key(key), t),
        )
        assert isinstance(n, int) and n == expected, (
            f"insert_and_match of {shown(key)} returned {n!r}; {expected} tokens were cached"
        )
        self.ledger.take(req.row[n:length])
        self.ref.took(key, req.row, n)
        self.settle_frees("insert_and_match")
        self.check_match(key, m)  # the whole key, now cached: the node to lock ends it
        duplicates = req.row[start:n]
        req.row[start:n] = m.slots.tolist()[start:n]  # readers move to the cache's slots
        self._unlock(req)
        self.cache.lock(m.node)
        self.lock_ref(key, +1)
        req.cached, req.node = length, m.node
        self.ledger.release(duplicates)
        self.check(f"insert_and_match {shown(key)} (the lock moved to its node)")

    def finish(self, req: Running) -> int:
        """Insert the request's KV, free its duplicates, unlock; returns insert's n."""
        self.log.append(f"finish {shown(req.key)}")
        self.running.remove(req)
        expected = self.ref.longest(req.key)
        own = req.row[req.cached :]
        n = self._handing_over(own, req.row, lambda t: self.cache.insert(engine_key(req.key), t))
        assert isinstance(n, int) and 0 <= n <= len(req.key), f"insert returned {n!r}"
        assert n >= req.cached, (
            f"insert of {shown(req.key)} returned {n}, but its first {req.cached} tokens "
            "are cached and locked"
        )
        if self.reuses:
            assert n == expected, (
                f"insert of {shown(req.key)} returned {n}; {expected} tokens were cached"
            )
        else:
            assert n <= expected, f"insert returned {n}; only {expected} tokens were cached"
        self.ledger.take(req.row[n:])
        self.ref.took(req.key, req.row, n)
        dropped = [s for s in self.ledger.freed if s in set(own)]
        early = [s for s in dropped if req.row.index(s) < n]
        assert not early, f"insert freed slots {early} of the caller's duplicates (kept: [:n])"
        self.settle_frees("insert")
        self.ledger.release(req.row[req.cached : n])  # duplicates of cached slots
        self._unlock(req)
        self.check("finish")
        return n

    def abort(self, req: Running) -> None:
        """Retraction: free what the request owns, never the cache's slots; unlock."""
        self.log.append(f"abort {shown(req.key)}")
        self.running.remove(req)
        self.ledger.release(req.row[req.cached :])
        self._unlock(req)
        self.check("abort")

    def evict(self, num_slots: int) -> int:
        self.log.append(f"evict {num_slots}")
        before = self.cache.evictable_size()
        freed = self.cache.evict(num_slots)
        got = len(self.ledger.freed)
        assert freed == got, f"evict({num_slots}) returned {freed} but freed {got} slots"
        want = min(num_slots, before) if num_slots > 0 else 0
        assert freed >= want, (
            f"evict({num_slots}) freed {freed} with {before} evictable: it must free at least "
            "what was asked, or everything evictable"
        )
        self.settle_frees("evict")
        self.check("evict")
        return freed

    def drain(self) -> None:
        """Finish every request, evict everything: the cache must give every slot back."""
        while self.running:
            self.finish(self.running[0])
        self.evict(self.ledger.total + 1)
        assert self.cache.evictable_size() == 0 and self.cache.protected_size() == 0, (
            "after finishing every request and evicting everything the cache still holds "
            f"{self.cache.evictable_size()} evictable + {self.cache.protected_size()} protected"
        )
        assert self.ledger.counts[FREE] == self.ledger.total, (
            f"{self.ledger.total - self.ledger.counts[FREE]} slots never came back"
        )

    # -- checks ---------------------------------------------------------------------------------
    def check_match(self, key: Key, m: PrefixMatch) -> None:
        s = m.slots
        assert isinstance(s, torch.Tensor) and s.dtype == torch.int64 and s.dim() == 1, (
            f"match slots must be an int64 [length] tensor, got {s!r}"
        )
        assert s.device.type == self.ledger.device.type, f"match slots on {s.device}"
        assert m.length <= len(key), f"match of {len(key)} tokens returned {m.length}"
        if self.force_miss or not self.reuses:
            why = "force_miss" if self.force_miss else "reuses=False"
            assert m.length == 0, f"match of {shown(key)} found {m.length} tokens under {why}"
            return
        want = self.ref.longest(key)
        assert m.length == want, (
            f"match of {shown(key)} found {m.length} tokens; the longest cached prefix has {want}"
        )
        assert s.tolist() == self.ref.slots(key, want), (
            f"match of {shown(key)} returned slots {shown(s.tolist())}, inserted first: "
            f"{shown(self.ref.slots(key, want))}"
        )

    def settle_frees(self, where: str) -> None:
        """Apply what the cache freed to the reference: only unlocked, leaf-first prefixes."""
        if not self.ledger.freed:
            return
        protected = self.ref.protected()
        gone = []
        for slot in self.ledger.freed:
            assert slot in self.ref.prefix_of, f"{where} freed slot {slot}, not a cached one"
            prefix = self.ref.forget(slot)
            assert prefix not in protected, f"{where} freed slot {slot} of locked {shown(prefix)}"
            gone.append(prefix)
        self.ledger.freed.clear()
        # Only a free can leave a cached prefix without its parent: look at what was freed.
        parents = [p for p in gone if self.ref.children[p] > 0]
        orphans = [
            q for p in parents for q in self.ref.cached if len(q) == len(p) + 1 and q[:-1] == p
        ]
        assert not orphans, (
            f"{where} freed a prefix but kept a longer one ({shown(orphans[0])}): "
            "eviction must take leaves first"
        )

    def check(self, where: str) -> None:
        c, led = self.cache, self.ledger
        evictable, protected = c.evictable_size(), c.protected_size()
        total = led.counts[FREE] + evictable + protected + led.counts[REQUEST]
        assert total == led.total, (
            f"after {where}: free {led.counts[FREE]} + evictable {evictable} + protected "
            f"{protected} + request-owned {led.counts[REQUEST]} = {total}, not {led.total}"
        )
        assert evictable + protected == led.counts[CACHE] == len(self.ref.cached), (
            f"after {where}: the cache reports {evictable + protected} slots, owns "
            f"{led.counts[CACHE]} and holds {len(self.ref.cached)} prefixes"
        )
        want = len(self.ref.protected())
        assert protected == want, f"after {where}: protected {protected}, locked paths: {want}"
        listed = c.cached_slots()
        owned = sorted(self.ref.prefix_of)
        ids = sorted(listed.tolist())
        kept_view = (
            " (-1 is what the harness wrote into the tensor it passed to insert, after the call: "
            "a cache must copy the slot ids it keeps, not keep that tensor or a view of it)"
            if -1 in ids
            else ""
        )
        assert listed.device.type == led.device.type, (
            f"after {where}: cached_slots() is on {listed.device}, not the cache's {led.device}"
        )
        assert listed.dtype == torch.int64 and ids == owned, (
            f"after {where}: cached_slots() lists {shown(ids)}, the cache owns {shown(owned)}"
            f"{_difference(ids, owned)}{kept_view}"
        )

    # -- helpers --------------------------------------------------------------------------------
    def _handing_over(self, own: Sequence[int], row: Sequence[int], call: Any) -> Any:
        """``call`` (an insert) on a tensor of ``row``, with ``own`` the slots it hands over
        (the cache may free those); the tensor is overwritten with -1 after, as a caller
        reuses its row: a cache must keep copies of the ids, not this tensor."""
        self.ledger.handing = set(own)
        passed = self.tensor(row)
        try:
            return call(passed)
        finally:
            self.ledger.handing = set()
            passed.fill_(-1)

    def _unlock(self, req: Running) -> None:
        """Release the lock ``req`` holds on the cache's part of its row."""
        self.cache.unlock(req.node)
        self.lock_ref(req.key[: req.cached], -1)

    def tensor(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64, device=self.ledger.device)

    def lock_ref(self, prefix: Key, delta: int) -> None:
        if prefix:
            self.ref.locks[prefix] += delta
            if self.ref.locks[prefix] == 0:
                del self.ref.locks[prefix]


def _difference(listed: Sequence[int], owned: Sequence[int]) -> str:
    """What tells two long slot lists apart, for a message ("" when both are short)."""
    if len(listed) <= 12 and len(owned) <= 12:
        return ""
    extra, missing = sorted(set(listed) - set(owned)), sorted(set(owned) - set(listed))
    return f" (listed, not owned: {shown(extra)}; owned, not listed: {shown(missing)})"
