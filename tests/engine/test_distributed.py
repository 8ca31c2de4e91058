"""Expert parallelism on CPU: two gloo processes produce the single-process logits and tokens."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from execrt.core.context import RuntimeContext
from execrt.core.parallel import ParallelState
from execrt.testing.moe_harness import rank_context
from tests.drivers import in_environment, make_worker, prefill_then_decode, rel_err

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77], [9] * 13]
STEPS = 4


def run_steps(
    path: str, context: RuntimeContext, ep_size: int = 0
) -> tuple[list[torch.Tensor], list[list[int]], int]:
    """Prefill then decode STEPS times; returns the logits, the tokens and the local experts."""
    worker = make_worker(path, context, ep_size=ep_size)
    model = worker.model_runner.model
    local_experts = next(p.shape[0] for n, p in model.named_parameters() if n.endswith("w13"))
    trace = prefill_then_decode(worker, PROMPTS, STEPS)
    worker.close()
    return trace.logits, trace.tokens, local_experts


def _rank_main(rank: int, world: int, path: str, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(
        1
    )  # two ranks spinning OpenMP threads on a small CPU stall at collectives
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ctx = RuntimeContext(parallel=ParallelState.from_process_group())
        logits, tokens, local = run_steps(path, ctx, ep_size=world)  # attention replicated
        torch.save(
            {"logits": logits, "tokens": tokens, "local_experts": local},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
        ctx.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["moe-8x2", "moe-mixed-layers"])
def test_two_gloo_ranks_match_one_process(checkpoint, name, tmp_path) -> None:
    path = checkpoint(name)
    ref_logits, ref_tokens, all_experts = run_steps(path, RuntimeContext())
    mp.start_processes(
        in_environment,
        args=(dict(os.environ), _rank_main, 2, path, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method=rank_context("cpu").get_start_method(),  # a preloaded fork server
    )
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["local_experts"] * 2 == all_experts == 8  # each rank holds half the experts
        assert got["tokens"] == ref_tokens
        for step, (a, b) in enumerate(zip(got["logits"], ref_logits, strict=True)):
            err = rel_err(a, b)
            assert err < 1e-5, f"rank {rank} step {step}: relative error {err:.2e}"
