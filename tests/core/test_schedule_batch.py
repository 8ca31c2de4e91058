"""ScheduleBatch: slot and row allocation for extend and decode, all or nothing."""

from __future__ import annotations

import torch

from execrt.core.memory import ReqToTokenPool, TokenToKVPoolAllocator
from execrt.core.schedule import ForwardMode, Req, SamplingParams, ScheduleBatch

CPU = torch.device("cpu")


def test_extend_allocates_rows_and_slots_and_records_them() -> None:
    pool, alloc = ReqToTokenPool(2, 16, CPU), TokenToKVPoolAllocator(10, CPU)
    a, b = Req(0, [5, 6, 7], SamplingParams()), Req(1, [8, 9], SamplingParams())
    sb = ScheduleBatch.for_extend([a, b], [3, 2], pool, alloc, CPU)
    assert sb is not None and sb.mode is ForwardMode.EXTEND
    assert sb.input_ids.tolist() == [5, 6, 7, 8, 9] and sb.seq_lens_cpu == [3, 2]
    assert a.req_pool_idx is not None and b.req_pool_idx is not None
    assert sb.req_pool_indices.tolist() == [a.req_pool_idx, b.req_pool_idx]
    slots = sb.out_cache_loc.tolist()
    assert len(set(slots)) == 5 and 0 not in slots
    assert pool.req_to_token[a.req_pool_idx, :3].tolist() == slots[:3]
    assert pool.req_to_token[b.req_pool_idx, :2].tolist() == slots[3:]
    assert alloc.available_size() == 5


def test_a_chunk_continues_after_the_cached_prefix() -> None:
    pool, alloc = ReqToTokenPool(1, 16, CPU), TokenToKVPoolAllocator(10, CPU)
    req = Req(0, list(range(1, 7)), SamplingParams())
    first = ScheduleBatch.for_extend([req], [4], pool, alloc, CPU)
    assert first is not None
    req.kv_len = 4
    second = ScheduleBatch.for_extend([req], [2], pool, alloc, CPU)
    assert second is not None
    assert second.prefix_lens == [4] and second.seq_lens_cpu == [6]
    assert second.input_ids.tolist() == [5, 6]
    assert req.req_pool_idx is not None
    row = pool.req_to_token[req.req_pool_idx, :6].tolist()
    assert row == first.out_cache_loc.tolist() + second.out_cache_loc.tolist()


def test_extend_is_all_or_nothing() -> None:
    pool, alloc = ReqToTokenPool(1, 16, CPU), TokenToKVPoolAllocator(4, CPU)
    reqs = [Req(0, [1, 2, 3], SamplingParams()), Req(1, [4], SamplingParams())]
    assert ScheduleBatch.for_extend(reqs, [3, 1], pool, alloc, CPU) is None  # one row only
    assert reqs[0].req_pool_idx is None and alloc.available_size() == 4
    too_long = Req(2, [1] * 5, SamplingParams())
    assert ScheduleBatch.for_extend([too_long], [5], pool, alloc, CPU) is None
    assert pool.available_size() == 1 and alloc.available_size() == 4


def test_decode_feeds_each_requests_last_token() -> None:
    pool, alloc = ReqToTokenPool(2, 16, CPU), TokenToKVPoolAllocator(6, CPU)
    reqs = [Req(0, [1, 2], SamplingParams()), Req(1, [3], SamplingParams())]
    sb = ScheduleBatch.for_extend(reqs, [2, 1], pool, alloc, CPU)
    assert sb is not None
    for req, token in zip(reqs, (40, 41), strict=True):
        req.kv_len = req.seq_len
        req.output_ids.append(token)
    dec = ScheduleBatch.for_decode(reqs, pool, alloc, CPU)
    assert dec is not None and dec.mode is ForwardMode.DECODE
    assert dec.input_ids.tolist() == [40, 41] and dec.seq_lens_cpu == [3, 2]
    assert dec.prefix_lens == [2, 1] and dec.extend_lens == [1, 1]
    assert alloc.available_size() == 1
    assert ScheduleBatch.for_decode(reqs, pool, alloc, CPU) is None  # 2 slots wanted, 1 free
    assert alloc.available_size() == 1
