"""ReqToTokenPool, TokenToKVPoolAllocator, SlotHolders and KVCache."""

from __future__ import annotations

import pytest
import torch

from execrt.core.errors import KVOwnershipError
from execrt.core.memory import KVCache, ReqToTokenPool, SlotHolders, TokenToKVPoolAllocator
from tests.core.fakes import HostReads


def test_req_to_token_pool_reserves_row_zero_and_recycles_rows() -> None:
    pool = ReqToTokenPool(max_reqs=3, max_context_len=8, device="cpu")
    assert pool.req_to_token.shape == (4, 8) and pool.req_to_token.dtype == torch.int32
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3]
    assert pool.alloc() is None
    pool.free(2)
    assert pool.available_size() == 1 and pool.free_rows() == [2] and pool.alloc() == 2


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
    assert alloc.available_size() == 3 and sorted(alloc.free_slot_ids().tolist()) == [8, 9, 10]
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


def test_req_to_token_pool_validates_its_size_and_hands_out_low_rows_first() -> None:
    with pytest.raises(ValueError, match="max_reqs 0 and max_context_len 4 must be >= 1"):
        ReqToTokenPool(max_reqs=0, max_context_len=4, device="cpu")
    with pytest.raises(ValueError, match="max_reqs 2 and max_context_len 0 must be >= 1"):
        ReqToTokenPool(max_reqs=2, max_context_len=0, device="cpu")
    pool = ReqToTokenPool(max_reqs=3, max_context_len=4, device="cpu")
    assert [pool.alloc(), pool.alloc()] == [1, 2]
    with pytest.raises(ValueError, match=r"row 4 out of range \(1..3\)"):
        pool.free(4)


def test_write_may_fill_a_row_to_its_last_position() -> None:
    pool = ReqToTokenPool(max_reqs=1, max_context_len=4, device="cpu")
    pool.write(1, 2, torch.tensor([8, 9], dtype=torch.int64))
    pool.write(1, 0, torch.tensor([], dtype=torch.int64))  # nothing to record
    assert pool.req_to_token[1].tolist() == [0, 0, 8, 9]
    with pytest.raises(ValueError, match="token 4 beyond max_context_len 4"):
        pool.write(1, 4, torch.tensor([1]))


def test_write_tokens_scatters_each_slot_to_its_row_and_position() -> None:
    pool = ReqToTokenPool(max_reqs=2, max_context_len=5, device="cpu")
    pool.req_to_token.fill_(-1)  # poison: only the three targets may change
    rows = torch.tensor([1, 2, 1])
    positions = torch.tensor([0, 3, 4])
    pool.write_tokens(rows, positions, torch.tensor([11, 12, 2**20], dtype=torch.int64))
    assert pool.req_to_token.dtype == torch.int32
    assert pool.req_to_token.tolist() == [
        [-1, -1, -1, -1, -1],
        [11, -1, -1, -1, 2**20],
        [-1, -1, -1, 12, -1],
    ]


def test_write_tokens_with_no_tokens_changes_nothing() -> None:
    pool = ReqToTokenPool(max_reqs=1, max_context_len=2, device="cpu")
    empty = torch.zeros(0, dtype=torch.int64)
    pool.write_tokens(empty, empty, empty)
    assert not pool.req_to_token.any()


def test_allocator_size_zero_alloc_zero_and_free_nothing() -> None:
    with pytest.raises(ValueError, match="size 0 must be >= 1"):
        TokenToKVPoolAllocator(size=0, device="cpu")
    alloc = TokenToKVPoolAllocator(size=3, device="cpu")
    none = alloc.alloc(0)
    assert none is not None and none.numel() == 0 and alloc.available_size() == 3
    alloc.free(torch.zeros(0, dtype=torch.int64))
    assert alloc.available_size() == 3


def test_allocator_hands_out_ascending_slots_and_reuses_freed_ones_last() -> None:
    alloc = TokenToKVPoolAllocator(size=5, device="cpu")
    first = alloc.alloc(3)
    assert first is not None and first.tolist() == [1, 2, 3] and first.dtype == torch.int64
    alloc.free(torch.tensor([[3], [1]], dtype=torch.int32))  # any int dtype or shape
    rest = alloc.alloc(4)
    assert rest is not None and rest.tolist() == [4, 5, 3, 1]


def test_a_rejected_free_returns_nothing_to_the_pool() -> None:
    alloc = TokenToKVPoolAllocator(size=4, device="cpu")
    taken = alloc.alloc(4)
    assert taken is not None
    with pytest.raises(ValueError, match=r"slot ids must be in 1..4"):
        alloc.free(torch.tensor([2, 0, 3]))  # one bad id spoils the whole call
    assert alloc.available_size() == 0


def test_kv_cache_with_a_distinct_v_head_dim() -> None:
    bf16 = torch.bfloat16
    cache = KVCache(
        5, num_layers=3, num_kv_heads=2, head_dim=8, dtype=bf16, device="cpu", v_head_dim=4
    )
    assert cache.k_buffers[2].shape == (6, 2, 8) and cache.v_buffers[2].shape == (6, 2, 4)
    assert len(cache.k_buffers) == len(cache.v_buffers) == 3
    # 3 layers * 2 heads * (8 + 4) values * 2 bytes
    assert cache.bytes_per_token() == 144
    k, v = torch.ones(1, 2, 8), torch.full((1, 2, 4), 2.0)
    cache.set_kv(0, torch.tensor([5]), k, v)
    assert (cache.v_buffers[0][5] == 2.0).all() and not cache.v_buffers[0][:5].any()


def test_bytes_per_token_for_known_shapes() -> None:
    # A Qwen3-0.6B-like cache: 28 layers, 8 KV heads, head_dim 128, bf16.
    assert KVCache.bytes_per_token_for(28, 8, 128, torch.bfloat16) == 28 * 8 * 256 * 2
    assert KVCache.bytes_per_token_for(2, 4, 64, torch.float32) == 2 * 4 * 128 * 4
    assert KVCache.bytes_per_token_for(2, 4, 64, torch.float32, v_head_dim=32) == 2 * 4 * 96 * 4
    assert KVCache.bytes_per_token_for(1, 1, 16, torch.float8_e4m3fn) == 32


def test_set_kv_casts_to_the_cache_dtype() -> None:
    cache = KVCache(2, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.bfloat16, device="cpu")
    # 1 + 2**-9 is exact in fp32 but rounds to 1.0 in bf16 (8 mantissa bits); 1 + 2**-7 is exact.
    k = torch.tensor([[[1 + 2**-9, 1 + 2**-7]]], dtype=torch.float32)
    cache.set_kv(0, torch.tensor([1]), k, -k)
    assert cache.k_buffers[0].dtype == torch.bfloat16
    assert cache.k_buffers[0][1, 0].float().tolist() == [1.0, 1 + 2**-7]
    assert cache.v_buffers[0][1, 0].float().tolist() == [-1.0, -(1 + 2**-7)]


def test_slot_holders_refuse_slot_zero_second_holders_and_foreign_frees() -> None:
    holders = SlotHolders()
    holders.claim([3], ["request 5"])
    with pytest.raises(KVOwnershipError, match="request 5 frees slot 0, the padding slot"):
        holders.drop([0, 3], "request 5")
    with pytest.raises(KVOwnershipError, match="request 6 frees slot 3, held by request 5"):
        holders.drop([3], "request 6")
    with pytest.raises(KVOwnershipError, match="slot 0 handed to request 6, the padding slot"):
        holders.claim([0], ["request 6"])
    with pytest.raises(KVOwnershipError, match="slot 4 handed to request 7, held by request 6"):
        holders.claim([4, 4], ["request 6", "request 7"])
    assert len(holders) == 1  # every refused call changed nothing
    holders.drop([3], "request 5")
    assert len(holders) == 0
    holders.claim([5, 6], ["request 8", "request 9"])
    holders.forget([5, 7])  # a failed reservation's claims; 7 was never claimed
    with pytest.raises(KVOwnershipError, match="request 8 frees slot 5, already free"):
        holders.drop([5], "request 8")
    holders.reset({})
    assert len(holders) == 0


def test_an_fp8_cache_stores_quantized_values_with_its_layer_scales() -> None:
    from execrt.core.kv_quant import KVScales

    cache = KVCache(
        4, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float8_e4m3fn, device="cpu"
    )
    assert cache.is_fp8 and cache.bytes_per_token() == 2 * 2 * 2  # one byte per value
    rows = [r.data_ptr() for r in cache.layer_scales]
    cache.set_scales(KVScales((1.0, 0.5), (1.0, 8.0)))
    # In place: a captured graph keeps reading the same scale rows.
    assert [r.data_ptr() for r in cache.layer_scales] == rows
    assert cache.layer_scales[1].tolist() == [0.5, 8.0, 2.0, 0.125]
    k = torch.tensor([[[3.0, 1000.0]]])
    cache.set_kv(0, torch.tensor([2]), k, k)
    cache.set_kv(1, torch.tensor([2]), k, k)
    assert cache.k_buffers[0][2].float().tolist() == [[3.0, 448.0]]  # clamped, scale 1
    assert cache.k_buffers[1][2].float().tolist() == [[6.0, 448.0]]  # 3 / 0.5
    assert cache.v_buffers[1][2].float().tolist() == [[0.375, 128.0]]  # / 8
    assert not cache.k_buffers[1][:2].float().any() and k.tolist() == [[[3.0, 1000.0]]]


def test_scales_are_for_an_fp8_cache_with_one_per_layer() -> None:
    from execrt.core.kv_quant import KVScales

    bf16 = KVCache(2, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="scales apply to an fp8 cache, not torch.bfloat16"):
        bf16.set_scales(KVScales.ones(1))
    assert bf16.layer_scales[0].tolist() == [1.0, 1.0, 1.0, 1.0]
    fp8 = KVCache(
        2, num_layers=3, num_kv_heads=1, head_dim=2, dtype=torch.float8_e5m2, device="cpu"
    )
    with pytest.raises(ValueError, match="2 layer scales for 3 layers"):
        fp8.set_scales(KVScales.ones(2))


def test_allocator_frees_without_reading_slot_ids_back_unless_it_checks_them() -> None:
    lazy = TokenToKVPoolAllocator(size=8, device="cpu", check_ids=False)
    taken = lazy.alloc(8)
    assert taken is not None
    with HostReads() as reads:
        lazy.free(taken[:3])
        lazy.free(taken[5:])
        assert lazy.available_size() == 6
        got = lazy.alloc(6)
    assert reads.seen == []  # on a GPU: no wait for the device per free
    assert got is not None and got.tolist() == [1, 2, 3, 6, 7, 8]  # in the order given back
    checked = TokenToKVPoolAllocator(size=8, device="cpu")
    assert checked.check_ids  # on CPU a read costs nothing: ids are always checked
    with HostReads() as reads:
        checked.free(checked.alloc(2))  # type: ignore[arg-type]
    assert reads.seen


def test_a_gpu_allocator_checks_slot_ids_only_with_the_ownership_debug_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EXECRT_DEBUG_KV_OWNERSHIP", "1")
    assert TokenToKVPoolAllocator(size=4, device="meta").check_ids
    monkeypatch.delenv("EXECRT_DEBUG_KV_OWNERSHIP")
    assert not TokenToKVPoolAllocator(size=4, device="meta").check_ids


def test_allocator_queues_many_frees_and_hands_them_out_in_order() -> None:
    alloc = TokenToKVPoolAllocator(size=200, device="cpu")
    taken = alloc.alloc(200)
    assert taken is not None
    for i in range(199, -1, -1):  # more frees than the queue keeps before merging
        alloc.free(taken[i : i + 1])
    assert alloc.available_size() == 200
    assert alloc.free_slot_ids().tolist() == list(range(200, 0, -1))
    got = alloc.alloc(200)
    assert got is not None and got.tolist() == list(range(200, 0, -1))
