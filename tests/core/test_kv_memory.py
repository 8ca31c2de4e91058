"""KVMemory: all-or-nothing reservation, idempotent release, reconciliation, the debug map, and
the prefix cache behind it (admission on a cached prefix, hand-over, eviction)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from execrt.backends.prefix_cache.radix import RadixCache
from execrt.core.errors import KVOwnershipError
from execrt.core.kv_memory import KVMemory, PrefixCacheFactory, Reclaimed
from execrt.core.memory import ReqToTokenPool, TokenToKVPoolAllocator
from execrt.core.prefix_cache import PrefixCacheCapabilities, PrefixCacheInit, PrefixMatch
from execrt.core.schedule import FinishReason, Req, SamplingParams
from execrt.core.staging import HostToDevice
from execrt.core.step import ForwardMode, StepInputs
from tests.core.fakes import HostReads

CPU = torch.device("cpu")


def radix(force_miss: bool = False) -> PrefixCacheFactory:
    def build(free: Callable[[torch.Tensor], None]) -> RadixCache:
        return RadixCache(PrefixCacheInit(PrefixCacheCapabilities(), CPU, free, force_miss))

    return build


def memory(
    rows: int = 4,
    slots: int = 20,
    context: int = 16,
    debug: bool = True,
    cache: PrefixCacheFactory | None = None,
) -> KVMemory:
    pool, alloc = ReqToTokenPool(rows, context, CPU), TokenToKVPoolAllocator(slots, CPU)
    return KVMemory(pool, alloc, HostToDevice(CPU), prefix_cache=cache, debug_ownership=debug)


def req(rid: int, prompt: list[int], **kw: Any) -> Req:
    return Req(rid, prompt, SamplingParams(), **kw)


def launched(reqs: list[Req], lens: list[int], tokens: list[int] | None = None) -> None:
    """What the scheduler does once a reserved step is launched and sampled."""
    for i, (r, n) in enumerate(zip(reqs, lens, strict=True)):
        r.kv_len += n
        if tokens is not None and r.kv_len == r.seq_len:
            r.output_ids.append(tokens[i])


def row_slots(mem: KVMemory, r: Req) -> list[int]:
    row = mem.row(r)
    assert row is not None
    return mem.req_to_token_pool.req_to_token[row, : mem.held_tokens(r)].tolist()


def state(mem: KVMemory, reqs: list[Req]) -> tuple[Any, ...]:
    """Everything a refused or failed reservation must leave as it was (free lists as sets:
    slots given back may come back in another order)."""
    held = tuple((mem.row(r), row_slots(mem, r) if mem.holds(r) else []) for r in reqs)
    free = sorted(mem.allocator.free_slot_ids().tolist())
    return free, sorted(mem.req_to_token_pool.free_rows()), held


def test_extend_takes_rows_and_slots_and_records_them_in_the_rows() -> None:
    mem = memory()
    a, b = req(0, [5, 6, 7]), req(1, [8, 9])
    inputs = mem.reserve_extend([a, b], [3, 2])
    assert inputs is not None and inputs.mode is ForwardMode.EXTEND
    assert inputs.input_ids.tolist() == [5, 6, 7, 8, 9] and inputs.seq_lens_cpu == [3, 2]
    assert inputs.positions.tolist() == [0, 1, 2, 0, 1]
    assert inputs.prefix_lens_cpu == [0, 0] and inputs.extend_lens_cpu == [3, 2]
    assert inputs.req_pool_indices.tolist() == [mem.row(a), mem.row(b)] == [1, 2]
    slots = inputs.out_cache_loc.tolist()
    assert sorted(slots) == list(range(1, 6))
    assert row_slots(mem, a) == slots[:3] and row_slots(mem, b) == slots[3:]
    assert (mem.free_slots, mem.owned_slots, mem.available_rows) == (15, 5, 2)
    mem.check()


def test_a_chunk_continues_after_the_tokens_already_held() -> None:
    mem = memory(rows=1)
    r = req(0, list(range(1, 7)))
    first = mem.reserve_extend([r], [4])
    assert first is not None
    launched([r], [4])
    second = mem.reserve_extend([r], [2])
    assert second is not None
    assert second.prefix_lens_cpu == [4] and second.seq_lens_cpu == [6]
    assert second.input_ids.tolist() == [5, 6] and second.positions.tolist() == [4, 5]
    assert row_slots(mem, r) == first.out_cache_loc.tolist() + second.out_cache_loc.tolist()


def test_a_refused_reservation_changes_nothing() -> None:
    mem = memory(rows=1, slots=4)
    reqs = [req(0, [1, 2, 3]), req(1, [4])]
    before = state(mem, reqs)
    assert mem.reserve_extend(reqs, [3, 1]) is None  # one row only
    assert mem.reserve_extend([req(2, [1] * 5)], [5]) is None  # 5 slots, 4 free
    assert state(mem, reqs) == before and not mem.holds(reqs[0])
    inputs = mem.reserve_extend(reqs[:1], [3])
    assert inputs is not None
    launched(reqs[:1], [3], [9])
    assert mem.reserve_decode(reqs[:1]) is not None  # the last slot
    launched(reqs[:1], [1], [9])
    held = state(mem, reqs)
    assert mem.reserve_decode(reqs[:1]) is None and state(mem, reqs) == held


def test_decode_feeds_each_requests_last_token_or_the_given_device_tokens() -> None:
    mem = memory()
    reqs = [req(0, [1, 2]), req(1, [3])]
    assert mem.reserve_extend(reqs, [2, 1]) is not None
    launched(reqs, [2, 1], [40, 41])
    dec = mem.reserve_decode(reqs)
    assert dec is not None and dec.mode is ForwardMode.DECODE
    assert dec.input_ids.tolist() == [40, 41] and dec.seq_lens_cpu == [3, 2]
    assert dec.positions.tolist() == [2, 1] and dec.seq_lens.tolist() == [3, 2]
    assert dec.prefix_lens_cpu == [2, 1] and dec.extend_lens_cpu == [1, 1]
    assert row_slots(mem, reqs[0])[2] == dec.out_cache_loc.tolist()[0]
    launched(reqs, [1, 1])
    for r in reqs:  # overlap: the next token is still on the device
        r.num_pending = 1
    on_device = torch.tensor([7, 8])
    dec = mem.reserve_decode(reqs, input_ids=on_device)
    assert dec is not None and dec.input_ids is on_device and dec.seq_lens_cpu == [4, 3]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, a: m.reserve_extend([a], [1, 2]), r"lengths \[1, 2\] must be >= 1, one per"),
        (lambda m, a: m.reserve_extend([a], [0]), r"lengths \[0\] must be >= 1"),
        (lambda m, a: m.reserve_extend([a], [4]), "request 0 has 3 tokens to prefill, 4 requested"),
        (lambda m, a: m.reserve_decode([a]), "request 0 decodes but holds no row"),
        (lambda m, a: m.reserve_decode([]), "a decode step needs at least one request"),
    ],
)
def test_bad_reservations_are_refused_naming_the_request(
    call: Callable[[KVMemory, Req], object], message: str
) -> None:
    mem = memory()
    with pytest.raises(ValueError, match=message):
        call(mem, req(0, [1, 2, 3]))
    assert mem.free_slots == 20 and mem.available_rows == 4


def test_a_request_may_not_outgrow_its_row_or_decode_more_than_one_token() -> None:
    mem = memory(context=4)
    r = req(0, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="request 0 would hold 5 tokens, a row holds 4"):
        mem.reserve_extend([r], [5])
    assert mem.reserve_extend([r], [2]) is not None
    launched([r], [2])
    with pytest.raises(ValueError, match="request 0 has 3 tokens without K/V; a decode step"):
        mem.reserve_decode([r])


def test_release_gives_everything_back_and_may_be_repeated() -> None:
    mem = memory()
    reqs = [req(0, [1, 2, 3]), req(1, [4, 5])]
    assert mem.reserve_extend(reqs, [3, 2]) is not None
    mem.release(reqs[0])
    assert not mem.holds(reqs[0]) and mem.held_tokens(reqs[0]) == 0 and mem.row(reqs[0]) is None
    assert (mem.free_slots, mem.available_rows) == (18, 3)
    mem.release(reqs[0])
    mem.release(req(7, [1]))  # never held anything
    assert (mem.free_slots, mem.available_rows) == (18, 3)
    mem.release(reqs[1])
    assert (mem.free_slots, mem.available_rows, mem.owned_slots) == (20, 4, 0)
    mem.check()


# -- a reservation that fails part-way --------------------------------------------------------
STAGES = ["slots", "row", "stager", "write_tokens"]


def fail_in(mem: KVMemory, stage: str, exc: BaseException, mp: pytest.MonkeyPatch) -> None:
    """Make one stage of a reservation raise ``exc`` (after what comes before it was taken)."""

    def boom(*args: object, **kwargs: object) -> Any:
        raise exc

    if stage == "slots":
        mp.setattr(mem.allocator, "alloc", boom)
    elif stage == "row":
        mp.setattr(mem.req_to_token_pool, "alloc", boom)
    elif stage == "stager":
        mp.setattr(mem, "stager", boom)
    else:
        mp.setattr(mem.req_to_token_pool, "write_tokens", boom)


@pytest.mark.parametrize("exc", [RuntimeError("device lost"), KeyboardInterrupt()])
@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_extend_changes_nothing(stage: str, exc: BaseException) -> None:
    mem = memory()
    held = req(0, [1, 2, 3, 4])  # mid-prefill: keeps its row and its two tokens
    assert mem.reserve_extend([held], [2]) is not None
    launched([held], [2])
    reqs = [held, req(1, [5, 6]), req(2, [7, 8, 9])]
    before = state(mem, reqs)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(type(exc)):
        fail_in(mem, stage, exc, mp)
        mem.reserve_extend(reqs, [2, 2, 3])
    assert state(mem, reqs) == before and mem.held_tokens(held) == 2
    assert not mem.holds(reqs[1]) and not mem.holds(reqs[2])
    mem.check()


@pytest.mark.parametrize("stage", ["slots", "stager", "write_tokens"])
def test_a_failed_decode_changes_nothing(stage: str) -> None:
    mem = memory()
    reqs = [req(i, [1, 2]) for i in range(3)]
    assert mem.reserve_extend(reqs, [2, 2, 2]) is not None
    launched(reqs, [2, 2, 2], [3, 3, 3])
    before = state(mem, reqs)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(KeyboardInterrupt):
        fail_in(mem, stage, KeyboardInterrupt(), mp)
        mem.reserve_decode(reqs)
    assert state(mem, reqs) == before
    mem.check()


# -- reconciliation ---------------------------------------------------------------------------
def test_reconcile_frees_what_no_live_request_holds_and_trims_unlaunched_steps() -> None:
    mem = memory()
    gone, chunked, fresh = req(0, [1, 2, 3]), req(1, [4, 5, 6, 7]), req(2, [8, 9])
    assert mem.reserve_extend([gone, chunked], [3, 2]) is not None
    launched([gone, chunked], [3, 2])
    kept = row_slots(mem, chunked)
    # A step reserved but never launched: a second chunk and a new request.
    assert mem.reserve_extend([chunked, fresh], [2, 2]) is not None
    assert mem.reconcile([chunked, fresh]) == Reclaimed(0, 0)
    assert not mem.holds(gone) and not mem.holds(fresh)  # fresh has kv_len 0: no row either
    assert row_slots(mem, chunked) == kept and mem.owned_slots == 2
    assert (mem.free_slots, mem.available_rows) == (18, 3)


def test_reconcile_finds_slots_and_rows_an_interrupted_release_lost() -> None:
    # Issue 30 C in miniature: the interrupt lands inside the free itself.
    mem = memory()
    a, b = req(0, [1, 2, 3]), req(1, [4, 5])
    assert mem.reserve_extend([a, b], [3, 2]) is not None
    launched([a, b], [3, 2])
    with pytest.MonkeyPatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(mem.allocator, "free", _raise_keyboard_interrupt)
        mem.release(a)
    assert not mem.holds(a) and mem.free_slots == 15  # a's 3 slots and its row: nobody's
    with pytest.raises(KVOwnershipError, match="15 free \\+ 2 owned \\+ 0 cached slots != 20"):
        mem.check()
    mem.release(a)  # a second release finds nothing: it cannot free twice
    assert mem.reconcile([b]) == Reclaimed(slots=3, rows=1)
    assert (mem.free_slots, mem.available_rows) == (18, 3) and mem.held_tokens(b) == 2
    mem.check()


def test_reconcile_refuses_a_slot_held_twice() -> None:
    mem = memory(debug=False)
    a = req(0, [1, 2, 3])
    inputs = mem.reserve_extend([a], [3])
    assert inputs is not None
    launched([a], [3])
    mem.allocator.free(inputs.out_cache_loc[:1])  # a bug: freed behind KVMemory's back
    with pytest.raises(KVOwnershipError, match=r"slots \[\d+\] and rows \[\] are each held twice"):
        mem.reconcile([a])


def test_reconcile_refuses_a_live_request_that_holds_less_than_it_computed() -> None:
    mem = memory()
    a = req(0, [1, 2, 3])
    assert mem.reserve_extend([a], [2]) is not None
    a.kv_len = 3  # claims a token it never reserved
    with pytest.raises(KVOwnershipError, match="request 0 has kv_len 3 but holds 2 tokens"):
        mem.reconcile([a])


# -- the debug map ----------------------------------------------------------------------------
def hand_a_held_slot_out_again(mem: KVMemory) -> Req:
    """Request 0 holds a slot that is also the only free one; returns request 1, about to
    take it."""
    a = req(0, [1, 2])
    inputs = mem.reserve_extend([a], [2])
    assert inputs is not None
    launched([a], [2])
    mem.allocator.free(inputs.out_cache_loc[:1])  # a bug: a's slot back in the free list
    while mem.free_slots > 1:  # hand out everything else
        assert mem.allocator.alloc(1) is not None
    return req(1, [3])


def test_the_debug_map_raises_on_a_slot_handed_to_two_holders() -> None:
    mem = memory()
    b = hand_a_held_slot_out_again(mem)
    with pytest.raises(KVOwnershipError, match=r"slot \d+ handed to request 1, held by request 0"):
        mem.reserve_extend([b], [1])
    assert not mem.holds(b) and mem.free_slots == 1  # the failed reservation was undone


def test_the_debug_map_raises_on_a_double_free() -> None:
    mem = memory()
    a = req(0, [1, 2])
    assert mem.reserve_extend([a], [2]) is not None
    launched([a], [2])
    row = mem.row(a)
    assert row is not None
    table = mem.req_to_token_pool.req_to_token
    table[row, 1] = table[row, 0]  # a bug: the row names one slot twice
    with pytest.raises(KVOwnershipError, match=r"request 0 frees slot \d+, already free"):
        mem.release(a)


@pytest.mark.parametrize("flag, checked", [("1", True), ("0", False), ("", False)])
def test_the_debug_map_is_on_when_the_variable_says_so(monkeypatch, flag, checked) -> None:
    monkeypatch.setenv("EXECRT_DEBUG_KV_OWNERSHIP", flag)
    pool, alloc = ReqToTokenPool(2, 4, CPU), TokenToKVPoolAllocator(4, CPU)
    mem = KVMemory(pool, alloc, HostToDevice(CPU))
    b = hand_a_held_slot_out_again(mem)
    if checked:
        with pytest.raises(KVOwnershipError, match="handed to request 1, held by request 0"):
            mem.reserve_extend([b], [1])
    else:  # unchecked, the bug goes through: two requests share one slot
        assert mem.reserve_extend([b], [1]) is not None


# -- random sequences -------------------------------------------------------------------------
class Model:
    """The reference: which slots each request holds, kept from what reservations returned."""

    def __init__(self, mem: KVMemory, reqs: list[Req]) -> None:
        self.mem, self.reqs = mem, reqs
        self.slots: dict[int, list[int]] = {r.rid: [] for r in reqs}

    def verify(self) -> None:
        mem = self.mem
        mem.check()
        held = [s for r in self.reqs for s in self.slots[r.rid]]
        free = mem.allocator.free_slot_ids().tolist()
        assert sorted(free + held) == list(range(1, mem.total_slots + 1)), "a slot lost or twice"
        rows = [row for row in map(mem.row, self.reqs) if row is not None]
        free_rows = mem.req_to_token_pool.free_rows()
        assert sorted(free_rows + rows) == list(range(1, mem.total_rows + 1)), "a row lost"
        for r in self.reqs:
            assert mem.held_tokens(r) == len(self.slots[r.rid]) == r.kv_len, r.rid
            if mem.holds(r):
                assert row_slots(mem, r) == self.slots[r.rid]


def reserve(mem: KVMemory, op: str, picked: list[Req], lens: list[int], stage: str | None) -> Any:
    """The reservation, with ``stage`` failing (KeyboardInterrupt): its inputs, None when
    refused, "interrupted" when it raised."""
    with pytest.MonkeyPatch.context() as mp:
        if stage is not None:
            fail_in(mem, stage, KeyboardInterrupt(), mp)
        try:
            if op == "extend":
                return mem.reserve_extend(picked, lens)
            return mem.reserve_decode(picked)
        except KeyboardInterrupt:
            return "interrupted"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), rows=st.integers(1, 4), slots=st.integers(1, 24))
def test_random_reserve_and_release_sequences_keep_every_slot_held_once(
    data: st.DataObject, rows: int, slots: int
) -> None:
    context = 12
    mem = memory(rows=rows, slots=slots, context=context)
    prompts = data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=6), label="prompts")
    reqs = [req(i, [i + 1] * n) for i, n in enumerate(prompts)]
    model = Model(mem, reqs)
    for _ in range(data.draw(st.integers(5, 40), label="ops")):
        op = data.draw(st.sampled_from(["extend", "decode", "release", "interrupt", "reconcile"]))
        if op in ("extend", "decode"):
            if op == "extend":
                ready = [r for r in reqs if r.kv_len < r.seq_len]
            else:  # a decode follows a step that computed all but the last sampled token
                ready = [r for r in reqs if mem.holds(r) and r.kv_len == r.seq_len - 1]
            ready = [r for r in ready if r.seq_len < context]
            if not ready:
                continue
            picked = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
            lens = [data.draw(st.integers(1, r.seq_len - r.kv_len)) for r in picked]
            stage = data.draw(st.sampled_from([None] * 4 + STAGES), label="fails in")
            new_rows = sum(not mem.holds(r) for r in picked)
            fits = sum(lens) <= mem.free_slots and new_rows <= mem.available_rows
            before = state(mem, reqs)
            inputs = reserve(mem, op, picked, lens, stage)
            event(f"{op}: {'reserved' if isinstance(inputs, StepInputs) else inputs}")
            if inputs is None or inputs == "interrupted":  # all or nothing
                assert state(mem, reqs) == before
                assert fits == (inputs == "interrupted"), (fits, inputs)
                continue
            assert fits and (stage is None or stage == "row" and new_rows == 0)
            out = inputs.out_cache_loc.tolist()
            for r, n in zip(picked, lens, strict=True):
                model.slots[r.rid] += out[:n]
                out = out[n:]
            launched(picked, lens, [0] * len(picked))
        elif op == "release":
            r = data.draw(st.sampled_from(reqs))
            mem.release(r)
            r.kv_len, model.slots[r.rid] = 0, []
        elif op == "interrupt":  # a release cut short inside the free, then the repair
            r = data.draw(st.sampled_from(reqs))
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(mem.allocator, "free", _raise_keyboard_interrupt)
                try:
                    mem.release(r)
                except KeyboardInterrupt:
                    pass
            r.kv_len, model.slots[r.rid] = 0, []
            mem.reconcile(reqs)
        else:
            live = data.draw(st.lists(st.sampled_from(reqs), unique=True), label="live")
            mem.reconcile(live)
            for r in reqs:
                if r not in live:
                    r.kv_len, model.slots[r.rid] = 0, []
        model.verify()


def _raise_keyboard_interrupt(*args: object) -> None:
    raise KeyboardInterrupt


# -- the prefix cache -------------------------------------------------------------------------
def computed(mem: KVMemory, r: Req, n: int | None = None) -> list[int]:
    """Prefill ``r`` (all its known tokens, or ``n``) after what it holds; its row's slots."""
    n = r.seq_len - r.kv_len if n is None else n
    assert mem.reserve_extend([r], [n]) is not None
    launched([r], [n])
    return row_slots(mem, r)


def cached_alone(mem: KVMemory, prompt: list[int], rid: int = 90) -> list[int]:
    """A request over ``prompt`` prefilled and finished: its K/V goes to the cache."""
    r = req(rid, prompt)
    slots = computed(mem, r)
    mem.release(r, keep=r.kv_len)
    return slots


def sizes(mem: KVMemory) -> tuple[int, int, int, int]:
    """(free, owned, evictable, protected)"""
    cache = mem.prefix_cache
    assert cache is not None
    return mem.free_slots, mem.owned_slots, cache.evictable_size(), cache.protected_size()


def test_admission_starts_a_request_on_its_cached_prefix_but_never_its_last_token() -> None:
    mem = memory(cache=radix())
    first = cached_alone(mem, [1, 2, 3, 4, 5, 6])
    assert sizes(mem) == (14, 0, 6, 0) and mem.available_slots == 20
    same, branch, other = req(0, [1, 2, 3, 4, 5, 6]), req(1, [1, 2, 3, 9]), req(2, [7, 8])
    assert mem.admit(same) == 5  # the sixth token's logits must be computed
    assert row_slots(mem, same) == first[:5] and mem.cached_tokens(same) == 5
    assert sizes(mem) == (14, 0, 1, 5) and mem.available_slots == 15  # locked: not available
    assert mem.admit(branch) == 3 and row_slots(mem, branch) == first[:3]
    assert mem.admit(other) == 0 and not mem.holds(other)  # a miss takes nothing, not a row
    same.kv_len = 5
    inputs = mem.reserve_extend([same], [1])
    assert inputs is not None and inputs.prefix_lens_cpu == [5] and inputs.input_ids.tolist() == [6]
    with pytest.raises(ValueError, match="request 0 is admitted but already holds a row"):
        mem.admit(same)
    mem.release(branch)  # undoes the admission: the lock and the row, nothing freed
    assert sizes(mem) == (13, 1, 1, 5) and mem.available_rows == 3
    mem.check()


def test_admission_needs_a_free_row() -> None:
    mem = memory(rows=1, cache=radix())
    cached_alone(mem, [1, 2, 3])
    holder = req(0, [4, 5])
    computed(mem, holder)
    assert mem.admit(req(1, [1, 2, 3])) == 0 and sizes(mem)[3] == 0  # nothing locked


def test_a_chunk_handed_over_points_the_row_at_the_cached_slots_before_freeing_its_own() -> None:
    mem = memory(cache=radix())
    a, b = req(0, [1, 2, 3, 4, 5, 6]), req(1, [1, 2, 3, 4, 5, 6])
    assert mem.reserve_extend([a, b], [4, 4]) is not None  # both compute [1, 2, 3, 4]
    launched([a, b], [4, 4])
    a_slots, b_slots = row_slots(mem, a), row_slots(mem, b)
    mem.cache_prefix(a, 4)
    assert mem.cached_tokens(a) == 4 and sizes(mem) == (12, 4, 0, 4)
    frees: list[tuple[list[int], list[int]]] = []  # (slots freed, b's row at that moment)
    real_free = mem.allocator.free

    def spy(slots: torch.Tensor) -> None:
        frees.append((slots.tolist(), row_slots(mem, b)))
        real_free(slots)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mem.allocator, "free", spy)
        mem.cache_prefix(b, 4)  # a inserted them first: b's are duplicates
    assert frees == [(b_slots, a_slots)], "b's slots freed while its row still named them"
    assert mem.cached_tokens(b) == 4 and sizes(mem) == (16, 0, 0, 4)
    computed(mem, b)  # the rest of b, on top of the cached four
    mem.cache_prefix(b, 6)  # b's lock moves to the longer path
    assert sizes(mem) == (14, 0, 0, 6)
    mem.release(a)
    mem.release(b, keep=6)
    assert sizes(mem) == (14, 0, 6, 0)
    mem.check()


def test_a_cache_that_drops_what_it_is_handed_is_a_kv_ownership_error() -> None:
    """A plugin that returns a short match from insert_and_match (it kept fewer tokens than
    it was handed: a capacity of its own) is an error that names it, under ``python -O``
    too (it was an assert: a silent slot leak there)."""

    class Dropping(RadixCache):
        def insert_and_match(self, key: Any, slots: torch.Tensor) -> tuple[int, PrefixMatch]:
            n, m = super().insert_and_match(key, slots)
            return n, PrefixMatch(m.slots[:-1], m.node)

    def build(free: Callable[[torch.Tensor], None]) -> RadixCache:
        return Dropping(PrefixCacheInit(PrefixCacheCapabilities(), CPU, free, False))

    mem = memory(cache=build)
    a = req(0, [1, 2, 3, 4, 5, 6])
    assert mem.reserve_extend([a], [4]) is not None
    launched([a], [4])
    with pytest.raises(KVOwnershipError, match=r"Dropping broke its contract.*returned 0 cached"):
        mem.cache_prefix(a, 4)


def test_release_without_keep_frees_only_what_the_request_owns() -> None:
    mem = memory(cache=radix())
    cached = cached_alone(mem, [1, 2, 3, 4])
    r = req(0, [1, 2, 3, 4, 5, 6])
    r.kv_len = mem.admit(r)
    assert r.kv_len == 4 and computed(mem, r)[:4] == cached
    mem.release(r)  # a retraction or an abort: the cache keeps its slots
    assert sizes(mem) == (16, 0, 4, 0)
    mem.check()


def test_force_miss_hands_a_request_to_the_cache_only_when_it_finishes() -> None:
    mem = memory(cache=radix(force_miss=True))
    cached_alone(mem, [1, 2, 3, 4])
    r = req(0, [1, 2, 3, 4, 5])
    assert mem.admit(r) == 0 and not mem.holds(r)
    computed(mem, r)
    mem.cache_prefix(r, 5)  # nothing would read the cache's copy: r keeps its own
    assert sizes(mem) == (11, 5, 4, 0)
    mem.release(r, keep=5)  # [1..4] were cached: r's four duplicates are freed, [5] is taken
    assert sizes(mem) == (15, 0, 5, 0)
    mem.check()


def test_a_cache_that_never_reuses_gets_a_request_only_when_it_finishes() -> None:
    # A cache that declares reuses=False never matches, so the hand-over after a prefill
    # chunk (insert_and_match, then locking the whole key's match) cannot apply: as under
    # force_miss, its K/V goes to the cache when it finishes.
    class NeverMatches(RadixCache):
        def match(self, key: Any) -> PrefixMatch:
            super().match(key)
            return PrefixMatch(self._empty, self._root)

        def insert_and_match(self, key: Any, slots: torch.Tensor) -> tuple[int, PrefixMatch]:
            return self.insert(key, slots), PrefixMatch(self._empty, self._root)

    caps = PrefixCacheCapabilities(reuses=False)
    mem = memory(cache=lambda free: NeverMatches(PrefixCacheInit(caps, CPU, free)))
    assert not mem.reuses
    r = req(0, [1, 2, 3, 4, 5])
    assert mem.admit(r) == 0
    computed(mem, r)
    mem.cache_prefix(r, 5)
    assert sizes(mem) == (15, 5, 0, 0)
    mem.release(r, keep=5)
    assert sizes(mem) == (15, 0, 5, 0)
    mem.check()


def test_a_reservation_evicts_what_it_is_short_of_and_nothing_when_that_would_not_do() -> None:
    mem = memory(slots=10, cache=radix())
    first = cached_alone(mem, [1, 2, 3, 4, 5, 6])
    locker = req(0, [1, 2, 3, 9])
    locker.kv_len = mem.admit(locker)
    assert sizes(mem) == (4, 0, 3, 3) and mem.available_slots == 7
    big = req(1, [7] * 8)
    assert mem.reserve_extend([big], [8]) is None
    assert sizes(mem) == (4, 0, 3, 3), "a refused reservation evicted"
    assert mem.reserve_extend([big], [7]) is not None
    assert sizes(mem) == (0, 7, 0, 3)  # the unlocked [4, 5, 6] went, the locked path stayed
    assert row_slots(mem, locker) == first[:3] and not set(first[:3]) & set(row_slots(mem, big))
    mem.check()


def test_flush_cache_frees_every_slot_no_request_reads() -> None:
    assert memory().flush_cache() == 0  # no cache
    mem = memory(cache=radix())
    cached_alone(mem, [1, 2, 3, 4])
    cached_alone(mem, [5, 6, 7])
    r = req(0, [1, 2, 3, 4, 8])
    r.kv_len = mem.admit(r)
    assert mem.flush_cache() == 3 and sizes(mem) == (16, 0, 0, 4)
    mem.release(r)
    assert mem.flush_cache() == 4 and mem.free_slots == 20 and mem.flush_cache() == 0
    mem.check()


def test_the_debug_map_knows_the_caches_slots() -> None:
    mem = memory(cache=radix())
    r = req(0, [1, 2, 3])
    computed(mem, r)
    mem.cache_prefix(r, 3)
    holding = mem._held[r]
    holding.cached, holding.owned = 0, 3  # a bug: the request takes the cache's slots for its own
    with pytest.raises(KVOwnershipError, match=r"request 0 frees slot \d+, held by prefix cache"):
        mem.release(r)


def test_reconcile_counts_the_caches_slots_and_finds_what_an_interrupted_eviction_lost() -> None:
    mem = memory(slots=8, cache=radix())
    cached_alone(mem, [1, 2, 3, 4, 5, 6])
    assert mem.reconcile([]) == Reclaimed(0, 0) and sizes(mem) == (2, 0, 6, 0)
    r = req(0, [7] * 5)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(mem.allocator, "free", _raise_keyboard_interrupt)
        mem.reserve_extend([r], [5])  # evicts, and the free of what it evicted is cut short
    assert sizes(mem) == (2, 0, 0, 0) and not mem.holds(r)
    with pytest.raises(KVOwnershipError, match=r"2 free \+ 0 owned \+ 0 cached slots != 8"):
        mem.check()
    assert mem.reconcile([]) == Reclaimed(slots=6, rows=0)
    assert mem.free_slots == 8
    mem.check()


class CachedModel:
    """The reference with a prefix cache: what each slot's K/V was computed for (the token at
    its position, written at reservation as a step would), so a row that names a freed,
    reused or wrong slot reads the wrong tokens."""

    def __init__(self, mem: KVMemory, reqs: list[Req]) -> None:
        self.mem, self.reqs = mem, reqs
        self.token = torch.full((mem.total_slots + 1,), -1, dtype=torch.int64)  # per slot

    def computed(self, inputs: StepInputs) -> None:
        self.token[inputs.out_cache_loc] = inputs.input_ids

    def verify(self) -> None:
        mem, cache = self.mem, self.mem.prefix_cache
        assert cache is not None
        mem.check()
        table = mem.req_to_token_pool.req_to_token
        owned: list[int] = []
        for r in self.reqs:
            if (row := mem.row(r)) is not None:
                owned += table[row, mem.cached_tokens(r) : mem.held_tokens(r)].tolist()
        parts = mem.allocator.free_slot_ids().tolist() + cache.cached_slots().tolist()
        parts += owned
        assert sorted(parts) == list(range(1, mem.total_slots + 1)), "a slot lost or twice"
        free, cached = set(parts[: mem.free_slots]), set(cache.cached_slots().tolist())
        for r in self.reqs:
            assert mem.held_tokens(r) == r.kv_len, r.rid
            if mem.holds(r):
                reads = row_slots(mem, r)
                assert not free & set(reads), f"request {r.rid} reads freed slots"
                assert set(reads[: mem.cached_tokens(r)]) <= cached, f"request {r.rid}: not cached"
                seen = self.token[reads].tolist()
                assert seen == r.fill_ids[: r.kv_len], f"request {r.rid} reads the wrong K/V"


#: Where a hand-over to the cache may be cut short: (owner, attribute) of the call that raises.
HANDOVER_CALLS: dict[str, Callable[[KVMemory], tuple[Any, str]]] = {
    "insert": lambda m: (m.prefix_cache, "insert"),  # release's
    "insert_and_match": lambda m: (m.prefix_cache, "insert_and_match"),  # cache_prefix's
    "lock": lambda m: (m.prefix_cache, "lock"),
    "unlock": lambda m: (m.prefix_cache, "unlock"),
    "write": lambda m: (m.req_to_token_pool, "write"),
    "free": lambda m: (m.allocator, "free"),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), rows=st.integers(1, 4), slots=st.integers(1, 24), force_miss=st.booleans())
def test_random_sequences_with_a_prefix_cache_keep_every_slot_in_one_state(
    data: st.DataObject, rows: int, slots: int, force_miss: bool
) -> None:
    context = 12
    mem = memory(rows=rows, slots=slots, context=context, cache=radix(force_miss))
    # Two token values only: prompts share prefixes often.
    prompts = data.draw(
        st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=8), min_size=1, max_size=6),
        label="prompts",
    )
    reqs = [req(i, p) for i, p in enumerate(prompts)]
    model = CachedModel(mem, reqs)
    ops = ["admit", "extend", "decode", "hand over", "finish", "abort", "evict", "cut short"]
    hits = cuts = 0
    for _ in range(data.draw(st.integers(10, 60), label="ops")):
        op = data.draw(st.sampled_from(ops))
        if op == "admit":
            free = [r for r in reqs if not mem.holds(r)]
            if free:
                r = data.draw(st.sampled_from(free))
                r.kv_len = mem.admit(r)
                hits += r.kv_len > 0
                assert not (force_miss and r.kv_len)
        elif op in ("extend", "decode"):
            if op == "extend":
                ready = [r for r in reqs if r.kv_len < r.seq_len]
            else:
                ready = [r for r in reqs if mem.holds(r) and r.kv_len == r.seq_len - 1]
            ready = [r for r in ready if r.seq_len < context]
            if not ready:
                continue
            picked = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
            for r in picked:  # as the scheduler does: a request holding nothing is admitted
                if not mem.holds(r):
                    r.kv_len = mem.admit(r)
                    hits += r.kv_len > 0
            lens = [data.draw(st.integers(1, r.seq_len - r.kv_len)) for r in picked]
            fits = sum(lens) <= mem.available_slots
            fits &= sum(not mem.holds(r) for r in picked) <= mem.available_rows
            held = [(mem.row(r), mem.held_tokens(r)) for r in reqs]
            stage = data.draw(st.sampled_from([None] * 4 + STAGES), label="fails in")
            inputs = reserve(mem, op, picked, lens, stage)
            if inputs is None or inputs == "interrupted":  # all or nothing (eviction aside)
                assert fits == (inputs == "interrupted"), (fits, inputs)
                assert [(mem.row(r), mem.held_tokens(r)) for r in reqs] == held
            if isinstance(inputs, StepInputs):
                model.computed(inputs)
                launched(picked, lens, [data.draw(st.integers(1, 2)) for _ in picked])
                if op == "extend" and data.draw(st.booleans(), label="hand the step over"):
                    for r, done in zip(picked, inputs.seq_lens_cpu, strict=True):
                        mem.cache_prefix(r, done)  # as the scheduler does once it is done
        elif op in ("hand over", "finish", "abort"):
            held = [r for r in reqs if mem.holds(r)]
            if not held:
                continue
            r = data.draw(st.sampled_from(held))
            if op == "hand over":
                mem.cache_prefix(r, data.draw(st.integers(0, r.kv_len), label="length"))
            else:
                keep = data.draw(st.integers(0, r.kv_len), label="keep") if op == "finish" else 0
                mem.release(r, keep)
                r.kv_len = 0
        elif op == "evict":
            assert mem.prefix_cache is not None
            mem.prefix_cache.evict(data.draw(st.integers(0, slots)))
        else:  # a hand-over cut short at one of its calls; the request is aborted, then repair
            held = [r for r in reqs if mem.holds(r) and r.kv_len > mem.cached_tokens(r)]
            if not held:
                continue
            r = data.draw(st.sampled_from(held))
            call = data.draw(st.sampled_from(sorted(HANDOVER_CALLS)), label="cut at")
            finish = data.draw(st.booleans(), label="finishing")
            owner, name = HANDOVER_CALLS[call](mem)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(owner, name, _raise_keyboard_interrupt)
                try:
                    if finish:
                        mem.release(r, keep=r.kv_len)
                    else:
                        mem.cache_prefix(r, r.kv_len)
                except KeyboardInterrupt:
                    event(f"cut short at {call}")
                    cuts += 1
            mem.release(r)
            r.kv_len = 0
            mem.reconcile(reqs)
        model.verify()
    target(float(hits), label="admissions on a cached prefix")
    target(float(cuts), label="hand-overs cut short")
    event(f"{min(hits, 3)}+ hits")
    for r in reqs:
        mem.release(r)
    cached = mem.cached_slots
    assert mem.flush_cache() == cached and mem.free_slots == slots  # nothing locked is left
    mem.check()


@pytest.mark.parametrize(
    "call, finish",
    [(c, False) for c in ("free", "insert_and_match", "lock", "unlock", "write")]
    + [(c, True) for c in ("free", "insert", "unlock")],
)
def test_a_hand_over_cut_short_at_any_call_loses_nothing_for_good(call: str, finish: bool) -> None:
    # b's hand-over makes every call: b holds a locked cached prefix, and a inserted b's
    # computed tokens first, so b's are duplicates (rewrite, then free).
    mem = memory(cache=radix())
    cached_alone(mem, [1, 2, 3, 4])
    a, b = req(0, [1, 2, 3, 4, 5, 6, 7, 8]), req(1, [1, 2, 3, 4, 5, 6, 7, 8])
    a.kv_len, b.kv_len = mem.admit(a), mem.admit(b)
    assert mem.reserve_extend([a, b], [3, 3]) is not None
    launched([a, b], [3, 3])
    mem.cache_prefix(a, 7)
    owner, name = HANDOVER_CALLS[call](mem)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, name, _raise_keyboard_interrupt)
        with pytest.raises(KeyboardInterrupt):
            if finish:
                mem.release(b, keep=7)
            else:
                mem.cache_prefix(b, 7)
    mem.release(b)  # the scheduler aborts b
    mem.reconcile([a])
    assert mem.prefix_cache is not None
    assert row_slots(mem, a)[:7] == mem.prefix_cache.match([1, 2, 3, 4, 5, 6, 7]).slots.tolist()
    mem.release(a, keep=7)
    assert mem.cached_slots == mem.evictable_slots == 7, "a lock was left behind"
    assert mem.flush_cache() == 7 and mem.free_slots == 20
    mem.check()


def test_with_a_prefix_cache_no_operation_reads_slot_ids_back_to_the_host() -> None:
    # On a GPU each read would make the host wait for the device, stalling the scheduler that
    # builds step N+1 while step N runs. Admission, reservation, the hand-over of a chunk
    # (duplicates freed), decode, finish, retraction, eviction and flush read none; only the
    # debug map and the allocator's id check do, both off here (as on a GPU by default).
    pool = ReqToTokenPool(4, 16, CPU)
    alloc = TokenToKVPoolAllocator(16, CPU, check_ids=False)
    mem = KVMemory(pool, alloc, HostToDevice(CPU), prefix_cache=radix(), debug_ownership=False)
    a, b = req(0, [1, 2, 3, 4, 5, 6, 7, 8]), req(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    evicting = req(2, [5] * 10)
    with HostReads() as reads:
        assert mem.reserve_extend([a], [6]) is not None  # a chunk of a
        launched([a], [6])
        mem.cache_prefix(a, 6)
        b.kv_len = mem.admit(b)
        assert b.kv_len == 6
        assert mem.reserve_extend([a, b], [2, 3]) is not None  # both compute 7 and 8
        launched([a, b], [2, 3], tokens=[40, 41])
        mem.cache_prefix(a, 8)
        mem.cache_prefix(b, 9)  # 7 and 8 are duplicates of a's: rewritten, then freed
        assert mem.reserve_decode([a, b]) is not None
        launched([a, b], [1, 1], tokens=[42, 43])
        a.finish_reason = FinishReason.LENGTH
        mem.release(a, keep=a.kv_len)  # finished: its K/V to the cache
        mem.release(b)  # retracted: frees only its own
        assert mem.free_slots < 10 <= mem.available_slots
        assert mem.reserve_extend([evicting], [10]) is not None  # evicts what is short
        launched([evicting], [10])
        mem.release(evicting)
        assert mem.flush_cache() > 0
    assert reads.seen == []
    assert mem.free_slots == 16
    mem.check()


def test_the_prefix_cache_gets_each_prompt_converted_once_as_a_read_only_key() -> None:
    mem = memory(cache=radix())
    keys: list[Any] = []
    cache = mem.prefix_cache
    assert cache is not None
    real_match, real_insert = cache.match, cache.insert_and_match

    def match(key: Any) -> Any:
        keys.append(key)
        return real_match(key)

    def insert_and_match(key: Any, slots: torch.Tensor) -> Any:
        keys.append(key)
        return real_insert(key, slots)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache, "match", match)
        mp.setattr(cache, "insert_and_match", insert_and_match)
        r = req(0, [3, 1, 4, 1, 5, 9])
        assert mem.admit(r) == 0
        assert mem.reserve_extend([r], [4]) is not None
        launched([r], [4])
        mem.cache_prefix(r, 4)
    assert [list(k) for k in keys] == [[3, 1, 4, 1, 5], [3, 1, 4, 1]]
    assert all(isinstance(k, memoryview) and k.readonly for k in keys)
    assert keys[0].obj is keys[1].obj, "the prompt was converted again"
    r.output_ids.append(2)  # a key past the prompt adds the output tokens
    assert list(mem._key(r, 7)) == [3, 1, 4, 1, 5, 9, 2]
    mem.release(r)
