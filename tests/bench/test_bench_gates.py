"""bench attention, extend and moe: a result past its tolerance is recorded as failed and never
ranked, a backend that raises is recorded with its reason, every record says what produced it,
and the records so far are on disk after each one (a killed run keeps them). The GPU parts
(problems, timing) are fakes: what is tested is what the runs do with their results."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from execrt.bench import attention, environment, extend, moe

ENV = {"execrt": "0.0-test", "git_commit": "abc1234", "driver": None}


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA device as far as the runs ask: its name, its copy rate, the run's environment."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(environment, "run_environment", lambda: dict(ENV))  # run_fields'
    monkeypatch.setattr(moe, "run_environment", lambda: dict(ENV))
    for bench in (attention, extend, moe):
        monkeypatch.setattr(bench, "PluginHost", lambda: None, raising=False)
    for bench in (attention, moe):
        monkeypatch.setattr(bench, "copy_bandwidth_gbps", lambda: 1000.0)


def _saved(out: Path) -> tuple[list[dict[str, Any]], list[Path]]:
    """The records of the one file in ``out``, and the partial files there."""
    (path,) = out.iterdir()
    return json.loads(path.read_text()), [p for p in out.iterdir() if "-partial-" in p.name]


# -- bench attention -----------------------------------------------------------------------------
#: backend -> (µs, relative error), or the exception its build raises
ATTENTION: dict[str, Any] = {
    "fast_wrong": (5.0, 0.5),  # the fastest, and wrong: it must not become the best peer
    "good": (10.0, 2e-3),
    "slower": (20.0, 1e-3),
    "broken": RuntimeError("flashinfer: not installed\nmore"),
}


@pytest.fixture
def fake_attention(monkeypatch: pytest.MonkeyPatch, fake_gpu: None) -> list[tuple[str, int]]:
    """Problems and backends that answer ``ATTENTION``; returns the (backend, bs) timed."""
    timed: list[tuple[str, int]] = []

    def problem(bs: int, ctx: int, hq: int, hkv: int, d: int, dtype: torch.dtype, **kw: Any):  # type: ignore[no-untyped-def]
        return SimpleNamespace(bs=bs, ctx=ctx, dtype=dtype, kv_bytes=1e6)

    def build(host: object, name: str, p: Any, ctx: object) -> Any:
        if isinstance(ATTENTION[name], Exception):
            raise ATTENTION[name]
        return SimpleNamespace(name=name, close=lambda: None)

    def time_backend(backend: Any, p: Any, iters: int, reps: int) -> tuple[float, float, bool]:
        timed.append((backend.name, p.bs))
        if backend.name == "stop":
            raise KeyboardInterrupt  # the run killed, e.g. by a time limit
        us, err = ATTENTION[backend.name]
        return us, err, True

    monkeypatch.setattr(attention, "DecodeProblem", problem)
    monkeypatch.setattr(attention, "build_backend", build)
    monkeypatch.setattr(attention, "time_backend", time_backend)
    return timed


def test_attention_records_a_wrong_or_broken_backend_and_ranks_only_the_correct(
    fake_attention: list[tuple[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = attention.run(list(ATTENTION), [(1, 4096), (8, 4096)], out_dir=str(tmp_path))
    assert [(r.backend, r.bs) for r in records] == [(n, bs) for bs in (1, 8) for n in ATTENTION]
    wrong, good, slower, broken = records[:4]
    assert (wrong.check, wrong.vs_best_peer, wrong.us) == ("failed", 0.0, 5.0)
    assert "failed the check: rel err 5.0e-01 > 3e-02 (bfloat16)" in wrong.note
    assert (good.check, good.vs_best_peer) == ("passed", 1.0)  # best of those that passed
    assert (slower.check, slower.vs_best_peer) == ("passed", 0.5)
    assert good.vs_kv_auto == 1.0 and wrong.vs_kv_auto is None
    assert (broken.check, broken.note) == ("error", "RuntimeError: flashinfer: not installed")
    assert (broken.us, broken.gbps, broken.pct_copy_bw, broken.vs_best_peer) == (None,) * 3 + (0,)
    assert good.copy_gbps == 1000.0 and good.pct_copy_bw == pytest.approx(100 * good.gbps / 1000)
    rows, partial = _saved(tmp_path)
    assert partial == [] and len(rows) == 8 and all(row["env"] == ENV for row in rows)
    assert rows[3]["check"] == "error" and rows[3]["us"] is None
    table = capsys.readouterr().out.splitlines()
    by_backend = {line.split()[0]: line for line in table[-10:-1]}
    assert "FAILED" in by_backend["fast_wrong"] and "ERROR" in by_backend["broken"]
    assert " passed " in by_backend["good"]


def test_a_killed_attention_run_keeps_the_records_it_finished(
    fake_attention: list[tuple[str, int]], tmp_path: Path
) -> None:
    ATTENTION["stop"] = None
    try:
        with pytest.raises(KeyboardInterrupt):
            attention.run(["good", "slower", "stop"], [(1, 4096), (8, 4096)], out_dir=str(tmp_path))
    finally:
        del ATTENTION["stop"]
    assert fake_attention[-1] == ("stop", 1)  # killed in the first shape's third backend
    rows, (partial,) = _saved(tmp_path)
    assert partial.name.startswith("attention-decode-partial-")
    assert [(r["backend"], r["vs_best_peer"]) for r in rows] == [("good", 1.0), ("slower", 0.5)]
    assert all(row["env"] == ENV for row in rows)


# -- bench extend --------------------------------------------------------------------------------
#: (backend, variant) -> (ms, relative error), or the exception building it raises
EXTEND: dict[tuple[str, str], Any] = {
    ("triton", ""): (2.0, 1e-3),
    ("flashinfer", "auto"): (1.0, 0.4),  # the fastest, and wrong
    ("flashinfer", "fa3"): RuntimeError("fa3: needs sm90"),
    ("sdpa", ""): (4.0, 1e-3),
}


@pytest.fixture
def fake_extend(monkeypatch: pytest.MonkeyPatch, fake_gpu: None) -> None:
    def problem(bs: int, new: int, prefix: int, *a: Any) -> Any:
        return SimpleNamespace(bs=bs, new=new, prefix=prefix, dtype=torch.bfloat16, flops=1e12)

    def calls(host: object, name: str, p: Any, ctx: object, options: Any) -> Any:
        key = (name, (options or {}).get("prefill_backend", ""))
        if isinstance(EXTEND[key], Exception):
            raise EXTEND[key]
        return [key], SimpleNamespace(close=lambda: None)

    def measure(calls: list[Any], p: Any, iters: int, reps: int) -> tuple[float, float]:
        if p.bs == 8:
            raise KeyboardInterrupt
        result: tuple[float, float] = EXTEND[calls[0]]
        return result

    monkeypatch.setattr(extend, "ExtendProblem", problem)
    monkeypatch.setattr(extend, "backend_calls", calls)
    monkeypatch.setattr(extend, "sdpa_calls", lambda p: [("sdpa", "")])
    monkeypatch.setattr(extend, "measure", measure)
    monkeypatch.setattr(extend, "run_peak_tflops", lambda device: 800.0)  # the run's peak


def test_extend_ranks_only_the_correct_and_keeps_what_it_finished_when_killed(
    fake_extend: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shapes = [(1, 8, 0), (8, 8, 0)]  # the second shape's first timing is killed
    with pytest.raises(KeyboardInterrupt):
        extend.run(shapes=shapes, variants=("auto", "fa3"), out_dir=str(tmp_path))
    rows, (partial,) = _saved(tmp_path)
    assert partial.name.startswith("extend-partial-")
    got = {(r["backend"], r["variant"]): r for r in rows}
    assert list(got) == list(EXTEND)  # the first shape, every record of it
    wrong, broken = got[("flashinfer", "auto")], got[("flashinfer", "fa3")]
    assert wrong["check"] == "failed" and wrong["vs_best_peer"] == 0.0 and wrong["ms"] == 1.0
    assert "rel err 4.0e-01 > 3e-02" in wrong["note"]
    assert (broken["check"], broken["note"], broken["ms"]) == (
        "error", "RuntimeError: fa3: needs sm90", None
    )  # fmt: skip
    assert [(got[k]["vs_best_peer"], got[k]["check"]) for k in (("triton", ""), ("sdpa", ""))] == [
        (1.0, "passed"), (0.5, "passed")
    ]  # fmt: skip
    # no flashinfer variant passed: nothing to compare with, rather than a wrong baseline
    assert all(r["vs_flashinfer"] == 0.0 and r["env"] == ENV for r in rows)
    # the physical limit, measured once: triton's 1e12 FLOP in 2 ms is 500 TFLOP/s, 62.5%
    assert all(r["peak_tflops"] == 800.0 for r in rows)
    assert (got[("triton", "")]["pct_peak"], broken["pct_peak"]) == (62.5, None)
    table = extend.format_table([extend.Record(**{**r, "env": {}}) for r in rows]).splitlines()
    assert "FAILED" in table[2] and "ERROR" in table[3] and " - " in table[2]  # not ranked


# -- bench moe -----------------------------------------------------------------------------------
@pytest.fixture
def fake_moe(monkeypatch: pytest.MonkeyPatch, fake_gpu: None) -> None:
    real_sets = moe.make_weight_sets

    def time_impl(fn: str, p: moe.MoELayerProblem, iters: int, reps: int) -> Any:
        if p.dispatch.hidden_states.shape[0] == 4:
            raise KeyboardInterrupt
        if fn == "triton":
            return 10.0, p.reference()  # exact
        if fn == "dense":
            return 30.0, torch.zeros_like(p.reference())  # wrong: rel err 1
        raise RuntimeError("grouped_mm: CUDA error: an illegal memory access")

    monkeypatch.setattr(
        moe, "make_weight_sets", lambda e, h, i, dtype, dev: real_sets(e, h, i, dtype, "cpu")
    )
    monkeypatch.setattr(moe, "implementation", lambda name: name)
    monkeypatch.setattr(moe, "time_impl", time_impl)
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda x, *w: x.shape[0] == 1)


def test_moe_records_wrong_broken_and_skipped_impls_and_keeps_them_when_killed(
    fake_moe: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = {"num_experts": 4, "top_k": 2, "hidden_size": 8, "intermediate_size": 4}
    with pytest.raises(KeyboardInterrupt):
        moe.run((1, 2, 4), out_dir=str(tmp_path), **small)
    rows, (partial,) = _saved(tmp_path)
    assert partial.name.startswith("moe-partial-")
    got = {(r["impl"], r["tokens"]): r for r in rows}
    assert list(got) == [(i, t) for t in (1, 2) for i in moe.IMPLS]
    assert got[("triton", 1)]["check"] == "passed" and got[("triton", 1)]["rel_err"] == 0.0
    wrong = got[("dense", 1)]
    assert (wrong["check"], wrong["us"]) == ("failed", 30.0)
    assert "failed the check: rel err 1.0e+00 > 3e-02 (bfloat16)" in wrong["note"]
    broken, skipped = got[("grouped_mm", 1)], got[("grouped_mm", 2)]
    assert (broken["check"], broken["us"], broken["gbps"], broken["pct_copy_bw"]) == (
        "error", None, None, None
    )  # fmt: skip
    assert broken["note"] == "RuntimeError: grouped_mm: CUDA error: an illegal memory access"
    assert (skipped["check"], skipped["note"]) == (
        "skipped", "no native grouped GEMM on this device/dtype"
    )  # fmt: skip
    triton = got[("triton", 1)]
    assert triton["copy_gbps"] == 1000.0
    assert triton["pct_copy_bw"] == pytest.approx(100 * triton["gbps"] / 1000.0)
    assert all(r["env"] == ENV for r in rows)
    table = moe.format_table([moe.Record(**{**r, "env": {}}) for r in rows]).splitlines()
    assert "FAILED" in table[3] and "ERROR" in table[2] and "skipped" in table[5]
