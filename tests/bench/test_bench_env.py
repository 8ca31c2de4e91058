"""What a benchmark record says produced it (``environment.run_environment``): the versions, the
source tree's commit and the driver, each None where it cannot be known, never a failure."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from execrt._version import __version__
from execrt.bench import environment

KEYS = {
    "execrt", "git_commit", "torch", "triton", "transformers", "flashinfer", "cuda",
    "cuda_driver", "driver",
}  # fmt: skip
REPO = Path(environment.__file__).resolve().parents[2]


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_the_environment_names_each_version_as_a_string_or_none() -> None:
    env = environment.run_environment()
    assert set(env) == KEYS
    assert all(v is None or (isinstance(v, str) and v) for v in env.values()), env
    assert json.loads(json.dumps(env)) == env  # goes into every record's JSON as it is
    assert (env["execrt"], env["torch"], env["cuda"]) == (
        __version__, torch.__version__, torch.version.cuda
    )  # fmt: skip
    assert env["transformers"] == _installed("transformers")
    assert env["flashinfer"] == (_installed("flashinfer-python") or _installed("flashinfer"))
    if not torch.cuda.is_available():
        assert env["cuda_driver"] is None


@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout"
)
def test_the_commit_is_the_checkouts_head() -> None:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert environment.run_environment()["git_commit"] in (head, f"{head}-dirty")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_says_dirty_and_is_none_outside_a_checkout_or_in_site_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path, capture_output=True, text=True, check=True,
        )  # fmt: skip
        return done.stdout.strip()

    for pkg in ("src/pkg", "venv/lib/site-packages/pkg"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "m.py").write_text("x = 1\n")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no checkout above
    assert environment._git_commit(str(tmp_path / "src/pkg")) is None  # not a checkout yet
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    head = git("rev-parse", "--short", "HEAD")
    assert environment._git_commit(str(tmp_path / "src/pkg")) == head
    (tmp_path / "src/pkg/m.py").write_text("x = 2\n")
    assert environment._git_commit(str(tmp_path / "src/pkg")) == f"{head}-dirty"
    # an installed copy inside some other checkout: that checkout's commit would be a lie
    assert environment._git_commit(str(tmp_path / "venv/lib/site-packages/pkg")) is None


@pytest.mark.parametrize(
    "failure",
    [FileNotFoundError("git"), subprocess.TimeoutExpired("git", 2)],
    ids=["no-git", "timeout"],
)
def test_git_missing_or_hanging_gives_no_commit_and_no_error(
    failure: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(environment.subprocess, "run", run)
    assert environment.run_environment()["git_commit"] is None


def test_the_driver_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = tmp_path / "version"
    for text in (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 UTC 2023\n",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.129.03  Release Build\n",
    ):
        proc.write_text(text + "GCC version:  gcc version 12.2.0\n")
        assert environment._nvidia_driver(str(proc)) == "535.129.03"
    assert environment._nvidia_driver(str(tmp_path / "absent")) is None
    # the CUDA version the driver supports, as torch reads it (12080 -> 12.8)
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert environment.run_environment()["cuda_driver"] == "12.8"
