"""benchmarks/bin/ninja: each manifest keeps its build log beside it (builds of different
FlashInfer modules in different processes no longer share, and truncate, one log), and a module
marked built is not rebuilt for want of its object files."""

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


def _flashinfer_like(root: Path, name: str) -> Path:
    """A module in FlashInfer's layout: ``<root>/<name>/build.ninja`` compiling one source
    into ``$name/x.o`` and linking ``$name/$name.so`` (cp stands in for both)."""
    (root / name).mkdir()
    src = root / f"{name}.cu"
    src.write_text(name)
    manifest = root / name / "build.ninja"
    manifest.write_text(
        f"name = {name}\n"
        "rule compile\n  command = cp $in $out\n"
        "rule link\n  command = cp $in $out\n"
        f"build $name/x.o: compile {src}\n"
        "build $name/$name.so: link $name/x.o\n"
        "default $name/$name.so\n"
    )
    return manifest


def _ninja(root: Path, manifest: Path, path: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(WRAPPER), "-v", "-C", str(root), "-f", str(manifest)]
    env = {**os.environ, "PATH": path}
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def _recording_ninja(folder: Path) -> Path:
    """A stand-in for the real ninja that only records its arguments."""
    log = folder / "calls.txt"
    fake = folder / "ninja"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    return log


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
    assert mod.per_module(["-f", str(manifest), "-t", "deps"])[-1] == "deps"  # tools pass


@pytest.mark.skipif(shutil.which("ninja") is None, reason="needs a ninja executable")
def test_two_modules_keep_two_logs_and_a_lost_one_costs_only_its_own(tmp_path: Path) -> None:
    path = f"{WRAPPER.parent}{os.pathsep}{os.environ['PATH']}"
    a, b = _flashinfer_like(tmp_path, "a"), _flashinfer_like(tmp_path, "b")
    for manifest in (a, b):
        assert _ninja(tmp_path, manifest, path).returncode == 0
    assert (tmp_path / "a" / "a.so").read_text() == "a"
    assert (tmp_path / "a" / ".ninja_log").exists() and (tmp_path / "b" / ".ninja_log").exists()
    assert not (tmp_path / ".ninja_log").exists()  # nothing shared in the -C folder
    (tmp_path / "b" / ".ninja_log").unlink()
    (tmp_path / "a" / ".execrt-built").unlink()  # a: ninja itself decides, from its own log
    out = _ninja(tmp_path, a, path)
    assert out.returncode == 0 and "no work to do" in out.stdout


def test_a_marked_module_runs_no_ninja_even_without_its_objects(tmp_path: Path) -> None:
    manifest = _flashinfer_like(tmp_path, "m")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = _recording_ninja(bin_dir)
    path = f"{WRAPPER.parent}{os.pathsep}{bin_dir}"

    assert _ninja(tmp_path, manifest, path).returncode == 0  # no marker yet: ninja runs
    assert calls.read_text().count("per-module.ninja") == 1
    marker = tmp_path / "m" / ".execrt-built"
    assert marker.exists()  # written after the build succeeded
    (tmp_path / "m" / "m.so").write_text("built")  # what the build would have left

    assert _ninja(tmp_path, manifest, path).returncode == 0  # no x.o at all: still built
    assert calls.read_text().count("\n") == 1

    future = marker.stat().st_mtime + 10
    os.utime(tmp_path / "m.cu", (future, future))  # a source changed since: ninja again
    assert _ninja(tmp_path, manifest, path).returncode == 0
    assert calls.read_text().count("\n") == 2

    os.utime(marker, (future + 1, future + 1))
    (tmp_path / "m" / "m.so").unlink()  # the module itself gone: ninja again
    assert _ninja(tmp_path, manifest, path).returncode == 0
    assert calls.read_text().count("\n") == 3


def test_a_failed_build_leaves_no_marker(tmp_path: Path) -> None:
    manifest = _flashinfer_like(tmp_path, "f")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ninja").write_text("#!/bin/sh\nexit 3\n")
    (bin_dir / "ninja").chmod(0o755)
    out = _ninja(tmp_path, manifest, f"{WRAPPER.parent}{os.pathsep}{bin_dir}")
    assert out.returncode == 3 and not (tmp_path / "f" / ".execrt-built").exists()


def test_the_real_ninja_is_found_past_the_wrapper(tmp_path: Path) -> None:
    fake = tmp_path / "ninja"
    fake.write_text('#!/bin/sh\necho real "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{WRAPPER.parent}{os.pathsep}{tmp_path}"}
    out = subprocess.run(
        [sys.executable, str(WRAPPER), "--version"], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "real --version"
