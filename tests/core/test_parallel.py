"""ParallelState: single process, and a real (one-rank) gloo group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from execrt.core.parallel import ParallelState, init_parallel


def test_single_process_collectives_are_identities() -> None:
    ps = ParallelState.single()
    assert (ps.world_size, ps.rank, ps.backend, ps.ep_size, ps.ep_rank) == (1, 0, "none", 1, 0)
    t = torch.tensor([1.0, 2.0])
    assert ps.all_reduce(t) is t and t.tolist() == [1.0, 2.0]
    assert ps.all_gather_counts(7, torch.device("cpu")) == [7]
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
        assert ps.all_reduce(t).tolist() == [3.0]
        assert ps.all_gather_counts(5, torch.device("cpu")) == [5]
    finally:
        dist.destroy_process_group()
