"""bench serve on CPU with a tiny random-weight shape: every run through HTTP and through the
Engine, the record fields, the JSON file and the plot."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from execrt.bench import http_load, load, serve
from execrt.bench.common import smoke_defaults
from execrt.bench.floor import Roof
from execrt.bench.models import SMOKE_MODEL, SMOKE_SHAPE, weight_bytes_per_step
from execrt.core.errors import ExecrtError
from execrt.models.config import ModelConfig
from tests.bench.test_decode import TINY
from tests.drivers import live_children


@pytest.mark.parametrize(
    ("workload", "runner"), [("random", "process"), ("shared-prefix", "thread")]
)
def test_a_small_run_measures_http_and_the_engine(tmp_path, monkeypatch, workload, runner) -> None:
    # The server's engine process (runner "process") on one torch thread: idle ones spin, and
    # the cores are shared with the server and the load here.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    plot = workload == "random" and importlib.util.find_spec("matplotlib") is not None
    opts = serve.Options(
        model="tiny",
        config=TINY,
        workload=workload,
        input_len=12,
        output_len=6,
        prefix_len=16,
        num_groups=2,
        concurrencies=(3,),
        request_rates=(40.0,) if workload == "random" else (),
        num_prompts=6,
        max_running_requests=8,
        device="cpu",
        server="thread",
        engine_runner=runner,
        client_procs=2 if runner == "thread" else None,  # the load split over two processes
        plot=plot,
        out_dir=str(tmp_path),
    )
    records = serve.run(opts)
    assert [(r.concurrency, r.request_rate) for r in records] == (
        [(3, None), (None, 40.0)] if workload == "random" else [(3, None)]
    )
    for r in records:
        assert r.errors == 0 and r.error_samples == []
        assert r.num_requests == 6 and r.workload == workload
        assert r.output_tok_s > 0 and r.engine_output_tok_s and r.engine_generate_output_tok_s
        assert r.ttft_ms_p50 and r.ttft_ms_p99 and r.ttft_ms_p99 >= r.ttft_ms_p50
        assert r.itl_ms_p50 and r.tpot_ms_p50 and r.engine_itl_ms_p50
        assert r.throughput_ratio == pytest.approx(r.output_tok_s / r.engine_output_tok_s)
        assert (r.model, r.gpu) == ("tiny", "cpu")
        assert r.client_procs == (2 if runner == "thread" else 1)
        assert r.tokens_per_chunk is not None and r.tokens_per_chunk >= 1.0
        # Every request prefilled (in one step or batched with others), on both sides.
        assert r.extend_steps and r.decode_steps and r.engine_extend_steps
        assert 1 <= r.extend_steps <= r.num_requests and r.engine_extend_steps <= r.num_requests
        assert r.decode_steps >= r.output_len_mean - 1
        # Every run starts with the prefix cache flushed and the warm-up's prompts are none
        # of a run's: random prompts find nothing cached (the warm-up used to be run 0's
        # first requests, and generate re-ran the replay's prompts warm).
        if workload == "random":
            assert r.prefix_hit_tokens == 0 and r.engine_prefix_hit_tokens == 0, r
        else:  # the groups' shared prefixes, once each group's first request cached them
            assert r.prefix_hit_tokens and r.engine_prefix_hit_tokens, r
        # The limit: the run's output tokens over its floor, at rates measured in the run;
        # neither side beats it (on CPU the host bounds a step: far below it closed-loop).
        assert r.peak_tflops and r.copy_gbps and r.floor_s and r.output_tok_s_limit
        assert r.output_tok_s_limit * r.floor_s == pytest.approx(6 * r.output_len_mean)
        assert r.pct_output_limit and 0 < r.pct_output_limit <= 100, r
        assert r.engine_pct_output_limit and 0 < r.engine_pct_output_limit <= 100, r
        if r.request_rate is not None:  # arrivals bound a rate run's floor: 6 at 40/s
            assert r.floor_s > max(serve.plan_runs(opts, 1000)[1].arrivals)
    (saved,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    assert saved.startswith("serve-")
    fields = json.load(open(tmp_path / saved))[0]
    required = "concurrency request_rate ttft_ms_p50 ttft_ms_p99 itl_ms_p50 tpot_ms_p50"
    required += " output_tok_s engine_output_tok_s model gpu date"
    required += " floor_s output_tok_s_limit pct_output_limit engine_pct_output_limit"
    required += " peak_tflops copy_gbps"
    assert set(required.split()) <= set(fields)
    if opts.plot:
        assert os.path.getsize(tmp_path / saved.replace(".json", ".png")) > 10_000


def test_the_limit_follows_the_concurrency_the_arrivals_and_shared_prefixes() -> None:
    mc = ModelConfig.from_dict(TINY)
    w = weight_bytes_per_step(mc, 1, 4)  # dense: one read a step at any batch
    roof = Roof(tflops=1e3, gbps=1e-9, dtype_bytes=4)  # 1 byte/s; FLOPs cost nothing
    reqs = (http_load.Request([1, 2, 3], 3), http_load.Request([4, 5, 6], 3))

    def floor(concurrency: int | None, arrivals: tuple[float, ...] = (0.0, 0.0)) -> float:
        return serve.run_floor_s(mc, http_load.Run(concurrency, None, reqs, arrivals), roof)

    # Two decode steps each: together 2 steps; one at a time 4, two more weight reads.
    assert floor(1) - floor(2) == pytest.approx(2 * w)
    assert floor(None) == floor(2) == floor(8)
    # The second arrives late: it cannot finish before its arrival and its time alone.
    late = floor(None, (0.0, 1e9))
    alone = w + 2 * w + (3 + 1 + 3 + 2) * 4 * 2 * 2 * 2 * 16  # prefill read, 2 steps, K/V
    assert late == pytest.approx(1e9 + alone)
    # A shared prefix is computed once (the server's prefix cache is on).
    shared = (http_load.Request([1, 2, 3, 4], 1), http_load.Request([1, 2, 3, 5], 1))
    distinct = (http_load.Request([1, 2, 3, 4], 1), http_load.Request([6, 7, 8, 5], 1))
    compute = Roof(tflops=1e-6, gbps=1e3, dtype_bytes=4)  # 1 FLOP/us; bytes cost nothing

    def compute_s(requests: tuple[http_load.Request, ...]) -> float:
        return serve.run_floor_s(mc, http_load.Run(None, None, requests, (0.0, 0.0)), compute)

    linear = 2 * 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64)  # FLOPs a token, 2 layers
    saved = 3 * linear + (3 * 4 // 2) * 2 * 4 * 16 * 4  # 3 tokens and their 6 (q, k) pairs
    assert compute_s(distinct) - compute_s(shared) == pytest.approx(saved / 1e6)


def test_the_warm_up_shares_no_prefix_with_any_run() -> None:
    for workload in ("random", "shared-prefix"):
        opts = serve.Options(model="tiny", config=TINY, workload=workload, input_len=32,
                             prefix_len=16, num_groups=2, concurrencies=(1, 4),
                             request_rates=(8.0,))  # fmt: skip
        runs = serve.plan_runs(opts, 1000)
        warm = serve.warm_up_run(opts, 1000)
        for w in warm.requests:
            for r in runs:
                for q in r.requests:
                    assert w.prompt[:4] != q.prompt[:4], (workload, w.prompt[:4])


def test_workloads_have_the_asked_lengths() -> None:
    opts = serve.Options(
        model="tiny", config=TINY, workload="shared-prefix", input_len=10, output_len=5,
        prefix_len=7, num_groups=3, range_ratio=0.5, device="cpu",
    )  # fmt: skip
    reqs = serve.make_requests(opts, 9, 1000, seed=1)
    assert all(12 <= len(r.prompt) <= 17 and 2 <= r.output_len <= 5 for r in reqs)
    assert reqs[0].prompt[:7] == reqs[3].prompt[:7] != reqs[1].prompt[:7]
    runs = serve.plan_runs(
        serve.Options(config=TINY, request_rates=(10.0,), concurrencies=()), 1000
    )
    (run,) = runs
    assert list(run.arrivals) == sorted(run.arrivals) and run.arrivals[0] == 0.0
    assert 3 < run.arrivals[-1] < 20  # 80 requests at 10/s: about 8 s
    assert load.percentile([1, 2, 3, 4], 50) == 2.5 and load.percentile([], 50) is None


def test_load_processes_follow_the_streams_and_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(serve.os, "cpu_count", lambda: 16)
    opts = serve.Options(config=TINY, device="cpu")

    def closed(c: int) -> http_load.Run:
        return http_load.Run(c, None, (http_load.Request([1], 1),) * 4 * c, (0.0,) * 4 * c)

    assert [opts.processes_for(closed(c)) for c in (1, 16, 32, 256)] == [1, 1, 2, 12]
    rated = http_load.Run(None, 8.0, (http_load.Request([1], 1),) * 64, (0.0,) * 64)
    assert opts.processes_for(rated) == 4
    assert serve.Options(config=TINY, client_procs=3).processes_for(closed(256)) == 3
    with pytest.raises(ExecrtError, match="client_procs 0 must be >= 1"):
        serve.Options(config=TINY, client_procs=0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"rate_concurrency": 0}, "rate_concurrency 0 must be >= 1"),  # it hung: no request sent
        ({"rate_concurrency": -1}, "rate_concurrency -1 must be >= 1"),
        ({"num_prompts": 0}, "num_prompts 0 must be >= 1"),
        ({"layers": 0}, "layers 0 must be >= 1"),
        ({"device": "tpu"}, "device 'tpu' unsupported (supported: cuda, cuda:N, cpu)"),
        ({"concurrencies": (4, 0)}, "max concurrency 0 must be >= 1"),
        (  # NaN passed the old `r <= 0` check and was timed and recorded as "rate nan/s"
            {"request_rates": (float("nan"), 2.0, float("inf"), -1.0)},
            "request rate nan, inf, -1.0 must be a finite number > 0 per s",
        ),
    ],
)
def test_bad_options_are_refused_before_a_server_starts(bad, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ExecrtError, match=re.escape(message)):
        serve.Options(config=TINY, **bad)


def test_an_output_folder_that_cannot_be_made_is_refused_before_the_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ExecrtError, match="--out .*: cannot make it (.*a-file is not a directory)"):
        serve.Options(config=TINY, out_dir=str(tmp_path / "a-file" / "sub"))
    assert serve.Options(config=TINY, out_dir=str(tmp_path / "new" / "sub")).out_dir


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from execrt.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    monkeypatch.setattr(serve, "run", lambda opts: pytest.fail("the benchmark ran"))
    with pytest.raises(ExecrtError, match=re.escape(serve.PLOT_NEEDS)):
        serve.Options(config=TINY, plot=True)
    assert serve.Options(config=TINY).plot is False  # without --plot it is not needed
    argv = ["bench", "serve", "--device", "cpu", "--plot", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "execrt: error: bench serve: --plot needs matplotlib (pip install 'execrt[plot]')\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cli_without_cuda_points_at_the_cpu_smoke_run(capsys) -> None:  # type: ignore[no-untyped-def]
    from execrt.cli import main

    assert main(["bench", "serve"]) == 2
    assert capsys.readouterr().err == (
        "execrt: error: bench serve: needs a CUDA device (none is visible; --device cpu?)\n"
    )


def test_layers_cut_a_named_model_and_a_custom_config_alike() -> None:
    assert serve.Options(model="qwen3-8b", layers=3).model_shape()["num_hidden_layers"] == 3
    custom = serve.Options(config=TINY, layers=1).model_shape()
    assert custom["num_hidden_layers"] == 1 and custom["hidden_size"] == TINY["hidden_size"]
    assert serve.Options(config=TINY).model_shape() == dict(TINY)  # a copy, not cut


def test_on_cpu_what_no_flag_set_is_the_tiny_smoke_run_and_flags_win(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The GPU defaults on CPU: qwen3-0.6b, 28 layers, up to 256 streams of 512-token prompts.
    from execrt.cli import main

    seen: list[serve.Options] = []
    monkeypatch.setattr(serve, "run", lambda opts: seen.append(opts) or [])
    assert main(["bench", "serve", "--device", "cpu", "--input-len", "20", "--out", ""]) == 0
    cpu = smoke_defaults(seen[0], serve.CPU_SMOKE)  # what run() measures
    assert (cpu.input_len, cpu.model, cpu.config) == (20, SMOKE_MODEL, SMOKE_SHAPE)
    assert cpu.model_shape()["num_hidden_layers"] == 2
    assert max(cpu.concurrencies) <= 4 and cpu.num_prompts and cpu.num_prompts <= 8
    assert cpu.output_len <= 8 and cpu.max_running_requests <= 8
    gpu = serve.Options(out_dir=None)
    assert smoke_defaults(gpu, serve.CPU_SMOKE) is gpu


def test_a_flag_typed_at_its_gpu_default_is_kept_on_the_cpu_smoke_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # `--input-len 512 --max-concurrency 1,32,256` equal the GPU defaults: the smoke run
    # replaced them with 12 and (3,) as if they had not been typed.
    from execrt.cli import main

    seen: list[serve.Options] = []
    monkeypatch.setattr(serve, "run", lambda opts: seen.append(opts) or [])
    argv = ["bench", "serve", "--device", "cpu", "--input-len", "512", "--out", ""]
    assert main([*argv, "--max-concurrency", "1,32,256", "--model", "qwen3-0.6b"]) == 0
    cpu = smoke_defaults(seen[0], serve.CPU_SMOKE)
    assert (cpu.input_len, cpu.concurrencies, cpu.model) == (512, (1, 32, 256), "qwen3-0.6b")
    assert cpu.config is None and cpu.output_len == serve.CPU_SMOKE["output_len"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the child in Linux's /proc")
def test_ctrl_c_while_the_server_starts_is_quiet_and_130(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The terminal's SIGINT reaches the whole group: the server process, still importing torch
    # in its spawn bootstrap, printed a 29-line KeyboardInterrupt traceback of its own.
    cmd = [sys.executable, "-m", "execrt", "bench", "serve", "--device", "cpu"]
    cmd += ["--no-engine", "--out", str(tmp_path)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    bench = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    try:
        deadline = time.monotonic() + 60
        while not [p for p, c in live_children(bench.pid) if "spawn_main" in c]:
            assert bench.poll() is None and time.monotonic() < deadline, "no server process"
            time.sleep(0.02)
        time.sleep(0.3)  # the parent past the start, the child in its bootstrap or loading
        os.killpg(bench.pid, signal.SIGINT)
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
    assert "Traceback" not in err and "Error" not in err, err
    assert bench.returncode == 130
    assert os.listdir(tmp_path) == []  # nothing measured, nothing saved
