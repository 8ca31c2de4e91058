"""``execrt generate --tp 2`` under torchrun on CPU (gloo) when a rank is killed mid-generation:
the survivor says one line naming the lost rank, as ``execrt serve`` does, with no traceback
and no request refused with gloo's own message, and exits 2 by itself although torchrun sends
it SIGTERM as soon as it sees the other rank die."""

from __future__ import annotations

import os
import queue
import re
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from execrt.cli import _rank_lost_ends
from execrt.core.parallel import ParallelState, RankLostError
from tests.drivers import live_children
from tests.engine.test_rank_failure import GLOO_GONE, RANK0_OF_2
from tests.serve.test_rank_failure_tp import EXECRT_FRAME, _gone, _rank_of
from tests.torchrun import torchrun_execrt

#: Long enough to be cut short: the built-in model decodes about a hundred tokens a second.
GENERATE = ["generate", "--model", "builtin", "--device", "cpu", "--tp", "2", "--ignore-eos"]
GENERATE += ["--max-new-tokens", "1500"]
#: What a survivor says, in full (the reason is gloo's first sentence).
LOST = r"rank (\d) of 2 is gone \(a collective failed: [^\n]+\); stopping"

#: What torchrun's report says of a rank that exited by itself with status 2 (not -15: SIGTERM).
EXITED_2 = r"rank\s*: {} \(local_rank: {}\)\n\s*exitcode\s*: 2 "
needs_proc = pytest.mark.skipif(
    not os.path.isdir("/proc/self"), reason="finds the ranks in Linux's /proc"
)


@pytest.fixture
def sigterm() -> Iterator[Any]:
    """SIGTERM's handler as it was, put back after the test."""
    before = signal.getsignal(signal.SIGTERM)
    yield before
    signal.signal(signal.SIGTERM, before)


def test_a_failed_collective_is_the_lost_rank_and_sigterm_then_waits(sigterm) -> None:
    with pytest.raises(RankLostError, match="^rank 1 of 2 is gone .*Connection closed") as info:
        with _rank_lost_ends(SimpleNamespace(parallel=RANK0_OF_2)):
            assert signal.getsignal(signal.SIGTERM) != sigterm  # torchrun's SIGTERM: exits
            raise RuntimeError(GLOO_GONE)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # until the line is said


def test_sigterm_while_the_failure_unwinds_still_names_the_lost_rank(sigterm) -> None:
    with pytest.raises(RankLostError, match="^rank 1 of 2 is gone"):
        with _rank_lost_ends(SimpleNamespace(parallel=RANK0_OF_2)):
            try:
                raise RuntimeError(GLOO_GONE)
            finally:  # torchrun saw the other rank die first
                signal.raise_signal(signal.SIGTERM)


def test_ctrl_c_stays_quiet_even_behind_a_failed_collective(sigterm) -> None:
    with pytest.raises(KeyboardInterrupt):  # every rank got it: each stops quietly
        with _rank_lost_ends(SimpleNamespace(parallel=RANK0_OF_2)):
            try:
                raise RuntimeError(GLOO_GONE)  # the peer stopped first
            finally:
                raise KeyboardInterrupt
    assert signal.getsignal(signal.SIGTERM) == sigterm


def test_sigterm_otherwise_exits_143_and_other_errors_pass_unchanged(sigterm) -> None:
    with pytest.raises(SystemExit) as info:
        with _rank_lost_ends(SimpleNamespace(parallel=RANK0_OF_2)):
            signal.raise_signal(signal.SIGTERM)
    assert info.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == sigterm
    with pytest.raises(RuntimeError, match="illegal memory access"):
        with _rank_lost_ends(SimpleNamespace(parallel=RANK0_OF_2)):
            raise RuntimeError("CUDA error: an illegal memory access")
    with pytest.raises(RuntimeError, match="Connection closed"):  # one process: no other rank
        with _rank_lost_ends(SimpleNamespace(parallel=ParallelState())):
            assert signal.getsignal(signal.SIGTERM) == sigterm
            raise RuntimeError(GLOO_GONE)
    assert signal.getsignal(signal.SIGTERM) == sigterm


STUCK = """
import os, signal, sys, threading, time
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
os.environ["RANK"] = "1"
from distributed.block import wait  # a module under a 'distributed' directory, as torch's
from execrt import cli

cli._StuckCollective.GRACE_S = 0.5
signal.signal(signal.SIGTERM, lambda *_: None)  # the main thread's handler waits its turn
stuck = cli._StuckCollective(SimpleNamespace(rank=1, world_size=2))
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
if sys.argv[2] == "collective":
    wait(20)  # as gloo's wait on a killed peer: the handler runs, the wait goes on
else:
    time.sleep(2)  # elsewhere: the SIGTERM is the main thread's to handle
stuck.close()
print("closed", signal.set_wakeup_fd(-1))
"""


@pytest.mark.parametrize("where", ["collective", "elsewhere"])
def test_sigterm_ends_a_rank_stuck_in_a_collective_with_the_line(tmp_path, where: str) -> None:
    """torchrun's SIGTERM reaches a rank whose main thread waits in a collective that never
    ends (gloo did not see the peer die): a thread of its own says the lost-rank line and
    exits 2 before torchrun's 30 s; a rank doing anything else is left to its handler, and
    closing restores the previous wakeup fd."""
    import subprocess
    import sys

    package = tmp_path / "distributed"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "block.py").write_text("import time\n\ndef wait(s):\n    time.sleep(s)\n")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", STUCK, str(tmp_path), where],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if where == "collective":
        assert done.returncode == 2, done.stderr
        assert time.monotonic() - start < 15
        line = (
            "execrt: error: rank 1: rank 0 of 2 is gone (a collective failed: no answer from "
            "it before torchrun stopped this rank); stopping"
        )
        assert done.stderr.strip().splitlines()[-1] == line, done.stderr
        assert re.search(LOST, line)
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "closed -1", done.stdout  # no wakeup fd left behind


def _generate_then_kill(prompts: list[str], victim: int) -> tuple[int, str, str]:
    """torchrun's two ranks generating ``prompts``; once rank 0 has started them, SIGKILL
    rank ``victim``. Returns torchrun's status, stdout and stderr."""
    proc = torchrun_execrt([*GENERATE, *prompts])
    out: queue.Queue[str] = queue.Queue()
    err: queue.Queue[str] = queue.Queue()
    readers = [
        threading.Thread(target=lambda p=pipe, q=lines: [q.put(x) for x in p], daemon=True)
        for pipe, lines in ((proc.stdout, out), (proc.stderr, err))
    ]
    for reader in readers:
        reader.start()
    said: list[str] = []
    ranks: dict[int, int] = {}
    try:
        # Rank 0's note on the random weights comes right before the requests start (the
        # streamed text says nothing: the detokenizer holds back the random model's bytes).
        while "random weights" not in (line := err.get(timeout=120)):
            said.append(line)
        said.append(line)
        time.sleep(1.0)  # well within the generation (seconds)
        for pid, _ in live_children(proc.pid):
            rank = _rank_of(pid)
            if rank is not None:
                ranks[rank] = pid
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[victim], signal.SIGKILL)
        status = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in ranks.values()):  # no rank outlives torchrun
        assert time.monotonic() < deadline, f"ranks left running: {ranks}"
        time.sleep(0.05)
    for reader in readers:  # to the pipes' ends
        reader.join(10)
    said += [err.get_nowait() for _ in range(err.qsize())]
    printed = [out.get_nowait() for _ in range(out.qsize())]
    return status, "".join(printed), "".join(said)


@pytest.mark.slow
@needs_proc
def test_a_killed_rank_1_ends_a_streamed_generate_with_one_line_on_rank_0() -> None:
    status, _, err = _generate_then_kill(["dead"], victim=1)
    lost = [x for x in err.splitlines() if re.search(LOST, x)]
    assert len(lost) == 1, err[-5000:]
    said = re.fullmatch(f"execrt: error: {LOST}", lost[0])
    assert said and said.group(1) == "1", lost
    assert "rejected" not in err and "gloo/transport" not in err, err[-5000:]
    assert not EXECRT_FRAME.search(err), err[-5000:]  # no traceback through execrt
    assert re.search(EXITED_2.format(0, 0), err), err[-3000:]
    assert status != 0


@pytest.mark.slow
@needs_proc
def test_a_killed_rank_0_ends_generate_with_one_line_on_rank_1() -> None:
    status, out, err = _generate_then_kill(["dead", "gone"], victim=0)
    lost = [x for x in err.splitlines() if re.search(LOST, x)]
    assert len(lost) == 1, err[-5000:]
    said = re.fullmatch(f"execrt: error: rank 1: {LOST}", lost[0])
    assert said and said.group(1) == "0", lost
    assert not EXECRT_FRAME.search(err), err[-5000:]
    assert re.search(EXITED_2.format(1, 1), err), err[-3000:]
    assert out == "" and status != 0
