"""GPU: an overlapped decode step never waits for the device outside the one planned wait.

Overlap only pays if nothing between launching step N+1 and reading step N's tokens
synchronises: ``torch.cuda.set_sync_debug_mode("error")`` turns every implicit sync of a
torch op (``.item()``, ``.tolist()``, ``int(tensor)``, a copy into pageable memory, a
``nonzero``) into an exception. The planned wait, ``HostCopy.tolist`` on the token copy's
event, is explicit and allowed. Requests finish at different steps (the not-steady-state
decode, freeing, the prefix cache), greedy and seeded rows share batches, with and without
graphs.

The suite's conftest turns on the KV ownership debug map, which reads every freed slot back
to the host (a sync by design); these tests run as a user does, without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from execrt.bench.models import RandomWeightsLoader
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
}


@pytest.fixture(autouse=True)
def _no_debug_map(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXECRT_DEBUG_KV_OWNERSHIP", "0")


def _submit_all(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> dict[int, list[int]]:
    """Submit every prompt; the returned dict collects each one's streamed tokens."""
    got: dict[int, list[int]] = {}

    def sink(rid: int) -> Any:
        return lambda out: got.setdefault(rid, []).extend(out.token_ids)

    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.submit(p, sp, on_output=sink(i))
    return got


def _step_without_syncs(engine: Engine, more: Callable[[], bool]) -> None:
    """Step while ``more()`` with every implicit sync an error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while more():
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("graph", ["none", "full_cuda_graph"])
def test_overlapped_decode_steps_never_sync_implicitly(graph: str) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 4000, (int(n),), generator=g).tolist() for n in range(5, 200, 9)]
    params = [
        SamplingParams(
            max_new_tokens=24 + 3 * i,  # finishes spread over the checked steps
            temperature=0.6 if i % 2 else 0.0,
            seed=i,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    with Engine(
        loader=RandomWeightsLoader(CONFIG, 0),
        device="cuda",
        graph_backend=graph,
        attention_backend="triton",
        max_running_requests=32,
        overlap_schedule=True,
    ) as engine:
        want = [r.token_ids for r in engine.generate(prompts, params)]  # warm: JIT, graphs
        got = _submit_all(engine, prompts, params)
        scheduler = engine.scheduler
        while scheduler.waiting or not scheduler.stats.decode_steps:  # prefills may sync
            engine.step()
        decodes = scheduler.stats.decode_steps
        _step_without_syncs(engine, lambda: bool(scheduler.running))
        engine.step()  # the last step's results
        assert scheduler.stats.decode_steps - decodes > 20
        assert [got[i] for i in range(len(prompts))] == want  # and the same tokens
        assert engine.stats().requests_running == 0


def test_overlapped_extend_steps_never_sync_implicitly() -> None:
    # Twelve ~300-token prompts through a 512-token prefill budget: a run of extends (chunks
    # among them) that each build while the one before runs, then the decodes. Nothing may
    # wait for the device but the planned token wait: a pageable copy in the model's forward
    # (the rows whose logits are wanted) used to block each extend's launch until the GPU had
    # finished it, so the next extend's host work could not overlap.
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 4000, (280 + 7 * i,), generator=g).tolist() for i in range(12)]
    params = SamplingParams(max_new_tokens=4, temperature=0.6, seed=3, ignore_eos=True)
    with Engine(
        loader=RandomWeightsLoader(CONFIG, 0),
        device="cuda",
        graph_backend="none",
        attention_backend="triton",
        max_running_requests=32,
        max_prefill_tokens=512,
        overlap_schedule=True,
    ) as engine:
        want = [r.token_ids for r in engine.generate(prompts, params)]  # warm: JIT
        engine.flush_cache()
        got = _submit_all(engine, prompts, [params] * len(prompts))
        scheduler = engine.scheduler
        extends = scheduler.stats.extend_steps
        _step_without_syncs(engine, lambda: scheduler.has_work)
        assert scheduler.stats.extend_steps - extends >= 6
        assert [got[i] for i in range(len(prompts))] == want
        assert engine.stats().requests_running == 0
