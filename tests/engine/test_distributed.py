"""Expert parallelism on CPU: two gloo processes produce the single-process logits and tokens."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.parallel import ParallelState
from execrt.core.plugins import PluginHost
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.core.worker import TpModelWorker

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77], [9] * 13]
STEPS = 4


def run_steps(
    path: str, context: RuntimeContext
) -> tuple[list[torch.Tensor], list[list[int]], int]:
    """Prefill then decode STEPS times; returns the logits, the tokens and the local experts."""
    worker = TpModelWorker(path, RuntimeConfig(device="cpu"), context, PluginHost(autoload=False))
    mr = worker.model_runner
    local_experts = next(p.shape[0] for n, p in mr.model.named_parameters() if n.endswith("w13"))
    reqs = [Req(i, p, SamplingParams(temperature=0)) for i, p in enumerate(PROMPTS)]
    batch = ScheduleBatch.for_extend(
        reqs,
        [len(p) for p in PROMPTS],
        mr.req_to_token_pool,
        mr.token_to_kv_pool_allocator,
        mr.device,
    )
    logits = []
    for step in range(STEPS + 1):
        if step:
            batch = ScheduleBatch.for_decode(
                reqs, mr.req_to_token_pool, mr.token_to_kv_pool_allocator, mr.device
            )
        assert batch is not None
        result = worker.forward_batch_generation(batch)
        logits.append(result.logits_output.next_token_logits.clone())
        for req, n, tok in zip(
            reqs, batch.extend_lens, result.next_token_ids.tolist(), strict=True
        ):
            req.kv_len += n
            req.output_ids.append(int(tok))
    worker.close()
    return logits, [r.output_ids for r in reqs], local_experts


def _rank_main(rank: int, world: int, path: str, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ctx = RuntimeContext(parallel=ParallelState.from_process_group())
        logits, tokens, local = run_steps(path, ctx)
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
        _rank_main,
        args=(2, path, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["local_experts"] * 2 == all_experts == 8  # each rank holds half the experts
        assert got["tokens"] == ref_tokens
        for step, (a, b) in enumerate(zip(got["logits"], ref_logits, strict=True)):
            err = float((a - b).norm() / b.norm())
            assert err < 1e-5, f"rank {rank} step {step}: relative error {err:.2e}"
