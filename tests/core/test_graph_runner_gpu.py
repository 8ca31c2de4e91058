"""GPU: decode graphs through ModelRunner (full_cuda_graph; triton, flashinfer; dense, MoE).

Replay must equal an eager run of the same padded batch with the same (graph) metadata
bitwise: the graph launches the very kernels eager would, on the very buffers.
"""

from __future__ import annotations

import gc

import pytest
import torch

from execrt.core.batch import ForwardBatch
from execrt.core.context import RuntimeContext
from execrt.core.runners import attention_step
from execrt.core.worker import TpModelWorker
from execrt.plugins.host import PluginHost
from tests.drivers import make_worker, prefill, rel_err, release

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BACKENDS = ["triton", "flashinfer"]


@pytest.fixture(scope="module")
def gpu_checkpoints(tmp_path_factory) -> dict[str, str]:  # type: ignore[no-untyped-def]
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
    out = {}
    for name, (cfg, cls) in {
        "dense": (Qwen3Config(intermediate_size=1024, **common), Qwen3ForCausalLM),
        "moe": (
            Qwen3MoeConfig(
                intermediate_size=1024,
                moe_intermediate_size=256,
                num_experts=16,
                num_experts_per_tok=4,
                **common,
            ),
            Qwen3MoeForCausalLM,
        ),
    }.items():
        path = str(tmp_path_factory.mktemp(f"gpu-{name}"))
        cls(cfg).to(torch.bfloat16).save_pretrained(path)
        out[name] = path
    return out


def _skip_unless_usable(backend: str) -> None:
    missing = PluginHost(autoload=False).registry.get("attention", backend).unusable_here()
    if missing:
        pytest.skip("; ".join(missing))


def _graph_worker(path: str, ctx: RuntimeContext, backend: str, **extra) -> TpModelWorker:  # type: ignore[no-untyped-def]
    return make_worker(
        path,
        ctx,
        device="cuda",
        attention_backend=backend,
        graph_backend="full_cuda_graph",
        max_running_requests=20,
        kv_cache_tokens=16384,
        **extra,
    )


def _prompts(bs: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 300, (bs,), generator=g)
    return [torch.randint(1, 2000, (int(n),), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_equals_eager_bitwise_for_every_bucket(gpu_checkpoints, backend, model) -> None:  # type: ignore[no-untyped-def]
    _skip_unless_usable(backend)
    ctx = RuntimeContext()
    w = _graph_worker(gpu_checkpoints[model], ctx, backend)
    mr = w.model_runner
    runner = mr.decode_graph_runner
    assert runner is not None, mr.resolution.describe()
    for bs in sorted({*runner.capture_bs, 3, 7, 19}):
        reqs, dec = prefill(w, _prompts(bs, seed=bs))
        fb = ForwardBatch.init_new(dec)
        out = mr.forward(fb)
        assert out.can_run_graph
        got = out.logits_output.next_token_logits.clone()
        with torch.inference_mode():
            padded = mr.input_buffers.load_padded(fb, runner.bucket(bs), runner.fill)
            step = attention_step(mr.attn_backend, mr.attn_backend.plan_graph(padded), padded)
            ref = mr.model(padded, step).next_token_logits[:bs]
        assert torch.equal(got, ref), f"bs {bs}: max |diff| {(got - ref).abs().max().item():.3g}"
        eager = mr.eager_runner.execute(ForwardBatch.init_new(dec))
        err = rel_err(got, eager.next_token_logits)
        assert err < 2e-2, f"bs {bs}: graph vs unpadded eager relative error {err:.3g}"
        release(w, reqs)
    w.close()
    ctx.close()


def test_recapture_cycles_do_not_grow_memory(gpu_checkpoints) -> None:  # type: ignore[no-untyped-def]
    _skip_unless_usable("triton")
    ctx = RuntimeContext()
    w = _graph_worker(gpu_checkpoints["moe"], ctx, "triton", cuda_graph_bs="1,2,4,8")
    runner = w.model_runner.decode_graph_runner
    assert runner is not None
    sizes = []
    for _ in range(50):
        runner.recapture()
        torch.cuda.synchronize()
        gc.collect()
        sizes.append(torch.cuda.memory_allocated())
    assert max(sizes[1:]) <= sizes[1], (
        f"allocated memory grew over recaptures: {sizes[:3]}..{sizes[-3:]}"
    )
    w.close()
    ctx.close()


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_the_graph_samples_the_eager_samplers_tokens(gpu_checkpoints, model) -> None:  # type: ignore[no-untyped-def]
    """With the fused draw the graph runs the sampler: its tokens are the eager Sampler's on
    the replayed logits, greedy and seeded rows mixed, all-greedy batches and later steps."""
    from execrt.core.sampler import Sampler
    from execrt.core.schedule import ScheduleBatch
    from tests.core.test_graph_sampling import PARAMS

    _skip_unless_usable("triton")
    ctx = RuntimeContext()
    w = _graph_worker(gpu_checkpoints[model], ctx, "triton")
    mr = w.model_runner
    runner = mr.decode_graph_runner
    assert runner is not None and runner.sampler is not None, "fused draw not in the graph"
    eager_sampler = Sampler(sample_fn=mr.sampler.sample_fn)
    for bs in sorted({*runner.capture_bs, 3, 7, 19}):
        for greedy in (False, True):
            reqs, dec = prefill(w, _prompts(bs, seed=bs))
            if not greedy:
                for i, req in enumerate(reqs):
                    req.sampling_params = PARAMS[(i + bs) % len(PARAMS)]
                    req.sampling_seed = 1000 * bs + i
            batch = ScheduleBatch.of(reqs, dec.inputs, w.memory.stager)
            fb = ForwardBatch.init_new(batch)
            out = mr.forward(fb)
            assert out.can_run_graph and out.logits_output.next_token_ids is not None
            got = out.logits_output.next_token_ids.clone()
            logits = out.logits_output.next_token_logits.clone()
            assert batch.sampling_info.all_greedy == greedy
            want = eager_sampler(logits, batch.sampling_info)
            assert got.tolist() == want.tolist(), f"bs {bs} greedy {greedy}"
            if greedy:
                assert got.tolist() == logits.argmax(-1).tolist()
            # The same rows one step later (overlap's advanced info; the KV slot is reused).
            fb.sampling_info = batch.sampling_info.advanced()
            out = mr.forward(fb)
            assert out.logits_output.next_token_ids is not None
            logits = out.logits_output.next_token_logits.clone()
            want = eager_sampler(logits, fb.sampling_info)
            assert out.logits_output.next_token_ids.tolist() == want.tolist(), f"bs {bs} step 2"
            release(w, reqs)
    w.close()
    ctx.close()
