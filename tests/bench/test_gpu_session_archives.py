"""benchmarks/gpu_session.sh: several runs in one device call may share ``$OUT``; each run's
logs archive gets a name of its own instead of replacing the one before (a call of three runs
brought back only the last run's logs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(out: Path, step: str, stubs: Path) -> None:
    # python3, pip and nvidia-smi stubbed out: the run only writes its summary and archives
    env = {**os.environ, "OUT": str(out), "FI_CACHE_BACK": "0", "WHEELS": str(stubs / "none")}
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    subprocess.run(
        ["bash", str(SCRIPT), step],
        cwd=stubs,
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )


def test_each_run_in_a_shared_out_keeps_its_own_logs_archive(tmp_path: Path) -> None:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for tool in ("python3", "nvidia-smi"):
        (stubs / tool).write_text("#!/bin/sh\nexit 0\n")
        (stubs / tool).chmod(0o755)
    out = tmp_path / "out"
    steps = ["first-step", "second-step", "third-step"]
    for step in steps:
        _run(out, step, stubs)
    archives = sorted(p.name for p in out.glob("logs*.tgz"))
    assert archives == ["logs-2.tgz", "logs-3.tgz", "logs.tgz"]
    # each archive holds its own run's summary, naming its own (unknown) step
    for name, step in zip(["logs.tgz", "logs-2.tgz", "logs-3.tgz"], steps, strict=True):
        with tarfile.open(out / name) as tar:
            member = tar.extractfile("summary.txt")
            assert member is not None
            assert f"step {step}:" in member.read().decode()
