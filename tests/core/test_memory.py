"""ReqToTokenPool, TokenToKVPoolAllocator and KVCache."""

from __future__ import annotations

import pytest
import torch

from execrt.core.errors import OutOfKVCacheError
from execrt.core.memory import KVCache, ReqToTokenPool, TokenToKVPoolAllocator


def test_req_to_token_pool_reserves_row_zero_and_recycles_rows() -> None:
    pool = ReqToTokenPool(max_reqs=3, max_context_len=8, device="cpu")
    assert pool.req_to_token.shape == (4, 8) and pool.req_to_token.dtype == torch.int32
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3]
    assert pool.alloc() is None
    pool.free(2)
    assert pool.available_size() == 1 and pool.alloc() == 2


def test_req_to_token_pool_rejects_bad_frees_and_writes() -> None:
    pool = ReqToTokenPool(max_reqs=2, max_context_len=4, device="cpu")
    row = pool.alloc()
    assert row is not None
    pool.free(row)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(row)
    with pytest.raises(ValueError, match="out of range"):
        pool.free(0)
    with pytest.raises(ValueError, match="beyond max_context_len"):
        pool.write(1, 2, torch.tensor([7, 8, 9]))
    pool.write(1, 1, torch.tensor([7, 8]))
    assert pool.req_to_token[1].tolist() == [0, 7, 8, 0]


def test_allocator_is_all_or_nothing_and_never_hands_out_slot_zero() -> None:
    alloc = TokenToKVPoolAllocator(size=10, device="cpu")
    a = alloc.alloc(7)
    assert a is not None and 0 not in a.tolist() and len(set(a.tolist())) == 7
    assert alloc.alloc(4) is None  # 3 left: no partial allocation
    assert alloc.available_size() == 3
    with pytest.raises(OutOfKVCacheError, match="4 slots requested, 3 of 10 free"):
        alloc.alloc_or_raise(4)
    alloc.free(a[:5])
    assert alloc.available_size() == 8
    b = alloc.alloc(8)
    assert b is not None and set(b.tolist()) | set(a[5:].tolist()) == set(range(1, 11))


def test_allocator_rejects_reserved_and_out_of_range_slots() -> None:
    alloc = TokenToKVPoolAllocator(size=4, device="cpu")
    with pytest.raises(ValueError, match="1..4"):
        alloc.free(torch.tensor([0]))
    with pytest.raises(ValueError, match="1..4"):
        alloc.free(torch.tensor([5]))
    with pytest.raises(ValueError, match="cannot allocate -1"):
        alloc.alloc(-1)


def test_kv_cache_writes_only_the_given_slots() -> None:
    cache = KVCache(
        size=6, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16, device="cpu"
    )
    assert cache.k_buffers[0].shape == (7, 2, 4)
    k = torch.randn(2, 2, 4)
    v = torch.randn(2, 2, 4)
    cache.set_kv(1, torch.tensor([3, 5]), k, v)
    assert torch.equal(cache.k_buffers[1][3], k[0].half()) and torch.equal(
        cache.v_buffers[1][5], v[1].half()
    )
    untouched = [0, 1, 2, 4, 6]
    assert not cache.k_buffers[1][untouched].any() and not cache.k_buffers[0].any()
    assert cache.bytes_per_token() == 2 * 2 * (4 + 4) * 2
