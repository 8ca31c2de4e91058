"""benchmarks/harness_generate.py, the second harness of issue 29: its own draw of the published
workload, and a smoke run of both measurements on CPU (a transformers checkpoint on disk, the
engine's defaults)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "harness_generate.py"


def test_its_draw_is_the_published_workload() -> None:
    prompts, outputs = load_benchmark("harness_generate").nano_vllm_workload(256, 1024, 1024)
    assert len(prompts) == len(outputs) == 256
    assert sum(outputs) == 133_966  # the output tokens nano-vllm and mini-sglang report
    assert sum(map(len, prompts)) == 142_827
    assert all(100 <= len(p) <= 1024 and max(p) <= 10000 for p in prompts)


def test_lengths_below_the_published_minimum_are_drawn_as_that_length() -> None:
    # The docstring's smoke run, --max-input 40 --max-output 8, raised "empty range for
    # randrange() (100, 41, -59)": lengths are uniform in [min(100, max), max].
    prompts, outputs = load_benchmark("harness_generate").nano_vllm_workload(4, 40, 8)
    assert [len(p) for p in prompts] == [40] * 4 and outputs == [8] * 4
    prompts, outputs = load_benchmark("harness_generate").nano_vllm_workload(50, 150, 100)
    assert all(100 <= len(p) <= 150 for p in prompts) and outputs == [100] * 50


def run(tmp_path: Path, *args: str) -> list[dict]:
    pytest.importorskip("transformers", reason="the harness writes its checkpoint with it")
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--shape", "tiny", "--device", "cpu"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_throughput_generates_every_token_and_reports_the_rate(tmp_path: Path) -> None:
    rows = run(
        tmp_path, "throughput", "--num-seqs", "3", "--max-input", "110", "--max-output", "102",
        "--temperature", "0.6,0", "--set", "max_running_requests=2",
    )  # fmt: skip
    assert [r["temperature"] for r in rows] == [0.6, 0.0]
    for r in rows:
        assert r["settings"] == {"max_running_requests": 2} and r["max_running_requests"] == 2
        assert 300 <= r["output_tokens"] <= 306 and r["num_seqs"] == 3
        assert r["out_tok_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
        assert r["harness"] == "benchmarks/harness_generate.py" and r["gpu"] is None


def test_decode_by_difference_per_batch_size(tmp_path: Path) -> None:
    rows = run(tmp_path, "decode", "--bs", "1,3", "--ctx", "12", "--steps", "3")
    assert [(r["bs"], r["ctx"], r["steps"]) for r in rows] == [(1, 12, 3), (3, 12, 3)]
    for r in rows:
        assert r["ms_per_step"] == pytest.approx((r["generate_n_s"] - r["generate_1_s"]) / 3 * 1e3)


def test_the_docstrings_smoke_run_runs(tmp_path: Path) -> None:
    rows = run(tmp_path, "throughput", "--num-seqs", "4", "--max-input", "40", "--max-output", "8")
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(160, 32)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_removes_the_temporary_checkpoint(tmp_path: Path, sig: int) -> None:
    # `timeout` (SIGTERM) or Ctrl-C mid-run left the written checkpoint in /tmp (1.2 GB for
    # the real shape).
    pytest.importorskip("transformers", reason="the harness writes its checkpoint with it")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "throughput", "--shape", "tiny", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=os.environ | {"TMPDIR": str(tmp_path)},
        # A shell's background job ignores SIGINT, and the child would inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the default workload runs long after this line
            if line.startswith("engine ready"):
                break
        assert [p.name for p in tmp_path.glob("execrt-harness-*")], "no checkpoint written"
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(tmp_path.glob("execrt-harness-*")) == []
