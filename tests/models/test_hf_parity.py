"""Our Llama / Qwen2 / Qwen3 / Qwen3-MoE logits and greedy tokens match transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from execrt.core.context import RuntimeContext
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine
from tests.checkpoints import build_hf_model
from tests.drivers import hf_trace_errors, make_worker, prefill_then_decode, rel_err

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77], [9] * 13 + [100, 101]]
MAX_REL_ERR = 1e-4


def test_logits_match_transformers(
    checkpoint, checkpoint_name, plugin_host, runtime_context
) -> None:
    hf = build_hf_model(checkpoint_name)
    worker = make_worker(checkpoint(checkpoint_name), runtime_context, plugin_host)
    trace = prefill_then_decode(worker, PROMPTS, steps=8, full_logits=True)
    worker.close()
    errors = hf_trace_errors(hf, PROMPTS, trace)
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


@pytest.mark.parametrize("name", ["dense-tied-hd64", "moe-8x2", "qwen2-untied"])
def test_fused_kernels_change_no_greedy_token(checkpoint, name: str, plugin_host) -> None:
    """The Triton layer kernels (interpreted on CPU) against their torch references: fp32 logits
    within 1e-5 and the same greedy tokens, prefill and decode."""
    pytest.importorskip("triton")
    from execrt.kernels._triton import interpreter_enabled

    if not interpreter_enabled():  # a CUDA machine: the GPU suites compare the kernels there
        pytest.skip("runs on CPU under the Triton interpreter, which is off where CUDA is")
    traces = {}
    for mode in ("off", "on"):
        ctx = RuntimeContext()
        worker = make_worker(checkpoint(name), ctx, plugin_host, fused_kernels=mode)
        fused = [m.fused for m in worker.model_runner.model.modules() if hasattr(m, "fused")]
        assert fused and all(fused) == (mode == "on")
        traces[mode] = prefill_then_decode(worker, PROMPTS[:2], steps=4)
        worker.close()
        ctx.close()
    assert traces["on"].tokens == traces["off"].tokens
    for a, b in zip(traces["on"].logits, traces["off"].logits, strict=True):
        assert rel_err(a, b) <= 1e-5
