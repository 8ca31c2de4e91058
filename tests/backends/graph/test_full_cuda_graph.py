"""full_cuda_graph: registration and argument errors anywhere; real capture and replay on CUDA."""

from __future__ import annotations

import gc
import importlib.util
import io
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from execrt.backends.graph import full_cuda_graph
from execrt.backends.graph.full_cuda_graph import FullCudaGraphBackend
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import GraphBackendInit, GraphRequirements, ShapeKey
from execrt.core.selection import resolve_backend
from execrt.plugins.builtin import FULL_CUDA_GRAPH
from execrt.plugins.host import PluginHost

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
HAS_TRITON = importlib.util.find_spec("triton") is not None
BUCKETS = (16, 8, 3, 1)  # largest first, as the graph runner captures
MIB = 1 << 20


def make_backend(
    context: RuntimeContext, device: str = "cuda:0", provider: Any = None, **kwargs: Any
) -> FullCudaGraphBackend:
    init = GraphBackendInit(FULL_CUDA_GRAPH, torch.device(device), context, provider)
    return FullCudaGraphBackend(init, **kwargs)


# ---------------------------------------------------------------------------------------------
# Anywhere: registration and the errors raised before any CUDA call
# ---------------------------------------------------------------------------------------------
def test_registered_for_cuda_and_auto_picks_it_where_cuda_works() -> None:
    registry = PluginHost(autoload=False).registry
    spec = registry.get("graph", "full_cuda_graph")
    assert spec.capabilities == FULL_CUDA_GRAPH
    caps = FULL_CUDA_GRAPH
    assert caps.devices == frozenset({"cuda"}) and caps.real_capture
    assert caps.shared_memory_pool and caps.graph_resources
    chosen = resolve_backend(registry, "graph", "auto", GraphRequirements("cuda")).chosen
    assert chosen == ("full_cuda_graph" if torch.cuda.is_available() else None)
    assert resolve_backend(registry, "graph", "auto", GraphRequirements("cpu")).chosen is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "cpu"}, "device cpu unsupported (supported: cuda)"),
        ({"warmup_runs": -1}, "warmup_runs -1 unsupported (supported: >= 0)"),
        ({"capture_error_mode": "lax"}, "'lax' unsupported (supported: global, thread_local"),
    ],
)
def test_bad_arguments_are_refused_with_what_is_supported(
    kwargs: dict[str, Any], message: str
) -> None:
    with RuntimeContext() as context, pytest.raises(ValueError) as err:
        make_backend(context, **kwargs)
    assert message in str(err.value)


def test_misuse_before_capture_raises_and_an_empty_cleanup_is_a_no_op() -> None:
    with RuntimeContext() as context:
        backend = make_backend(context)  # builds without touching the device
        with pytest.raises(
            KeyError, match=r"ShapeKey\(batch_size=2.*not captured \(captured: none"
        ):
            backend.replay(ShapeKey(2))
        with pytest.raises(RuntimeError, match="outside capture_session"):
            backend.capture(ShapeKey(2), lambda: None)
        assert not backend.has(ShapeKey(2))
        backend.cleanup()
        backend.cleanup()
        assert backend.generation == 0


# ---------------------------------------------------------------------------------------------
# CUDA: a small model-like forward (two matmuls, a Triton or torch activation, a residual)
# ---------------------------------------------------------------------------------------------
@dataclass
class StepOutput:
    hidden: torch.Tensor  # [bs, H]
    logits: torch.Tensor  # [bs, V]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[bs, 2H]`` -> ``[bs, H]``; a Triton kernel when Triton is here."""
    if not HAS_TRITON:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    from tests.backends.graph import silu_mul_triton

    return silu_mul_triton.silu_mul(gate_up)


class TinyModel:
    """Weights and one static input buffer of ``max_bs`` rows; bucket ``bs`` reads ``[:bs]``."""

    def __init__(self, dtype: torch.dtype, hidden: int = 256, vocab: int = 512) -> None:
        gen = torch.Generator().manual_seed(0)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen) / rows**0.5
            return w.to("cuda", dtype)

        self.w_gate_up = weight(hidden, 2 * hidden)  # [H, 2H]
        self.w_down = weight(hidden, hidden)  # [H, H]
        self.w_out = weight(hidden, vocab)  # [H, V]
        self.x = torch.zeros(max(BUCKETS), hidden, device="cuda", dtype=dtype)  # [max_bs, H]
        self.gen = gen

    def refill(self) -> None:
        """New inputs, written in place: the address a graph reads never changes."""
        self.x.copy_(torch.randn(self.x.shape, generator=self.gen))

    def fn(self, bs: int, log: list[Any] | None = None) -> Callable[[], StepOutput]:
        x = self.x[:bs]  # [bs, H]

        def step() -> StepOutput:
            if log is not None:
                default = torch.cuda.current_stream() == torch.cuda.default_stream()
                log.append(("fn", bs, torch.cuda.is_current_stream_capturing(), default))
            act = silu_mul(x @ self.w_gate_up)  # [bs, H]
            hidden = act @ self.w_down + x  # [bs, H]
            return StepOutput(hidden, hidden @ self.w_out)

        return step


def capture_all(
    backend: FullCudaGraphBackend, model: TinyModel, buckets: tuple[int, ...] = BUCKETS
) -> dict[int, StepOutput]:
    with backend.capture_session():
        return {bs: backend.capture(ShapeKey(bs), model.fn(bs)) for bs in buckets}


def replay_equals_eager(
    backend: FullCudaGraphBackend, model: TinyModel, captured: dict[int, StepOutput]
) -> None:
    """Every bucket: poisoned static outputs, replay, then bitwise equal to a fresh eager call."""
    model.refill()
    for bs, out in captured.items():
        out.hidden.fill_(float("nan"))
        out.logits.fill_(float("nan"))
        assert backend.replay(ShapeKey(bs)) is out
        want = model.fn(bs)()
        for name in ("hidden", "logits"):
            got, ref = getattr(out, name), getattr(want, name)
            diff = (got.float() - ref.float()).abs().max().item()
            assert torch.equal(got, ref), f"bs {bs}: replayed {name} differs, max |diff| {diff}"


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_replay_is_bitwise_equal_to_eager(dtype: torch.dtype) -> None:
    with RuntimeContext() as context:
        backend = make_backend(context)
        model = TinyModel(dtype)
        captured = capture_all(backend, model)
        for _ in range(3):
            replay_equals_eager(backend, model, captured)
        backend.cleanup()


@requires_cuda
def test_replay_neither_synchronises_nor_allocates() -> None:
    with RuntimeContext() as context:
        backend = make_backend(context)
        model = TinyModel(torch.bfloat16)
        capture_all(backend, model)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                for bs in BUCKETS:
                    backend.replay(ShapeKey(bs))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
        backend.cleanup()


@requires_cuda
def test_fifty_recaptures_leak_no_device_memory() -> None:
    with RuntimeContext() as context:
        backend = make_backend(context)
        model = TinyModel(torch.bfloat16)

        def cycle() -> None:
            replay_equals_eager(backend, model, capture_all(backend, model))
            backend.cleanup()  # the static outputs die with this frame

        allocated, reserved = [], []
        for _ in range(50):
            cycle()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
            torch.cuda.empty_cache()
            reserved.append(torch.cuda.memory_reserved())
        # Cycle 0 creates what lives on (cuBLAS workspaces of the capture stream); then nothing.
        assert set(allocated[1:]) == {allocated[0]}, f"allocated bytes per cycle: {allocated}"
        assert max(reserved) - min(reserved) <= 4 * MIB, f"reserved bytes per cycle: {reserved}"
        assert backend.generation == 50


@requires_cuda
@pytest.mark.parametrize("failure", ["python_error", "host_sync"])
def test_an_exception_inside_capture_leaves_the_backend_usable(failure: str) -> None:
    with RuntimeContext() as context:
        backend = make_backend(context)
        model = TinyModel(torch.float32)
        captured = capture_all(backend, model, (16,))
        good = model.fn(8)

        def bad() -> StepOutput:
            out = good()
            if torch.cuda.is_current_stream_capturing():  # the warm-up runs pass
                if failure == "python_error":
                    raise ValueError("boom inside capture")
                out.hidden.sum().item()  # a host sync: CUDA invalidates the capture
            return out

        frozen = gc.get_freeze_count()
        with pytest.raises(RuntimeError, match=r"capturing ShapeKey\(batch_size=8.*failed"):
            with backend.capture_session():
                backend.capture(ShapeKey(8), bad)
        # A freeze left behind holds the whole heap, a thaw empties the caller's frozen heap;
        # a frozen object freed by its reference count meanwhile only lowers the count.
        count = gc.get_freeze_count()
        assert count <= frozen, "gc left frozen"
        assert count > 0 or frozen == 0, "the caller's frozen heap was thawed"
        assert not torch.cuda.is_current_stream_capturing()
        assert not backend.has(ShapeKey(8)) and backend.has(ShapeKey(16))
        torch.randn(1 << 20, device="cuda").sum().item()  # eager work and allocation still fine
        with backend.capture_session():
            captured[8] = backend.capture(ShapeKey(8), good)
        replay_equals_eager(backend, model, captured)
        backend.cleanup()
        assert not backend.has(ShapeKey(16))


@requires_cuda
def test_graph_resources_are_warmed_outside_capture_and_closed_after_the_graphs() -> None:
    log: list[Any] = []
    keys = [ShapeKey(bs) for bs in BUCKETS[:2]]

    class Provider:
        resource_name = "test_cuda_graph_resources"

        def create_graph_resources(self, capacity: int, context: RuntimeContext) -> Any:
            log.append(("create", capacity))
            return torch.zeros(capacity, device="cuda")

        def warm_up_graph_resources(self, resources: Any, num_tokens: int) -> None:
            log.append(("warm", num_tokens, torch.cuda.is_current_stream_capturing()))

        def close_graph_resources(self, resources: Any) -> None:
            log.append(("close", [k for k in keys if backend.has(k)]))

    with RuntimeContext() as context:
        backend = make_backend(context, provider=Provider())
        model = TinyModel(torch.float32)
        with backend.capture_session():
            for key in keys:
                backend.capture(key, model.fn(key.batch_size, log))
        assert context.owner_of(Provider.resource_name) == "full_cuda_graph graph backend"
        backend.cleanup()
        backend.cleanup()
    big, small = BUCKETS[0], BUCKETS[1]
    per_key = [
        [("fn", bs, False, False), ("fn", bs, False, False), ("warm", bs, False)]
        + [("fn", bs, True, False)]
        for bs in (big, small)
    ]
    assert log == [("create", big), *per_key[0], *per_key[1], ("close", [])]


# ---------------------------------------------------------------------------------------------
# Progress bar and capture logs
# ---------------------------------------------------------------------------------------------
class _Terminal(io.StringIO):
    """A stderr that says it is an interactive terminal."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("tty", "level", "shown"),
    [(True, logging.INFO, True), (True, logging.WARNING, False), (False, logging.INFO, False)],
)
def test_the_progress_bar_shows_on_a_terminal_at_info_only(
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tty: bool,
    level: int,
    shown: bool,
) -> None:
    monkeypatch.setattr(sys, "stderr", _Terminal() if tty else io.StringIO())
    caplog.set_level(level, logger=full_cuda_graph.logger.name)
    bar = full_cuda_graph._progress_bar()
    assert bar.disable == (not shown)
    bar.update(1)
    bar.close()
    text = sys.stderr.getvalue()
    assert ("full_cuda_graph graph backend: capturing" in text) == shown, text


@requires_cuda
def test_capture_logs_its_time_and_graph_memory_and_shows_progress(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with RuntimeContext() as context:
        backend = make_backend(context)
        model = TinyModel(torch.float32)
        with caplog.at_level(logging.DEBUG, logger=full_cuda_graph.logger.name):
            started = time.perf_counter()
            capture_all(backend, model)
            elapsed = time.perf_counter() - started
            with backend.capture_session():
                pass  # captures nothing: logs nothing
        messages = [r.getMessage() for r in caplog.records]
        per_key = [
            m for m in messages if re.fullmatch(r".*: captured ShapeKey\(.*\) in [\d.]+ s", m)
        ]
        assert len(per_key) == len(BUCKETS), messages
        for message, bs in zip(per_key, BUCKETS, strict=True):  # largest first, as captured
            assert f"ShapeKey(batch_size={bs}," in message, per_key
        summary = [m for m in messages if "graphs in" in m]
        assert len(summary) == 1, messages
        match = re.fullmatch(
            r"full_cuda_graph graph backend: captured 4 graphs in (\d+\.\d\d) s; graph memory "
            r"\+(-?\d+\.\d) MiB reserved, \+(-?\d+\.\d) MiB allocated "
            r"\(generation 0, 4 graphs in all\)",
            summary[0],
        )
        assert match, summary[0]
        seconds, reserved, allocated = map(float, match.groups())
        assert 0 <= seconds <= elapsed + 0.01
        # The pool holds every graph's static outputs: it reserved and still allocates memory.
        assert 0 < reserved < 256 and 0 < allocated < 256, summary[0]
        assert "full_cuda_graph graph backend: capturing" in sys.stderr.getvalue()
        backend.cleanup()


@requires_cuda
def test_a_larger_key_after_a_smaller_one_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with RuntimeContext() as context:
        backend = make_backend(context)
        model = TinyModel(torch.float32)
        with caplog.at_level(logging.WARNING, logger=full_cuda_graph.logger.name):
            capture_all(backend, model, (1, 8))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "ShapeKey(batch_size=8" in warnings[0], warnings
        assert "captured after a smaller key (largest so far 1)" in warnings[0]
        backend.cleanup()
