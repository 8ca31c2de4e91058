"""The GPU-session pytest plugin: failure and time logs, resuming from a log, reversed order.

Each test runs pytest in a subprocess on a scratch module, with only this plugin loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = """
import pytest

def test_a(): pass
def test_b(): assert 1 == 2, "b is wrong"
def test_c(): pytest.skip("not here")
@pytest.fixture
def broken(): raise RuntimeError("setup broke")
def test_d(broken): pass
def test_e(): pass
"""


def run_pytest(tmp_path: Path, **env: str) -> list[str]:
    """Run the scratch module with the plugin; the node ids that ran, in order."""
    (tmp_path / "test_scratch.py").write_text(SCRATCH)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TESTS_")}
    environ["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.gpu_session_log", "-p", "no:cacheprovider",
         "-v", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env={**environ, **env},
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    return [
        line.split(" ")[0].split("::")[1]
        for line in done.stdout.splitlines()
        if line.startswith("test_scratch.py::") and " " in line
    ]


def test_without_settings_nothing_is_written_and_the_order_is_kept(tmp_path: Path) -> None:
    assert run_pytest(tmp_path) == ["test_a", "test_b", "test_c", "test_d", "test_e"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["test_scratch.py"]


def test_the_logs_name_every_failure_and_every_finished_test(tmp_path: Path) -> None:
    faillog, timelog = tmp_path / "failures.log", tmp_path / "done.txt"
    run_pytest(tmp_path, TESTS_FAILLOG=str(faillog), TESTS_TIMELOG=str(timelog))
    failures = faillog.read_text()
    assert "===== test_scratch.py::test_b (call)" in failures and "b is wrong" in failures
    assert "===== test_scratch.py::test_d (setup)" in failures and "setup broke" in failures
    assert "test_a" not in failures and "test_c" not in failures
    lines = [line.split(" ") for line in timelog.read_text().splitlines()]
    assert all(float(seconds) >= 0 for seconds, _, _ in lines)
    assert [(outcome, node) for _, outcome, node in lines] == [
        ("passed", "test_scratch.py::test_a"),
        ("failed", "test_scratch.py::test_b"),
        ("skipped", "test_scratch.py::test_c"),
        ("failed", "test_scratch.py::test_d"),  # its setup failed: logged, never called
        ("passed", "test_scratch.py::test_e"),
    ]


def test_a_later_call_runs_only_what_the_log_does_not_list_as_done(tmp_path: Path) -> None:
    timelog = tmp_path / "done.txt"
    # A call cut short after test_c: test_d and test_e never ran, test_b failed.
    timelog.write_text(
        "0.01 passed test_scratch.py::test_a\n"
        "0.02 failed test_scratch.py::test_b\n"
        "0.00 skipped test_scratch.py::test_c\n"
    )
    assert run_pytest(tmp_path, TESTS_SKIP_DONE=str(timelog)) == ["test_b", "test_d", "test_e"]
    ids = tmp_path / "ids.txt"  # a plain list of node ids: every line counts as done
    ids.write_text("test_scratch.py::test_b\n\ntest_scratch.py::test_e\n")
    assert run_pytest(tmp_path, TESTS_SKIP_DONE=str(ids)) == ["test_a", "test_c", "test_d"]
    both = f"{timelog}{os.pathsep}{ids}"  # several lists: what any of them lists as done
    assert run_pytest(tmp_path, TESTS_SKIP_DONE=both) == ["test_d"]  # b: done in ids.txt


@pytest.mark.parametrize(("order", "reversed_"), [("reverse", True), ("forward", False)])
def test_reverse_order_runs_the_collection_back_to_front(
    tmp_path: Path, order: str, reversed_: bool
) -> None:
    names = ["test_a", "test_b", "test_c", "test_d", "test_e"]
    assert run_pytest(tmp_path, TESTS_ORDER=order) == (names[::-1] if reversed_ else names)
