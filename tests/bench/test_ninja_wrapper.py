"""benchmarks/bin/ninja: each manifest keeps its build log beside it, so builds of different
FlashInfer modules in different processes no longer share (and lose) one log."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "benchmarks" / "bin" / "ninja"


def _module():  # type: ignore[no-untyped-def]
    loader = importlib.machinery.SourceFileLoader("ninja_wrapper", str(WRAPPER))
    spec = importlib.util.spec_from_loader("ninja_wrapper", loader)
    assert spec
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_the_manifest_is_swapped_for_one_whose_log_stays_in_its_folder(tmp_path: Path) -> None:
    mod = _module()
    folder = tmp_path / "mod a$b"
    folder.mkdir()
    manifest = folder / "build.ninja"
    args = mod.per_module(["-v", "-C", str(tmp_path), "-f", str(manifest), "-j", "4"])
    wrapper = folder / mod.WRAPPER_NAME
    assert args == ["-v", "-C", str(tmp_path), "-f", str(wrapper), "-j", "4"]
    escaped = str(folder).replace("$", "$$").replace(" ", "$ ")
    assert wrapper.read_text() == f"builddir = {escaped}\ninclude {escaped}/build.ninja\n"
    os.utime(wrapper, (1, 1))
    mod.per_module(["-f", str(manifest)])
    assert wrapper.stat().st_mtime == 1  # rewritten only when it would change
    assert mod.per_module(["-t", "clean"]) == ["-t", "clean"]  # no manifest named: untouched


@pytest.mark.skipif(shutil.which("ninja") is None, reason="needs a ninja executable")
def test_two_modules_keep_two_logs_and_each_is_up_to_date_after_the_other(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / f"{name}.src").write_text(name)
        (tmp_path / name / "build.ninja").write_text(
            "rule copy\n  command = cp $in $out\n"
            f"build {name}/out.txt: copy {tmp_path / name}.src\n"
        )
    env = {**os.environ, "PATH": f"{WRAPPER.parent}{os.pathsep}{os.environ['PATH']}"}

    def build(name: str) -> str:
        cmd = ["ninja", "-C", str(tmp_path), "-f", str(tmp_path / name / "build.ninja")]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        return done.stdout

    build("a")
    build("b")
    assert (tmp_path / "a" / ".ninja_log").exists() and (tmp_path / "b" / ".ninja_log").exists()
    assert not (tmp_path / ".ninja_log").exists()  # nothing shared in the -C folder
    (tmp_path / "b" / ".ninja_log").unlink()  # b's log lost: a's build must not care
    assert "no work to do" in build("a")
    assert (tmp_path / "a" / "out.txt").read_text() == "a"


def test_the_real_ninja_is_found_past_the_wrapper(tmp_path: Path) -> None:
    fake = tmp_path / "ninja"
    fake.write_text('#!/bin/sh\necho real "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{WRAPPER.parent}{os.pathsep}{tmp_path}"}
    out = subprocess.run(
        [sys.executable, str(WRAPPER), "--version"], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "real --version"
