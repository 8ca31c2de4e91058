"""The benchmarks' shared tail: ranking a row of records, printing and saving them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from execrt.bench import common
from execrt.bench.common import CopyRate, chosen_backend, measure_copy_rate, rank, report
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
