"""bench throughput: nano-vllm's workload, its roofline bytes, a tiny CPU run, the CLI."""

from __future__ import annotations

import json
import os
import random
from random import randint
from typing import Any

import pytest
import torch

import execrt
from execrt.bench import throughput
from execrt.bench.models import kv_bytes_per_step, weight_bytes_per_step
from execrt.cli import main
from execrt.models.config import ModelConfig
from tests.bench.test_decode import TINY


def test_the_draw_is_nano_vllms_with_its_133966_output_tokens() -> None:
    wl = throughput.draw_workload()
    assert len(wl.prompts) == len(wl.max_tokens) == 256
    assert wl.output_tokens == throughput.PUBLISHED_OUTPUT_TOKENS == 133_966
    assert wl.input_tokens == 142_827
    assert all(100 <= len(p) <= 1024 for p in wl.prompts)
    assert all(100 <= m <= 1024 for m in wl.max_tokens)
    assert all(0 <= t <= 10000 for p in wl.prompts for t in p)
    # nano-vllm's bench.py, as it is written there (module-level random, seeded 0).
    state = random.getstate()
    try:
        random.seed(0)
        prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
        max_tokens = [randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    assert (wl.prompts, wl.max_tokens) == (prompts, max_tokens)
    assert throughput.draw_workload(seed=1).output_tokens != 133_966


def test_roofline_bytes_follow_the_ideal_schedule() -> None:
    mc = ModelConfig.from_dict(TINY)
    # Two sequences: prompts of 3 and 5 tokens, 2 and 4 output tokens (1 and 3 decode steps).
    wl = throughput.Workload([[1, 2, 3], [4, 5, 6, 7, 8]], [2, 4])
    weights, kv = throughput.workload_bytes(mc, wl)
    # the prefill step, then 3 decode steps: 2 sequences in the first, 1 in the other two
    w = weight_bytes_per_step(mc, 1)  # dense: the same bytes at any batch size
    assert weights == 4 * w
    # K/V read: sequence 1 step 1 reads 4 tokens; sequence 2 reads 6, 7, 8
    assert kv == (4 + 6 + 7 + 8) * kv_bytes_per_step(mc, 1, 1)


def _cpu_options(out_dir: str, num_seqs: int, max_len: int, **kw: Any) -> throughput.Options:
    """The tiny shape on the CPU: ``num_seqs`` sequences of 3..``max_len`` tokens each way."""
    return throughput.Options(
        model="tiny", config=TINY, device="cpu", num_seqs=num_seqs, min_len=3,
        max_len=max_len, max_token_id=999, out_dir=out_dir, **kw,
    )  # fmt: skip


def test_cpu_run_times_each_config_and_temperature_and_saves(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    records = throughput.run(_cpu_options(str(tmp_path), 5, 9))
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("# saved ") and out[-2 - len(records)].startswith("config ")
    wl = throughput.draw_workload(5, 3, 9, 999)
    by_key = {(r.config["name"], r.temperature): r for r in records}
    assert set(by_key) == {(c, t) for c in ("defaults", "tuned") for t in (0.6, 0.0)}
    for r in records:
        assert r.note == "" and r.seconds and r.seconds > 0
        assert r.out_tok_s == pytest.approx(wl.output_tokens / r.seconds)
        assert r.total_tok_s == pytest.approx((wl.input_tokens + wl.output_tokens) / r.seconds)
        assert r.output_tokens == wl.output_tokens and r.retractions == 0
        # Every sequence runs at once: one prefill step, then the longest output's decode.
        assert r.extend_steps >= 1 and r.decode_steps >= max(wl.max_tokens) - 1
        assert r.steps == r.extend_steps + r.decode_steps
        assert r.mean_decode_batch == pytest.approx((wl.output_tokens - 5) / r.decode_steps)
        assert r.pct_roofline == pytest.approx(100 * r.roofline_s / r.seconds)
        # Host time and waits for the device split each step's time (on the CPU, no waits).
        assert r.host_ms_per_step is not None and r.wait_ms_per_step is not None
        step_ms = r.seconds / r.steps * 1e3
        assert r.host_ms_per_step + r.wait_ms_per_step == pytest.approx(step_ms)
        assert 0 <= r.wait_ms_per_step < r.host_ms_per_step
        assert r.attention == "torch_native" and r.startup_s and r.startup_s > 0
    defaults, tuned = by_key[("defaults", 0.6)].config, by_key[("tuned", 0.6)].config
    # What the sizes resolved to is recorded: CPU defaults, and the tuned settings as given.
    assert (defaults["max_running_requests"], defaults["max_prefill_tokens"]) == (32, 4096)
    assert (tuned["max_running_requests"], tuned["max_prefill_tokens"]) == (256, 16384)
    assert tuned["settings"] == throughput.TUNED and defaults["settings"] == {}
    (saved,) = os.listdir(tmp_path)
    assert saved.startswith("throughput-") and saved.endswith(".json")
    rows = json.loads((tmp_path / saved).read_text())
    required = {"out_tok_s", "total_tok_s", "pct_roofline", "config", "model", "gpu", "date"}
    assert len(rows) == 4 and all(required <= set(row) for row in rows)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--configs", "defaults,fast"], "configs ['defaults', 'fast'] unknown"),
        (["--temperatures", "hot"], "--temperatures 'hot' must look like 0.6,0"),
        (["--temperatures", "-1"], "temperatures [-1.0] must be >= 0"),
        (["--model", "nope"], "model 'nope' unknown"),
        (["--repeats", "0"], "repeats 0 must be >= 1"),
    ],
)
def test_cli_refuses_bad_options_with_one_line(argv: list[str], expected: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "throughput", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


def test_cli_parses_options_into_the_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen: list[throughput.Options] = []
    monkeypatch.setattr(throughput, "run", lambda opts: seen.append(opts) or [])
    argv = ["--configs", "tuned,tuned-flashinfer", "--temperatures", "0", "--num-seqs", "64"]
    assert main(["bench", "throughput", *argv, "--out", "x", "--profile", "--repeats", "5"]) == 0
    assert main(["bench", "throughput"]) == 0
    given, default = seen
    assert given.profile and not default.profile
    assert (given.repeats, default.repeats) == (5, 3)
    assert (given.configs, given.temperatures, given.num_seqs, given.out_dir) == (
        ("tuned", "tuned-flashinfer"),
        (0.0,),
        64,
        "x",
    )
    assert (default.configs, default.temperatures, default.num_seqs, default.model) == (
        ("defaults", "tuned"),
        (0.6, 0.0),
        256,
        "qwen3-0.6b",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cli_without_cuda_says_so(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "throughput"]) == 2
    assert capsys.readouterr().err.strip() == (
        "execrt: error: bench throughput: needs a CUDA device (none is visible)"
    )


def test_profile_runs_the_workload_again_and_records_the_kernels(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    opts = _cpu_options(
        str(tmp_path), 3, 6, configs=("defaults",), temperatures=(0.0,), profile=True, repeats=3
    )
    (rec,) = throughput.run(opts)
    assert rec.note == "" and rec.profile is not None
    # Three timed runs; the median is the one reported, with its garbage collection time.
    assert len(rec.seconds_each) == 3 and rec.seconds == sorted(rec.seconds_each)[1]
    assert rec.gc_ms is not None and 0 <= rec.gc_ms < rec.seconds * 1e3
    # On the CPU nothing runs on a GPU: the profile says so rather than inventing kernels.
    assert rec.profile["kernels"] == [] and rec.profile["gpu_busy_s"] == 0
    assert rec.profile["wall_s"] > 0
    # No GPU: the whole unprofiled run counts as the GPU's idle estimate.
    assert rec.profile["unprofiled_idle_s"] == pytest.approx(rec.seconds)
    assert rec.jit_compiles == 0 and rec.jit_compile_ms == 0  # the interpreter compiles nothing
    out = capsys.readouterr().out
    assert "GPU busy 0.000 of" in out and "of GPU idle (an estimate)" in out
    assert "0 JIT compiles" in out
    (saved,) = os.listdir(tmp_path)
    (row,) = json.loads((tmp_path / saved).read_text())
    assert row["profile"]["wall_s"] > 0
    # what produced it: this execrt and torch (the rest: tests/bench/test_bench_env.py)
    assert (row["env"]["execrt"], row["env"]["torch"]) == (execrt.__version__, torch.__version__)


def test_every_named_config_is_in_the_cli_help(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--help"])
    # argparse wraps lines at spaces and after hyphens: join both back before looking.
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    missing = [name for name in throughput.CONFIGS if name not in text]
    assert not missing, f"bench throughput --help does not name {missing}"
