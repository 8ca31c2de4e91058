"""A pytest plugin for time-limited GPU sessions (``benchmarks/gpu_session.sh``): logs as it goes,
resumes where an earlier call stopped.

Every setting is an environment variable, so a run without them is untouched:

- ``TESTS_FAILLOG=<file>``: each failure's report is appended as it happens (a run cut short
  still leaves its failures behind).
- ``TESTS_TIMELOG=<file>``: one line per finished test, ``"<seconds> <outcome> <node id>"``:
  what a run cut short reached, and where its time went.
- ``TESTS_SKIP_DONE=<file>[:<file>...]``: ``TESTS_TIMELOG``s of earlier calls (or files of node
  ids, one per line); the tests they list as passed or skipped are deselected, so the next call
  runs only what was cut off and what failed.
- ``TESTS_ORDER=reverse``: the collection runs back to front (a call cut short whose log was
  lost reached the front).

``tests/conftest.py`` loads it with ``pytest_plugins``.
"""

from __future__ import annotations

import os

import pytest

FAILLOG, TIMELOG, SKIP_DONE, ORDER = (
    "TESTS_FAILLOG",
    "TESTS_TIMELOG",
    "TESTS_SKIP_DONE",
    "TESTS_ORDER",
)
#: Outcomes in a time log whose tests a later call need not run again.
DONE_OUTCOMES = ("passed", "skipped")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if getattr(report, "node", None) is not None:
        return  # under xdist the controller sees each worker's report again: log it once
    path = os.environ.get(FAILLOG)
    if path and report.failed:
        with open(path, "a") as fh:
            fh.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
    timelog = os.environ.get(TIMELOG)
    if timelog and (report.when == "call" or (report.when == "setup" and not report.passed)):
        with open(timelog, "a") as fh:
            fh.write(f"{report.duration:.2f} {report.outcome} {report.nodeid}\n")


def done_node_ids(path: str) -> set[str]:
    """The node ids a ``TESTS_SKIP_DONE`` file lists as done: a time log's passed and skipped
    lines (not its failed ones), or every line of a plain list of node ids."""
    done = set()
    with open(path) as fh:
        for line in fh:
            parts = line.rstrip("\n").split(" ", 2)
            if len(parts) == 3 and parts[1] in (*DONE_OUTCOMES, "failed"):
                if parts[1] in DONE_OUTCOMES:
                    done.add(parts[2])
            elif line.strip():
                done.add(line.strip())
    return done


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(ORDER) == "reverse":
        items.reverse()
    paths = [p for p in os.environ.get(SKIP_DONE, "").split(os.pathsep) if p]
    if not paths:
        return
    done = set().union(*map(done_node_ids, paths))
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = [item for item in items if item.nodeid not in done]
