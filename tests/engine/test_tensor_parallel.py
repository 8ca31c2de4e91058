"""Tensor parallelism (and expert parallelism inside it) on CPU: two gloo processes produce the
single-process logits and tokens; bad layouts fail at start with one line; torchrun runs the CLI
and rank 0 alone prints."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from execrt.core.context import RuntimeContext
from execrt.core.errors import ConfigError
from execrt.core.parallel import ParallelState
from tests.drivers import (
    STATIC_GRAPH,
    graph_attention_host,
    make_worker,
    prefill_then_decode,
    rel_err,
)

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77], [9] * 13]
STEPS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# case -> (checkpoint, RuntimeConfig overrides at TP=2, expected per-rank (q, kv) heads, experts)
CASES: dict[str, tuple[str, dict[str, Any], tuple[int, int], int]] = {
    # 8 q / 2 kv heads, head_dim 128, untied LM head: one kv head per rank.
    "dense": ("dense-untied-hd128-sharded", {}, (4, 1), 0),
    # 4 q / 1 kv head: the kv head replicated on both ranks; biases everywhere.
    "llama-bias-kv1": ("llama-bias-kv1", {}, (2, 1), 0),
    # Qwen3-MoE, EP over the TP ranks under each dispatcher: 4 of 8 experts per rank.
    "moe-allreduce": ("moe-8x2", {"moe_dispatcher": "allreduce"}, (2, 1), 4),
    "moe-all_to_all": ("moe-8x2", {"moe_dispatcher": "all_to_all"}, (2, 1), 4),
    "moe-all_to_all_fixed": ("moe-8x2", {"moe_dispatcher": "all_to_all_fixed"}, (2, 1), 4),
    # EP 1: experts replicated; 1 kv head replicated; layer 3 is a dense (sharded) MLP.
    "moe-ep1": ("moe-mixed-layers", {"ep_size": 1, "moe_dispatcher": "allreduce"}, (2, 1), 8),
    # The Triton kernels on local shapes (q/k norm + RoPE + K/V store into this rank's cache,
    # SwiGLU) and decode through the graph runner (the re-execution backend replays the TP
    # all-reduces). The ranks run Triton on CPU tensors: the test gives them the interpreter.
    "dense-fused-graph": (
        "dense-tied-hd64",
        {
            "attention_backend": "triton",
            "fused_kernels": "on",
            "graph_backend": "reexec",
            "cuda_graph_max_bs": 4,
        },
        (2, 1),
        0,
    ),
    # Qwen3-MoE decode through the graph runner at TP 2 / EP 2: the allreduce dispatcher's
    # combine runs inside every replay, and 3 requests in the bucket of 4 bring a padding row
    # that must route to no expert on either rank (a graph-capable torch attention: fast).
    "moe-allreduce-graph": (
        "moe-8x2",
        {
            "moe_dispatcher": "allreduce",
            "attention_backend": STATIC_GRAPH,
            "graph_backend": "reexec",
            "cuda_graph_max_bs": 4,
        },
        (2, 1),
        4,
    ),
}
if torch.cuda.is_available():
    # The Triton interpreter of the GPU machine's triton (3.6) fails on this case's CPU
    # tensors (TypeError inside _decode_metadata_kernel); CPU CI runs it, and on a GPU the
    # fused kernels under TP-sized shapes run compiled in tests/engine/test_gpu_decode_paths.
    del CASES["dense-fused-graph"]


def run_case(path: str, context: RuntimeContext, **config: Any) -> dict[str, Any]:
    host = graph_attention_host() if config.get("attention_backend") == STATIC_GRAPH else None
    worker = make_worker(path, context, host, **config)
    mr = worker.model_runner
    w13 = [p for n, p in mr.model.named_parameters() if n.endswith("w13")]
    trace = prefill_then_decode(worker, PROMPTS, STEPS, full_logits=True)
    out = {
        "logits": trace.logits,
        "tokens": trace.tokens,
        "prefill": trace.prefill_full_logits,
        "heads": (mr.attn_backend.init.num_q_heads, mr.kv_cache.k_buffers[0].shape[1]),
        "graph": mr.decode_graph_runner is not None,
        "graphed": trace.graphed,
        "experts": w13[0].shape[0] if w13 else 0,
    }
    worker.close()
    return out


def _rank_main(rank: int, paths: dict[str, str], init_file: str, out_dir: str) -> None:
    # One thread per rank: two ranks spinning OpenMP threads on a small CPU slow each other
    # down by orders of magnitude at every collective.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for case, (_, overrides, _, _) in CASES.items():
            ctx = RuntimeContext(parallel=ParallelState.from_process_group())
            got = run_case(paths[case], ctx, tp_size=2, **overrides)
            torch.save(got, os.path.join(out_dir, f"{case}-rank{rank}.pt"))
            ctx.close()
    finally:
        dist.destroy_process_group()
    # The group is gone, its threads joined: none is left to run into interpreter shutdown
    # (building the model once imported torch modules that kept the group alive). A leaked
    # group keeps all its threads for good; a freed one loses its pt_gloo_runloop workers at
    # once, but gloo's transport thread (gloo_tcp_loop) can end a moment later on a loaded
    # machine (CI saw it alone, still there), and a garbage cycle can hold the group until the
    # collector runs. So wait up to a few seconds, which a leak outlives.
    deadline = time.monotonic() + 10.0
    while (threads := gloo_threads()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not threads, threads


def gloo_threads() -> list[str]:
    """This process's threads whose name says gloo (Linux: /proc/self/task/*/comm)."""
    names = [
        open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")
    ]
    return [name for name in names if "gloo" in name]


def test_two_tp_ranks_match_one_process(checkpoint, tmp_path) -> None:
    paths = {case: checkpoint(spec[0]) for case, spec in CASES.items()}
    with pytest.MonkeyPatch.context() as env:
        # "dense-fused-graph" runs Triton kernels on CPU tensors in the ranks: they need the
        # interpreter, which tests/conftest.py sets only where CUDA is absent. A spawned rank
        # starts with this environment, before it imports any kernel; this process (whose
        # reference runs no Triton) keeps its own.
        env.setenv("TRITON_INTERPRET", "1")
        mp.start_processes(
            _rank_main,
            args=(paths, str(tmp_path / "init"), str(tmp_path)),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
    for case, (_, overrides, heads, experts) in CASES.items():
        ref = run_case(paths[case], RuntimeContext(), moe_dispatcher="allreduce")
        for rank in range(2):
            got = torch.load(tmp_path / f"{case}-rank{rank}.pt")
            where = f"{case} rank {rank}"
            assert got["heads"] == heads, f"{where}: attention/KV heads {got['heads']}"
            assert got["experts"] == experts, f"{where}: {got['experts']} local experts"
            graph = "graph_backend" in overrides
            assert got["graph"] == graph, where
            # The prefill runs eagerly; every decode step (3 requests) replays a graph.
            assert got["graphed"] == [False] + [graph] * STEPS, f"{where}: {got['graphed']}"
            assert got["tokens"] == ref["tokens"], where
            err = rel_err(got["prefill"], ref["prefill"])
            assert err <= 1e-4, f"{where} prefill: relative error {err:.2e}"
            for step, (a, b) in enumerate(zip(got["logits"], ref["logits"], strict=True)):
                err = rel_err(a, b)
                assert err <= 1e-4, f"{where} step {step}: relative error {err:.2e}"


@pytest.mark.parametrize(
    ("name", "world", "config", "message"),
    [
        # 3 query heads do not split over 2 ranks.
        (
            "llama-untied-bias-llama3",
            2,
            {"tp_size": 2},
            "tensor parallel: num_q_heads 3 not divisible by tp_size 2",
        ),
        # 8 experts over 3 EP ranks (attention replicated).
        (
            "moe-8x2",
            3,
            {"ep_size": 3},
            "expert parallel: num_experts 8 not divisible by ep_size 3",
        ),
        ("dense-tied-hd64", 1, {"tp_size": 2}, "tp_size 2 needs 2 processes, this world has 1"),
        ("dense-tied-hd64", 2, {}, "a world of 2 processes but tp_size 1"),
        ("moe-8x2", 2, {"ep_size": 1}, "tp_size 1 and ep_size 1"),
        ("dense-tied-hd64", 4, {"tp_size": 2}, "tp_size 2 / ep_size 2 unsupported in a world of 4"),
    ],
)
def test_bad_layouts_fail_at_start_with_one_line(checkpoint, name, world, config, message) -> None:
    # No process group is needed: the layout is checked before any collective runs.
    ctx = RuntimeContext(parallel=ParallelState(world, 0, "gloo" if world > 1 else "none"))
    with pytest.raises(ConfigError) as info:
        make_worker(checkpoint(name), ctx, **config)
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert ctx.close() == []


def test_cli_tp_in_one_process_is_one_line_on_rank_0_only(checkpoint, capsys, monkeypatch) -> None:
    from execrt.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["generate", "--model", checkpoint("dense-tied-hd64"), "--device", "cpu"]
    argv += ["--tp", "2", "--token-ids", "1,2,3"]
    capsys.readouterr()  # building the checkpoint may print (transformers' shard-writing bar)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "execrt: error: parallel: tp_size 2 needs 2" in err, err
    monkeypatch.setenv("RANK", "1")  # any other torchrun rank: the same error, not printed
    assert main(argv) == 2
    assert capsys.readouterr().err == ""


def test_torchrun_generate_prints_once_and_matches_one_process(checkpoint, capsys) -> None:
    from execrt.cli import main

    path = checkpoint("moe-8x2")
    argv = ["generate", "--model", path, "--device", "cpu", "--token-ids", "5,17,33,2,90", "9,9"]
    argv += ["--max-new-tokens", "8", "--json"]
    # Penalties too: every rank counts the same tokens, the one in flight included.
    argv += ["--repetition-penalty", "1.3", "--frequency-penalty", "0.5", "--min-tokens", "8"]
    assert main(argv) == 0
    expected = json.loads(capsys.readouterr().out)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += ["--nproc-per-node", "2", "-m", "execrt"]
    done = subprocess.run(
        [*launcher, *argv, "--tp", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)  # one JSON document: rank 1 printed nothing
    assert got == expected
    assert [len(r["token_ids"]) for r in got] == [8, 8]
