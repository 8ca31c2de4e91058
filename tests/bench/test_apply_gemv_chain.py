"""benchmarks/apply_gemv_chain.py: which one-row chain winners reach the skinny-GEMM table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench import load_benchmark

pytest.importorskip("triton")


def _record(kind: str, us: float, variant: str = "norm", **tile) -> dict:  # type: ignore[no-untyped-def]
    base = {"block_n": 4, "block_k": 512, "warps": 4, "stages": 2, "use_dot": False,
            "late_norm": True, "preload": None if kind == "table" else True}  # fmt: skip
    return {"shape": "qkv", "n": 4096, "k": 1024, "rows": 1, "kind": kind, "variant": variant,
            "us_per_call": us, **base, **tile}  # fmt: skip


def _table(tmp_path: Path) -> Path:
    table = {"format": 2, "device_name": "X", "date": "", "torch": "", "shapes": {
        "4096,1024,norm": {"1": {"block_n": 4, "block_k": 512, "use_dot": False, "num_warps": 4,
                                 "num_stages": 2, "fuse_norm": True, "split_k": 1,
                                 "late_norm": True},
                           "8": {"block_n": 32, "block_k": 256, "use_dot": True, "num_warps": 4,
                                 "num_stages": 4, "fuse_norm": True, "split_k": 1,
                                 "late_norm": False}}}}  # fmt: skip
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    return path


def _run(tmp_path: Path, records: list[dict], *extra: str) -> dict:  # type: ignore[type-arg]
    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps({"gpu": "X", "records": records}))
    table = _table(tmp_path)
    assert load_benchmark("apply_gemv_chain").main([str(chain), "--table", str(table), *extra]) == 0
    return json.loads(table.read_text())["shapes"]["4096,1024,norm"]


def test_a_winner_by_more_than_the_gain_replaces_only_the_one_row_tile(tmp_path: Path) -> None:
    got = _run(tmp_path, [
        _record("table", 4.2),
        _record("candidate", 3.9, block_n=8, block_k=1024),
        _record("candidate", 3.5, block_n=16, preload=False),  # not what the step runs
        {**_record("candidate", 2.0, block_n=16), "rows": 8},  # another batch's run
    ])  # fmt: skip
    assert got["1"]["block_n"] == 8 and got["1"]["block_k"] == 1024 and got["1"]["late_norm"]
    assert got["8"]["block_n"] == 32  # other batch sizes are kept


def test_a_winner_inside_the_noise_leaves_the_table(tmp_path: Path) -> None:
    got = _run(tmp_path, [_record("table", 4.2), _record("candidate", 4.05, block_n=8)])
    assert got["1"]["block_n"] == 4
    got = _run(tmp_path, [_record("table", 4.2), _record("candidate", 4.05, block_n=8)],
               "--min-gain", "0.02")  # fmt: skip
    assert got["1"]["block_n"] == 8


def test_records_of_another_gpu_need_a_named_table(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    paths = []
    for i, gpu in enumerate(["NVIDIA H100 80GB HBM3", "NVIDIA H200"]):
        paths.append(tmp_path / f"c{i}.json")
        paths[-1].write_text(json.dumps({"gpu": gpu, "records": []}))
    assert load_benchmark("apply_gemv_chain").main([str(p) for p in paths]) == 2
    assert "pass --table" in capsys.readouterr().err
