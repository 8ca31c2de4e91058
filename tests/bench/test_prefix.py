"""bench prefix: the whole method on a tiny shape on CPU (the numbers mean nothing there), the
records it saves, its checks and the CLI."""

from __future__ import annotations

import json
import os

import pytest
import torch

from execrt.bench import prefix, throughput
from execrt.bench.common import smoke_defaults
from execrt.bench.floor import Roof, Served, workload_floor
from execrt.bench.models import SMOKE_MODEL, model_config, weight_bytes_per_step
from execrt.cli import BENCH_PREFIX_FLAGS, main
from execrt.core.errors import ExecrtError
from execrt.models.config import ModelConfig
from tests.bench.test_decode import TINY, TINY_MOE

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
    # The floor: below the measured time (by far on CPU, where the host bounds a step), the
    # rates measured once for the whole run.
    for r in records:
        assert r.floor_s and r.pct_floor and r.pct_ttft_floor and r.ttft_floor_ms, r
        assert r.floor_s == pytest.approx(r.prefill_floor_s + r.decode_floor_s), r  # type: ignore[operator]
        assert 0 < r.pct_floor <= 100 and 0 < r.pct_ttft_floor <= 100, r
        assert r.pct_floor == pytest.approx(100 * r.floor_s / r.duration_s)
        assert (r.peak_tflops, r.copy_gbps) == (records[0].peak_tflops, records[0].copy_gbps)
    assert records[0].peak_tflops > 0 and records[0].copy_gbps > 0
    off, on = got[("shared-prefix", "off")], got[("shared-prefix", "on")]
    # Cache on: each group's 48-token prefix once (3 groups) and every 8-token question;
    # random tokens of two questions may begin alike, which the cache may reuse too.
    assert off.computed_tokens == off.prompt_tokens == 12 * 56
    assert 3 * 48 + 12 * 8 - 12 <= on.computed_tokens <= 3 * 48 + 12 * 8
    assert on.prefill_floor_s < off.prefill_floor_s  # type: ignore[operator]
    assert on.decode_floor_s == off.decode_floor_s  # the same requests decode alike
    for workload in prefix.WORKLOADS:  # neither reuses anything
        a, b = got[(workload, "off")], got[(workload, "force_miss")]
        assert (a.computed_tokens, a.floor_s) == (b.computed_tokens, b.floor_s), workload
    # Chat: the first turn's 24 tokens, then each turn's new 24 and the answer's last token
    # (its K/V was never computed); off, every prompt whole (24, 24 + 4 + 24, 52 + 4 + 24).
    assert got[("chat", "on")].computed_tokens == 2 * (24 + 25 + 25)
    assert got[("chat", "off")].computed_tokens == 2 * (24 + 52 + 80)
    (saved,) = os.listdir(tmp_path)
    assert saved.startswith("prefix-") and saved.endswith(".json")
    rows = json.loads((tmp_path / saved).read_text())
    assert len(rows) == 9
    fields = {"workload", "cache", "hit_rate", "ttft_ms_mean", "ttft_ms_p50"}
    fields |= {"throughput_tok_s", "model", "gpu", "date"}
    fields |= {"floor_s", "pct_floor", "ttft_floor_ms", "pct_ttft_floor", "peak_tflops"}
    fields |= {"copy_gbps", "computed_tokens", "prefill_floor_s", "decode_floor_s"}
    assert all(fields <= set(row) for row in rows) and rows[0]["gpu"] == "cpu"
    assert "%floor" in prefix.format_table(records).splitlines()[0]


# -- the floor on hand-counted workloads ---------------------------------------------------------
# TINY: 2 layers of hidden 64, 4 query heads and 2 K/V heads of 16, MLP 128, vocabulary 1000.
LINEAR_FLOPS = 2 * 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64)  # per token, both layers
PAIR_FLOPS = 2 * 4 * 16 * 4  # per visible (query, key) pair, both layers: 2 GEMMs, 2 FLOP each
LM_HEAD_FLOPS = 2 * 1000 * 64  # the last token's logits
WEIGHT_BYTES = 4 * (2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64) + 1000 * 64)  # fp32, a step
KV_BYTES = 4 * 2 * 2 * 2 * 16  # one token's K and V, both layers, fp32
#: 1 FLOP/us, 1 byte/us: the floor's seconds are FLOPs and bytes in millions
SLOW = Roof(tflops=1e-6, gbps=1e-3, dtype_bytes=4)
A = Served([1, 2, 3, 4, 5, 6, 7, 8], 3)  # two prompts sharing 5 tokens
B = Served([1, 2, 3, 4, 5, 9, 10, 11], 2)


def _flops(new: int, cached: int) -> float:
    pairs = new * cached + new * (new + 1) // 2
    return new * LINEAR_FLOPS + pairs * PAIR_FLOPS + LM_HEAD_FLOPS


def test_with_the_cache_on_a_shared_prefix_is_computed_once_and_off_twice() -> None:
    mc = ModelConfig.from_dict(TINY)
    on = workload_floor(mc, [[A, B]], SLOW, reuse=True)
    off = workload_floor(mc, [[A, B]], SLOW, reuse=False)
    assert (on.computed_tokens, off.computed_tokens) == (8 + 3, 8 + 8)
    # Compute-bound at these rates: one weight read (0.55 s) is less than either prefill.
    assert on.prefill_s == pytest.approx((_flops(8, 0) + _flops(3, 5)) / 1e6)
    assert off.prefill_s == pytest.approx(2 * _flops(8, 0) / 1e6)
    assert on.first_token_s == pytest.approx((_flops(8, 0) / 1e6, _flops(3, 5) / 1e6))
    # Decode: step 1 runs both, step 2 A alone (its first token came from the prefill); A
    # reads 8 + 1, 8 + 2 tokens of K/V, B 8 + 1. The cache does not change what decode reads.
    decode = (2 * WEIGHT_BYTES + (9 + 10 + 9) * KV_BYTES) / 1e6
    assert on.decode_s == off.decode_s == pytest.approx(decode)
    assert on.seconds == pytest.approx(on.prefill_s + decode)


def test_a_chat_turn_computes_its_new_tokens_and_the_answers_last() -> None:
    mc = ModelConfig.from_dict(TINY)
    first = Served([1, 2, 3, 4], 3, output=[7, 8, 9])
    second = Served([1, 2, 3, 4, 7, 8, 9, 5, 6], 2)  # the prompt, the answer, 2 new tokens
    again = Served([1, 2, 3, 4], 1)  # a prompt all computed: its last token's logits are not
    waves = [[first], [second], [again]]
    assert workload_floor(mc, waves, SLOW, reuse=True).computed_tokens == 4 + 3 + 1
    assert workload_floor(mc, waves, SLOW, reuse=False).computed_tokens == 4 + 9 + 4
    unknown = [[first._replace(output=())], [second]]  # without the answer: from the 5th token
    assert workload_floor(mc, unknown, SLOW, reuse=True).computed_tokens == 4 + 5
    # Turns one after the other: each decodes alone, a weight read per step.
    alone = workload_floor(mc, waves, SLOW, reuse=True)
    kv = (4 + 1) + (4 + 2) + (9 + 1)
    assert alone.decode_s == pytest.approx((3 * WEIGHT_BYTES + kv * KV_BYTES) / 1e6)


def test_the_floor_follows_the_workload() -> None:
    mc = ModelConfig.from_dict(TINY)
    base = workload_floor(mc, [[A, B]], SLOW, reuse=True)
    c = Served([1, 2, 3, 4, 5, 12, 13, 14], 2)  # another prompt of the group
    more = workload_floor(mc, [[A, B, c]], SLOW, reuse=True)
    assert more.prefill_s - base.prefill_s == pytest.approx(_flops(3, 5) / 1e6)
    more_off = workload_floor(mc, [[A, B, c]], SLOW, reuse=False)
    assert more_off.prefill_s - workload_floor(mc, [[A, B]], SLOW, reuse=False).prefill_s == (
        pytest.approx(_flops(8, 0) / 1e6)
    )
    longer = workload_floor(mc, [[A._replace(output_len=5), B]], SLOW, reuse=True)
    assert longer.prefill_s == base.prefill_s  # two more steps of A alone: 8 + 3, 8 + 4 of K/V
    assert longer.decode_s - base.decode_s == pytest.approx(
        (2 * WEIGHT_BYTES + (11 + 12) * KV_BYTES) / 1e6
    )
    # One slot: B decodes after A, a third step and its weight read.
    one = workload_floor(mc, [[A, B]], SLOW, reuse=True, slots=1)
    assert one.decode_s - base.decode_s == pytest.approx(WEIGHT_BYTES / 1e6)
    fast = workload_floor(mc, [[A, B]], SLOW._replace(tflops=2e-6, gbps=2e-3), reuse=True)
    assert fast.seconds == pytest.approx(base.seconds / 2)


@pytest.mark.parametrize("shape", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_all_at_once_the_decode_floor_is_bench_throughputs_roofline_less_its_prefill(
    shape: dict,  # type: ignore[type-arg]
) -> None:
    # Two models of one ideal schedule: bench throughput's counts a step's batch by who is
    # still running, this one by slots; all requests at once they must agree (MoE: the
    # experts each step's batch touches).
    mc = ModelConfig.from_dict(shape)
    wl = throughput.draw_workload(7, 2, 9, 999, seed=3)
    served = [Served(p, n) for p, n in zip(wl.prompts, wl.max_tokens, strict=True)]
    weights, kv = throughput.workload_bytes(mc, wl)
    bytes_only = Roof(tflops=1.0, gbps=1e-9, dtype_bytes=2)  # 1 byte/s: seconds are bytes
    floor = workload_floor(mc, [served], bytes_only, reuse=False)
    assert floor.decode_s == pytest.approx(weights - weight_bytes_per_step(mc, 7) + kv)


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
