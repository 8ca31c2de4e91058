"""Sampling inside the decode graph (CPU, ``reexec``): the static sampling buffers, and replayed
tokens equal to the eager sampler's on the same logits, greedy and seeded rows mixed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from execrt.core.batch import ForwardBatch
from execrt.core.context import RuntimeContext
from execrt.core.runners import SamplingBuffers
from execrt.core.sampler import SampleFn, Sampler, SamplingBatchInfo
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.core.worker import TpModelWorker
from execrt.models.decoder import DecoderForCausalLM
from tests.drivers import STATIC_GRAPH, graph_attention_host, make_worker, prefill, release

Checkpoint = Callable[[str], str]

#: Per row, cycled: greedy, plain temperature, top-k, top-p, both, top_k 1 (greedy again).
PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=0.9, top_k=5),
    SamplingParams(temperature=1.1, top_p=0.8),
    SamplingParams(temperature=2.0, top_k=20, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=1),
]


def info(rows: list[tuple[float, int, float, int, int]]) -> SamplingBatchInfo:
    t, k, p, seed, step = (list(c) for c in zip(*rows, strict=True))
    return SamplingBatchInfo(
        torch.tensor(t), torch.tensor(k), torch.tensor(p), torch.tensor(seed), torch.tensor(step),
        all_greedy=False,
    )  # fmt: skip


def test_sampling_buffers_copy_the_rows_and_make_the_padding_greedy() -> None:
    buf = SamplingBuffers(6, torch.device("cpu"))
    addresses = [t.data_ptr() for t in buf.view(6).__dict__.values() if isinstance(t, torch.Tensor)]
    buf.static.temperatures.fill_(9.0)  # stale rows of an earlier, larger batch
    buf.load(info([(0.5, 3, 0.9, 7, 2), (1.5, -1, 1.0, 8, 0)]), 2, 4)
    view = buf.view(4)
    assert view.temperatures.tolist() == [0.5, 1.5, 0.0, 0.0]
    assert view.top_ks[:2].tolist() == [3, -1] and view.top_ps[:2].tolist() == [
        pytest.approx(0.9),
        1.0,
    ]
    assert view.seeds[:2].tolist() == [7, 8] and view.steps[:2].tolist() == [2, 0]
    assert buf.static.temperatures[4:].tolist() == [9.0, 9.0]  # beyond the bucket: untouched
    # An all-greedy batch holds no tensors: every row of the bucket becomes greedy.
    none = torch.empty(0)
    greedy = SamplingBatchInfo(none, none.long(), none, none.long(), none.long(), all_greedy=True)
    buf.load(greedy, 3, 6)
    assert buf.view(6).temperatures.tolist() == [0.0] * 6
    after = [t.data_ptr() for t in buf.view(6).__dict__.values() if isinstance(t, torch.Tensor)]
    assert after == addresses  # loads write in place: a captured graph reads the same memory
    with pytest.raises(ValueError, match="2 rows of sampling parameters for a batch of 3"):
        buf.load(info([(0.5, 3, 0.9, 7, 2)] * 2), 3, 4)


def give_draw(monkeypatch: pytest.MonkeyPatch, fn: SampleFn | None) -> None:
    """Models built from now on bring ``fn`` as their fused draw (the fused layers stay off:
    only the sampler's path is under test)."""
    original = DecoderForCausalLM.set_fused_kernels

    def with_draw(self: DecoderForCausalLM, enabled: bool) -> None:
        original(self, enabled)
        self.sample_fn = fn

    monkeypatch.setattr(DecoderForCausalLM, "set_fused_kernels", with_draw)


#: A reexec-graph run on a graph-capable CPU attention backend, fused layers off.
GRAPH_CONFIG: dict[str, Any] = {
    "attention_backend": STATIC_GRAPH,
    "graph_backend": "reexec",
    "fused_kernels": "off",
    "max_running_requests": 6,
}


def graph_worker(
    path: str, ctx: RuntimeContext, monkeypatch: pytest.MonkeyPatch, fn: SampleFn | None, **cfg
) -> TpModelWorker:
    give_draw(monkeypatch, fn)
    config = GRAPH_CONFIG | {"kv_cache_tokens": 512} | cfg
    return make_worker(path, ctx, graph_attention_host(), **config)


def sampled_decode(
    worker: TpModelWorker, prompts: list[list[int]], seed: int
) -> tuple[list[Req], ScheduleBatch]:
    """Prefill greedily, then the decode batch of the same requests with mixed PARAMS."""
    reqs, decode = prefill(worker, prompts)
    for i, req in enumerate(reqs):
        req.sampling_params = PARAMS[(i + seed) % len(PARAMS)]
        req.sampling_seed = 1000 * seed + i
    return reqs, ScheduleBatch.of(reqs, decode.inputs, worker.memory.stager)


def _torch_draw(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    return Sampler.sample_torch(logits, info)


def draws() -> list[object]:
    """The torch draw, and the fused Triton draw where Triton runs on the CPU these tests use:
    only under the interpreter (a CUDA machine leaves it off, so the GPU suite skips it)."""
    from execrt.kernels._triton import runs_on, triton_importable

    reason = None
    if not triton_importable():
        reason = "triton is not installed"
    elif not runs_on(torch.device("cpu")):
        reason = "these tests run on the CPU, where Triton needs TRITON_INTERPRET=1"
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return [
        pytest.param("torch", id="torch-draw"),
        pytest.param("fused", id="fused-triton", marks=marks),
    ]


def draw_fn(name: str) -> SampleFn:
    if name == "torch":
        return _torch_draw
    from execrt.kernels.sampling import fused_sample

    return fused_sample


@pytest.mark.parametrize("draw", draws())
def test_replayed_tokens_are_the_eager_samplers_for_every_bucket(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None, draw: str
) -> None:
    fn = draw_fn(draw)
    ctx = RuntimeContext()
    w = graph_worker(checkpoint("dense-tied-hd64"), ctx, monkeypatch, fn)
    mr = w.model_runner
    runner = mr.decode_graph_runner
    assert runner is not None and runner.sampler is mr.sampler and mr.sampler.sample_fn is fn
    g = torch.Generator().manual_seed(0)
    differs_from_argmax = 0
    sizes = range(1, 7) if draw == "torch" else (1, 3, 6)  # the interpreter is slow
    for bs in sizes:
        prompts = [torch.randint(1, 200, (3 + i,), generator=g).tolist() for i in range(bs)]
        reqs, batch = sampled_decode(w, prompts, seed=bs)
        fb = ForwardBatch.init_new(batch)
        out = mr.forward(fb)
        assert out.can_run_graph
        ids = out.logits_output.next_token_ids
        assert ids is not None and ids.shape == (bs,) and ids.dtype == torch.int64
        logits = out.logits_output.next_token_logits  # still available for logprobs
        assert logits.shape[0] == bs
        assert fb.sampling_info is not None
        eager = Sampler(sample_fn=fn)(logits.clone(), fb.sampling_info)
        assert ids.tolist() == eager.tolist(), f"bs {bs}"
        assert mr.sample(out.logits_output, fb).tolist() == eager.tolist()
        # The draw really samples: temperature rows leave the argmax now and then.
        differs_from_argmax += int((eager != logits.argmax(-1)).sum())
        greedy = [i for i, r in enumerate(reqs) if r.sampling_params.greedy]
        assert all(eager[i] == logits[i].argmax() for i in greedy)
        release(w, reqs)
    assert differs_from_argmax > 0
    # The next step of the same rows (overlap's advanced() info) samples one step further.
    reqs, batch = sampled_decode(w, [[5, 6, 7], [8, 9], [1, 2, 3, 4]], seed=7)
    fb = ForwardBatch.init_new(batch)
    fb.sampling_info = batch.sampling_info.advanced()
    out = mr.forward(fb)
    eager = Sampler(sample_fn=fn)(out.logits_output.next_token_logits.clone(), fb.sampling_info)
    assert out.logits_output.next_token_ids is not None
    assert out.logits_output.next_token_ids.tolist() == eager.tolist()
    release(w, reqs)
    w.close()
    ctx.close()


def test_without_a_fused_draw_or_with_the_switch_off_sampling_stays_outside(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None
) -> None:
    for fn, cfg in ((None, {}), (_torch_draw, {"cuda_graph_sampling": False})):
        ctx = RuntimeContext()
        w = graph_worker(checkpoint("dense-tied-hd64"), ctx, monkeypatch, fn, **cfg)
        mr = w.model_runner
        assert mr.decode_graph_runner is not None and mr.decode_graph_runner.sampler is None
        reqs, batch = sampled_decode(w, [[5, 6, 7], [8, 9]], seed=1)
        fb = ForwardBatch.init_new(batch)
        out = mr.forward(fb)
        assert out.can_run_graph and out.logits_output.next_token_ids is None
        logits = out.logits_output.next_token_logits.clone()
        assert fb.sampling_info is not None
        assert (
            mr.sample(out.logits_output, fb).tolist()
            == mr.sampler(logits, fb.sampling_info).tolist()
        )
        release(w, reqs)
        w.close()
        ctx.close()


@pytest.mark.parametrize("draw", draws())
def test_engine_tokens_are_the_same_with_sampling_in_or_after_the_graph(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None, draw: str
) -> None:
    """Through Engine.generate (overlap on and off, seeded and greedy requests): sampling in
    the graph changes no token against sampling after the replay of the same graph."""
    from execrt import Engine

    give_draw(monkeypatch, draw_fn(draw))
    prompts = [[5, 17, 33, 2, 90], [250, 3, 77], [9] * 11]
    params = [
        SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=7, temperature=1.0, top_k=20, seed=11, ignore_eos=True),
    ]
    out = {}
    for in_graph in (True, False):
        for overlap in (True, False):
            with Engine(
                checkpoint("dense-tied-hd64"),
                plugin_host=graph_attention_host(),
                device="cpu",
                overlap_schedule=overlap,
                cuda_graph_sampling=in_graph,
                **GRAPH_CONFIG,
            ) as e:
                runner = e.worker.model_runner.decode_graph_runner
                assert runner is not None and (runner.sampler is not None) == in_graph
                out[in_graph, overlap] = [r.token_ids for r in e.generate(prompts, params)]
    assert [len(t) for t in out[True, True]] == [6, 5, 7]
    assert out[True, True] == out[True, False] == out[False, True] == out[False, False]
