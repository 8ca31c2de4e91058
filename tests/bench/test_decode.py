"""bench decode: random-weight models, the same weights in transformers, roofline bytes, CLI."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
from dataclasses import MISSING
from typing import Any

import pytest
import torch
from torch import nn

from execrt.bench import decode
from execrt.bench.models import (
    MODELS,
    SMOKE_SHAPE,
    RandomWeightsLoader,
    build_hf_model,
    fill_hf_model,
    kv_bytes_per_step,
    prefill_flops,
    weight_bytes_per_step,
)
from execrt.cli import main
from execrt.core import envs
from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.schedule import SamplingParams
from execrt.core.worker import TpModelWorker
from execrt.engine import Engine
from execrt.models.config import ModelConfig
from tests.drivers import prefill_then_decode

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Two layers, hidden 64: 4 q / 2 kv heads of 16, MLP 128, vocab 1000 (the CPU smoke shape).
TINY = SMOKE_SHAPE | {"max_position_embeddings": 256}
TINY_MOE = (
    dict(MODELS["qwen3-30b-a3b"])
    | {k: v for k, v in TINY.items() if k not in ("architectures", "model_type")}
    | {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
)


def test_random_loader_runs_through_engine_with_token_id_prompts(plugin_host) -> None:  # type: ignore[no-untyped-def]
    loader = RandomWeightsLoader(TINY | {"tie_word_embeddings": True}, seed=3)
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    with Engine(loader=loader, device="cpu", plugin_host=plugin_host, context_len=64) as engine:
        assert engine.tokenizer is None
        results = engine.generate([[1, 2, 3, 4], [999, 5]], params)
        model: Any = engine.worker.model_runner.model
        weights = {n: w.detach().clone() for n, w in model.named_parameters()}
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [len(r.token_ids) for r in results] == [3, 3]
    assert all(r.error is None and r.text is None for r in results)
    assert all(0 <= t < 1000 for r in results for t in r.token_ids)
    # build_empty leaves garbage: every matrix must hold the N(0, 0.02) draw, norms ones.
    for name, w in weights.items():
        assert torch.isfinite(w).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(w, torch.ones_like(w)), name
        else:
            assert 0.015 < float(w.std()) < 0.025 and abs(float(w.mean())) < 0.005, name


def test_generate_timing_starts_each_run_on_a_cold_prefix_cache(plugin_host) -> None:  # type: ignore[no-untyped-def]
    # The timed prompts repeat: a warm cache would skip their prefill (t(1) would time
    # nothing) and keep earlier runs' K/V, which a cache sized for one run then evicts.
    loader = RandomWeightsLoader(TINY, seed=3)
    with Engine(loader=loader, device="cpu", plugin_host=plugin_host, context_len=64) as engine:
        prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5]]
        assert decode._generate_s(engine, prompts, 3, reps=3) > 0
        assert gc.isenabled()  # back on after the timed runs
        stats = engine.stats()
        assert stats.prefix_query_tokens > 0 and stats.prefix_hit_tokens == 0
        engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0))
        assert engine.stats().prefix_hit_tokens > 0  # the cache is on: a warm call hits


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    def qkv_proj(seed: int) -> torch.Tensor:
        ctx = RuntimeContext()
        worker = _worker(RandomWeightsLoader(TINY, seed), ctx)
        model: Any = worker.model_runner.model
        w = model.model.layers[1].self_attn.qkv_proj.weight.detach().clone()
        worker.close()
        ctx.close()
        return w

    a, b, c = qkv_proj(0), qkv_proj(0), qkv_proj(1)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize(
    "config",
    [TINY | {"tie_word_embeddings": True}, TINY_MOE],
    ids=["dense-tied", "moe"],
)
def test_transformers_model_holds_the_same_weights(config: dict[str, Any]) -> None:
    # The oracle is transformers itself: its logits on our weights must equal execrt's.
    pytest.importorskip("transformers")
    hf = build_hf_model(config, seed=7, device="cpu", dtype=torch.float32)
    ctx = RuntimeContext()
    worker = _worker(RandomWeightsLoader(config, seed=7), ctx)
    prompts = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77]]
    trace = prefill_then_decode(worker, prompts, steps=0, full_logits=True)
    worker.close()
    ctx.close()
    assert trace.prefill_full_logits is not None
    offset = 0
    with torch.no_grad():
        for prompt in prompts:
            ref = hf(torch.tensor([prompt])).logits[0]  # [n, V]
            got = trace.prefill_full_logits[offset : offset + len(prompt)]
            offset += len(prompt)
            assert float((got - ref).norm() / ref.norm()) < 1e-4


def test_per_expert_transformers_layout_gets_the_fused_experts() -> None:
    # transformers 4.x keeps one module per expert: experts.<e>.{gate,up,down}_proj.weight.
    mc = ModelConfig.from_dict(TINY_MOE | {"num_hidden_layers": 1})
    h, inter, e = mc.hidden_size, mc.moe_intermediate_size, mc.num_experts

    def expert() -> nn.Module:
        m = nn.Module()
        m.gate_proj = nn.Linear(h, inter, bias=False)
        m.up_proj = nn.Linear(h, inter, bias=False)
        m.down_proj = nn.Linear(inter, h, bias=False)
        return m

    root, model, layer, mlp = nn.Module(), nn.Module(), nn.Module(), nn.Module()
    mlp.experts = nn.ModuleList(expert() for _ in range(e))
    layer.mlp = mlp
    model.layers = nn.ModuleList([layer])
    root.model = model
    for p in root.parameters():
        p.data.fill_(float("nan"))  # poison: every value must be written
    fill_hf_model(root, mc, seed=5)

    ctx = RuntimeContext()
    worker = _worker(RandomWeightsLoader(TINY_MOE | {"num_hidden_layers": 1}, seed=5), ctx)
    moe: Any = worker.model_runner.model.model.layers[0].mlp  # type: ignore[attr-defined]
    for i, ex in enumerate(mlp.experts):
        assert torch.equal(ex.gate_proj.weight, moe.w13[i, :inter])
        assert torch.equal(ex.up_proj.weight, moe.w13[i, inter:])
        assert torch.equal(ex.down_proj.weight, moe.w2[i])
    worker.close()
    ctx.close()


def test_roofline_bytes_match_hand_counts() -> None:
    dense = ModelConfig.from_dict(TINY)
    # per layer: q 64*64 + k 32*64 + v 32*64 + o 64*64 = 12288; MLP 3*64*128 = 24576
    # two layers 73728 + LM head 1000*64 = 137728 elements, 2 bytes each
    assert weight_bytes_per_step(dense, 1) == 275456
    assert weight_bytes_per_step(dense, 64) == 275456
    tied = ModelConfig.from_dict(TINY | {"tie_word_embeddings": True})  # embedding = LM head
    assert weight_bytes_per_step(tied, 1) == 275456
    moe = ModelConfig.from_dict(TINY_MOE)
    # bs 3: 8 * (1 - (6/8)^3) = 4.625 experts of 3*64*32; + router 8*64 + attention 12288
    assert weight_bytes_per_step(moe, 3) == pytest.approx(2 * (2 * (12288 + 512 + 28416) + 64000))
    # bs 1: exactly top_k = 2 experts
    assert weight_bytes_per_step(moe, 1) == pytest.approx(2 * (2 * (12288 + 512 + 12288) + 64000))
    # K and V: bs 3 * ctx 10 * 2 layers * 2 * 2 kv heads * 16 * 2 bytes
    assert kv_bytes_per_step(dense, 3, 10) == 7680


def test_the_roofline_counts_the_context_each_timed_step_reads() -> None:
    # forward: a step after a 512-token prompt reads 513 tokens; generate at base 1, 32 steps:
    # decode steps 1..32 read 513..544, 528.5 on average; base 33: steps 33..64, 560.5
    assert decode.timed_context(512, "forward", 1, 32) == 513
    assert decode.timed_context(512, "generate", 1, 32) == 528.5
    assert decode.timed_context(512, "generate", 33, 32) == 560.5
    assert decode.timed_context(6, "generate", 1, 1) == 7  # one step: the first decode step


def test_records_price_the_kv_their_steps_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    opts = decode.Options(
        model="tiny", config=TINY, device="cpu", batch_sizes=(2,), ctx=6, steps=2, reps=1,
        hf=False, modes=("eager",), out_dir=str(tmp_path), generate_base=3,
    )  # fmt: skip
    records = {r.path: r for r in decode.run(opts)}
    mc = ModelConfig.from_dict(TINY)
    for path, kv_ctx in (("forward", 7), ("generate", 6 + 3 + 0.5)):
        r = records[path]
        assert r.kv_ctx == kv_ctx
        assert r.kv_gb * 1e9 == pytest.approx(kv_bytes_per_step(mc, 2, kv_ctx))
        assert r.roofline_ms == pytest.approx(
            (weight_bytes_per_step(mc, 2) + kv_bytes_per_step(mc, 2, kv_ctx))
            / (r.copy_gbps * 1e9) * 1e3
        )  # fmt: skip


def test_prefill_flops_match_hand_counts() -> None:
    dense = ModelConfig.from_dict(TINY)
    # per token: 2 x (12288 + 24576) x 2 layers = 147456; attention 4 * 16 * 4 heads * 55
    # visible pairs (10 tokens) * 2 layers = 28160; LM head 2 * 1000 * 64 once
    assert prefill_flops(dense, 10) == 147456 * 10 + 28160 + 128000
    moe = ModelConfig.from_dict(TINY_MOE)
    # experts: 2 of 8 per token (3 * 64 * 32 each) + router 8 * 64 + attention 12288 per layer
    per_token = 2 * 2 * (12288 + 512 + 2 * 3 * 64 * 32)
    assert prefill_flops(moe, 1) == per_token + 4 * 16 * 4 * 1 * 2 + 128000


def test_cpu_run_writes_every_record_and_prints_the_table_last(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    has_hf = _has_transformers()
    opts = decode.Options(
        model="tiny",
        config=TINY,
        device="cpu",
        batch_sizes=(1, 2),
        ctx=6,
        steps=2,
        reps=1,
        hf=has_hf,
        hf_compile_timeout=0,
        profile=True,
        out_dir=str(tmp_path),
        ttft=(16, 40),
    )
    records = decode.run(opts)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("# saved ") and out[-2 - len(records)].startswith("mode ")
    # The profile table comes before the records' table: one line per profiled record.
    profiled = [r for r in records if r.profile]
    at = out.index(next(line for line in out if line.startswith("mode ") and "kernels" in line))
    assert len(profiled) == 4 and [line.split()[:3] for line in out[at + 1 : at + 5]] == [
        [r.mode, r.path, str(r.bs)] for r in profiled
    ]
    by_key = {(r.mode, r.path, r.bs): r for r in records}
    for bs in (1, 2):
        for path in ("generate", "forward"):
            r = by_key[("eager", path, bs)]
            assert r.note.startswith("noise") or r.step_ms is not None and r.step_ms > 0
            assert r.roofline_ms > 0 and r.attention == "torch_native"
        assert by_key[("eager", "generate", bs)].prefill_ms is not None
        profile = by_key[("eager", "forward", bs)].profile  # every batch size is profiled
        assert profile is not None and profile["steps"] == decode.PROFILE_STEPS
        assert 0 < profile["host_us_per_step"] < 1e6 * profile["wall_ms_per_step"]
        assert by_key[("eager", "forward", bs)].kernels == []  # the GPU's kernels: none here
        gen = by_key[("eager", "generate", bs)]
        # The generate path's decode steps by difference (1 + steps tokens less 1), and the
        # host time per step broken down by the same difference. On a busy 2-core CPU both
        # differences of two short runs may be noise, negative even (CI once saw -408 us of
        # host time), so only that they are numbers, and the hotspots' order, are checked.
        assert gen.profile is not None and gen.profile["by_difference"]
        assert gen.profile["steps"] == opts.steps
        assert math.isfinite(gen.profile["wall_ms_per_step"])
        assert math.isfinite(gen.profile["host_us_per_step"])
        us = [us for _, us in gen.hotspots]
        assert us and all(map(math.isfinite, us)) and us == sorted(us, reverse=True)
        # CPU has no CUDA graphs: the graph mode is reported, not silently dropped.
        assert "graph" in by_key[("graph", "generate", bs)].note
        if has_hf:
            assert ("hf-eager", "generate", bs) in by_key
    if has_hf:
        assert by_key[("hf-compile", "generate", 1)].note == "disabled"
    # Time to first token: the prompt's FLOPs over the time, against a matmul of this run.
    for n in (16, 40):
        ttft = next(r for r in records if r.mode == "ttft" and r.ctx == n)
        assert ttft.prefill_ms and ttft.prefill_ms > 0 and ttft.peak_tflops
        assert ttft.prefill_tflops == pytest.approx(
            prefill_flops(ModelConfig.from_dict(TINY), n) / ttft.prefill_ms / 1e9
        )
        assert ttft.pct_peak == pytest.approx(100 * ttft.prefill_tflops / ttft.peak_tflops)
        assert ttft.spec_peak_tflops is None and ttft.pct_spec_peak is None  # no datasheet: CPU
        assert "1 chunk(s) of <= 4096" in ttft.note
    (saved,) = [f for f in os.listdir(tmp_path) if f.startswith("decode-step-")]
    for bs in (1, 2):
        assert [f for f in os.listdir(tmp_path) if f.startswith(f"decode-trace-tiny-eager-bs{bs}-")]
        generate = f"decode-trace-tiny-eager-generate-bs{bs}-"
        assert [f for f in os.listdir(tmp_path) if f.startswith(generate)]
    rows = json.loads((tmp_path / saved).read_text())
    required = {"model", "layers", "mode", "path", "bs", "ctx", "step_ms", "prefill_ms"}
    required |= {"tokens_per_s", "pct_roofline", "roofline_ms", "copy_gbps", "gpu", "date"}
    assert all(required | {"attention"} <= set(row) for row in rows)
    assert {row["layers"] for row in rows} == {2}


@pytest.mark.parametrize(
    ("context_len", "resolved"), [("run", 6 + 2 + 16), ("model", 256), ("99", 99)]
)
def test_cpu_run_records_the_context_limit_it_ran_with(tmp_path, context_len, resolved) -> None:  # type: ignore[no-untyped-def]
    # "model" is what a user's engine gets by default (TINY's 256), and it sizes what a graph
    # bucket launches; the KV pool still holds only what the run needs.
    opts = decode.Options(
        model="tiny", config=TINY, device="cpu", batch_sizes=(2,), ctx=6, steps=2, reps=1,
        hf=False, modes=("eager",), out_dir=str(tmp_path), context_len=context_len,
    )  # fmt: skip
    records = decode.run(opts)
    assert records and all(r.context_len == resolved for r in records)
    assert all(r.step_ms or r.note.startswith("noise") for r in records)


def test_a_generate_base_times_steady_steps_in_a_run_sized_context(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # base 3: the step is (t(3 + 2) - t(3)) / 2, so the longest generate decodes 4 steps past
    # its prompt and the engine's context ("run") holds them; the record says which base.
    seen: list[int] = []
    real = decode._generate_s

    def generate_s(engine, prompts, new_tokens, reps):  # type: ignore[no-untyped-def]
        seen.append(new_tokens)
        return real(engine, prompts, new_tokens, reps)

    monkeypatch.setattr(decode, "_generate_s", generate_s)
    opts = decode.Options(
        model="tiny", config=TINY, device="cpu", batch_sizes=(2,), ctx=6, steps=2, reps=1,
        hf=False, modes=("eager",), out_dir=str(tmp_path), generate_base=3, context_len="run",
    )  # fmt: skip
    records = decode.run(opts)
    generate = [r for r in records if r.path == "generate"]
    assert generate and all(r.generate_base == 3 for r in generate)
    assert all(r.generate_base is None for r in records if r.path == "forward")
    assert all(r.context_len == 6 + 3 - 1 + 2 + 16 for r in records)
    assert max(seen) == 5 and {3, 5} <= set(seen)
    assert all(r.step_ms or r.note.startswith("noise") for r in generate)

    # A generate that fails still records the run's base, and its roofline at that base.
    def fail(engine, prompts, new_tokens, reps):  # type: ignore[no-untyped-def]
        raise RuntimeError("no")

    monkeypatch.setattr(decode, "_generate_s", fail)
    failed = [r for r in decode.run(opts) if r.path == "generate"]
    assert failed and all(r.step_ms is None for r in failed)
    assert all(r.generate_base == 3 and r.kv_ctx == 6 + 3 + 0.5 for r in failed)


def test_records_name_the_kernel_switches_of_the_run(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # An A/B of a kernel switch is two calls whose records must say which was which.
    monkeypatch.setenv(envs.PDL_PREFETCH, "linear")
    monkeypatch.delenv(envs.DISABLE_PDL, raising=False)
    opts = decode.Options(
        model="tiny", config=TINY, device="cpu", batch_sizes=(1,), ctx=6, steps=2, reps=1,
        hf=False, modes=("eager",), out_dir=str(tmp_path),
    )  # fmt: skip
    records = decode.run(opts)
    assert records and all(r.kernel_env == {envs.PDL_PREFETCH: "linear"} for r in records)
    assert envs.kernel_switches({envs.DISABLE_PDL: "1", "EXECRT_OTHER": "x"}) == {
        envs.DISABLE_PDL: "1"
    }


def test_cpu_run_times_each_kv_dtype_against_auto(tmp_path) -> None:  # type: ignore[no-untyped-def]
    opts = decode.Options(
        model="tiny", config=TINY, device="cpu", batch_sizes=(1, 2), ctx=6, steps=2, reps=1,
        hf=False, modes=("eager",), kv_dtypes=("auto", "fp8_e5m2"), out_dir=str(tmp_path),
    )  # fmt: skip
    records = decode.run(opts)
    by_key = {(r.kv_dtype, r.path, r.bs): r for r in records}
    assert len(by_key) == len(records) == 8
    for path in ("generate", "forward"):
        for bs in (1, 2):
            auto, fp8 = by_key[("auto", path, bs)], by_key[("fp8_e5m2", path, bs)]
            assert fp8.kv_gb == auto.kv_gb / 2  # 1 byte per value
            if auto.step_ms and fp8.step_ms:  # a step lost in timing noise has no ratio
                assert auto.vs_kv_auto == 1.0
                assert fp8.vs_kv_auto == pytest.approx(fp8.step_ms / auto.step_ms)
    (saved,) = [f for f in os.listdir(tmp_path) if f.startswith("decode-step-")]
    rows = json.loads((tmp_path / saved).read_text())
    assert {row["kv_dtype"] for row in rows} == {"auto", "fp8_e5m2"}


def test_a_run_cut_short_keeps_what_it_measured(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A device call's time limit can end a run between its configurations: the records so
    # far are on disk (compared as the final file compares them), and a run that completes
    # leaves only the final file.
    opts = decode.Options(
        model="tiny", config=TINY, device="cpu", batch_sizes=(1, 2), ctx=6, steps=2, reps=1,
        hf=False, modes=("eager",), kv_dtypes=("auto", "fp8_e5m2"), out_dir=str(tmp_path),
    )  # fmt: skip
    real = decode._run_execrt

    def cut(ctx, mode, kv_dtype="auto"):  # type: ignore[no-untyped-def]
        if kv_dtype != "auto":
            raise KeyboardInterrupt  # (as the call's timeout would end it)
        real(ctx, mode, kv_dtype)

    monkeypatch.setattr(decode, "_run_execrt", cut)
    with pytest.raises(KeyboardInterrupt):
        decode.run(opts)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("decode-step-")]
    (partial,) = [f for f in os.listdir(tmp_path) if f.startswith("decode-partial-")]
    rows = json.loads((tmp_path / partial).read_text())
    assert {(row["path"], row["bs"]) for row in rows} == {
        (path, bs) for path in ("generate", "forward") for bs in (1, 2)
    }
    assert all(row["kv_dtype"] == "auto" for row in rows)
    assert all(row["vs_kv_auto"] == 1.0 for row in rows if row["step_ms"])
    monkeypatch.setattr(decode, "_run_execrt", real)
    (tmp_path / partial).unlink()
    decode.run(opts)
    names = os.listdir(tmp_path)
    assert len([f for f in names if f.startswith("decode-step-")]) == 1
    assert not [f for f in names if f.startswith("decode-partial-")]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model", "nope"], "model 'nope' unknown (known: qwen3-0.6b, qwen3-8b, qwen3-30b-a3b)"),
        (["--bs", "1,x"], "--bs '1,x' must look like 1,8,32"),
        (["--bs", "0,8"], "batch sizes [0, 8] must be integers >= 1"),
        (["--modes", "eager,fast"], "modes ['eager', 'fast'] unsupported"),
        (["--layers", "0"], "layers 0 must be >= 1"),
        (["--kv-dtype", "fp8"], "--kv-dtype fp8 unsupported (supported: auto, fp8_e4m3, fp8_e5m2)"),
        (["--ttft", "8k"], "--ttft '8k' must look like 8192,32768 or none"),
        (["--ttft", "0"], "ttft prompt lengths [0] must be >= 1"),
        (["--context-len", "all"], "context_len 'all' unsupported (run, model, or a number"),
        (["--context-len", "100", "--ctx", "90"], "above ctx + steps = 122"),
        (["--generate-base", "0"], "generate base 0 must be >= 1"),
        (["--steps", "0"], "steps 0"),  # not taken for "not given" (it timed 32 steps)
        (
            ["--context-len", "130", "--ctx", "90", "--generate-base", "9"],
            "above ctx + steps + generate base - 1 = 130",
        ),
    ],
)
def test_cli_refuses_bad_options_with_one_line(argv: list[str], expected: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "decode", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


def test_cli_parses_options_into_the_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen: list[decode.Options] = []
    monkeypatch.setattr(decode, "run", lambda opts: seen.append(opts) or [])
    argv = ["--model", "qwen3-8b", "--layers", "4", "--bs", "2,16", "--ctx", "128"]
    argv += ["--modes", "graph", "--no-hf", "--profile", "--attention", "triton", "--out", "x"]
    argv += ["--no-overlap", "--kv-dtype", "fp8_e4m3", "--context-len", "model"]
    argv += ["--generate-base", "33"]
    assert main(["bench", "decode", *argv]) == 0
    assert main(["bench", "decode", "--quick"]) == 0
    assert main(["bench", "decode", "--ttft", "none"]) == 0
    assert main(["bench", "decode", "--quick", "--ttft", "4096"]) == 0
    full, quick, no_ttft, quick_ttft = seen
    assert (full.ttft, quick.ttft, no_ttft.ttft, quick_ttft.ttft) == (
        (8192, 32768),
        (),
        (),
        (4096,),
    )
    # The fp8 run is always paired with the model-dtype one, so its ratio comes from one run.
    assert (full.kv_dtypes, quick.kv_dtypes) == (("auto", "fp8_e4m3"), ("auto",))
    assert (full.model, full.layers, full.batch_sizes, full.ctx, full.steps) == (
        "qwen3-8b",
        4,
        (2, 16),
        128,
        32,
    )
    assert (full.modes, full.hf, full.profile, full.attention, full.out_dir, full.overlap) == (
        ("graph",),
        False,
        True,
        "triton",
        "x",
        False,
    )
    assert quick.overlap
    # A user's engine keeps the model's context limit: so does the default run.
    assert (full.context_len, quick.context_len, full.reps) == ("model", "model", 3)
    assert (full.generate_base, quick.generate_base) == (33, 1)
    assert (quick.model, quick.batch_sizes, quick.steps, quick.reps, quick.hf) == (
        "qwen3-0.6b",
        (1, 32),
        8,
        1,
        True,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cli_without_cuda_says_so(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "decode", "--layers", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "execrt: error: bench decode: needs a CUDA device (none is visible)"
    )


@requires_cuda
def test_gpu_quick_run_times_eager_and_graph(tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = ["bench", "decode", "--quick", "--layers", "2", "--hf-compile-timeout", "0"]
    assert main([*argv, "--profile", "--out", str(tmp_path)]) == 0
    (saved,) = [f for f in os.listdir(tmp_path) if f.startswith("decode-step-")]
    rows = json.loads((tmp_path / saved).read_text())
    for mode in ("eager", "graph"):
        forward = [r for r in rows if (r["mode"], r["path"]) == (mode, "forward")]
        generate = [r for r in rows if (r["mode"], r["path"]) == (mode, "generate")]
        assert {r["bs"] for r in forward} == {r["bs"] for r in generate} == {1, 32}
        # The forward path must have run (through a graph in graph mode: note "").
        assert all(r["step_ms"] and r["step_ms"] > 0 and r["note"] == "" for r in forward), forward
        assert all(r["prefill_ms"] and r["prefill_ms"] > 0 for r in generate), generate
    eager_profile = next(
        r["profile"] for r in rows if (r["mode"], r["path"], r["bs"]) == ("eager", "forward", 1)
    )
    assert eager_profile["kernels_per_step"] > 10 and eager_profile["wall_ms_per_step"] > 0


def _worker(loader: RandomWeightsLoader, ctx: RuntimeContext) -> TpModelWorker:
    from execrt.plugins.host import PluginHost

    registry = PluginHost(autoload=False).registry
    return TpModelWorker(loader, RuntimeConfig(device="cpu", context_len=64), ctx, registry)


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def test_a_run_that_measured_nothing_exits_2_naming_the_first_reason(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    # A misspelled backend skips every configuration: exit 0 with a file of empty rows let a
    # CI job publish nothing as a pass. Peer rows (transformers) do not count as measured.
    def failed(opts: decode.Options) -> list[decode.Record]:
        row = dict.fromkeys(
            f.name for f in dataclasses.fields(decode.Record) if f.default is MISSING
        )
        note = "skipped: BackendUnavailableError: attention backend 'bogus' unavailable"
        own = decode.Record(**(row | {"mode": "graph", "step_ms": None}), note=note)
        peer = decode.Record(**(row | {"mode": "hf-eager", "step_ms": 30.0}))
        return [own, peer]

    monkeypatch.setattr(decode, "run", failed)
    assert main(["bench", "decode", "--attention", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "bench decode: nothing was measured: skipped: BackendUnavailableError" in err


def test_the_peer_ratios_compare_generate_with_generate() -> None:
    """transformers is timed through a whole generate: the forward path (no scheduling, no
    sampling, no token copied back) gets no ratio, and a compile peer that did not compile
    is no peer."""
    from execrt.bench.decode import Record, _compare_to_peers

    def rec(mode: str, path: str, ms: float, note: str = "") -> Record:
        return Record("m", 2, mode, path, 1, 512, 8, ms, None, None, 1.0, None, 1.0, 1.0,
                      0.1, "cpu", "today", "triton", note=note)  # fmt: skip

    ours = [rec("graph", "generate", 1.0), rec("graph", "forward", 0.9)]
    _compare_to_peers(
        [*ours, rec("hf-eager", "generate", 20.0), rec("hf-compile", "generate", 3.0)]
    )
    assert (ours[0].vs_hf_eager, ours[0].vs_hf_compile) == (20.0, 3.0)
    assert (ours[1].vs_hf_eager, ours[1].vs_hf_compile) == (None, None)
    ours = [rec("graph", "generate", 1.0)]
    _compare_to_peers([*ours, rec("hf-compile", "generate", 3.0, "compile 9 s; NOT compiled")])
    assert ours[0].vs_hf_compile is None
