"""The execrt command line: backends, generate and user-mistake handling."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import execrt
from execrt.cli import main


def test_backends_json_lists_every_backend_with_usability(capsys) -> None:
    assert main(["backends", "--json"]) == 0
    inv = json.loads(capsys.readouterr().out)
    rows = {(r["kind"], r["name"]): r for r in inv["backends"]}
    native = rows[("attention", "torch_native")]
    assert native["usable"] is True and native["plugin"] == "execrt.builtin"
    assert native["version"] == execrt.__version__
    assert native["capabilities"]["devices"] == ["cpu", "cuda"]
    assert rows[("moe_dispatch", "allreduce")]["capabilities"]["output_format"] == "standard"
    fi = rows[("attention", "flashinfer")]
    try:
        import flashinfer  # noqa: F401

        installed = torch.cuda.is_available()
    except ImportError:
        installed = False
    # Usable exactly when the module and a GPU are here; otherwise the reasons say which.
    assert fi["usable"] is installed, fi["reasons"]
    if not installed:
        assert any("flashinfer" in r or "CUDA" in r or "cuda" in r for r in fi["reasons"])
    assert rows[("attention", "triton")]["capabilities"]["head_dims"] == [64, 96, 128, 256]
    assert {"plugin_failures", "conflicts", "plugins"} <= set(inv)


def test_backends_table_filters_by_kind(capsys) -> None:
    assert main(["backends", "--kind", "moe_dispatch"]) == 0
    out = capsys.readouterr().out
    assert "allreduce" in out and "torch_native" not in out


def test_generate_on_the_builtin_model(capsys) -> None:
    assert main(["generate", "Hi", "--max-new-tokens", "4", "-v", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "attention: requested 'auto' -> torch_native" in captured.err
    assert captured.out.strip() != ""


def test_generate_json_and_token_ids(capsys) -> None:
    assert main(["generate", "1,2,3", "--token-ids", "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out[0]["token_ids"]) == 3 and out[0]["prompt_token_ids"] == [1, 2, 3]


def test_user_mistakes_print_one_line_and_exit_2(capsys) -> None:
    assert main(["generate", "x", "--attention", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attention backend 'nope' unavailable: not registered" in err[0]
    assert main(["generate", "x", "--dtype", "float64"]) == 2
    assert "dtype 'float64' unsupported" in capsys.readouterr().err


def test_python_m_execrt_bad_flag_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "execrt", "generate", "--no-such-flag"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_conformance_command_writes_a_report_backends_shows(tmp_path, capsys) -> None:
    report = tmp_path / "r.json"
    args = ["conformance", "attention", "torch_native", "--json", str(report), "-k", "single"]
    assert main(args) == 0
    data = json.loads(report.read_text())
    assert data["failed"] == 0 and data["passed"] > 0 and data["name"] == "torch_native"
    capsys.readouterr()
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["backends"]}
    assert rows["torch_native"]["last_conformance"]["passed"] == data["passed"]
    assert main(["conformance", "attention", "no_such_backend"]) == 2
