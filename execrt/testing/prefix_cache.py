"""PrefixCacheSuite: match, insert, lock and evict semantics and slot ownership of a cache."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from execrt.core.prefix_cache import (
    PrefixCache,
    PrefixCacheCapabilities,
    PrefixCacheInit,
    PrefixCacheRequirements,
    PrefixMatch,
)
from execrt.testing.prefix_cache_harness import (
    CACHE,
    REQUEST,
    Session,
    SlotLedger,
    engine_key,
    shown,
)
from execrt.testing.suite import Case, ConformanceSuite, cases, generated_settings, not_declared

#: The page size the suite tests (the interface's contract is written for it).
PAGE_SIZE = 1


@dataclass(frozen=True)
class PrefixCacheProfile:
    slots: int  # the fake pool of the generated test: small, so eviction happens often
    steps: int  # operations per generated program
    max_examples: int


CPU_PROFILE = PrefixCacheProfile(slots=40, steps=40, max_examples=60)
CUDA_PROFILE = PrefixCacheProfile(slots=40, steps=40, max_examples=30)


def refused(case: Case, what: str, call: Callable[[], object]) -> None:
    """``call`` must raise ValueError, the contract's error for a misuse."""
    try:
        call()
    except ValueError:
        return
    raise AssertionError(f"{case.id}: {what} did not raise ValueError (the contract's error)")


class PrefixCacheSuite(ConformanceSuite):
    """Conformance of a prefix cache, driven through a slot ledger that owns every slot.

    Every test checks after each step that free + evictable + protected + request-owned slots
    add up to the pool, and the ledger raises the moment the cache frees a slot it does not
    own. Tests that need the cache to find what was inserted skip when ``reuses`` is False.
    """

    kind: ClassVar[str] = "prefix_cache"
    cpu_profile: ClassVar[PrefixCacheProfile] = CPU_PROFILE
    cuda_profile: ClassVar[PrefixCacheProfile] = CUDA_PROFILE

    # -- cases ----------------------------------------------------------------------------------
    @classmethod
    def caps(cls) -> PrefixCacheCapabilities:
        caps = cls.collection_spec().capabilities
        if not isinstance(caps, PrefixCacheCapabilities):
            raise TypeError(
                f"{cls.__name__}: {cls.backend_label()} declares {type(caps).__name__}, "
                "not PrefixCacheCapabilities"
            )
        return caps

    @classmethod
    def make_case(cls, device: str, *, reuse: bool = False, variant: str = "") -> Case:
        spec, caps = cls.collection_spec(), cls.caps()
        declared = not_declared("devices", device, caps.devices) or not_declared(
            "page_sizes", PAGE_SIZE, caps.page_sizes
        )
        if not declared and reuse and not caps.reuses:
            declared = "capability reuses is False: the cache never matches"
        req = PrefixCacheRequirements(device, PAGE_SIZE)
        skip, error = cls.runnable(spec, device, req, declared)
        case_id = f"{device}-{variant}" if variant else device
        return Case(case_id, device, None, {"force_miss": variant == "force_miss"}, skip, error)

    @classmethod
    def device_cases(cls) -> list[Case]:
        return [cls.make_case(d) for d in cls.device_axis(cls.caps().devices)]

    @classmethod
    def reuse_cases(cls) -> list[Case]:
        return [cls.make_case(d, reuse=True) for d in cls.device_axis(cls.caps().devices)]

    @classmethod
    def generated_cases(cls) -> list[Case]:
        return [
            cls.make_case(d, variant=v)
            for d in cls.device_axis(cls.caps().devices)
            for v in ("hits", "force_miss")
        ]

    @classmethod
    def refusal_cases(cls) -> list[Case]:
        return [Case(d, d) for d in cls.device_axis(cls.caps().devices)]

    # -- helpers --------------------------------------------------------------------------------
    @contextmanager
    def open_cache(
        self, case: Case, slots: int = 64, force_miss: bool = False, first_slot: int = 1
    ) -> Iterator[Session]:
        spec = type(self).backend_spec()  # a fresh PluginHost for every test
        device = torch.device(case.device)
        ledger = SlotLedger(slots, device, first_slot)
        init = PrefixCacheInit(
            capabilities=spec.capabilities,
            device=device,
            free_slots=ledger.free_slots,
            force_miss=force_miss,
        )
        cache = spec.create(init)
        assert isinstance(cache, PrefixCache), f"{spec.name} built a {type(cache).__name__}"
        unset = [a for a in ("init", "capabilities", "device") if a not in vars(cache)]
        assert not unset, (
            f"{spec.name}: the cache has no {', '.join(unset)} (KVMemory reads them): its "
            "__init__ must call super().__init__(init)"
        )
        caps = type(self).caps()
        try:
            yield Session(cache, ledger, reuses=caps.reuses, force_miss=force_miss)
        finally:
            cache.close()
            cache.close()  # idempotent, as the contract says

    @staticmethod
    def cached(session: Session, key: list[int]) -> list[int]:
        """Run one request over ``key`` to completion; the slots it computed itself."""
        req = session.begin(tuple(key))
        assert req is not None, f"no room for {shown(key)} in a pool of {session.ledger.total}"
        own = req.row[req.cached :]
        session.finish(req)
        return own

    @staticmethod
    def insert_again(session: Session, key: list[int]) -> None:
        """Insert ``key``, all cached already, with fresh duplicate slots (a request that
        computed it again under force_miss): the cache keeps its own and marks them used."""
        s = session
        slots = s.ledger.alloc(len(key))
        assert slots is not None
        s.log.append(f"insert again {key}")
        n = s.cache.insert(engine_key(key), s.tensor(slots))
        assert n == len(key), f"insert of cached {key} returned {n}, not {len(key)}"
        s.settle_frees("insert")
        s.ledger.release(slots)
        s.check(f"insert again {key}")

    # -- tests ----------------------------------------------------------------------------------
    @cases("device_cases")
    def test_empty_cache(self, case: Case) -> None:
        """An empty cache matches nothing, holds nothing and evicts nothing."""
        self.begin(case)
        with self.open_cache(case) as s:
            m = s.match((1, 2, 3))
            assert m.length == 0, f"{case.id}: an empty cache matched {m.length} tokens"
            s.cache.lock(m.node)  # the empty match's node: locking it is allowed (a no-op)
            s.cache.unlock(m.node)
            s.check("lock/unlock of the empty match")
            assert s.evict(8) == 0, f"{case.id}: an empty cache evicted something"

    @cases("reuse_cases")
    def test_match_returns_the_inserted_slots(self, case: Case) -> None:
        """A match finds the longest inserted prefix, ending inside an entry too (a split)."""
        self.begin(case)
        with self.open_cache(case) as s:
            key = [5, 6, 7, 8, 9]
            self.cached(s, key)
            for probe in (key + [1], key, key[:3], key, [5, 6, 1], [6], key[:1]):
                s.match(tuple(probe))  # checks length and slots against the reference

    @cases("reuse_cases")
    def test_insert_returns_the_cached_length(self, case: Case) -> None:
        """insert returns how many leading tokens were cached; it takes only the rest.
        insert_and_match does the same and matches the whole key."""
        self.begin(case)
        with self.open_cache(case) as s:
            first = self.cached(s, [1, 2, 3, 4, 5])
            keys = ([1, 2, 3, 4, 5, 6, 7], [1, 2, 9], [1, 2, 3, 4, 5], [1, 2], [1, 2, 9, 8])
            for i, key in enumerate(keys + keys[1:]):
                n_before = s.cache.evictable_size()
                slots = s.ledger.alloc(len(key))
                assert slots is not None
                s.ledger.handing = set(slots)
                m: PrefixMatch | None = None
                if i < len(keys):
                    n = s.cache.insert(engine_key(key), s.tensor(slots))
                else:
                    n, m = s.cache.insert_and_match(engine_key(key), s.tensor(slots))
                s.ledger.handing = set()
                want = s.ref.longest(tuple(key))
                assert n == want, f"{case.id}: insert of {key} returned {n}, {want} were cached"
                kept = [t for t in slots[:n] if s.ledger.owner[t] != REQUEST]
                assert not kept, f"{case.id}: insert of {key} disposed of duplicates {kept}"
                s.ledger.take(slots[n:])
                s.ref.took(tuple(key), slots, n)
                s.settle_frees("insert")
                if m is not None:  # the whole key, cached now (nothing under force_miss)
                    s.check_match(tuple(key), m)
                s.ledger.release(slots[:n])
                assert s.cache.evictable_size() == n_before + len(key) - n, (
                    f"{case.id}: insert of {key} ({n} cached) grew the cache by "
                    f"{s.cache.evictable_size() - n_before}, not {len(key) - n}"
                )
                s.check(f"insert {key}")
                lost = [t for t in first if s.ledger.owner[t] != CACHE]
                assert not lost, f"{case.id}: insert of {key} dropped cached slots {lost}"
            s.match((1, 2, 3, 4, 5, 6, 7))

    @cases("reuse_cases")
    def test_long_keys_many_slots_and_wide_slot_ids(self, case: Case) -> None:
        """At an engine's scale, which the small tests never reach: keys of 1,500 tokens
        (a path that deep: nothing recursive per token), a pool of 4,096 slots whose ids lie
        past 65,535 (no narrow integer type holds them), and hundreds of entries (no fixed
        capacity: what insert took stays cached until evicted). A match's slots never change
        afterwards. Found by an audit: three plugins that passed every other test crashed
        the engine or served other requests' KV."""
        self.begin(case)
        rng = random.Random(0)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(100_000) for _ in range(n)]

        with self.open_cache(case, slots=4_096, first_slot=100_000) as s:
            long_key = tokens(1_500)
            self.cached(s, long_key)
            branch = long_key[:1_000] + tokens(400)
            self.cached(s, branch)
            shorts = [tokens(3) for _ in range(300)]
            for key in shorts:
                self.cached(s, key)
            first = s.match(tuple(long_key))
            kept = first.slots.clone()
            for probe in (branch, long_key[:1_200], branch[:1_001], *shorts[::37]):
                s.match(tuple(probe))  # length and slots against the reference
            assert torch.equal(first.slots, kept), (
                f"{case.id}: the slots of an earlier match changed (a cache must hand out "
                "slot ids that stay as they were, not a view of a buffer it reuses)"
            )
            holder = s.begin(tuple(long_key) + (7,))  # locks the 1,500-token path
            assert holder is not None and holder.match.length == 1_500
            freed = s.evict(s.ledger.total)
            assert freed == 400 + 900, f"{case.id}: evicted {freed}, not the 1,300 unlocked"
            s.match(tuple(long_key))
            s.finish(holder)
            s.drain()

    @cases("reuse_cases")
    def test_lock_moves_the_path_between_evictable_and_protected(self, case: Case) -> None:
        """Locks nest; the matched path is protected while locked, evictable after."""
        self.begin(case)
        with self.open_cache(case) as s:
            key = [1, 2, 3, 4, 5, 6, 7, 8]
            self.cached(s, key)
            m = s.match(tuple(key[:5]))
            for _ in range(2):
                s.cache.lock(m.node)
                s.lock_ref(tuple(key[:5]), +1)
                s.check("lock")  # protected 5, evictable 3, whatever the nesting
            s.cache.unlock(m.node)
            s.lock_ref(tuple(key[:5]), -1)
            s.check("one unlock of two")
            assert s.evict(100) == 3, f"{case.id}: only the 3 unlocked tokens are evictable"
            s.match(tuple(key))  # the locked 5 survive
            s.cache.unlock(m.node)
            s.lock_ref(tuple(key[:5]), -1)
            s.check("last unlock")
            assert s.cache.protected_size() == 0 and s.cache.evictable_size() == 5

    @cases("reuse_cases")
    def test_eviction_takes_least_recently_used_leaves_first(self, case: Case) -> None:
        """Entries go in order of last use (match counts as use); a parent after its leaves."""
        self.begin(case)
        with self.open_cache(case) as s:
            x = self.cached(s, [1, 1, 1])
            y = self.cached(s, [2, 2])
            z = self.cached(s, [3, 3, 3, 3])
            s.match((1, 1, 1))  # x is now the most recently used
            self.insert_again(s, [2, 2])  # then y: insert marks use too
            order = [(z, "z"), (x, "x"), (y, "y")]
            for i, (expected, name) in enumerate(order):
                s.evict(len(expected))
                left = [t for t in expected if s.ledger.owner[t] == CACHE]
                gone = [n for slots, n in order[i + 1 :] if s.ledger.owner[slots[0]] != CACHE]
                assert not left and not gone, (
                    f"{case.id}: evicting {len(expected)} "
                    + (f"left {name} cached" if left else f"took {gone[0]} before {name}")
                    + " (last used: z inserted, then x matched, then y inserted again)"
                )
            shared = self.cached(s, [4, 4, 5])
            self.cached(s, [4, 4, 6])
            s.evict(1)  # a leaf ([5] or [6]) goes, never the shared [4, 4] before both
            assert all(s.ledger.owner[t] == CACHE for t in shared[:2]), shared

    @cases("reuse_cases")
    def test_eviction_never_touches_locked_entries(self, case: Case) -> None:
        """With a path locked, evicting everything frees only what is not on it."""
        self.begin(case)
        with self.open_cache(case) as s:
            self.cached(s, [1, 2, 3, 4])
            self.cached(s, [1, 2, 5, 6])
            self.cached(s, [7, 8])
            holder = s.begin((1, 2, 3, 4, 9))
            assert holder is not None and holder.match.length == 4
            assert s.evict(s.ledger.total) == 4, f"{case.id}: [5, 6] and [7, 8] only"
            s.match((1, 2, 3, 4))
            s.finish(holder)
            s.drain()

    @cases("device_cases")
    def test_evict_returns_what_it_freed(self, case: Case) -> None:
        """evict(0) frees nothing; asked for more than is evictable, it frees all of it."""
        self.begin(case)
        with self.open_cache(case) as s:
            self.cached(s, [1, 2, 3])
            self.cached(s, [4, 5])
            assert s.evict(0) == 0, f"{case.id}: evict(0) freed slots"
            s.drain()  # evict(total + 1): everything, and every slot back in the pool

    @cases("device_cases")
    def test_reset_forgets_without_freeing(self, case: Case) -> None:
        """reset() drops every entry and lock without calling free_slots (the caller reclaims
        the pool itself)."""
        self.begin(case)
        with self.open_cache(case) as s:
            self.cached(s, [1, 2, 3])
            m = s.cache.match(engine_key([1, 2, 3]))
            s.cache.lock(m.node)
            s.cache.reset()
            assert not s.ledger.freed, f"{case.id}: reset() freed slots {s.ledger.freed}"
            assert s.cache.evictable_size() == 0 and s.cache.protected_size() == 0
            listed = s.cache.cached_slots().tolist()
            assert listed == [], f"{case.id}: cached_slots() lists {listed} after reset()"
            again = s.cache.match(engine_key([1, 2, 3]))
            assert again.length == 0, f"{case.id}: matched {again.length} tokens after reset()"
            assert s.cache.evict(100) == 0 and not s.ledger.freed

    @cases("reuse_cases")
    def test_lock_misuse_raises_value_error(self, case: Case) -> None:
        """The contract's errors: unlocking more often than locking, and locking or
        unlocking a node that is no longer in the cache (evicted, or from before reset())."""
        self.begin(case)
        with self.open_cache(case) as s:
            self.cached(s, [1, 2, 3])
            m = s.match((1, 2, 3))
            s.cache.lock(m.node)
            s.cache.unlock(m.node)
            refused(case, "an unlock more than the locks", lambda: s.cache.unlock(m.node))
            s.check("a refused unlock")  # and it changed nothing
            s.drain()  # evicts [1, 2, 3]: m.node is gone
            refused(case, "lock of an evicted node", lambda: s.cache.lock(m.node))
            refused(case, "unlock of an evicted node", lambda: s.cache.unlock(m.node))
            self.cached(s, [4, 5])
            old = s.match((4, 5))
            s.cache.reset()
            refused(case, "lock of a node from before reset()", lambda: s.cache.lock(old.node))
            refused(case, "unlock of a node from before reset()", lambda: s.cache.unlock(old.node))
        with self.open_cache(case) as s:
            self.cached(s, [6, 7, 8])
            parent, child = s.match((6, 7)), s.match((6, 7, 8))
            s.cache.lock(child.node)  # locks the path through [6, 7], but not [6, 7]'s node
            refused(
                case,
                "unlock of a node that was not locked itself (its child was)",
                lambda: s.cache.unlock(parent.node),
            )
            s.cache.unlock(child.node)
            assert s.cache.protected_size() == 0, f"{case.id}: a refused unlock changed a lock"

    @cases("reuse_cases")
    def test_insert_and_match_hands_a_running_prefix_to_the_cache(self, case: Case) -> None:
        """As KVMemory after each prefill chunk: ``insert_and_match`` of a running request's
        first tokens returns the node that ends them, and locking it protects exactly them,
        whether they were new, cached by another request meanwhile, or partly both."""
        self.begin(case)
        with self.open_cache(case) as s:
            a = s.begin((1, 2, 3, 4, 5, 6))  # nothing cached: computes all 6
            assert a is not None
            s.cache_prefix(a, 4)  # protected: [1, 2, 3, 4]
            assert s.evict(s.ledger.total) == 0, f"{case.id}: evicted a running prefix"
            b = s.begin((1, 2, 3, 4, 7, 8))  # matches a's 4
            assert b is not None and b.match.length == 4
            c = s.begin((1, 2, 3, 4, 5, 9))  # matches 4, computes [5] again
            assert c is not None
            s.cache_prefix(a, 6)  # the lock moves to the end of a's 6 tokens
            s.cache_prefix(c, 6)  # [5] was cached by a meanwhile: c moves to it
            s.finish(a)
            s.abort(b)
            s.finish(c)
            s.drain()

    @cases("device_cases")
    def test_force_miss_reports_no_match(self, case: Case) -> None:
        """Under force_miss, match reports nothing; insert and eviction work as usual."""
        self.begin(case)
        with self.open_cache(case, force_miss=True) as s:
            key = (1, 2, 3, 4)
            self.cached(s, list(key))
            s.match(key)  # asserts length 0
            req = s.begin(key)  # computes every token again
            assert req is not None and req.match.length == 0
            s.finish(req)  # insert finds the first copy cached; the duplicates go back
            s.drain()
            first = self.cached(s, [5, 5])
            self.cached(s, [6, 6])
            s.match((5, 5))  # reports nothing, yet marks [5, 5] used: [6, 6] goes first
            s.evict(2)
            assert all(s.ledger.owner[t] == CACHE for t in first), (
                f"{case.id}: under force_miss a match must still mark what it walks used; "
                "evict(2) took the entry matched last"
            )

    @cases("generated_cases")
    def test_generated(self, case: Case) -> None:
        """Random begin / finish / abort / match / evict programs against the reference."""
        self.begin(case)
        hypothesis = pytest.importorskip("hypothesis")
        st = hypothesis.strategies
        prof = type(self).profile(case.device)
        keys = st.lists(st.integers(0, 2), min_size=1, max_size=10).map(tuple)
        op = st.one_of(
            st.tuples(st.just("begin"), keys),
            st.tuples(st.just("chunk"), st.tuples(st.integers(0, 7), st.integers(1, 10))),
            st.tuples(st.just("finish"), st.integers(0, 7)),
            st.tuples(st.just("abort"), st.integers(0, 7)),
            st.tuples(st.just("match"), keys),
            st.tuples(st.just("evict"), st.integers(0, prof.slots)),
        )

        @generated_settings(
            type(self).max_examples or prof.max_examples,
            shrink=type(self).shrink_failures,
            report_multiple_bugs=False,  # one error (the shrunk program's) in the report
        )
        @hypothesis.given(program=st.lists(op, min_size=prof.steps // 2, max_size=prof.steps))
        def run(program: list[tuple[str, Any]]) -> None:
            with self.open_cache(case, prof.slots, case["force_miss"]) as s:
                try:
                    for name, arg in program:
                        if name == "begin":
                            s.begin(arg)
                        elif name in ("finish", "abort") and s.running:
                            req = s.running[arg % len(s.running)]
                            if name == "finish":
                                s.finish(req)
                            else:
                                s.abort(req)
                        elif name == "chunk" and s.running:
                            req = s.running[arg[0] % len(s.running)]
                            s.cache_prefix(req, min(arg[1], len(req.key)))
                        elif name == "match":
                            s.match(arg)
                        elif name == "evict":
                            s.evict(arg)
                    s.drain()
                except AssertionError as exc:
                    raise AssertionError(f"{exc}\nsteps: {'; '.join(s.log)}") from None

        run()

    @cases("refusal_cases")
    def test_refusals_explain_themselves(self, case: Case) -> None:
        spec, caps = type(self).backend_spec(), type(self).caps()
        reasons = spec.refusals(PrefixCacheRequirements(case.device, PAGE_SIZE))
        assert all(isinstance(r, str) and r.strip() for r in reasons), reasons
        if case.device not in caps.devices:
            assert reasons, f"{case.device} accepted although not declared"
