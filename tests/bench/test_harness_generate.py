"""benchmarks/harness_generate.py, the second harness of issue 29: its own draw of the published
workload, and a smoke run of both measurements on CPU (a transformers checkpoint on disk, the
engine's defaults)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "harness_generate.py"


def load_harness():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("harness_generate", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_its_draw_is_the_published_workload() -> None:
    prompts, outputs = load_harness().nano_vllm_workload(256, 1024, 1024)
    assert len(prompts) == len(outputs) == 256
    assert sum(outputs) == 133_966  # the output tokens nano-vllm and mini-sglang report
    assert sum(map(len, prompts)) == 142_827
    assert all(100 <= len(p) <= 1024 and max(p) <= 10000 for p in prompts)


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
