"""ForwardBatch.init_new, positions, PaddedContext and the one graph padding rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from execrt.core.batch import (
    ForwardBatch,
    ForwardMode,
    PaddedContext,
    padded_decode_batch,
)
from execrt.core.kv_memory import KVMemory
from execrt.core.memory import ReqToTokenPool, TokenToKVPoolAllocator
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.core.staging import HostToDevice
from execrt.core.step import StepInputs

CPU = torch.device("cpu")


def memory(rows: int = 4, ctx: int = 32, slots: int = 64) -> KVMemory:
    pool, alloc = ReqToTokenPool(rows, ctx, CPU), TokenToKVPoolAllocator(slots, CPU)
    return KVMemory(pool, alloc, HostToDevice(CPU))


def extend(mem: KVMemory, reqs: list[Req], lens: list[int]) -> ScheduleBatch:
    inputs = mem.reserve_extend(reqs, lens)
    assert inputs is not None
    return ScheduleBatch.of(reqs, inputs, mem.stager)


def test_init_new_holds_the_schedule_batch_tensors_by_reference() -> None:
    reqs = [Req(0, [1, 2, 3], SamplingParams()), Req(1, [4, 5], SamplingParams(seed=7))]
    sb = extend(memory(), reqs, [3, 2])
    fb = ForwardBatch.init_new(sb)
    assert fb.mode is ForwardMode.EXTEND and fb.batch_size == 2 and fb.num_tokens == 5
    for name in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc"):
        assert getattr(fb, name).data_ptr() == getattr(sb.inputs, name).data_ptr(), name
    assert fb.positions.tolist() == [0, 1, 2, 0, 1]
    assert fb.seq_lens_cpu == [3, 2] and fb.seq_lens_sum == 5 and fb.max_seq_len == 3
    assert fb.max_extend_len == 3 and fb.num_token_non_padded == 5
    assert fb.num_token_non_padded_device is None  # eager batches carry no padding
    assert fb.sampling_info is not None and fb.sampling_info.seeds.tolist()[1] == 0


def test_decode_positions_are_the_last_token_of_each_request() -> None:
    mem = memory()
    reqs = [Req(0, [1, 2, 3], SamplingParams()), Req(1, [4], SamplingParams())]
    extend(mem, reqs, [3, 1])
    for req, token in zip(reqs, (9, 8), strict=True):
        req.kv_len = req.seq_len
        req.output_ids.append(token)
    inputs = mem.reserve_decode(reqs)
    assert inputs is not None
    fb = ForwardBatch.init_new(ScheduleBatch.of(reqs, inputs, mem.stager))
    assert fb.mode is ForwardMode.DECODE
    assert fb.input_ids.tolist() == [9, 8] and fb.positions.tolist() == [3, 1]
    assert fb.prefix_lens_cpu == [3, 1] and fb.extend_lens_cpu == [1, 1]


def decode_batch(rows: list[int], lens: list[int], locs: list[int]) -> ForwardBatch:
    b = len(rows)
    seq = torch.tensor(lens)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.arange(10, 10 + b),
        positions=seq - 1,
        req_pool_indices=torch.tensor(rows),
        seq_lens=seq,
        out_cache_loc=torch.tensor(locs),
        seq_lens_cpu=list(lens),
        prefix_lens_cpu=[n - 1 for n in lens],
        extend_lens_cpu=[1] * b,
    )


def test_padding_rule_into_new_tensors() -> None:
    fb = decode_batch([3, 1], [5, 9], [11, 12])
    padded = padded_decode_batch(fb, 4, seq_len_fill=1)
    assert padded.batch_size == 4 and padded.num_token_non_padded == 2
    assert padded.num_token_non_padded_device is not None
    assert padded.num_token_non_padded_device.tolist() == [2]
    assert padded.input_ids.tolist() == [10, 11, 0, 0]
    assert padded.req_pool_indices.tolist() == [3, 1, 0, 0]  # padding reads request row 0
    assert padded.out_cache_loc.tolist() == [11, 12, 0, 0]  # and writes KV slot 0
    assert padded.seq_lens.tolist() == [5, 9, 1, 1]
    assert padded.positions.tolist() == [4, 8, 0, 0]
    assert padded.seq_lens_cpu == [5, 9, 1, 1] and padded.prefix_lens_cpu == [4, 8, 0, 0]
    assert fb.batch_size == 2 and fb.input_ids.tolist() == [10, 11]  # the original is untouched


def test_padding_rule_writes_static_buffers_in_place_with_any_fill_value() -> None:
    def buf() -> torch.Tensor:
        return torch.full((6,), -7)

    static = StepInputs(ForwardMode.DECODE, buf(), buf(), buf(), buf(), buf(), [], [], [])
    count = torch.zeros(1, dtype=torch.int64)
    fb = decode_batch([2, 4, 1], [3, 3, 7], [5, 6, 9])
    padded = padded_decode_batch(fb, 5, seq_len_fill=2, out=static, out_count=count)
    for got, want in zip(
        (padded.input_ids, padded.positions, padded.req_pool_indices, padded.seq_lens),
        (static.input_ids, static.positions, static.req_pool_indices, static.seq_lens),
        strict=True,
    ):
        assert got.data_ptr() == want.data_ptr(), "an input left the static buffer"
    assert padded.out_cache_loc.data_ptr() == static.out_cache_loc.data_ptr()
    assert static.seq_lens.tolist() == [3, 3, 7, 2, 2, -7]  # the tail past 5 is untouched
    assert static.positions.tolist()[:5] == [2, 2, 6, 1, 1]
    assert count.tolist() == [3]
    assert padded.num_token_non_padded_device is count
    same = padded_decode_batch(fb, 3, seq_len_fill=2, out=static, out_count=count)  # no pads
    assert same.num_token_non_padded == 3 and same.seq_lens.tolist() == [3, 3, 7]


def test_padding_rule_refuses_what_it_cannot_pad() -> None:
    fb = decode_batch([1, 2], [3, 4], [5, 6])
    with pytest.raises(ValueError, match="cannot pad a batch of 2 down to 1"):
        padded_decode_batch(fb, 1, 1)
    with pytest.raises(ValueError, match="fill value 0"):
        padded_decode_batch(fb, 4, 0)
    extend = dataclasses.replace(fb, mode=ForwardMode.EXTEND)
    with pytest.raises(ValueError, match="only decode batches are padded, got EXTEND"):
        padded_decode_batch(extend, 4, 1)


def test_padded_context_reads_only_each_requests_slots() -> None:
    table = torch.zeros(4, 6, dtype=torch.int32)
    table[1, :3] = torch.tensor([7, 8, 9])
    table[2, :5] = torch.tensor([1, 2, 3, 4, 5])
    table[1, 3:] = 99  # stale entries past the length must not be read
    fb = decode_batch([1, 2], [3, 5], [0, 0])
    ctx = PaddedContext.of(fb, table)
    assert ctx.slots.tolist() == [[7, 8, 9, 0, 0], [1, 2, 3, 4, 5]]
    assert ctx.valid.tolist() == [[True] * 3 + [False] * 2, [True] * 5]


def test_extend_segments_give_each_request_a_causal_mask() -> None:
    table = torch.zeros(3, 8, dtype=torch.int32)
    table[1, :4] = torch.tensor([3, 4, 5, 6])
    table[2, :2] = torch.tensor([9, 10])
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(3, dtype=torch.int64),
        positions=torch.tensor([2, 3, 1]),
        req_pool_indices=torch.tensor([1, 2]),
        seq_lens=torch.tensor([4, 2]),
        out_cache_loc=torch.tensor([5, 6, 10]),
        seq_lens_cpu=[4, 2],
        prefix_lens_cpu=[2, 1],
        extend_lens_cpu=[2, 1],
    )
    segments = list(PaddedContext.of(fb, table).extend_segments())
    (rows_a, slots_a, mask_a), (rows_b, slots_b, mask_b) = segments
    assert (rows_a, rows_b) == (slice(0, 2), slice(2, 3))
    assert slots_a.tolist() == [3, 4, 5, 6] and slots_b.tolist() == [9, 10]
    assert mask_a.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert mask_b.tolist() == [[True, True]]
