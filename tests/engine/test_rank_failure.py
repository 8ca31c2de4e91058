"""A rank that goes away: a failed collective becomes one RankLostError line naming the rank
and the collective's first-line reason, and ends the serving loop (the command channel's or a
step's collective) instead of a wall of tracebacks; any other step failure is as before."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from execrt.core.errors import ExecrtError
from execrt.core.parallel import REASON_CHARS, ParallelState, RankLostError, rank_lost
from execrt.engine.threaded import CommandChannel, run_commands

GLOO_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:22955. This is typically caused by a remote worker crashing. Check the "
    "logs of the remote worker before reporting an error. GLHF!"
)
GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
    "for recv operation to complete"
)
RANK0_OF_2 = ParallelState(world_size=2, rank=0, tp_size=2)
RANK1_OF_2 = ParallelState(world_size=2, rank=1, tp_size=2)


def test_a_closed_gloo_connection_names_the_other_rank_and_the_reason() -> None:
    lost = rank_lost(RuntimeError(GLOO_GONE), RANK0_OF_2)
    assert isinstance(lost, RankLostError) and isinstance(lost, ExecrtError)
    assert str(lost) == (
        "rank 1 of 2 is gone (a collective failed: Connection closed by peer "
        "[127.0.0.1]:22955); stopping"
    )
    assert str(rank_lost(RuntimeError(GLOO_GONE), RANK1_OF_2)).startswith("rank 0 of 2 is gone")


def test_a_timed_out_collective_says_the_rank_stopped_answering() -> None:
    world = ParallelState(world_size=3, rank=2, tp_size=3)
    assert str(rank_lost(RuntimeError(GLOO_TIMEOUT), world)) == (
        "another rank (of 3) stopped answering (a collective failed: Timed out waiting "
        "1800000ms for recv operation to complete); stopping"
    )


def test_the_failure_is_found_behind_the_error_raised_from_it() -> None:
    try:
        try:
            raise RuntimeError(GLOO_GONE)
        except RuntimeError as exc:
            raise ValueError("step failed") from exc
    except ValueError as outer:
        lost = rank_lost(outer, RANK0_OF_2)
    assert lost is not None and "Connection closed by peer" in str(lost)


def test_a_distributed_error_counts_and_its_reason_is_cut_short() -> None:
    error = dist.DistBackendError("NCCL error in: x.cpp:1, remote process exited " + "x" * 500)
    lost = rank_lost(error, RANK0_OF_2)
    assert lost is not None and lost.reason.endswith("...")
    assert len(lost.reason) == REASON_CHARS and "\n" not in str(lost)


@pytest.mark.parametrize(
    ("error", "world"),
    [
        (RuntimeError("CUDA error: an illegal memory access"), RANK0_OF_2),  # not a collective
        (ValueError(GLOO_GONE), RANK0_OF_2),  # only a RuntimeError is gloo's
        (RuntimeError(GLOO_GONE), ParallelState()),  # one process has no other rank
    ],
)
def test_other_failures_are_not_a_lost_rank(error: BaseException, world: ParallelState) -> None:
    assert rank_lost(error, world) is None


# -- the serving loop ---------------------------------------------------------------------------
class _FailingCollective:
    """What the command channel's broadcast does when the other rank is gone."""

    @staticmethod
    def broadcast_object_list(box: list[Any], src: int, group: Any) -> None:
        raise RuntimeError(GLOO_GONE)


def _channel(world: ParallelState) -> CommandChannel:
    channel = CommandChannel.__new__(CommandChannel)  # no process group: its collective fails
    channel._dist = _FailingCollective()  # type: ignore[assignment]
    channel.group, channel.world, channel.rank = None, world, world.rank
    return channel


def _engine(step_error: BaseException, world: ParallelState) -> Any:
    steps: list[int] = []

    def step() -> bool:
        steps.append(1)
        raise step_error

    return SimpleNamespace(has_work=True, step=step, parallel=world, steps=steps)


def test_a_follower_whose_rank_0_is_gone_stops_with_one_line(caplog) -> None:
    engine = _engine(AssertionError("never stepped"), RANK1_OF_2)
    with pytest.raises(RankLostError) as info:
        run_commands(engine, None, _channel(RANK1_OF_2))
    assert str(info.value).startswith("rank 0 of 2 is gone (a collective failed: Connection")
    assert isinstance(info.value.__cause__, RuntimeError)  # the collective's own error
    assert engine.steps == [] and caplog.records == []


def test_a_step_whose_collective_failed_ends_the_loop_without_a_traceback(caplog) -> None:
    engine = _engine(RuntimeError(GLOO_GONE), RANK0_OF_2)
    with pytest.raises(RankLostError, match="rank 1 of 2 is gone"):
        run_commands(engine, lambda block: [], None)
    assert engine.steps == [1]  # the first failed step ends it
    assert not [r for r in caplog.records if r.exc_info]


def test_any_other_failed_step_is_logged_and_the_loop_goes_on(caplog) -> None:
    engine = _engine(RuntimeError("CUDA error: an illegal memory access"), RANK0_OF_2)
    rounds = iter([[], [("stop",)]])
    summary = run_commands(engine, lambda block: next(rounds), None)
    assert (summary.failed_steps, engine.steps) == (1, [1])
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "engine thread: a step failed; the requests in it were aborted"
    ]
