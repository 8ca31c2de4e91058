"""KVMemory: the one holder of KV slots and request rows, with the prefix cache behind it."""

from __future__ import annotations

import logging
import weakref
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from execrt.core import envs
from execrt.core.errors import KVOwnershipError
from execrt.core.memory import ReqToTokenPool, SlotHolders, TokenToKVPoolAllocator
from execrt.core.prefix_cache import cache_key
from execrt.core.staging import HostToDevice
from execrt.core.step import StepInputs
from execrt.core.step_inputs import decode_inputs, extend_inputs

if TYPE_CHECKING:
    from execrt.core.prefix_cache import PrefixCache
    from execrt.core.schedule import Req

logger = logging.getLogger(__name__)
#: The prefix cache's name in messages and in the debug map.
CACHE = "prefix cache"
#: Builds the prefix cache around the callback through which it gives slots back.
PrefixCacheFactory = Callable[[Callable[[torch.Tensor], None]], "PrefixCache"]


@dataclass
class Holding:
    """What one request holds: row ``row`` of ``req_to_token``, whose first ``tokens`` entries
    are the KV slots of its first tokens. The leading ``cached`` of them belong to the prefix
    cache (locked through ``node`` while the request reads them; None: no lock); the ``owned``
    after them are the request's own. The counts grow only once the entries they cover were
    written, so freeing reads back only written entries."""

    row: int
    holder: str  # "request <rid>": names the holder in messages and in the debug map
    cached: int = 0
    owned: int = 0
    node: Any = None

    @property
    def tokens(self) -> int:
        return self.cached + self.owned


@dataclass(frozen=True)
class Reclaimed:
    """What ``KVMemory.reconcile`` found held by nobody and freed."""

    slots: int
    rows: int


class KVMemory:
    """Hands out request rows and KV slots, and takes them back; nothing else frees a slot.

    Every slot is in one state: free (in the allocator), owned by one request, or owned by the
    prefix cache (protected while a request reads it, evictable otherwise); every row is free
    or held by one request. ``check`` tests free + owned + evictable + protected == total
    slots and free + held == total rows.

    ``reserve_extend`` / ``reserve_decode`` take what one step needs for all its requests or
    nothing, record the slots in the requests' rows and return the step's ``StepInputs``
    (every host integer staged in one copy); short of free slots, they evict from the cache
    first. ``release`` gives back all a request holds and may be called any number of times.
    ``reconcile`` repairs what an exception (a KeyboardInterrupt at any point) cut short.

    Prefix cache (``prefix_cache``, built around ``_free_cached``, the one way it gives slots
    back). ``admit`` starts a request on the longest cached prefix of its tokens (locked, in
    its row). ``cache_prefix`` hands a prefill chunk's K/V to the cache once its step is done:
    where the cache already had those tokens (another request inserted them meanwhile) the
    row is pointed at the cache's slots first and the request's duplicates are freed after,
    never before. ``release(req, keep)`` hands a finished request's K/V to the cache; without
    ``keep`` (retraction, abort, error) it unlocks and frees only what the request owns. Under
    ``force_miss`` matches report nothing, so chunks are not handed over (nothing would read
    the cache's copy) and a request's K/V goes to the cache when it finishes.

    Operations give up ownership before they free, and change a lock before they record it,
    so an interruption at any call can lose a slot or a row (``reconcile`` finds it) but never
    free one twice or unlock twice.

    ``req.kv_len`` (tokens whose K/V is computed, or being computed by a launched step) is
    read, never written: a step's new tokens follow a request's held ones, which must number
    ``kv_len``, and the caller advances ``kv_len`` when it launches the step (to ``admit``'s
    result when it admits).
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        stager: HostToDevice,
        *,
        prefix_cache: PrefixCacheFactory | None = None,
        debug_ownership: bool | None = None,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.stager = stager
        self.prefix_cache = None if prefix_cache is None else prefix_cache(self._free_cached)
        self.force_miss = self.prefix_cache is not None and self.prefix_cache.init.force_miss
        self.device = req_to_token_pool.device
        self.total_slots = allocator.size  # sizes are fixed at build
        self.total_rows = req_to_token_pool.size
        self._held: dict[Req, Holding] = {}
        # Each request's prompt as int64, converted once: the keys of its cache lookups.
        self._prompts: weakref.WeakKeyDictionary[Req, array[int]] = weakref.WeakKeyDictionary()
        if debug_ownership is None:
            debug_ownership = envs.flag(envs.DEBUG_KV_OWNERSHIP)
        self._holders = SlotHolders() if debug_ownership else None

    # -- counts -------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.allocator.available_size()

    @property
    def owned_slots(self) -> int:
        """Slots held by requests as their own (not the prefix cache's)."""
        return sum(h.owned for h in self._held.values())

    @property
    def cached_slots(self) -> int:
        """Slots the prefix cache owns (evictable + protected)."""
        c = self.prefix_cache
        return 0 if c is None else c.evictable_size() + c.protected_size()

    @property
    def evictable_slots(self) -> int:
        return 0 if self.prefix_cache is None else self.prefix_cache.evictable_size()

    @property
    def reuses(self) -> bool:
        """True when a match can find something (a cache that reuses, not under force_miss)."""
        c = self.prefix_cache
        return c is not None and c.capabilities.reuses and not self.force_miss

    @property
    def available_slots(self) -> int:
        """Slots a reservation can get: free ones and those the cache would evict for it."""
        return self.free_slots + self.evictable_slots

    @property
    def available_rows(self) -> int:
        return self.req_to_token_pool.available_size()

    def holds(self, req: Req) -> bool:
        """True while ``req`` holds a row (and the slots of ``held_tokens(req)`` tokens)."""
        return req in self._held

    def held_tokens(self, req: Req) -> int:
        holding = self._held.get(req)
        return 0 if holding is None else holding.tokens

    def row(self, req: Req) -> int | None:
        holding = self._held.get(req)
        return None if holding is None else holding.row

    def cached_tokens(self, req: Req) -> int:
        """How many of ``req``'s held tokens are the prefix cache's (locked for it)."""
        holding = self._held.get(req)
        return 0 if holding is None else holding.cached

    def check(self) -> None:
        """Raise KVOwnershipError unless free + owned + evictable + protected == total slots
        and free + held == total rows (and, with the debug map, the map holds exactly the
        owned and the cached slots)."""
        free, owned, cached = self.free_slots, self.owned_slots, self.cached_slots
        rows = len(self._held)
        problems = []
        if free + owned + cached != self.total_slots:
            problems.append(
                f"{free} free + {owned} owned + {cached} cached slots != {self.total_slots}"
            )
        if self.available_rows + rows != self.total_rows:
            problems.append(f"{self.available_rows} free + {rows} held rows != {self.total_rows}")
        if self._holders is not None and len(self._holders) != owned + cached:
            problems.append(
                f"the debug map holds {len(self._holders)} slots, requests {owned}, the "
                f"prefix cache {cached}"
            )
        if problems:
            raise KVOwnershipError("KVMemory: " + "; ".join(problems))

    # -- the prefix cache ---------------------------------------------------------------------
    def admit(self, req: Req) -> int:
        """Start ``req``, which holds nothing, on the longest cached prefix of its known tokens
        but the last (whose logits must be computed): lock it, take a row, write the cached
        slots into it. Returns how many tokens ``req`` holds now, its new ``kv_len``; 0, with
        nothing taken, without a cache, on a miss, with no row free, or for a request that
        wants its prompt's logits (``Req.prompt_logits``). ``release`` undoes it.
        Locking makes those slots protected: ``available_slots`` may shrink."""
        cache = self.prefix_cache
        if req in self._held:
            raise ValueError(f"KVMemory: request {req.rid} is admitted but already holds a row")
        if cache is None or self.available_rows == 0 or req.prompt_logits:
            return 0
        assert req.kv_len == 0 and req.num_pending == 0, "a request holding nothing"
        match = cache.match(self._key(req, req.seq_len - 1))
        if match.length == 0:
            return 0
        row = self.req_to_token_pool.alloc()
        assert row is not None, "a row was free"
        holding = self._held[req] = Holding(row, f"request {req.rid}")
        self.req_to_token_pool.write(row, 0, match.slots)
        cache.lock(match.node)
        holding.node = match.node
        holding.cached = match.length
        return match.length

    def cache_prefix(self, req: Req, length: int) -> None:
        """Hand the K/V of ``req``'s first ``length`` tokens to the prefix cache; ``req`` keeps
        reading it, locked. Call it once the step that computed them is done (never with K/V
        still being written: a failed step would leave garbage in the cache). A no-op without
        a cache, under ``force_miss`` or with a cache that never matches (``reuses`` False:
        nothing would read its copy, so the request keeps its own until it finishes, as under
        ``force_miss``), or for tokens already cached."""
        cache, holding = self.prefix_cache, self._held.get(req)
        if cache is None or not self.reuses or holding is None or length <= holding.cached:
            return
        if length > holding.tokens:
            raise ValueError(
                f"KVMemory: request {req.rid} holds {holding.tokens} tokens, {length} to cache"
            )
        start, row = holding.cached, holding.row
        slots = self.req_to_token_pool.req_to_token[row, :length].long()  # [length] copy
        key = self._key(req, length)
        mine = self._hand_over(holding, slots[start:])  # [length - start]
        holding.cached, holding.owned = length, holding.owned - (length - start)
        # The cache takes [n, length); [start, n) are duplicates. One walk of the key.
        n, match = cache.insert_and_match(key, slots)
        if not match.length == length >= n >= start:  # an error, also under python -O
            raise KVOwnershipError(
                f"prefix cache {type(cache).__module__}.{type(cache).__qualname__} broke its "
                f"contract: insert_and_match of a {length}-token key returned {n} cached (at "
                f"least {start}, the request's locked match) and a match of {match.length} "
                "tokens (the whole key): it must keep every token it is handed until evicted; "
                "its conformance suite (execrt conformance prefix_cache NAME) checks that"
            )
        if n > start:  # readers move to the cache's slots before the duplicates are freed
            self.req_to_token_pool.write(row, start, match.slots[start:n])
        if holding.node is not None:
            cache.unlock(holding.node)
            holding.node = None
        cache.lock(match.node)
        holding.node = match.node
        self._free_cached(mine[: n - start])

    def flush_cache(self) -> int:
        """Free every cached slot that no request reads; returns how many."""
        cache = self.prefix_cache
        return 0 if cache is None else cache.evict(cache.evictable_size())

    def close(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.close()

    def _key(self, req: Req, n: int) -> memoryview:
        """``req.fill_ids[:n]`` as the prefix cache's key: a read-only sequence of int over an
        int64 buffer (numpy reads it without a copy). The prompt is converted once per
        request, not at each lookup (admission, each chunk's hand-over, the finish)."""
        prompt = self._prompts.get(req)
        if prompt is None:
            prompt = self._prompts[req] = array("q", req.origin_input_ids)
        if n > len(prompt):
            prompt = prompt + array("q", req.output_ids[: n - len(prompt)])
        return cache_key(prompt, n)

    def _hand_over(self, holding: Holding, slots: torch.Tensor) -> torch.Tensor:
        """Record ``slots`` (a request's own) as the cache's in the debug map."""
        if self._holders is not None:
            self._holders.move(slots.tolist(), holding.holder, CACHE)
        return slots

    def _free_cached(self, slots: torch.Tensor) -> None:
        """The cache gives ``slots`` back (eviction, an insert's duplicates)."""
        if slots.numel() == 0:
            return
        if self._holders is not None:
            self._holders.drop(slots.tolist(), CACHE)
        self.allocator.free(slots)

    def _make_room(self, n: int) -> bool:
        """Make ``n`` slots free, evicting from the cache what is short; False (nothing
        evicted) when even evicting everything unlocked would not do."""
        short = n - self.free_slots
        if short <= 0:
            return True
        if self.prefix_cache is None or short > self.prefix_cache.evictable_size():
            return False
        self.prefix_cache.evict(short)
        return True

    # -- reservation --------------------------------------------------------------------------
    def reserve_extend(self, reqs: Sequence[Req], lens: Sequence[int]) -> StepInputs | None:
        """Slots for ``lens[i]`` new tokens of each request after its ``kv_len`` held ones,
        and a row for each request without one. None, with nothing changed, when rows or slots
        are short (evictable slots count as free: the cache evicts what is short); an
        exception leaves nothing changed either (but what was evicted)."""
        if not reqs or len(lens) != len(reqs) or min(lens) < 1:
            raise ValueError(
                f"KVMemory: extend lengths {list(lens)} must be >= 1, one per request "
                f"({len(reqs)} requests)"
            )
        found = [self._held.get(r) for r in reqs]
        for req, holding, n in zip(reqs, found, lens, strict=True):
            assert req.num_pending == 0, "a prefill needs every sampled token on the host"
            if req.kv_len + n > req.seq_len:
                raise ValueError(
                    f"KVMemory: request {req.rid} has {req.seq_len - req.kv_len} tokens to "
                    f"prefill, {n} requested"
                )
            self._check_room(req, holding, req.kv_len + n)
        if found.count(None) > self.available_rows or not self._make_room(sum(lens)):
            return None
        return self._reserve(
            reqs,
            found,
            lens,
            lambda slots, rows: extend_inputs(
                self.stager, self.req_to_token_pool, reqs, rows, lens, slots
            ),
        )

    def reserve_decode(
        self,
        reqs: Sequence[Req],
        input_ids: torch.Tensor | None = None,
        seq_lens: list[int] | None = None,
    ) -> StepInputs | None:
        """A slot for one new token of each request: its last sampled one, or ``input_ids``
        (``[B]`` on the device) when some were sampled but not yet copied back (overlap
        scheduling). ``seq_lens``: each request's ``scheduled_len``, when the caller knows
        them. None, with nothing changed, when slots are short."""
        if not reqs:
            raise ValueError("KVMemory: a decode step needs at least one request")
        held = self._held
        found = [held.get(r) for r in reqs]
        seq = [r.scheduled_len for r in reqs] if seq_lens is None else seq_lens
        limit = self.req_to_token_pool.max_context_len
        # One pass of plain comparisons per request; the message comes from the slow path.
        for req, holding, n in zip(reqs, found, seq, strict=True):
            if holding is None or req.kv_len != n - 1 or n > limit:
                self._decode_refusal(req, holding, n)
            assert holding.cached + holding.owned == req.kv_len, (
                f"request {req.rid} holds {holding.tokens} tokens, kv_len {req.kv_len}"
            )
        if not self._make_room(len(reqs)):
            return None
        return self._reserve(
            reqs,
            found,
            [1] * len(reqs),
            lambda slots, rows: decode_inputs(
                self.stager, self.req_to_token_pool, reqs, rows, slots, input_ids, seq
            ),
        )

    def _decode_refusal(self, req: Req, holding: Holding | None, seq_len: int) -> NoReturn:
        """Raise why ``req`` cannot decode to ``seq_len`` tokens."""
        if holding is None:
            raise ValueError(f"KVMemory: request {req.rid} decodes but holds no row")
        if req.kv_len != seq_len - 1:
            raise ValueError(
                f"KVMemory: request {req.rid} has {seq_len - req.kv_len} tokens "
                "without K/V; a decode step computes one"
            )
        self._check_room(req, holding, seq_len)
        raise AssertionError(f"request {req.rid}: a decode to {seq_len} tokens is fine")

    def _check_room(self, req: Req, holding: Holding | None, seq_len: int) -> None:
        held = 0 if holding is None else holding.tokens
        assert held == req.kv_len, f"request {req.rid} holds {held} tokens, kv_len {req.kv_len}"
        limit = self.req_to_token_pool.max_context_len
        if seq_len > limit:
            raise ValueError(
                f"KVMemory: request {req.rid} would hold {seq_len} tokens, a row holds {limit}"
            )

    def _reserve(
        self,
        reqs: Sequence[Req],
        found: list[Holding | None],
        lens: Sequence[int],
        build: Callable[[torch.Tensor, list[int]], StepInputs],
    ) -> StepInputs:
        """Take slots and rows for requests without one (``found[i]`` None), write the rows
        and stage (``build(slots, rows)``), then commit the counts; any exception undoes all
        of it."""
        before = [0 if h is None else h.owned for h in found]
        slots: torch.Tensor | None = None
        rows: list[int] = []
        claimed: list[int] = []
        try:
            slots = self.allocator.alloc(sum(lens))  # [T]
            assert slots is not None, "the caller counted the free slots"
            held: list[Holding] = []
            for req, holding in zip(reqs, found, strict=True):
                if holding is None:
                    row = self.req_to_token_pool.alloc()
                    assert row is not None, "the caller counted the free rows"
                    rows.append(row)
                    holding = self._held[req] = Holding(row, f"request {req.rid}")
                held.append(holding)
            inputs = build(slots, [h.row for h in held])
            if self._holders is not None:
                ids = slots.tolist()
                each = [h.holder for h, n in zip(held, lens, strict=True) for _ in range(n)]
                self._holders.claim(ids, each)
                claimed = ids
            for holding, n in zip(held, lens, strict=True):
                holding.owned += n
            return inputs
        except BaseException:
            for req, holding, owned in zip(reqs, found, before, strict=True):
                if holding is None:  # ownership first, then the frees (see the class docstring)
                    self._held.pop(req, None)
                else:
                    holding.owned = owned
            if self._holders is not None:
                self._holders.forget(claimed)
            for row in rows:
                self.req_to_token_pool.free(row)
            if slots is not None:
                self.allocator.free(slots)
            raise

    # -- giving back --------------------------------------------------------------------------
    def release(self, req: Req, keep: int = 0) -> None:
        """Give back everything ``req`` holds: its row, its lock on the cache, its slots. The
        K/V of its first ``keep`` tokens (computed, every step writing it done) goes to the
        prefix cache, the rest is freed; ``keep`` 0 (retraction, abort, error) frees only what
        ``req`` owns, never the cache's slots. Idempotent."""
        holding = self._held.get(req)
        if holding is None:
            return
        cache = self.prefix_cache
        if holding.node is not None:
            assert cache is not None, "a lock without a cache"
            cache.unlock(holding.node)
            holding.node = None
        # No longer held from here on: an interruption below loses what is left (reconcile
        # finds it), and a second release finds nothing to free twice.
        del self._held[req]
        start, keep = holding.cached, min(keep, holding.tokens)
        if cache is not None and keep > start:
            slots = self.req_to_token_pool.req_to_token[holding.row, :keep].long()  # [keep]
            mine = self._hand_over(holding, slots[start:])
            n = cache.insert(self._key(req, keep), slots)  # takes [n, keep)
            self._free_cached(mine[: n - start])  # duplicates of what others cached meanwhile
            start = keep
        self._free_range(holding, start, holding.tokens)
        self.req_to_token_pool.free(holding.row)
        if req.finished:
            self._prompts.pop(req, None)

    def _free_range(self, holding: Holding, start: int, end: int) -> None:
        """Free the slots of tokens ``start..end`` of ``holding``'s row (no longer counted)."""
        if end <= start:
            return
        slots = self.req_to_token_pool.req_to_token[holding.row, start:end].long()  # [n] copy
        if self._holders is not None:
            self._holders.drop(slots.tolist(), holding.holder)
        self.allocator.free(slots)

    def reconcile(self, live: Iterable[Req]) -> Reclaimed:
        """Repair ownership after an exception cut an operation short.

        Afterwards each request of ``live`` holds the slots of exactly its first ``kv_len``
        tokens (what a step reserved but never launched is given back; with ``kv_len`` 0 it
        holds nothing, not even a row), every other request holds nothing, and every slot
        and row that nobody holds (no request, not the prefix cache) is free. Raises
        KVOwnershipError when a slot or a row is held twice (a bug: interruptions lose, they
        never duplicate). Costs host arithmetic only when nothing was lost.
        """
        keep = set(live)
        for req in [r for r in self._held if r not in keep]:
            self.release(req)
        for req, holding in list(self._held.items()):
            if req.kv_len == 0:
                self.release(req)
            elif holding.tokens != req.kv_len:
                if holding.tokens < req.kv_len or req.kv_len < holding.cached:
                    raise KVOwnershipError(
                        f"KVMemory: request {req.rid} has kv_len {req.kv_len} but holds "
                        f"{holding.tokens} tokens ({holding.cached} of them cached)"
                    )
                end, holding.owned = holding.tokens, req.kv_len - holding.cached
                self._free_range(holding, req.kv_len, end)
        lost = self._reclaim() if self._counts_off() else Reclaimed(0, 0)
        if lost.slots or lost.rows:
            logger.warning(
                "KVMemory: freed %d slots and %d rows that no request held (an operation was "
                "interrupted)",
                lost.slots,
                lost.rows,
            )
        self.check()
        return lost

    def _counts_off(self) -> bool:
        rows = self.available_rows + len(self._held) != self.total_rows
        held = self.owned_slots + self.cached_slots
        mapped = self._holders is not None and len(self._holders) != held
        return rows or mapped or self.free_slots + held != self.total_slots

    def _reclaim(self) -> Reclaimed:
        """Free every slot and row that is neither free nor held; rebuild the debug map."""
        table = self.req_to_token_pool.req_to_token
        held = [table[h.row, h.cached : h.tokens].long() for h in self._held.values()]
        cached = [] if self.prefix_cache is None else [self.prefix_cache.cached_slots()]
        ids = torch.cat([self.allocator.free_slot_ids(), *held, *cached])  # [free + held]
        counts = torch.bincount(ids, minlength=self.total_slots + 1)  # [S + 1]
        counts[0] = 1  # the padding slot is never handed out
        twice = (counts > 1).nonzero().flatten().tolist()
        rows = Counter(self.req_to_token_pool.free_rows() + [h.row for h in self._held.values()])
        twice_rows = sorted(r for r, n in rows.items() if n > 1)
        if twice or twice_rows:
            raise KVOwnershipError(
                f"KVMemory: slots {twice[:8]} and rows {twice_rows[:8]} are each held twice"
            )
        lost = (counts == 0).nonzero().flatten()  # [n]
        self.allocator.free(lost)
        lost_rows = [r for r in range(1, self.total_rows + 1) if r not in rows]
        for row in lost_rows:
            self.req_to_token_pool.free(row)
        if self._holders is not None:
            holders = {slot: CACHE for slots in cached for slot in slots.tolist()}
            for h, slots in zip(self._held.values(), held, strict=True):
                holders.update(dict.fromkeys(slots.tolist(), h.holder))
            self._holders.reset(holders)
        return Reclaimed(int(lost.numel()), len(lost_rows))
