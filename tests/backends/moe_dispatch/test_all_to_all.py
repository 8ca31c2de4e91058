"""all_to_all and all_to_all_fixed: expert-major layout, weights at the source, errors, gloo."""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from execrt.backends.moe_dispatch.all_to_all import AllToAllDispatcher
from execrt.backends.moe_dispatch.all_to_all_fixed import FixedCapacityAllToAllDispatcher
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import (
    ExpertMajorDispatchOutput,
    MoEDispatcher,
    MoEDispatcherInit,
    StandardDispatchOutput,
)
from execrt.core.parallel import ParallelState
from execrt.plugins.builtin import ALL_TO_ALL_DISPATCH, ALL_TO_ALL_FIXED_DISPATCH
from tests.drivers import spawn_ranks

E, K, H = 8, 3, 16
MAX_TOKENS = 16
BOTH = ["all_to_all", "all_to_all_fixed"]


def make(
    name: str,
    parallel: ParallelState,
    dtype: torch.dtype = torch.float32,
    max_tokens: int = MAX_TOKENS,
    device: str = "cpu",
) -> MoEDispatcher:
    cls, caps = {
        "all_to_all": (AllToAllDispatcher, ALL_TO_ALL_DISPATCH),
        "all_to_all_fixed": (FixedCapacityAllToAllDispatcher, ALL_TO_ALL_FIXED_DISPATCH),
    }[name]
    init = MoEDispatcherInit(
        caps, E, K, H, dtype, torch.device(device), max_tokens, parallel, RuntimeContext(parallel)
    )
    return cls(init)


def slots_per_expert(name: str, world: int, counts: list[int], max_tokens: int) -> int:
    """The expert-major slot dimension: the busiest expert now, or P * max_tokens fixed."""
    return max(counts, default=0) if name == "all_to_all" else world * max_tokens


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
    name: str,
    d: ExpertMajorDispatchOutput,
    all_ids: list[torch.Tensor],
    first_expert: int,
    max_tokens: int = MAX_TOKENS,
) -> None:
    assert isinstance(d, ExpertMajorDispatchOutput)
    e_local, capacity, hidden = d.hidden_states.shape
    assert hidden == H and d.expert_counts.dtype == torch.int32
    wanted = [expected_rows(all_ids, first_expert + e) for e in range(e_local)]
    assert d.expert_counts.tolist() == [len(w) for w in wanted]
    assert capacity == slots_per_expert(name, len(all_ids), [len(w) for w in wanted], max_tokens)
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
@pytest.mark.parametrize("name", BOTH)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_layout_and_weighted_combine_world1(name: str, id_dtype: torch.dtype) -> None:
    x = tagged_tokens(0, 11, torch.float32, seed=1)
    ids, weights = draw_routing(11, seed=2)
    dispatcher = make(name, ParallelState.single())
    d = dispatcher.dispatch(x, ids.to(id_dtype), weights)
    assert isinstance(d, ExpertMajorDispatchOutput) and d.num_tokens == 11
    check_layout(name, d, [ids], first_expert=0)
    out = dispatcher.combine(scaled_experts(d, 0), d)
    torch.testing.assert_close(out.double(), scaled_oracle(x, ids, weights), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", BOTH)
def test_weights_applied_once_at_the_source(name: str) -> None:
    # Identity experts: combine must return sum_k w * x, i.e. weights applied exactly once.
    x = torch.randn(4, H)
    ids = torch.tensor([[0, 5, -1], [7, 7, 2], [-1, -1, -1], [3, 4, 6]])
    weights = torch.tensor([[0.5, 0.25, 9.0], [0.1, 0.2, 0.3], [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]])
    dispatcher = make(name, ParallelState.single())
    d = dispatcher.dispatch(x, ids, weights)
    assert isinstance(d, ExpertMajorDispatchOutput)
    out = dispatcher.combine(d.hidden_states.clone(), d)
    want = (weights * (ids >= 0)).sum(1, keepdim=True) * x  # [T, H]
    torch.testing.assert_close(out, want)
    assert d.expert_counts.tolist() == [1, 0, 1, 1, 1, 1, 1, 2]


@pytest.mark.parametrize("name", BOTH)
def test_no_tokens_and_all_masked_world1(name: str) -> None:
    dispatcher = make(name, ParallelState.single(), torch.bfloat16)
    empty = dispatcher.dispatch(
        torch.empty(0, H, dtype=torch.bfloat16),
        torch.empty(0, K, dtype=torch.int64),
        torch.empty(0, K),
    )
    assert isinstance(empty, ExpertMajorDispatchOutput)
    assert tuple(empty.hidden_states.shape) == (E, slots_per_expert(name, 1, [], MAX_TOKENS), H)
    assert not empty.expert_counts.any()
    out = dispatcher.combine(empty.hidden_states, empty)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16
    x = torch.randn(3, H, dtype=torch.bfloat16)
    masked = dispatcher.dispatch(x, torch.full((3, K), -1), torch.ones(3, K))
    out = dispatcher.combine(masked.hidden_states + 1, masked)  # type: ignore[union-attr]
    assert out.dtype == torch.bfloat16 and not out.any()


@pytest.mark.parametrize("name", BOTH)
@pytest.mark.parametrize("bad", [E, -2, 1 << 40])
def test_invalid_expert_ids_raise(name: str, bad: int) -> None:
    ids = torch.tensor([[0, 1, 2], [3, bad, -1]])
    with pytest.raises(ValueError, match=rf"{name} dispatcher: .*1 invalid ids"):
        make(name, ParallelState.single()).dispatch(torch.randn(2, H), ids, torch.ones(2, K))


@pytest.mark.parametrize("name", BOTH)
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
    name: str, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make(name, ParallelState.single()).dispatch(x, ids, weights)


@pytest.mark.parametrize("name", BOTH)
def test_combine_rejects_foreign_outputs(name: str) -> None:
    dispatcher = make(name, ParallelState.single())
    x, ids = torch.randn(2, H), torch.tensor([[0, 1, 2], [2, 3, 4]])
    d = dispatcher.dispatch(x, ids, torch.ones(2, K))
    assert isinstance(d, ExpertMajorDispatchOutput)
    with pytest.raises(ValueError, match="expert output"):
        dispatcher.combine(d.hidden_states[:, :1], d)
    with pytest.raises(TypeError, match="ExpertMajorDispatchOutput it made"):
        dispatcher.combine(x, StandardDispatchOutput(x, ids, torch.ones(2, K)))
    other = make(BOTH[1 - BOTH.index(name)], ParallelState.single()).dispatch(
        x, ids, torch.ones(2, K)
    )
    with pytest.raises(TypeError, match="ExpertMajorDispatchOutput it made"):
        dispatcher.combine(other.hidden_states, other)  # type: ignore[union-attr]


@pytest.mark.parametrize("name", BOTH)
def test_num_experts_must_split_over_ranks(name: str) -> None:
    cls = {"all_to_all": AllToAllDispatcher, "all_to_all_fixed": FixedCapacityAllToAllDispatcher}
    init = MoEDispatcherInit(
        ALL_TO_ALL_DISPATCH, 7, K, H, torch.float32, torch.device("cpu"), 8,
        ParallelState(world_size=2, rank=0, backend="gloo"), RuntimeContext(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="num_experts 7 unsupported"):
        cls[name](init)


def test_fixed_refuses_more_tokens_or_top_k_than_built_for() -> None:
    dispatcher = make("all_to_all_fixed", ParallelState.single(), max_tokens=4)
    with pytest.raises(ValueError, match="5 tokens unsupported .*max_tokens_per_rank 4"):
        dispatcher.dispatch(
            torch.randn(5, H), torch.zeros(5, K, dtype=torch.int64), torch.ones(5, K)
        )
    with pytest.raises(ValueError, match=f"top_k {K + 1} unsupported"):
        dispatcher.dispatch(
            torch.randn(2, H), torch.zeros(2, K + 1, dtype=torch.int64), torch.ones(2, K + 1)
        )


def test_fixed_over_capacity_rows_raise_never_vanish() -> None:
    # With max_tokens 2, expert 3 may take 2 rows from a rank; a token naming it twice makes 3.
    dispatcher = make("all_to_all_fixed", ParallelState.single(), max_tokens=2)
    ids = torch.tensor([[3, 3, -1], [3, 1, 2]])
    with pytest.raises(ValueError, match="rank 0: 0 invalid ids, 1 over capacity"):
        dispatcher.dispatch(torch.randn(2, H), ids, torch.ones(2, K))
    fits = torch.tensor([[3, 3, -1], [0, 1, 2]])  # exactly at capacity: nothing dropped
    x = tagged_tokens(0, 2, torch.float32, seed=3)
    d = dispatcher.dispatch(x, fits, torch.ones(2, K))
    check_layout("all_to_all_fixed", d, [fits], 0, max_tokens=2)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fixed_counts_drops_under_cuda_graph_replay() -> None:
    dispatcher = make("all_to_all_fixed", ParallelState.single(), max_tokens=2, device="cuda")
    assert isinstance(dispatcher, FixedCapacityAllToAllDispatcher)
    x = torch.randn(2, H, device="cuda")
    ids = torch.tensor([[3, 4, -1], [0, 1, 2]], device="cuda")
    weights = torch.ones(2, K, device="cuda")

    def step() -> torch.Tensor:
        d = dispatcher.dispatch(x, ids, weights)
        return dispatcher.combine(d.hidden_states * 2, d)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.testing.assert_close(out, 2 * (ids >= 0).sum(1, keepdim=True) * x)
    dispatcher.check_dropped()  # nothing dropped yet
    ids.copy_(torch.tensor([[3, 3, -1], [3, 9, 2]]))  # 1 over capacity, 1 invalid
    graph.replay()
    with pytest.raises(ValueError, match="2 \\(token, expert\\) rows dropped"):
        dispatcher.check_dropped()
    dispatcher.check_dropped()  # the check resets the count


# ---------------------------------------------------------------------------------------------
# Two gloo ranks, one spawn for both dispatchers: layout, bf16 round trip, T = 0 on one rank,
# replicated tokens, errors every rank raises together
# ---------------------------------------------------------------------------------------------
ROUNDS = ((5, 0), (0, 7), (9, 4), (6, 6))  # tokens per rank; the last round is replicated


def _exercise(name: str, rank: int) -> None:
    dispatcher = make(name, ParallelState(2, rank, "gloo"), torch.bfloat16)
    first = rank * E // 2
    for i, counts in enumerate(ROUNDS):
        xs = [tagged_tokens(r, n, torch.bfloat16, seed=10 * i + r) for r, n in enumerate(counts)]
        routes = [draw_routing(n, seed=100 * i + r) for r, n in enumerate(counts)]
        if i == len(ROUNDS) - 1:  # replicated attention: both ranks bring the same tokens
            xs[1][:, 2:], routes[1] = xs[0][:, 2:], routes[0]
        d = dispatcher.dispatch(xs[rank], *routes[rank])
        assert isinstance(d, ExpertMajorDispatchOutput)
        check_layout(name, d, [ids for ids, _ in routes], first)
        out = dispatcher.combine(scaled_experts(d, first), d)
        ref = scaled_oracle(xs[rank], *routes[rank])
        # bf16 wire: expert outputs are rounded once; the fp32 sum of K terms adds little.
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * E)
        assert out.dtype == torch.bfloat16
    # Bad ids on rank 1 only: both ranks raise after the counts exchange, none hangs ...
    ids = torch.tensor([[0, 1, 2]]) if rank == 0 else torch.tensor([[0, E + 3, -1]])
    with pytest.raises(ValueError, match="rank 1: 1 invalid ids"):
        dispatcher.dispatch(torch.randn(1, H, dtype=torch.bfloat16), ids, torch.ones(1, K))
    # ... and the ranks stay in step: the next dispatch pairs up correctly.
    x = tagged_tokens(rank, 2, torch.bfloat16, seed=rank)
    ids = torch.tensor([[7, 0, -1], [4, 3, 3]])
    d = dispatcher.dispatch(x, ids, torch.ones(2, K))
    check_layout(name, d, [ids, ids], first)  # type: ignore[arg-type]


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        torch.set_num_threads(1)
        for name in BOTH:
            _exercise(name, rank)
        # Over capacity on rank 1 (expert 3 three times, 2 allowed): both ranks raise.
        small = make("all_to_all_fixed", ParallelState(2, rank, "gloo"), max_tokens=2)
        ids = torch.tensor([[0, 1, 2]]) if rank == 0 else torch.tensor([[3, 3, 3]])
        with pytest.raises(ValueError, match="rank 1: 0 invalid ids, 1 over capacity"):
            small.dispatch(torch.randn(1, H), ids, torch.ones(1, K))
        Path(out_dir, f"rank{rank}.ok").touch()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_gloo_ranks(tmp_path: Path) -> None:
    spawn_ranks(_rank_main, (str(tmp_path / "store"), str(tmp_path)), 2, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == ["rank0.ok", "rank1.ok"]
