"""benchmarks/kernel_sass.py compiles the Triton decode split kernel for sm90 without a GPU and
reads its K/V loop as the GPU would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "kernel_sass.py")
triton = pytest.importorskip("triton")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(
    not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
    reason="this triton has no bundled ptxas/cuobjdump (no NVIDIA backend)",
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # The tool compiles whatever TRITON_INTERPRET the suite runs under (it turns it off).
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=env,
    )  # fmt: skip


def test_the_loop_is_compiled_as_the_jit_would_with_vector_loads_and_mma() -> None:
    run = _run("--kv", "bf16", "--tiles", "64,4,2", "--top", "200")
    assert run.returncode == 0, run.stderr[-2000:]
    head, mix = run.stdout.strip().splitlines()
    counts = dict((op, int(n)) for op, n in re.findall(r"([A-Z][\w.]+) (\d+)", mix))
    # The JIT's 16-byte divisibility is given: K/V arrive by 16-byte cp.async, never as
    # scalar 2-byte loads (which is what the loop looked like without it).
    assert counts.get("LDGSTS.E.BYPASS.128", 0) > 0
    assert "LDG.E.U16" not in counts
    assert counts.get("HMMA.16816.F32.BF16", 0) > 0
    loop = int(re.search(r"loop (\d+) instructions", head).group(1))  # type: ignore[union-attr]
    assert loop == sum(counts.values()) and 200 < loop < 5000
    # 4 warps: the issue floor is the loop's instruction count (x 4 warps / 4 per clock).
    assert re.search(rf"issue floor {loop} clk vs memory floor \d+ clk", head), head


def test_fp8_converts_pairs_and_unknown_dtypes_are_refused() -> None:
    run = _run("--kv", "fp8", "--tiles", "64,4,2", "--top", "200")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "fp8 block_n 64, 4 warps, 2 stages" in run.stdout
    assert "F2FP.F16.E4M3.UNPACK_B" in run.stdout
    bad = _run("--kv", "fp4")
    assert bad.returncode == 2 and "--kv 'fp4' unsupported (supported: bf16, fp8)" in bad.stderr
