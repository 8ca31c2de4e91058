"""ParallelState: single process, a real (one-rank) gloo group, TP/EP layouts, head sharding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from execrt.core.errors import ConfigError
from execrt.core.parallel import ParallelState, init_parallel, shard_heads, shard_rows


def test_single_process_collectives_are_identities() -> None:
    ps = ParallelState.single()
    assert (ps.world_size, ps.rank, ps.backend, ps.ep_size, ps.ep_rank) == (1, 0, "none", 1, 0)
    t = torch.tensor([1.0, 2.0])
    assert ps.all_reduce(t, ps.tp_group) is t and t.tolist() == [1.0, 2.0]
    assert ps.all_gather_counts(7, torch.device("cpu"), ps.world) == [7]
    ps.barrier()


def test_init_parallel_without_torchrun_needs_no_group(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if not dist.is_initialized():
        assert init_parallel(torch.device("cpu")).world_size == 1


def test_from_process_group_wraps_an_initialised_gloo_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    if dist.is_initialized():
        return
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ps = ParallelState.from_process_group()
        assert (ps.world_size, ps.rank, ps.backend) == (1, 0, "gloo")
        assert init_parallel(torch.device("cpu")).backend == "gloo"  # joins, does not re-init
        t = torch.tensor([3.0])
        assert ps.all_reduce(t, ps.ep_group).tolist() == [3.0]
        assert ps.all_gather_counts(5, torch.device("cpu"), ps.world) == [5]
    finally:
        dist.destroy_process_group()


def _gqa_cases() -> list[tuple[int, int, int]]:
    """Every (Hq, Hkv, tp) with Hq a multiple of Hkv, small enough to enumerate."""
    return [
        (hq, hkv, tp)
        for hkv in (1, 2, 3, 4, 8)
        for hq in (hkv, 2 * hkv, 4 * hkv, 6 * hkv)
        for tp in (1, 2, 3, 4, 8)
    ]


@pytest.mark.parametrize(("hq", "hkv", "tp"), _gqa_cases())
def test_shard_heads_keeps_each_query_head_with_its_kv_head(hq: int, hkv: int, tp: int) -> None:
    splits = hq % tp == 0 and (hkv % tp == 0 if hkv >= tp else tp % hkv == 0)
    if not splits:
        with pytest.raises(ConfigError, match="tensor parallel: "):
            shard_heads(hq, hkv, tp, 0)
        return
    group = hq // hkv  # query heads per kv head in the checkpoint
    owned: list[int] = []
    for rank in range(tp):
        s = shard_heads(hq, hkv, tp, rank)
        owned += range(s.q_start, s.q_start + s.num_q)
        assert s.num_q * tp == hq and 0 <= s.kv_start and s.kv_start + s.num_kv <= hkv
        assert s.num_kv == max(1, hkv // tp)
        local_group = s.num_q // s.num_kv  # what the attention backend assumes on this rank
        for i in range(s.num_q):
            # Local query head i reads local kv head i // local_group: it must be the global
            # kv head its global query head reads.
            assert s.kv_start + i // local_group == (s.q_start + i) // group, (rank, i)
    assert owned == list(range(hq))  # every query head on exactly one rank


def test_shard_rows_splits_evenly_or_fails() -> None:
    assert [shard_rows(12, 3, r, "intermediate_size") for r in range(3)] == [
        slice(0, 4),
        slice(4, 8),
        slice(8, 12),
    ]
    with pytest.raises(ConfigError, match="intermediate_size 10 not divisible by tp_size 4"):
        shard_rows(10, 4, 0, "intermediate_size")


@pytest.mark.parametrize(
    ("world", "tp", "ep", "moe", "expected"),
    [
        (1, 1, 0, False, (1, 1)),
        (2, 2, 0, True, (2, 2)),  # EP follows TP
        (2, 2, 1, True, (2, 1)),  # experts replicated over the TP ranks
        (2, 1, 2, True, (1, 2)),  # attention replicated, experts sharded
        (2, 2, 0, False, (2, 1)),  # a dense model has no EP group
        (1, 2, 0, False, "tp_size 2 needs 2 processes, this world has 1"),
        (1, 1, 2, True, "ep_size 2 needs 2 processes, this world has 1 (launch 2 processes"),
        (2, 1, 0, False, "a world of 2 processes but tp_size 1: every rank would repeat"),
        (2, 1, 0, True, "tp_size 1 and ep_size 1"),
        (2, 1, 2, False, "supported: tp_size 2)"),
        (4, 2, 0, False, "tp_size 2 / ep_size 2 unsupported in a world of 4"),
        (2, 2, 3, True, "tp_size 2 / ep_size 3 unsupported in a world of 2"),
    ],
)
def test_with_layout(world: int, tp: int, ep: int, moe: bool, expected: object) -> None:
    base = ParallelState(world, world - 1, "gloo" if world > 1 else "none")
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as info:
            base.with_layout(tp, ep, is_moe=moe)
        assert expected in str(info.value) and "\n" not in str(info.value)
        return
    ps = base.with_layout(tp, ep, is_moe=moe)
    assert (ps.tp_size, ps.ep_size) == expected
    assert ps.tp_rank == (world - 1 if tp > 1 else 0) and ps.tp_group.size == tp
    assert ps.ep_rank == (world - 1 if ps.ep_size > 1 else 0) and ps.ep_group.size == ps.ep_size
    assert ps.world.size == world
