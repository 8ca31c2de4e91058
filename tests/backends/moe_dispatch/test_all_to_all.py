"""all_to_all dispatcher: expert-major layout, weights at the source, errors, two gloo ranks."""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from execrt.backends.moe_dispatch.all_to_all import AllToAllDispatcher
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import (
    ExpertMajorDispatchOutput,
    MoEDispatcherInit,
    StandardDispatchOutput,
)
from execrt.core.parallel import ParallelState
from execrt.plugins.builtin import ALL_TO_ALL_DISPATCH

E, K, H = 8, 3, 16


def make(parallel: ParallelState, dtype: torch.dtype = torch.float32) -> AllToAllDispatcher:
    init = MoEDispatcherInit(
        ALL_TO_ALL_DISPATCH, E, K, H, dtype, torch.device("cpu"), 64, parallel,
        RuntimeContext(parallel),
    )  # fmt: skip
    return AllToAllDispatcher(init)


def tagged_tokens(rank: int, num_tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[T, H]`` whose first two columns say (source rank, token): rows describe themselves."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen)
    x[:, 0], x[:, 1] = float(rank), torch.arange(num_tokens, dtype=torch.float32)
    return x.to(dtype)


def draw_routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids with masked slots and repeated experts within a token (all allowed)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E, (num_tokens, K), generator=gen)
    weights = torch.rand(num_tokens, K, generator=gen)
    return ids, weights


def expected_rows(all_ids: list[torch.Tensor], expert: int) -> list[tuple[int, int]]:
    """(source rank, token) of every row for ``expert``, source-major then token order."""
    return [
        (rank, t)
        for rank, ids in enumerate(all_ids)
        for t in range(ids.shape[0])
        for k in range(ids.shape[1])
        if int(ids[t, k]) == expert
    ]


def check_layout(
    d: ExpertMajorDispatchOutput, all_ids: list[torch.Tensor], first_expert: int
) -> None:
    assert isinstance(d, ExpertMajorDispatchOutput)
    e_local, capacity, hidden = d.hidden_states.shape
    assert hidden == H and d.expert_counts.dtype == torch.int32
    wanted = [expected_rows(all_ids, first_expert + e) for e in range(e_local)]
    assert d.expert_counts.tolist() == [len(w) for w in wanted]
    assert capacity == max((len(w) for w in wanted), default=0)
    for e, want in enumerate(wanted):
        rows = d.hidden_states[e, : len(want)].float()
        got = [(int(r[0]), int(r[1])) for r in rows]
        assert got == want, f"expert {first_expert + e}: rows {got}, expected {want}"
        assert not d.hidden_states[e, len(want) :].any(), "padding rows must be zero"


def scaled_experts(d: ExpertMajorDispatchOutput, first_expert: int) -> torch.Tensor:
    """A known expert: global expert e multiplies its input by e + 1."""
    scale = torch.arange(first_expert + 1, first_expert + 1 + d.hidden_states.shape[0])
    return d.hidden_states * scale.to(d.hidden_states.dtype)[:, None, None]


def scaled_oracle(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64 ``sum_k w[t, k] * (ids[t, k] + 1) * x[t]`` over unmasked slots."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] >= 0:
                out[t] += float(weights[t, k]) * (int(ids[t, k]) + 1) * x[t].double()
    return out


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_layout_and_weighted_combine_world1(id_dtype: torch.dtype) -> None:
    x = tagged_tokens(0, 11, torch.float32, seed=1)
    ids, weights = draw_routing(11, seed=2)
    dispatcher = make(ParallelState.single())
    d = dispatcher.dispatch(x, ids.to(id_dtype), weights)
    assert isinstance(d, ExpertMajorDispatchOutput) and d.num_tokens == 11
    check_layout(d, [ids], first_expert=0)
    out = dispatcher.combine(scaled_experts(d, 0), d)
    torch.testing.assert_close(out.double(), scaled_oracle(x, ids, weights), rtol=1e-6, atol=1e-6)


def test_weights_applied_once_at_the_source() -> None:
    # Identity experts: combine must return sum_k w * x, i.e. weights applied exactly once.
    x = torch.randn(4, H)
    ids = torch.tensor([[0, 5, -1], [7, 7, 2], [-1, -1, -1], [3, 4, 6]])
    weights = torch.tensor([[0.5, 0.25, 9.0], [0.1, 0.2, 0.3], [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]])
    dispatcher = make(ParallelState.single())
    d = dispatcher.dispatch(x, ids, weights)
    out = dispatcher.combine(d.hidden_states.clone(), d)
    want = (weights * (ids >= 0)).sum(1, keepdim=True) * x  # [T, H]
    torch.testing.assert_close(out, want)
    assert d.expert_counts.tolist() == [1, 0, 1, 1, 1, 1, 1, 2]


def test_no_tokens_and_all_masked_world1() -> None:
    dispatcher = make(ParallelState.single(), torch.bfloat16)
    empty = dispatcher.dispatch(
        torch.empty(0, H, dtype=torch.bfloat16),
        torch.empty(0, K, dtype=torch.int64),
        torch.empty(0, K),
    )
    assert isinstance(empty, ExpertMajorDispatchOutput)
    assert tuple(empty.hidden_states.shape) == (E, 0, H) and not empty.expert_counts.any()
    out = dispatcher.combine(empty.hidden_states, empty)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16
    x = torch.randn(3, H, dtype=torch.bfloat16)
    masked = dispatcher.dispatch(x, torch.full((3, K), -1), torch.ones(3, K))
    out = dispatcher.combine(masked.hidden_states + 1, masked)
    assert out.dtype == torch.bfloat16 and not out.any()


@pytest.mark.parametrize("bad", [E, -2, 1 << 40])
def test_invalid_expert_ids_raise(bad: int) -> None:
    ids = torch.tensor([[0, 1, 2], [3, bad, -1]])
    with pytest.raises(ValueError, match=r"all_to_all dispatcher: topk_ids outside \[-1, 8\)"):
        make(ParallelState.single()).dispatch(torch.randn(2, H), ids, torch.ones(2, K))


@pytest.mark.parametrize(
    ("x", "ids", "weights", "match"),
    [
        (torch.randn(2, H + 1), torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K), "hidden"),
        (torch.randn(2, H), torch.zeros(3, K, dtype=torch.int64), torch.ones(3, K), "3 routing"),
        (torch.randn(2, H), torch.zeros(2, K), torch.ones(2, K), "topk_ids dtype float32"),
        (torch.randn(2, H), torch.zeros(2, K, dtype=torch.int64), torch.ones(2, 2), r"\[T, K\]"),
        (
            torch.randn(2, H),
            torch.zeros(2, K, dtype=torch.int64),
            torch.ones(2, K, dtype=torch.int64),
            "topk_weights dtype int64",
        ),
    ],
)
def test_bad_inputs_raise(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make(ParallelState.single()).dispatch(x, ids, weights)


def test_combine_rejects_foreign_outputs() -> None:
    dispatcher = make(ParallelState.single())
    x, ids = torch.randn(2, H), torch.tensor([[0, 1, 2], [2, 3, 4]])
    d = dispatcher.dispatch(x, ids, torch.ones(2, K))
    with pytest.raises(ValueError, match="expert output"):
        dispatcher.combine(d.hidden_states[:, :1], d)
    with pytest.raises(TypeError, match="ExpertMajorDispatchOutput it made"):
        dispatcher.combine(x, StandardDispatchOutput(x, ids, torch.ones(2, K)))


def test_num_experts_must_split_over_ranks() -> None:
    init = MoEDispatcherInit(
        ALL_TO_ALL_DISPATCH, 7, K, H, torch.float32, torch.device("cpu"), 8,
        ParallelState(world_size=2, rank=0, backend="gloo"), RuntimeContext(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="num_experts 7 unsupported"):
        AllToAllDispatcher(init)


# ---------------------------------------------------------------------------------------------
# Two gloo ranks, one spawn: layout, bf16 round trip, T = 0 on one rank, collective errors
# ---------------------------------------------------------------------------------------------
ROUNDS = ((5, 0), (0, 7), (9, 4), (6, 6))  # tokens per rank; the last round is replicated


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        torch.set_num_threads(1)
        dispatcher = make(ParallelState(2, rank, "gloo"), torch.bfloat16)
        first = rank * E // 2
        for i, counts in enumerate(ROUNDS):
            xs = [
                tagged_tokens(r, n, torch.bfloat16, seed=10 * i + r) for r, n in enumerate(counts)
            ]
            routes = [draw_routing(n, seed=100 * i + r) for r, n in enumerate(counts)]
            all_ids = [ids for ids, _ in routes]
            d = dispatcher.dispatch(xs[rank], *routes[rank])
            assert isinstance(d, ExpertMajorDispatchOutput)
            check_layout(d, all_ids, first)
            out = dispatcher.combine(scaled_experts(d, first), d)
            ref = scaled_oracle(xs[rank], *routes[rank])
            # bf16 wire: expert outputs are rounded once; the fp32 sum of K terms adds little.
            torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * E)
            assert out.dtype == torch.bfloat16
        # Bad ids on rank 1 only: both ranks raise after the counts exchange, none hangs ...
        ids = torch.tensor([[0, 1, 2]]) if rank == 0 else torch.tensor([[0, E + 3, -1]])
        with pytest.raises(ValueError, match="invalid ids per rank: rank 1: 1"):
            dispatcher.dispatch(torch.randn(1, H, dtype=torch.bfloat16), ids, torch.ones(1, K))
        # ... and the ranks stay in step: the next dispatch pairs up correctly.
        x = tagged_tokens(rank, 2, torch.bfloat16, seed=rank)
        ids = torch.tensor([[7, 0, -1], [4, 3, 3]])
        d = dispatcher.dispatch(x, ids, torch.ones(2, K))
        check_layout(d, [ids, ids], first)
        Path(out_dir, f"rank{rank}.ok").touch()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_gloo_ranks(tmp_path: Path) -> None:
    try:
        mp.start_processes(
            _rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True,
            start_method="spawn",
        )  # fmt: skip
    except mp.ProcessRaisedException:
        pass  # the per-rank tracebacks below say more
    errors = [p.read_text() for p in sorted(tmp_path.glob("rank*.err"))]
    assert not errors, "\n".join(errors)
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == ["rank0.ok", "rank1.ok"]
