"""The nccl.ep double itself: LL expert-major semantics, arrival order, and where it aborts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.doubles.nccl_ep import FakeNccl, FakeNcclAbort

E, K, H, C = 4, 2, 32, 6


def open_group(fake: FakeNccl) -> Any:
    ep, core = fake.ep, fake.core
    comm = core.Communicator.init(1, 0, core.get_unique_id())
    config = ep.GroupConfig(
        num_experts=E, max_dispatch_tokens_per_rank=C, max_token_bytes=2 * H, num_topk=K
    )
    return ep.Group.create(comm, config)


def routed(fake: FakeNccl, ids: torch.Tensor, x: torch.Tensor) -> tuple[Any, torch.Tensor, Any]:
    ep = fake.ep
    group = open_group(fake)
    handle = group.create_handle(ep.Layout.EXPERT_MAJOR, ep.Tensor(ids), stream=0)
    recv = torch.zeros(E, C, H, dtype=torch.bfloat16)
    counters = torch.zeros(E, dtype=torch.int32)
    handle.dispatch(
        ep.DispatchInputs(tokens=ep.Tensor(x)),
        ep.DispatchOutputs(tokens=ep.Tensor(recv)),
        layout_info=ep.LayoutInfo(expert_counters=ep.Tensor(counters)),
        stream=0,
    )
    return handle, recv, counters


def test_dispatch_delivers_per_expert_multisets_in_arrival_order() -> None:
    fake = FakeNccl(seed=3)
    t = 5
    x = torch.arange(t, dtype=torch.float32)[:, None].repeat(1, H).to(torch.bfloat16)  # row = t
    ids = torch.tensor([[0, 1], [1, -1], [1, 3], [-1, -1], [1, 0]])
    orders = set()
    for _ in range(4):
        _, recv, counters = routed(fake, ids, x)
        assert counters.tolist() == [2, 4, 0, 1]
        for e in range(E):
            n = int(counters[e])
            got = sorted(recv[e, :n, 0].float().tolist())  # a multiset: slot order is arrival
            want = sorted(float(r) for r in range(t) for kk in range(K) if ids[r, kk] == e)
            assert got == want
            assert torch.isnan(recv[e, n:].float()).all(), "rows past the count are undefined"
        orders.add(tuple(recv[1, :4, 0].tolist()))
    assert len(orders) > 1, "arrival order must not be predictable"


def test_combine_applies_the_weights_and_staging_waits_for_complete() -> None:
    fake = FakeNccl()
    ep = fake.ep
    t = 3
    x = torch.randn(t, H).to(torch.bfloat16)
    ids = torch.tensor([[2, 0], [-1, 2], [1, 1]])  # a duplicate expert within one token
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.125, 0.875]])
    handle, recv, counters = routed(fake, ids, x)
    y = (recv.float() * 2).to(torch.bfloat16)  # every expert doubles its input
    out = torch.full((t, H), 7.0, dtype=torch.bfloat16)
    inputs = ep.CombineInputs(tokens=ep.Tensor(y))
    outputs = ep.CombineOutputs(tokens=ep.Tensor(out), topk_weights=ep.Tensor(w))
    handle.combine(inputs, outputs, config=ep.CombineConfig(send_only=1), stream=0)
    assert (out == 7).all(), "a staged combine writes nothing before complete"
    handle.complete(stream=0)
    want = torch.stack([2 * x[r].float() * w[r][ids[r] >= 0].sum() for r in range(t)])
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    assert [e.op for e in fake.events][-3:] == ["dispatch", "combine", "complete"]


def test_where_the_real_library_would_abort() -> None:
    fake = FakeNccl()
    ep = fake.ep
    ids = torch.zeros(C, K, dtype=torch.int64)
    group = open_group(fake)
    handle = group.create_handle(ep.Layout.EXPERT_MAJOR, ep.Tensor(ids[:4]), stream=0)
    handle.update(ep.Tensor(ids[:2]), stream=0)  # same base pointer: fine
    with pytest.raises(FakeNcclAbort, match="moved topk_idx"):
        handle.update(ep.Tensor(ids[1:3]), stream=0)
    with pytest.raises(FakeNcclAbort, match="max_dispatch_tokens_per_rank"):
        handle.update(ep.Tensor(torch.zeros(C + 1, K, dtype=torch.int64)), stream=0)
    with fake.capture():
        with pytest.raises(FakeNcclAbort, match="inside CUDA-graph capture"):
            group.create_handle(ep.Layout.EXPERT_MAJOR, ep.Tensor(ids), stream=0)
    x = torch.zeros(3, H, dtype=torch.bfloat16)  # the handle holds 2 rows
    recv, counters = torch.zeros(E, C, H, dtype=torch.bfloat16), torch.zeros(E, dtype=torch.int32)

    def dispatch(tokens: torch.Tensor) -> None:  # a complete (not staged) dispatch
        handle.dispatch(
            ep.DispatchInputs(tokens=ep.Tensor(tokens)),
            ep.DispatchOutputs(tokens=ep.Tensor(recv)),
            layout_info=ep.LayoutInfo(expert_counters=ep.Tensor(counters)),
            stream=0,
        )

    with pytest.raises(FakeNcclAbort, match="num_tokens"):
        dispatch(x)
    handle.dispatch(  # descriptors made inline and dropped: gone before complete
        ep.DispatchInputs(tokens=ep.Tensor(x[:2].clone())),
        ep.DispatchOutputs(tokens=ep.Tensor(recv)),
        layout_info=ep.LayoutInfo(expert_counters=ep.Tensor(counters)),
        config=ep.DispatchConfig(send_only=1),
        stream=0,
    )
    with pytest.raises(FakeNcclAbort, match="freed before complete"):
        handle.complete(stream=0)
    ids[1, 0] = E  # rank E // E_local does not exist; a negative id only routes nowhere
    with pytest.raises(FakeNcclAbort, match="expert id >= num_experts 4"):
        dispatch(x[:2])
    ids[1, 0] = -5
    dispatch(x[:2])
    assert counters.tolist() == [3, 0, 0, 0]
    with pytest.raises(FakeNcclAbort, match="before its 1 live handle"):
        group.destroy()
    with pytest.raises(FakeNcclAbort, match="non-contiguous"):
        ep.Tensor(torch.zeros(4, 2).t())
    handle.destroy()
    group.destroy()
    assert not fake.live_groups() and not fake.live_handles()
    assert len(fake.violations) == 7
    assert [e.capturing for e in fake.ops("create_handle")] == [False, True]


def test_worlds_are_independent() -> None:
    a, b = FakeNccl(), FakeNccl()
    open_group(a)
    assert len(a.ops("create_group")) == 1 and not b.events
    assert a.ep.Group is not b.ep.Group
