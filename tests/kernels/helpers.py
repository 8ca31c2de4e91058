"""Shared checks for the fused-kernel tests: error measures, the device, CUDA-graph replay."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
# Small cases run compiled on a GPU when there is one, under the Triton interpreter otherwise.
DEVICE = torch.device("cuda" if CUDA else "cpu")

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parents[2]


def _bundled_ptxas() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


#: Tests that compile kernels for sm90 ahead of time (no GPU needed, Triton's own ptxas).
needs_ptxas = pytest.mark.skipif(
    not _bundled_ptxas(), reason="this triton has no bundled ptxas (no NVIDIA backend)"
)


def run_compile_probe(tmp_path: Path, source: str) -> str:
    """Run ``source`` as a script (compiled kernels, not the interpreter; execrt importable)
    and return what it printed; a failure shows the script's stderr."""
    probe = tmp_path / "probe.py"  # (triton.jit reads a kernel's source from its file)
    probe.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"}
    run = subprocess.run(
        [sys.executable, str(probe)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


# Mantissa bits of each dtype: one ulp of a value v in [2^e, 2^(e+1)) is 2^(e - bits).
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def max_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest expected magnitude."""
    expected = expected.double()
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual.double() - expected).abs().max() / scale)


def assert_within_ulps(
    actual: torch.Tensor, expected: torch.Tensor, ulps: float, dtype: torch.dtype
) -> None:
    """Every element within ``ulps`` units in the last place of ``dtype`` (relative form)."""
    expected = expected.double()
    err = (actual.double() - expected).abs()
    tiny = torch.finfo(dtype).tiny  # below this, subnormal spacing is absolute
    bound = ulps * 2.0 ** -MANTISSA_BITS[dtype] * expected.abs().clamp_min(tiny)
    worst = float((err - bound).max())
    assert worst <= 0, f"error exceeds {ulps} ulp by {worst:.3g} (max err {float(err.max()):.3g})"


def replay_matches_eager(
    fn: Callable[[], Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    fresh: Sequence[torch.Tensor],
) -> None:
    """Capture ``fn`` (which reads ``inputs``) in a CUDA graph, load ``fresh`` values into the
    inputs, replay, and check the outputs equal an eager call on the same values bit for bit."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        before = [t.clone() for t in fn()]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for dst, src in zip(inputs, fresh, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in captured]
    eager = fn()
    for r, e in zip(replayed, eager, strict=True):
        assert torch.equal(r, e)
    # The replay read the fresh values, not the ones seen at capture.
    assert all(not torch.equal(r, b) for r, b in zip(replayed, before, strict=True))
