"""GPU, bf16: the decode-step options change no result (triton and flashinfer, eager and graph).

- ``overlap_schedule`` on vs off: the same kernels on the same inputs, so the tokens are
  identical, greedy and seeded sampling alike, through ``Engine.generate``.
- ``fused_kernels`` on vs off: different (bf16) arithmetic, so both runs are fed the same
  tokens and compared step by step: logits within bf16 tolerance, and the same greedy token
  wherever the reference's top-2 margin is wider than the logits' disagreement.
"""

from __future__ import annotations

import pytest
import torch

from execrt.core.context import RuntimeContext
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine
from execrt.plugins.host import PluginHost
from tests.drivers import Trace, assert_traces_agree, make_worker, prefill_then_decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GRAPHS = ["none", "full_cuda_graph"]
BACKENDS = ["triton", "flashinfer"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=2048,
        hidden_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    models = {
        "dense": Qwen3ForCausalLM(Qwen3Config(intermediate_size=1024, **common)),
        "moe": Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                intermediate_size=1024,
                moe_intermediate_size=256,
                num_experts=16,
                num_experts_per_tok=4,
                **common,
            )
        ),
    }
    out = {}
    for name, model in models.items():
        out[name] = str(tmp_path_factory.mktemp(f"paths-{name}"))
        model.to(torch.bfloat16).save_pretrained(out[name])
    return out


def _usable(backend: str) -> None:
    missing = PluginHost(autoload=False).registry.get("attention", backend).unusable_here()
    if missing:
        pytest.skip("; ".join(missing))


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 2000, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 400, (n,), generator=g)
    ]


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_overlap_changes_no_token(checkpoints, model, backend, graph) -> None:  # type: ignore[no-untyped-def]
    _usable(backend)
    prompts = _prompts(6, seed=1)
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=17, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=0.7, top_k=20, seed=6, ignore_eos=True),
    ] * 2
    tokens = {}
    for overlap in (False, True):
        with Engine(
            checkpoints[model],
            device="cuda",
            attention_backend=backend,
            graph_backend=graph,
            overlap_schedule=overlap,
            max_running_requests=8,
            kv_cache_tokens=8192,
        ) as engine:
            results = engine.generate(prompts, params)
        assert all(r.error is None for r in results)
        tokens[overlap] = [r.token_ids for r in results]
    assert tokens[True] == tokens[False]
    assert [len(t) for t in tokens[True]] == [p.max_new_tokens for p in params]


def _trace(
    path: str, backend: str, graph: str, fused: str, follow: list[list[int]] | None
) -> Trace:
    ctx = RuntimeContext()
    worker = make_worker(
        path,
        ctx,
        device="cuda",
        attention_backend=backend,
        graph_backend=graph,
        fused_kernels=fused,
        max_running_requests=8,
        kv_cache_tokens=8192,
    )
    fused_modules = [m.fused for m in worker.model_runner.model.modules() if hasattr(m, "fused")]
    assert fused_modules and all(fused_modules) == (fused == "on")
    try:
        return prefill_then_decode(worker, _prompts(5, seed=2), steps=8, follow=follow)
    finally:
        worker.close()
        ctx.close()


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_fused_kernels_match_the_torch_layers(checkpoints, model, backend, graph) -> None:  # type: ignore[no-untyped-def]
    _usable(backend)
    ref = _trace(checkpoints[model], backend, graph, "off", None)
    got = _trace(checkpoints[model], backend, graph, "on", ref.tokens)
    assert_traces_agree(got, ref)
