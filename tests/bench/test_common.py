"""The benchmarks' shared tail: ranking a row of records, printing and saving them."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from execrt.bench import common
from execrt.bench.common import CopyRate, chosen_backend, measure_copy_rate, rank, report
from execrt.core.errors import ExecrtError
from execrt.core.selection import Resolution, ResolutionReport


@dataclass
class Row:
    backend: str
    gbps: float
    vs_best_peer: float = -1.0
    vs_flashinfer: float = -1.0


def table(rows: Sequence[Row]) -> str:
    return "\n".join(f"{r.backend} {r.vs_best_peer:.2f}" for r in rows)


def test_rank_against_the_rows_best_and_against_a_given_value() -> None:
    row = [Row("a", 50.0), Row("b", 200.0), Row("c", 100.0)]
    rank(row, "gbps")
    assert [r.vs_best_peer for r in row] == [0.25, 1.0, 0.5]
    rank(row, "gbps", "vs_flashinfer", against=100.0)
    assert [r.vs_flashinfer for r in row] == [0.5, 2.0, 1.0]
    assert [r.vs_best_peer for r in row] == [0.25, 1.0, 0.5]  # the other field untouched


def test_rank_gives_zero_where_there_is_nothing_to_compare_with() -> None:
    row = [Row("a", 0.0), Row("b", 0.0)]
    rank(row, "gbps")
    assert [r.vs_best_peer for r in row] == [0.0, 0.0]
    rank(row, "gbps", "vs_flashinfer", against=0.0)  # the peer did not run
    assert [r.vs_flashinfer for r in row] == [0.0, 0.0]
    rank([], "gbps")  # a shape every backend skipped


def test_report_prints_saves_and_returns_the_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [Row("a", 1.0, 0.5), Row("b", 2.0, 1.0)]
    assert report(rows, table, str(tmp_path / "out"), "attention-decode") is rows
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["a 0.50", "b 1.00"]
    saved = out[2].removeprefix("# saved ")
    assert Path(saved).parent == tmp_path / "out"
    assert Path(saved).name.startswith("attention-decode-") and saved.endswith(".json")
    assert json.loads(Path(saved).read_text())[1] == {
        "backend": "b", "gbps": 2.0, "vs_best_peer": 1.0, "vs_flashinfer": -1.0
    }  # fmt: skip


def test_report_without_a_directory_saves_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    report([Row("a", 1.0)], table, None, "moe")
    assert "saved" not in capsys.readouterr().out


def test_measure_copy_rate_off_cuda_is_the_host_copy_rate() -> None:
    rate = measure_copy_rate(torch.device("cpu"))
    assert rate.gpu == "cpu" and rate.gbps > 0


def test_measure_copy_rate_on_cuda_frees_the_copy_buffers_after_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"GPU {device}")
    monkeypatch.setattr(common, "copy_bandwidth_gbps", lambda: calls.append("copy") or 4000.0)
    monkeypatch.setattr(common, "release_memory", lambda: calls.append("release"))
    rate = measure_copy_rate(torch.device("cuda", 0))
    assert rate == CopyRate("GPU cuda:0", 4000.0)
    assert calls == ["copy", "release"]  # else the next engine's KV pool sizes smaller


def test_chosen_backend_names_the_kinds_choice_or_none() -> None:
    resolution = ResolutionReport(
        [Resolution("attention", "auto", "triton"), Resolution("graph", "auto", None)]
    )
    assert chosen_backend(resolution, "attention") == "triton"
    assert chosen_backend(resolution, "graph") == "none"  # resolved to nothing
    assert chosen_backend(resolution, "moe_dispatch") == "none"  # not in the report


def test_records_saved_in_the_same_second_never_overwrite_each_other(tmp_path: Path) -> None:
    @dataclass
    class Row:
        n: int

    paths = [common.save_records([Row(i)], str(tmp_path), "x") for i in range(3)]
    assert len(set(paths)) == 3
    assert [json.loads(Path(p).read_text())[0]["n"] for p in paths] == [0, 1, 2]


def test_a_records_folder_that_cannot_be_written_names_out(tmp_path: Path) -> None:
    @dataclass
    class Row:
        n: int

    (tmp_path / "a-file").write_text("")
    # Before: `execrt: error: [Errno 20] Not a directory: ...`, after the whole run.
    with pytest.raises(ExecrtError, match=r"--out '.*a-file/sub': the x records were not saved"):
        common.save_records([Row(1)], str(tmp_path / "a-file" / "sub"), "x")


def test_the_out_folder_is_made_and_written_to_before_a_run(tmp_path: Path) -> None:
    out = tmp_path / "new" / "results"
    common.prepare_out_dir("prefix", str(out))
    assert out.is_dir() and list(out.iterdir()) == []  # the probe file removed again
    common.prepare_out_dir("prefix", None)  # nothing saved: nothing to check


def test_an_out_folder_under_a_regular_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ExecrtError, match=r"bench prefix: --out '.*a-file': cannot make it \(it"):
        common.prepare_out_dir("prefix", str(tmp_path / "a-file"))
    with pytest.raises(ExecrtError, match=r"--out '.*a-file/sub': cannot make it \(not a direc"):
        common.prepare_out_dir("prefix", str(tmp_path / "a-file" / "sub"))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_out_folder_that_cannot_be_made_in_proc_is_refused() -> None:
    # For root, /proc is writable by its mode bits (out_dir_problem's os.access check passed),
    # yet it refuses a new entry: the run measured everything, then died on saving, status 2,
    # with "[Errno 2] No such file or directory: '/proc/xx'" not naming --out.
    with pytest.raises(ExecrtError, match=r"--out '/proc/execrt-x': cannot make it \(no such"):
        common.prepare_out_dir("serve", "/proc/execrt-x")
    with pytest.raises(ExecrtError, match=r"--out '/proc/self': cannot write a file in it"):
        common.prepare_out_dir("serve", "/proc/self")


def test_smoke_defaults_fill_what_was_left_at_its_default_on_cpu_only() -> None:
    @dataclass(frozen=True)
    class Opts:
        model: str = "big"
        config: dict[str, int] | None = None
        size: int = 100
        steps: int = 10
        device: str = "cuda"

    smoke = {"model": "tiny", "config": {"layers": 1}, "size": 2, "steps": 1}
    gpu = Opts()
    assert common.smoke_defaults(gpu, smoke) is gpu
    assert common.smoke_defaults(Opts(device="cpu"), smoke) == Opts(
        "tiny", {"layers": 1}, 2, 1, "cpu"
    )
    given = common.smoke_defaults(Opts(size=7, device="cpu"), smoke)
    assert (given.size, given.steps, given.model) == (7, 1, "tiny")
    # A model given keeps its own shape (the smoke config would have replaced it).
    named = common.smoke_defaults(Opts(model="other", device="cpu"), smoke)
    assert (named.model, named.config, named.size) == ("other", None, 2)
    assert "smoke shape and sizes" in common.smoke_note(
        Opts(device="cpu"), Opts("tiny", {"layers": 1}, 2, 1, "cpu")
    )
    assert common.smoke_note(gpu, gpu) == ""


@dataclass
class Gated:
    backend: str
    check: str = ""
    note: str = ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_result_past_its_dtypes_tolerance_fails_the_check_and_says_by_how_much(
    dtype: torch.dtype, capsys: pytest.CaptureFixture[str]
) -> None:
    tol = common.TOLERANCES[dtype]
    within, past = Gated("a"), Gated("b", note="auto runs fa3")
    assert common.check_error(within, tol / 2, dtype, "a bs=1")
    assert (within.check, within.note) == ("passed", "")
    assert not common.check_error(past, 2 * tol, dtype, "b bs=1")
    name = str(dtype).removeprefix("torch.")
    why = f"failed the check: rel err {2 * tol:.1e} > {tol:.0e} ({name})"
    assert past.check == "failed" and past.note == f"auto runs fa3; {why}"  # what ran is kept
    assert capsys.readouterr().out == f"  b bs=1 {why}\n"  # said as it happens
    for err in (float("nan"), float("inf")):  # a kernel that wrote garbage
        assert not common.check_error(Gated("c"), err, dtype, "c")
    assert [r.backend for r in common.passing([within, past])] == ["a"]


def test_a_backend_that_raised_is_an_error_with_its_one_line_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    record = Gated("flashinfer")
    common.note_error(record, RuntimeError("flashinfer: not installed\nTraceback ..."), "fi T=1")
    assert (record.check, record.note) == ("error", "RuntimeError: flashinfer: not installed")
    assert capsys.readouterr().out == "  fi T=1 error: RuntimeError: flashinfer: not installed\n"
    assert common.passing([record]) == []
    cells = [common.check_cell(Gated("x", c)) for c in ("passed", "failed", "error", "skipped")]
    assert cells == ["passed", "FAILED", "ERROR", "skipped"]
    # A backend that refuses the problem (an fp8 cache it does not declare, a package not
    # installed) is skipped with its reasons, not an error (seen on an H100: every backend
    # without fp8 KV was listed as ERROR in the fp8 rows).
    refused = Gated("sdpa_example")
    common.note_error(refused, common.Refused("KV cache dtype float8_e4m3fn unsupported"), "s")
    assert (refused.check, refused.note) == (
        "skipped",
        "Refused: KV cache dtype float8_e4m3fn unsupported",
    )
    assert common.passing([refused]) == []


def test_a_checkpoint_keeps_the_records_so_far_until_the_final_file_replaces_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved, other = common.Checkpoint(str(tmp_path), "moe"), common.Checkpoint(str(tmp_path), "moe")
    assert list(tmp_path.iterdir()) == []  # nothing finished: nothing written
    saved.save([Row("a", 1.0)])
    saved.save([Row("a", 1.0), Row("b", 2.0)])
    other.save([Row("c", 3.0)])  # a run beside it, started in the same second
    partial = Path(str(saved.path))
    assert partial.name.startswith("moe-partial-") and partial != Path(str(other.path))
    assert [r["backend"] for r in json.loads(partial.read_text())] == ["a", "b"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    rows = [Row("a", 1.0), Row("b", 2.0)]
    assert saved.report(rows, table) is rows
    assert not partial.exists()  # the final file has every record
    final = capsys.readouterr().out.splitlines()[-1].removeprefix("# saved ")
    assert Path(final).name.startswith("moe-2") and len(json.loads(Path(final).read_text())) == 2
    nowhere = common.Checkpoint(None, "moe")
    nowhere.save(rows)
    assert nowhere.report(rows, table) is rows and nowhere.path is None
