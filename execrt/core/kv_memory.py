"""KVMemory: the one holder of KV slots and request rows; all-or-nothing reservation per step."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from execrt.core import envs
from execrt.core.errors import KVOwnershipError
from execrt.core.memory import ReqToTokenPool, SlotHolders, TokenToKVPoolAllocator
from execrt.core.staging import HostToDevice
from execrt.core.step import ForwardMode, StepInputs

if TYPE_CHECKING:
    from execrt.core.prefix_cache import PrefixCache
    from execrt.core.schedule import Req

logger = logging.getLogger(__name__)


@dataclass
class Holding:
    """What one request holds: row ``row`` of ``req_to_token``, whose first ``tokens`` entries
    are the KV slots of its first tokens. The leading ``cached`` of them belong to the prefix
    cache (locked through ``node`` while the request reads them); the ``owned`` after them are
    the request's own. The counts grow only once the entries they cover were written, so
    freeing reads back only written entries."""

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

    Every slot is free (in the allocator) or held by exactly one request (later also by the
    prefix cache); so is every row. ``reserve_extend`` / ``reserve_decode`` take what one step
    needs for all its requests or nothing, record the slots in the requests' rows and return
    the step's ``StepInputs`` (every host integer staged in one copy). ``release`` gives back
    all a request holds and may be called any number of times. ``reconcile`` repairs what an
    exception (a KeyboardInterrupt at any point) cut short. ``check`` tests the invariant
    free + held == total, for slots and for rows.

    Operations give up ownership before they free, so an interruption can lose a slot or a
    row (``reconcile`` finds it) but never free one twice.

    ``req.kv_len`` (tokens whose K/V is computed, or being computed by a launched step) is
    read, never written: a step's new tokens follow a request's held ones, which must number
    ``kv_len``, and the caller advances ``kv_len`` when it launches the step.

    Prefix cache (not wired in yet, so ``prefix_cache`` must be None): a request's row will
    start with the cache's slots for its matched prefix (``Holding.cached``, locked), and a
    finished request will hand its slots to the cache instead of freeing them.
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        stager: HostToDevice,
        *,
        prefix_cache: PrefixCache | None = None,
        debug_ownership: bool | None = None,
    ) -> None:
        if prefix_cache is not None:
            raise NotImplementedError("KVMemory: a prefix cache is not wired in yet (issue 25)")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.stager = stager
        self.prefix_cache = prefix_cache
        self.device = req_to_token_pool.device
        self.total_slots = allocator.size  # sizes are fixed at build
        self.total_rows = req_to_token_pool.size
        self._held: dict[Req, Holding] = {}
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

    def check(self) -> None:
        """Raise KVOwnershipError unless free + owned == total slots and free + held == total
        rows (and, with the debug map, the map holds exactly the owned slots)."""
        free, owned, rows = self.free_slots, self.owned_slots, len(self._held)
        problems = []
        if free + owned != self.total_slots:
            problems.append(f"{free} free + {owned} owned slots != {self.total_slots}")
        if self.available_rows + rows != self.total_rows:
            problems.append(f"{self.available_rows} free + {rows} held rows != {self.total_rows}")
        if self._holders is not None and len(self._holders) != owned:
            problems.append(f"the debug map holds {len(self._holders)} slots, requests {owned}")
        if problems:
            raise KVOwnershipError("KVMemory: " + "; ".join(problems))

    # -- reservation --------------------------------------------------------------------------
    def reserve_extend(self, reqs: Sequence[Req], lens: Sequence[int]) -> StepInputs | None:
        """Slots for ``lens[i]`` new tokens of each request after its ``kv_len`` cached ones,
        and a row for each request without one. None, with nothing changed, when rows or slots
        are short; an exception leaves nothing changed either."""
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
        if found.count(None) > self.available_rows or sum(lens) > self.free_slots:
            return None
        return self._reserve(
            reqs, found, lens, lambda slots, rows: self._extend_inputs(reqs, rows, lens, slots)
        )

    def reserve_decode(
        self, reqs: Sequence[Req], input_ids: torch.Tensor | None = None
    ) -> StepInputs | None:
        """A slot for one new token of each request: its last sampled one, or ``input_ids``
        (``[B]`` on the device) when some were sampled but not yet copied back (overlap
        scheduling). None, with nothing changed, when slots are short."""
        if not reqs:
            raise ValueError("KVMemory: a decode step needs at least one request")
        found = [self._held.get(r) for r in reqs]
        for req, holding in zip(reqs, found, strict=True):
            if holding is None:
                raise ValueError(f"KVMemory: request {req.rid} decodes but holds no row")
            if req.kv_len != req.scheduled_len - 1:
                raise ValueError(
                    f"KVMemory: request {req.rid} has {req.scheduled_len - req.kv_len} tokens "
                    "without K/V; a decode step computes one"
                )
            self._check_room(req, holding, req.scheduled_len)
        if len(reqs) > self.free_slots:
            return None
        return self._reserve(
            reqs,
            found,
            [1] * len(reqs),
            lambda slots, rows: self._decode_inputs(reqs, rows, slots, input_ids),
        )

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

    def _extend_inputs(
        self, reqs: Sequence[Req], rows: list[int], lens: Sequence[int], slots: torch.Tensor
    ) -> StepInputs:
        ids: list[int] = []
        token_rows: list[int] = []
        positions: list[int] = []
        for req, row, n in zip(reqs, rows, lens, strict=True):
            start = req.kv_len
            ids += req.fill_ids[start : start + n]
            token_rows += [row] * n
            positions += range(start, start + n)
        prefix = [r.kv_len for r in reqs]
        seq = [p + n for p, n in zip(prefix, lens, strict=True)]
        t, b = len(ids), len(reqs)
        dev = self.stager(ids + rows + seq + token_rows + positions)  # one host->device copy
        pos = dev[2 * b + 2 * t :]  # [T]
        self.req_to_token_pool.write_tokens(dev[2 * b + t : 2 * b + 2 * t], pos, slots)
        return StepInputs(
            mode=ForwardMode.EXTEND,
            input_ids=dev[:t],
            positions=pos,
            req_pool_indices=dev[t : t + b],
            seq_lens=dev[t + b : t + 2 * b],
            out_cache_loc=slots,
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_lens_cpu=list(lens),
        )

    def _decode_inputs(
        self,
        reqs: Sequence[Req],
        rows: list[int],
        slots: torch.Tensor,
        input_ids: torch.Tensor | None,
    ) -> StepInputs:
        b = len(reqs)
        seq = [r.scheduled_len for r in reqs]
        last = [] if input_ids is not None else [r.last_token_id for r in reqs]
        dev = self.stager(last + rows + seq)  # one host->device copy
        k = len(last)
        req_pool_indices, seq_lens = dev[k : k + b], dev[k + b :]  # [B], [B]
        positions = seq_lens - 1  # [B]: where each request's new token goes
        self.req_to_token_pool.write_tokens(req_pool_indices, positions, slots)
        return StepInputs(
            mode=ForwardMode.DECODE,
            input_ids=dev[:b] if input_ids is None else input_ids,
            positions=positions,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=slots,
            seq_lens_cpu=seq,
            prefix_lens_cpu=[s - 1 for s in seq],
            extend_lens_cpu=[1] * b,
        )

    # -- giving back --------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Give back everything ``req`` holds: its slots and its row. Idempotent."""
        holding = self._held.pop(req, None)
        if holding is None:
            return
        # No longer held from here on: an interruption below loses what is left (reconcile
        # finds it), and a second release finds nothing to free twice.
        self._free_range(holding, holding.cached, holding.tokens)
        self.req_to_token_pool.free(holding.row)

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
        and row that nobody holds is free. Raises KVOwnershipError when a slot or a row is
        held twice (a bug: interruptions lose, they never duplicate). Costs host arithmetic
        only when nothing was lost.
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
        return rows or self.free_slots + self.owned_slots != self.total_slots

    def _reclaim(self) -> Reclaimed:
        """Free every slot and row that is neither free nor held; rebuild the debug map."""
        table = self.req_to_token_pool.req_to_token
        held = [table[h.row, h.cached : h.tokens].long() for h in self._held.values()]
        ids = torch.cat([self.allocator.free_slot_ids(), *held])  # [free + owned]
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
            self._holders.reset(
                {
                    slot: h.holder
                    for h, slots in zip(self._held.values(), held, strict=True)
                    for slot in slots.tolist()
                }
            )
        return Reclaimed(int(lost.numel()), len(lost_rows))
