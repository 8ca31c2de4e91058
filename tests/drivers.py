"""One test driver for stepping a worker by hand: prefill every prompt, then decode N steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.core.worker import TpModelWorker
from execrt.models import CheckpointLoader
from execrt.plugins.host import PluginHost


def make_worker(
    path: str, context: RuntimeContext, host: PluginHost | None = None, **config: Any
) -> TpModelWorker:
    """A worker for the checkpoint at ``path`` (CPU unless ``device`` is given)."""
    cfg = RuntimeConfig(**({"device": "cpu"} | config))
    registry = (host or PluginHost(autoload=False)).registry
    return TpModelWorker(CheckpointLoader(path), cfg, context, registry)


@dataclass
class Trace:
    """What one prefill + decode run produced, step by step."""

    logits: list[torch.Tensor]  # per step: next-token logits [B, V] (cloned)
    tokens: list[list[int]]  # per request: every generated token
    prefill_full_logits: torch.Tensor | None  # [T, V] of the prefill, when asked for


def prefill_then_decode(
    worker: TpModelWorker,
    prompts: list[list[int]],
    steps: int,
    *,
    full_logits: bool = False,
    follow: list[list[int]] | None = None,
) -> Trace:
    """Prefill all ``prompts`` in one extend, then ``steps`` greedy decode steps.

    ``follow`` (per request, the tokens of another run) feeds those tokens instead of this
    run's samples, so two backends compared step by step always see the same inputs (bf16
    near-ties would otherwise send them down different continuations)."""
    mr = worker.model_runner
    pools = (mr.req_to_token_pool, mr.token_to_kv_pool_allocator, mr.device)
    reqs = [Req(i, list(p), SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    batch = ScheduleBatch.for_extend(reqs, [len(p) for p in prompts], *pools)
    assert batch is not None, "the test's KV cache is too small for its prompts"
    batch.return_full_logits = full_logits
    logits: list[torch.Tensor] = []
    full = None
    for step in range(steps + 1):
        if step:
            batch = ScheduleBatch.for_decode(reqs, *pools)
            assert batch is not None, "the test's KV cache is too small for its decode steps"
        result = worker.forward_batch_generation(batch)
        if step == 0 and full_logits:
            assert result.logits_output.full_logits is not None
            full = result.logits_output.full_logits.clone()
        logits.append(result.logits_output.next_token_logits.clone())
        sampled = result.next_token_ids.tolist()
        fed = sampled if follow is None else [tokens[step] for tokens in follow]
        for req, n, tok in zip(reqs, batch.extend_lens, fed, strict=True):
            req.kv_len += n
            req.output_ids.append(int(tok))
    return Trace(logits, [r.output_ids for r in reqs], full)
