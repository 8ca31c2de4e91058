"""benchmarks/trace_critical.py on a small Chrome trace: per-kernel critical time per step, and
the timeline of launches (what the GPU calls read it for)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(trace: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trace_critical.py"), str(trace), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_critical_time_per_step_and_the_timeline(tmp_path: Path) -> None:
    def kernel(name: str, ts: float, dur: float, grid: list[int] | None = None) -> dict:
        args = {"grid": grid, "block": [128, 1, 1], "registers per thread": 64} if grid else {}
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": args}

    events = [
        # two steps: gemm, then norm launched early under PDL (it adds 1 µs past gemm's end)
        kernel("void gemm<1>(float*)", 0, 10, [8, 1, 1]),
        kernel("norm", 6, 5),
        kernel("void gemm<1>(float*)", 20, 10, [8, 1, 1]),
        kernel("norm", 26, 5),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 40},  # not the GPU's
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = run(trace, "--steps", "2")
    assert "GPU busy 11.0 of 15.5 µs per step" in out
    rows = {line.split()[-1]: line.split()[:3] for line in out.splitlines()[2:]}
    assert rows == {"gemm": ["1.00", "10.00", "10.00"], "norm": ["1.00", "5.00", "1.00"]}
    lines = run(trace, "--timeline", "1:2").splitlines()
    assert lines[1].split()[:4] == ["6.00", "11.00", "5.00", "1.00"]
    assert lines[1].endswith("norm") and "grid [8, 1, 1]" in lines[2]
    assert lines[2].split()[:4] == ["20.00", "30.00", "10.00", "10.00"]
