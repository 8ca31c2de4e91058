"""The extend benchmark's problem, FLOP count and peers, run once on the CPU (no timing)."""

from __future__ import annotations

import pytest
import torch

from execrt.bench import extend as bench
from execrt.core.context import RuntimeContext
from execrt.plugins.host import PluginHost


def test_causal_flops_counts_visible_pairs() -> None:
    # 2 requests, 3 new tokens after 4 cached: rows see 5, 6, 7 keys -> 18 pairs each.
    assert bench.causal_flops(2, 3, 4, 8, 64) == 4 * 64 * 8 * 2 * 18
    # The first row: 1 x 8192 from scratch in 1.97 ms is 280 TFLOP/s.
    tflops = bench.causal_flops(1, 8192, 0, 32, 128) / 1.97e-3 / 1e12
    assert 279 < tflops < 280


@pytest.mark.parametrize("name", ["triton", "sdpa"])
def test_problem_peers_agree_with_the_fp32_reference(name: str) -> None:
    pytest.importorskip("triton")
    # Triton runs compiled on CUDA machines and under the interpreter elsewhere.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = bench.ExtendProblem(2, 20, 13, 4, 2, 64, torch.float32, device=device)
    fb = p.forward_batch()
    assert fb.out_cache_loc.tolist() == p.pool.req_to_token[1:, 13:].reshape(-1).tolist()
    context = RuntimeContext()
    try:
        if name == "sdpa":
            calls = bench.sdpa_calls(p)
        else:
            calls, backend = bench.backend_calls(PluginHost(autoload=False), name, p, context)
        # Every layer holds different K/V: the check reads layer 0, so call 0 must be layer 0.
        outs = [call() for call in calls[:2]]
        # fp32 runs in TF32 on a GPU (as the backend documents), exactly under the interpreter.
        assert p.rel_err(outs[0]) < (5e-3 if device == "cuda" else 1e-5)
        if len(outs) > 1:
            assert p.rel_err(outs[1]) > 1e-2
    finally:
        context.close()


def _record(backend: str, tflops: float | None, variant: str = "") -> bench.Record:
    return bench.Record(
        backend, 1, 8, 0, None if tflops is None else 1.0, tflops, 0.0, 0.0, None,
        "paged cache", "gpu", "date", 4, 2, 64, "bfloat16", variant=variant,
        check="error" if tflops is None else "passed",
    )  # fmt: skip


def test_vs_flashinfer_is_over_its_best_variant_and_failures_stay_unranked() -> None:
    row = [
        _record("triton", 300.0),
        _record("flashinfer", 500.0, "auto"),
        _record("flashinfer", 320.0, "fa2"),
        _record("flashinfer", None, "fa3"),  # did not build here
        _record("sdpa", 250.0),
    ]
    bench.rank_row(row)
    assert [r.vs_flashinfer for r in row] == [0.6, 1.0, 0.64, 0.0, 0.5]
    assert [r.vs_best_peer for r in row] == [0.6, 1.0, 0.64, 0.0, 0.5]
    alone = [_record("triton", 300.0)]
    bench.rank_row(alone)  # no flashinfer in the run: nothing to compare with
    assert (alone[0].vs_best_peer, alone[0].vs_flashinfer) == (1.0, 0.0)


def test_each_record_is_held_against_the_matmul_peak_of_its_run() -> None:
    ran, failed = _record("triton", 300.0), _record("flashinfer", None, "fa3")
    for record in (ran, failed):
        bench.add_peak(record, 750.0)
    assert (ran.peak_tflops, ran.pct_peak) == (750.0, 40.0)
    assert (failed.peak_tflops, failed.pct_peak) == (750.0, None)  # it did not run
    header, line, _ = bench.format_table([ran, failed]).splitlines()
    assert header.split()[6:8] == ["TFLOP/s", "%peak"]  # triton's variant is blank below
    assert line.split()[5:7] == ["300.0", "40.0"]


def test_a_variant_that_cannot_build_is_recorded_with_its_reason(capsys) -> None:  # type: ignore[no-untyped-def]
    # No GPU (or no flashinfer) here: every variant fails to build and says why, no raise.
    p = bench.ExtendProblem(1, 4, 0, 4, 2, 64, torch.float32, device="cpu")
    for variant in bench.FLASHINFER_VARIANTS:
        record = _record("flashinfer", None, variant)
        bench.time_into(record, PluginHost(autoload=False), p, iters=1, reps=1)
        assert record.ms is None and record.tflops is None
        # refused (the device is not declared): skipped with the reasons, not an error
        assert record.note.startswith("Refused: ") and "cuda" in record.note
        assert record.check == "skipped"
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["flashinfer[auto]", "flashinfer[fa2]",
                                                   "flashinfer[fa3]"]  # fmt: skip
    table = bench.format_table([record])
    assert table.splitlines()[1].split()[:2] == ["flashinfer", "fa3"]


def test_cli_refuses_an_unknown_variant(capsys) -> None:  # type: ignore[no-untyped-def]
    from execrt.cli import main

    assert main(["bench", "extend", "--variants", "fa2,fa4"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "execrt: error: bench extend: --variants 'fa2,fa4' unknown (known: auto, fa2, fa3)"
    )


def test_triton_runs_each_kernel_named_and_one_that_cannot_run_says_why(capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = bench.ExtendProblem(2, 20, 13, 4, 2, 64, torch.float32, device=device)
    host = PluginHost(autoload=False)
    # gather and fresh run everywhere (the interpreter on CPU), each as asked
    for kernel in ("gather", "fresh"):
        context = RuntimeContext()
        try:
            calls, backend = bench.backend_calls(
                host, "triton", p, context, {"extend_kernel": kernel}
            )
            assert backend.extend_kernel == kernel
            assert p.rel_err(calls[0]()) < (5e-3 if device == "cuda" else 1e-5)
        finally:
            context.close()
    # ws is refused by name here (fp32; and on CPU a Gluon kernel cannot run at all): its
    # record says why and the run goes on
    record = _record("triton", None, "ws")
    bench.time_into(record, host, p, iters=1, reps=1)
    assert record.ms is None
    assert "extend_kernel 'ws' cannot run here" in record.note, record.note
    assert capsys.readouterr().out.split()[0] == "triton[ws]"
