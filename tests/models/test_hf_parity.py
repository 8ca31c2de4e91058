"""Our Llama / Qwen2 / Qwen3 / Qwen3-MoE logits and greedy tokens match transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from execrt.core.config import RuntimeConfig
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.core.worker import TpModelWorker
from execrt.engine import Engine
from tests.checkpoints import build_hf_model

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77], [9] * 13 + [100, 101]]
MAX_REL_ERR = 1e-4


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def step(worker: TpModelWorker, batch: ScheduleBatch, reqs: list[Req]) -> torch.Tensor:
    result = worker.forward_batch_generation(batch)
    for req, n, tok in zip(reqs, batch.extend_lens, result.next_token_ids.tolist(), strict=True):
        req.kv_len += n
        req.output_ids.append(int(tok))
    return result.logits_output.next_token_logits


def test_logits_match_transformers(
    checkpoint, checkpoint_name, plugin_host, runtime_context
) -> None:
    path = checkpoint(checkpoint_name)
    hf = build_hf_model(checkpoint_name)
    worker = TpModelWorker(path, RuntimeConfig(device="cpu"), runtime_context, plugin_host)
    mr = worker.model_runner
    reqs = [Req(i, p, SamplingParams(temperature=0)) for i, p in enumerate(PROMPTS)]
    batch = ScheduleBatch.for_extend(
        reqs,
        [len(p) for p in PROMPTS],
        mr.req_to_token_pool,
        mr.token_to_kv_pool_allocator,
        mr.device,
    )
    assert batch is not None
    batch.return_full_logits = True
    result = worker.forward_batch_generation(batch)
    errors = []
    offset = 0
    with torch.no_grad():
        for prompt in PROMPTS:
            ref = hf(torch.tensor([prompt])).logits[0]  # [n, V]
            errors.append(
                rel_err(result.logits_output.full_logits[offset : offset + len(prompt)], ref)
            )
            offset += len(prompt)
    for req, tok in zip(reqs, result.next_token_ids.tolist(), strict=True):
        req.kv_len = req.seq_len
        req.output_ids.append(int(tok))
    for _ in range(8):
        batch = ScheduleBatch.for_decode(
            reqs, mr.req_to_token_pool, mr.token_to_kv_pool_allocator, mr.device
        )
        assert batch is not None
        ours = step(worker, batch, reqs)
        with torch.no_grad():
            for i, req in enumerate(reqs):
                ref = hf(torch.tensor([req.fill_ids[:-1]])).logits[0, -1]
                errors.append(rel_err(ours[i], ref))
    worker.close()
    assert len(errors) == len(PROMPTS) * 9
    assert max(errors) <= MAX_REL_ERR, f"max relative error {max(errors):.2e}"


@pytest.mark.parametrize(
    "name", ["dense-tied-hd64", "moe-8x2", "llama-untied-bias-llama3", "qwen2-untied"]
)
def test_greedy_generation_matches_transformers(checkpoint, name: str, plugin_host) -> None:
    path = checkpoint(name)
    hf = build_hf_model(name)
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    with Engine(path, device="cpu", plugin_host=plugin_host) as engine:
        results = engine.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert result.token_ids == ref
