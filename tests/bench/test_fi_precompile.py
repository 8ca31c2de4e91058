"""benchmarks/fi_precompile.py: the jobs it builds (each distinct FlashInfer module once), its
job list on CPU, and a one-line refusal without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bench import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fi_precompile.py"


def test_fp8_caches_build_fa2_once_and_never_fa3() -> None:
    mod = load_benchmark("fi_precompile")
    todo = mod.jobs(
        ["bfloat16"], ["auto", "float8_e4m3fn"], [128], [1, 4], ["auto", "fa2", "fa3"], 4
    )
    fp8 = [j for j in todo if j.kv_dtype == "float8_e4m3fn"]
    # auto and fa2 are one family for an fp8 cache; fa3 cannot read one: a job per decode kind.
    assert sorted((j.group, j.variant) for j in fp8) == [(1, "auto"), (4, "auto")]
    bf16 = [j for j in todo if j.kv_dtype == "auto"]
    assert len(bf16) == 2 * 3  # each group kind x each family


def test_groups_matter_only_across_the_tensor_core_threshold() -> None:
    todo = load_benchmark("fi_precompile").jobs(
        ["bfloat16"], ["auto"], [64], [1, 2, 4, 8], ["fa2"], 4
    )
    assert [j.group for j in todo] == [1, 4]


def test_lists_its_jobs_and_refuses_without_a_gpu() -> None:
    listed = subprocess.run(
        [sys.executable, str(SCRIPT), "--list", "--head-dims", "64", "--kv-dtypes", "auto"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert listed.stdout.count("job: ") == 4  # GQA 1 and 4, prefill auto and fa2
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without a GPU")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--head-dims", "64"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 2
    assert "needs a CUDA device" in run.stderr
