"""bench prefix: the whole method on a tiny shape on CPU (the numbers mean nothing there), the
records it saves, its checks and the CLI."""

from __future__ import annotations

import json
import os

import pytest
import torch

from execrt.bench import prefix
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
