"""What produced a benchmark's records: the versions and the commit each record's ``env`` holds."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
from typing import Any

import torch

from execrt._version import __version__


def run_environment() -> dict[str, str | None]:
    """What produced a run's records (each record's ``env``): ``execrt``, its version;
    ``git_commit``, the commit of its source tree (``-dirty`` with uncommitted changes to the
    package; None outside a git checkout); the ``torch``, ``triton``, ``transformers`` and
    ``flashinfer`` versions (from package metadata: nothing is imported; None where not
    installed); ``cuda``, the CUDA torch was built with; ``cuda_driver``, the CUDA version the
    driver supports as torch reads it (None without a GPU); ``driver``, the NVIDIA driver's
    version (None without one)."""
    cuda_driver = None
    read = getattr(torch._C, "_cuda_getDriverVersion", None)  # absent from CPU builds
    if read is not None and torch.cuda.is_available():
        version = int(read())  # e.g. 12080
        cuda_driver = f"{version // 1000}.{version % 1000 // 10}"
    return {
        "execrt": __version__,
        "git_commit": _git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "torch": str(torch.__version__),
        "triton": _dist_version("triton", "pytorch-triton"),
        "transformers": _dist_version("transformers"),
        "flashinfer": _dist_version("flashinfer-python", "flashinfer"),
        "cuda": torch.version.cuda,
        "cuda_driver": cuda_driver,
        "driver": _nvidia_driver(),
    }


def _dist_version(*names: str) -> str | None:
    """The version of the first of ``names`` (distribution names) installed, else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git_commit(package_dir: str) -> str | None:
    """``git rev-parse --short HEAD`` of the checkout ``package_dir`` is in, ``-dirty`` when
    tracked files under it have changed; None without git, outside a checkout, for a copy
    installed into site-packages inside some other checkout, or past a 2 s timeout."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=package_dir, capture_output=True, text=True, timeout=2, check=True
        )
        return done.stdout.strip()

    try:
        if "site-packages" in git("rev-parse", "--show-prefix"):
            return None
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def _nvidia_driver(path: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel module's version as Linux's /proc reports it, e.g. "550.54.15"; None
    without one."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else None


def write_run(path: str, records: list[dict[str, Any]]) -> None:
    """A script's records as ``{"gpu", "env", "records"}`` JSON at ``path`` (the benchmarks in
    ``benchmarks/`` that are no ``execrt bench`` command)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    with open(path, "w") as f:
        json.dump({"gpu": gpu, "env": run_environment(), "records": records}, f, indent=1)
