"""Launching ``execrt`` under torchrun on CPU (gloo) for the tensor-parallel tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun_execrt(
    args: Sequence[str],
    *,
    nproc: int = 2,
    options: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[str]:
    """``torchrun --standalone [options] --nproc-per-node nproc -m execrt args`` from the
    repository root, its stdout and stderr piped (text), one OpenMP thread per rank."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", *options]
    return subprocess.Popen(
        [*launcher, "--nproc-per-node", str(nproc), "-m", "execrt", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"} | dict(env or {}),
    )
