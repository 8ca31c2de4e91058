"""benchmarks/profile_extend.py runs end to end on CPU: a row per prompt length, the profiler's
table and cProfile's functions (a smoke test, so the GPU call that uses it does not find it
broken)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_profile_extend_reports_every_prompt_length_on_cpu() -> None:
    args = ["--device", "cpu", "--hidden", "64", "--layers", "2", "--lens", "8,24", "--reps", "2"]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_extend.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = re.findall(r"== prompt (\d+): generate \(1 token\) median ([\d.]+) ms", run.stdout)
    assert [int(n) for n, _ in rows] == [8, 24]
    assert all(float(ms) > 0 for _, ms in rows)
    assert run.stdout.count("kernel launches per prefill") == 2
    assert run.stdout.count("Ordered by: internal time") == 2
