"""bench prefix: the whole method on a tiny shape on CPU (the numbers mean nothing there), the
records it saves, its checks and the CLI."""

from __future__ import annotations

import json
import os

import pytest
import torch

from execrt.bench import prefix
from execrt.bench.common import smoke_defaults
from execrt.bench.models import SMOKE_MODEL, model_config
from execrt.cli import BENCH_PREFIX_FLAGS, main
from execrt.core.errors import ExecrtError
from tests.bench.test_decode import TINY

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = dict(
    config=TINY | {"max_position_embeddings": 512},
    model="tiny",
    device="cpu",
    groups=3,
    per_group=4,
    prefix_len=48,
    question_len=8,
    output_len=4,
    random_prompts=4,
    turns=3,
    turn_len=24,
    answer_len=4,
    conversations=2,
    max_running_requests=8,
    kv_cache_tokens=2048,
)


def test_a_tiny_run_measures_every_workload_under_every_cache_setting(tmp_path) -> None:
    records = prefix.run(prefix.Options(**SMALL, out_dir=str(tmp_path)))  # type: ignore[arg-type]
    got = {(r.workload, r.cache): r for r in records}
    assert set(got) == {(w, c) for w in prefix.WORKLOADS for c in prefix.CACHES}
    shared = got[("shared-prefix", "on")]
    # Each group's prefix is computed once: 3 of 4 prompts find it, but never a last token.
    ideal = 3 * 48 / (4 * 56)
    assert ideal - 0.1 < shared.hit_rate <= ideal + 0.01
    assert shared.requests == 12 and shared.output_tokens == 12 * 4
    assert shared.prompt_tokens == 12 * 56 and shared.throughput_tok_s > 0
    for workload in prefix.WORKLOADS:
        for cache in ("off", "force_miss"):
            assert got[(workload, cache)].hit_rate == 0, (workload, cache)
        assert got[(workload, "off")].ttft_vs_off == pytest.approx(1.0)
    assert got[("random", "on")].hit_rate < 0.05  # random tokens: almost nothing shared
    chat = got[("chat", "on")]
    assert chat.ttft_ms_per_turn is not None and len(chat.ttft_ms_per_turn) == 3
    assert chat.hit_rate > 0.5 and chat.requests == 2 * 3
    (saved,) = os.listdir(tmp_path)
    assert saved.startswith("prefix-") and saved.endswith(".json")
    rows = json.loads((tmp_path / saved).read_text())
    assert len(rows) == 9
    fields = {"workload", "cache", "hit_rate", "ttft_ms_mean", "ttft_ms_p50"}
    fields |= {"throughput_tok_s", "model", "gpu", "date"}
    assert all(fields <= set(row) for row in rows) and rows[0]["gpu"] == "cpu"


def test_options_are_checked_naming_what_is_wrong() -> None:
    with pytest.raises(ExecrtError, match=r"workloads \['nope'\] \(known: shared-prefix"):
        prefix.Options(workloads=("nope",))
    with pytest.raises(ExecrtError, match=r"caches \['maybe'\].*groups 0 must be >= 1"):
        prefix.Options(caches=("maybe",), groups=0)
    # These ran to the end and saved rows of failures with exit 0, or ended in a traceback.
    with pytest.raises(ExecrtError, match=r"max_running_requests -1 must be >= 0 .*tokens -5"):
        prefix.Options(max_running_requests=-1, max_prefill_tokens=-5)
    with pytest.raises(ExecrtError, match=r"device 'tpu' unsupported"):
        prefix.Options(device="tpu")


def test_the_cli_runs_the_benchmark_with_its_flags(monkeypatch, tmp_path) -> None:
    seen: list[prefix.Options] = []
    monkeypatch.setattr(prefix, "run", lambda opts: seen.append(opts) or [])
    code = main(
        ["bench", "prefix", "--groups", "2", "--per-group", "3", "--caches", "on,off"]
        + ["--workloads", "chat", "--device", "cpu", "--layers", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    (opts,) = seen
    assert (opts.groups, opts.per_group, opts.layers) == (2, 3, 1)
    assert opts.caches == ("on", "off") and opts.workloads == ("chat",)
    assert opts.model == "qwen3-8b" and opts.output_len == 256 and opts.out_dir == str(tmp_path)


def test_a_flag_typed_at_its_gpu_default_is_kept_on_the_cpu_smoke_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # `--groups 32` equals the GPU default: the smoke run made it 3 as if it was not typed.
    seen: list[prefix.Options] = []
    monkeypatch.setattr(prefix, "run", lambda opts: seen.append(opts) or [])
    assert main(["bench", "prefix", "--groups", "32", "--device", "cpu", "--out", ""]) == 0
    cpu = smoke_defaults(seen[0], prefix.CPU_SMOKE)
    assert (cpu.groups, cpu.per_group) == (32, prefix.CPU_SMOKE["per_group"])
    assert main(["bench", "prefix", "--model", "qwen3-8b", "--device", "cpu", "--out", ""]) == 0
    named = smoke_defaults(seen[1], prefix.CPU_SMOKE)
    assert (named.model, named.config, named.groups) == ("qwen3-8b", None, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cli_without_cuda_points_at_the_cpu_smoke_run(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "prefix"]) == 2
    assert capsys.readouterr().err == (
        "execrt: error: bench prefix: needs a CUDA device (none is visible; --device cpu?)\n"
    )


def test_the_defaults_the_cli_help_names_are_the_options_defaults() -> None:
    defaults = prefix.Options()
    for flag, (field, what) in BENCH_PREFIX_FLAGS.items():
        shown = what.rsplit("(default: ", 1)[1].rstrip(")")
        value = getattr(defaults, field)
        assert shown == str(value) or (value is None and shown == "the model's"), flag


def test_on_cpu_what_no_flag_set_is_the_tiny_smoke_run_and_flags_win() -> None:
    # `bench prefix --device cpu` kept the GPU defaults (qwen3-8b, 36 layers, 512 prompts of
    # 2,176 tokens) and was killed for memory at about 20 GB.
    cpu = smoke_defaults(prefix.Options(device="cpu", out_dir=None), prefix.CPU_SMOKE)
    config = model_config(cpu.model, cpu.layers, cpu.config)
    assert cpu.model == SMOKE_MODEL and config["num_hidden_layers"] == 2
    assert config["hidden_size"] <= 64 and config["vocab_size"] <= 1000
    assert cpu.groups * cpu.per_group <= 16 and cpu.context_len <= 512
    given = prefix.Options(device="cpu", groups=5, layers=1, output_len=9, out_dir=None)
    flags = smoke_defaults(given, prefix.CPU_SMOKE)
    assert (flags.groups, flags.layers, flags.output_len) == (5, 1, 9)  # given: kept
    assert (flags.model, flags.prefix_len) == (SMOKE_MODEL, cpu.prefix_len)  # the rest: smoke
    named = smoke_defaults(prefix.Options(model="qwen3-0.6b", device="cpu"), prefix.CPU_SMOKE)
    assert (named.model, named.config, named.groups) == ("qwen3-0.6b", None, cpu.groups)
    gpu = prefix.Options(out_dir=None)
    assert smoke_defaults(gpu, prefix.CPU_SMOKE) is gpu


def test_the_cli_on_cpu_runs_the_smoke_shape_and_says_so(monkeypatch, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    built: list[prefix.Options] = []

    def no_engine(opts: prefix.Options, config: dict, cache: str) -> None:  # type: ignore[type-arg]
        built.append(opts)
        raise RuntimeError("not built in this test")  # recorded as a failure, the run goes on

    monkeypatch.setattr(prefix, "_engine", no_engine)
    argv = ["bench", "prefix", "--device", "cpu", "--groups", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    opts = built[0]
    assert (opts.model, opts.groups, opts.prefix_len) == (SMOKE_MODEL, 2, 48)
    header = capsys.readouterr().out.splitlines()[:2]
    assert header[0].startswith("# cpu: tiny, 2 layers;") and "CPU smoke" in header[1]


def test_an_out_folder_that_cannot_be_made_stops_the_run_before_it_measures(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # It measured everything, then died saving: "[Errno 2] No such file or directory".
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    monkeypatch.setattr(prefix, "_engine", lambda *a: pytest.fail("the benchmark measured"))
    with pytest.raises(ExecrtError, match=r"bench prefix: --out '/proc/execrt-x': cannot make"):
        # (not root: refused as the options are built, /proc being read-only by its modes)
        prefix.run(prefix.Options(**SMALL, out_dir="/proc/execrt-x"))  # type: ignore[arg-type]
