"""DecodeCudaGraphRunner on CPU: re-execution graphs, a graph-capable torch attention backend.

The runner's bucket, pad and trim logic is the same on every device; the reexec backend replays
by re-running the captured function on the static buffers, so a wrong fill shows here too.
"""

from __future__ import annotations

import logging

import pytest
import torch

from execrt.core.batch import ForwardBatch
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import ShapeKey
from execrt.core.plugins import hookimpl
from execrt.core.runners import capture_batch_sizes
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.core.worker import TpModelWorker
from execrt.plugins.host import PluginHost
from tests.drivers import make_worker
from tests.testing import fake_backends

STATIC = f"{fake_backends.__name__}:StaticGraphAttention"


class GraphAttentionPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):  # type: ignore[no-untyped-def]
        registry.register("attention", "static_graph", STATIC, fake_backends.GRAPH_CAPS)


def host() -> PluginHost:
    h = PluginHost(autoload=False)
    assert h.add_plugin(GraphAttentionPlugin(), "graph-attention")
    return h


def worker(path: str, context: RuntimeContext, graph: str, **config) -> TpModelWorker:  # type: ignore[no-untyped-def]
    return make_worker(
        path,
        context,
        host(),
        attention_backend="static_graph",
        graph_backend=graph,
        max_running_requests=6,
        kv_cache_tokens=512,
        **config,
    )


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 12, 16, 24, 32, 40]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(10, (3, 1, 3, 50)) == [1, 3, 10]
    with pytest.raises(ValueError, match="must be >= 1"):
        capture_batch_sizes(10, (0, 2))


def decode_batches(w: TpModelWorker, prompts: list[list[int]]) -> tuple[list[Req], ScheduleBatch]:
    mr = w.model_runner
    pools = (mr.req_to_token_pool, mr.token_to_kv_pool_allocator, mr.device)
    reqs = [Req(i, p, SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    batch = ScheduleBatch.for_extend(reqs, [len(p) for p in prompts], *pools)
    assert batch is not None
    result = w.forward_batch_generation(batch)
    for req, tok in zip(reqs, result.next_token_ids.tolist(), strict=True):
        req.kv_len = req.seq_len
        req.output_ids.append(int(tok))
    decode = ScheduleBatch.for_decode(reqs, *pools)
    assert decode is not None
    return reqs, decode


@pytest.mark.parametrize("name", ["dense-tied-hd64", "moe-8x2"])
def test_every_bucket_matches_eager_and_padding_writes_only_slot_zero(checkpoint, name) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint(name)
    g = torch.Generator().manual_seed(0)
    for bs in range(1, 7):
        prompts = [
            torch.randint(1, 200, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 9, (bs,), generator=g)
        ]
        results = {}
        for graph in ("reexec", "none"):
            ctx = RuntimeContext()
            w = worker(path, ctx, graph)
            mr = w.model_runner
            assert (mr.decode_graph_runner is not None) == (graph == "reexec")
            reqs, decode = decode_batches(w, prompts)
            k_before = [k.clone() for k in mr.kv_cache.k_buffers]
            fb = ForwardBatch.init_new(decode, mr.attn_backend)
            out = mr.forward(fb)
            assert out.can_run_graph == (graph == "reexec")
            results[graph] = out.logits_output.next_token_logits.clone()
            if graph == "reexec":
                runner = mr.decode_graph_runner
                assert runner is not None
                bucket = runner.bucket(bs)
                assert bucket == min(b for b in runner.capture_bs if b >= bs)
                written = set(decode.out_cache_loc.tolist())
                for layer, (before, after) in enumerate(
                    zip(k_before, mr.kv_cache.k_buffers, strict=True)
                ):
                    changed = set((before != after).flatten(1).any(1).nonzero().flatten().tolist())
                    assert changed <= written | {0}, (
                        f"layer {layer}: padding wrote slots {sorted(changed - written - {0})}"
                    )
                    assert written <= changed
                assert out.logits_output.next_token_logits.shape[0] == bs  # trimmed
            w.close()
            ctx.close()
        assert torch.allclose(results["reexec"], results["none"], rtol=1e-5, atol=1e-5), bs
        assert torch.equal(results["reexec"].argmax(-1), results["none"].argmax(-1))


def test_larger_batches_and_extends_run_eagerly_and_say_so_once(checkpoint, caplog) -> None:  # type: ignore[no-untyped-def]
    ctx = RuntimeContext()
    w = worker(checkpoint("dense-tied-hd64"), ctx, "reexec", cuda_graph_max_bs=4)
    mr = w.model_runner
    assert mr.decode_graph_runner is not None and mr.decode_graph_runner.capture_bs == [1, 2, 4]
    with caplog.at_level(logging.INFO, logger="execrt.core.runners"):
        for _ in range(2):
            reqs, decode = decode_batches(w, [[1, 2, 3]] * 5)
            out = mr.forward(ForwardBatch.init_new(decode, mr.attn_backend))
            assert not out.can_run_graph
            for req in reqs:
                w.model_runner.token_to_kv_pool_allocator.free(
                    mr.req_to_token_pool.req_to_token[req.req_pool_idx, : req.seq_len].long()
                )
                mr.req_to_token_pool.free(req.req_pool_idx)
    fallbacks = [r.message for r in caplog.records if "falling back to eager" in r.message]
    assert len(fallbacks) == 2, fallbacks  # one extend notice, one too-large notice
    assert any("exceeds the largest graph (4)" in m for m in fallbacks)
    w.close()
    ctx.close()


def test_cleanup_then_recapture_replays_correctly(checkpoint) -> None:  # type: ignore[no-untyped-def]
    ctx = RuntimeContext()
    w = worker(checkpoint("dense-tied-hd64"), ctx, "reexec")
    mr = w.model_runner
    runner = mr.decode_graph_runner
    assert runner is not None
    reqs, decode = decode_batches(w, [[5, 6, 7], [8, 9]])
    first = mr.forward(ForwardBatch.init_new(decode, mr.attn_backend)).logits_output
    first_logits = first.next_token_logits.clone()
    runner.cleanup()
    runner.cleanup()
    assert not any(runner.backend.has(ShapeKey(b)) for b in runner.capture_bs)
    runner.recapture()
    again = mr.forward(ForwardBatch.init_new(decode, mr.attn_backend))
    assert again.can_run_graph and torch.equal(again.logits_output.next_token_logits, first_logits)
    w.close()
    ctx.close()
    assert not ctx.has("graph_backend")


def test_auto_and_explicit_graphs_with_a_backend_that_cannot_capture(checkpoint) -> None:  # type: ignore[no-untyped-def]
    from execrt.core.errors import BackendUnavailableError

    ctx = RuntimeContext()
    w = make_worker(checkpoint("dense-tied-hd64"), ctx, attention_backend="torch_native")
    graph = next(r for r in w.model_runner.resolution.resolutions if r.kind == "graph")
    assert graph.chosen is None
    assert w.model_runner.decode_graph_runner is None
    w.close()
    with pytest.raises(BackendUnavailableError, match="'torch_native' is not graph-capable"):
        make_worker(
            checkpoint("dense-tied-hd64"),
            ctx,
            attention_backend="torch_native",
            graph_backend="reexec",
        )
    ctx.close()
