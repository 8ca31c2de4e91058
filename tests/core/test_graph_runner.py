"""DecodeCudaGraphRunner on CPU: re-execution graphs, a graph-capable torch attention backend.

The runner's bucket, pad and trim logic is the same on every device; the reexec backend replays
by re-running the captured function on the static buffers, so a wrong fill shows here too.
"""

from __future__ import annotations

import logging

import pytest
import torch

from execrt.backends.graph.reexec import ReexecGraphBackend
from execrt.core.batch import ForwardBatch
from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.errors import BackendUnavailableError, ConfigError
from execrt.core.interfaces import ShapeKey
from execrt.core.runners import attention_step, capture_batch_sizes
from execrt.core.worker import TpModelWorker
from tests.drivers import STATIC_GRAPH, graph_attention_host, make_worker, prefill, release


def worker(path: str, context: RuntimeContext, graph: str, **config) -> TpModelWorker:  # type: ignore[no-untyped-def]
    return make_worker(
        path,
        context,
        graph_attention_host(),
        **{
            "attention_backend": STATIC_GRAPH,
            "graph_backend": graph,
            "max_running_requests": 6,
            "kv_cache_tokens": 512,
        }
        | config,
    )


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 12, 16, 24, 32, 40]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(10, (3, 1, 3, 50)) == [1, 3, 10]
    with pytest.raises(ValueError, match="must be >= 1"):
        capture_batch_sizes(10, (0, 2))


@pytest.mark.parametrize("value", ["1,x", "0,2", "-1", "1;2", "2.5"])
def test_cuda_graph_bs_that_does_not_parse_is_refused_with_an_example(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        RuntimeConfig(cuda_graph_bs=value)
    assert str(info.value) == (
        f"config: cuda_graph_bs {value!r} must be comma-separated integers >= 1, e.g. '1,2,4,8'"
    )
    assert RuntimeConfig(cuda_graph_bs=" 8, 1,,2 ").graph_batch_sizes() == (8, 1, 2)


@pytest.mark.parametrize(
    ("config", "capture_bs"),
    [
        ({}, [1, 2, 4, 6]),  # the default list, capped at max_running_requests 6
        ({"cuda_graph_max_bs": 16}, [1, 2, 4, 6]),  # more than can ever run: capped
        ({"cuda_graph_bs": "16,3,1,8"}, [1, 3, 6]),  # larger than the cap: dropped, cap added
    ],
)
def test_capture_sizes_are_capped_by_max_running_requests(  # type: ignore[no-untyped-def]
    checkpoint, config, capture_bs, caplog
) -> None:
    with RuntimeContext() as ctx, caplog.at_level("WARNING", logger="execrt.core.model_runner"):
        w = worker(checkpoint("dense-tied-hd64"), ctx, "reexec", **config)
        runner = w.model_runner.decode_graph_runner
        assert runner is not None and runner.capture_bs == capture_bs
        assert all(runner.backend.has(ShapeKey(b)) for b in capture_bs)
        w.close()
    # Sizes the user asked for and does not get are named; the default list's are not.
    warned = [r.getMessage() for r in caplog.records if "not captured" in r.getMessage()]
    if "cuda_graph_bs" in config:
        assert warned == [
            "cuda_graph_bs: 8, 16 not captured: no decode batch exceeds 6 "
            "(max_running_requests 6, cuda_graph_max_bs auto)"
        ]
    else:
        assert warned == []


def test_buckets_are_captured_largest_first_and_recaptured_alike(checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    order: list[int] = []
    capture = ReexecGraphBackend.capture

    def recording(self, key, fn):  # type: ignore[no-untyped-def]
        order.append(key.batch_size)
        return capture(self, key, fn)

    monkeypatch.setattr(ReexecGraphBackend, "capture", recording)
    with RuntimeContext() as ctx:
        w = worker(checkpoint("dense-tied-hd64"), ctx, "reexec")
        runner = w.model_runner.decode_graph_runner
        assert runner is not None
        assert order == [6, 4, 2, 1]
        runner.recapture()
        assert order == [6, 4, 2, 1] * 2
        w.close()


@pytest.mark.parametrize("name", ["dense-tied-hd64", "moe-8x2"])
def test_every_bucket_matches_eager_and_padding_writes_only_slot_zero(checkpoint, name) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint(name)
    contexts = {graph: RuntimeContext() for graph in ("reexec", "none")}
    workers = {graph: worker(path, ctx, graph) for graph, ctx in contexts.items()}
    mr = workers["reexec"].model_runner
    runner = mr.decode_graph_runner
    assert runner is not None and runner.capture_bs == [1, 2, 4, 6]
    assert workers["none"].model_runner.decode_graph_runner is None
    g = torch.Generator().manual_seed(0)
    for bs in range(1, 7):
        prompts = [
            torch.randint(1, 200, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 9, (bs,), generator=g)
        ]
        # Unpadded eager: the same prompts through a worker without graphs.
        eager_worker = workers["none"]
        reqs, decode = prefill(eager_worker, prompts)
        eager_mr = eager_worker.model_runner
        out = eager_mr.forward(ForwardBatch.init_new(decode))
        assert not out.can_run_graph
        eager = out.logits_output.next_token_logits.clone()
        release(eager_worker, reqs)

        reqs, decode = prefill(workers["reexec"], prompts)
        kv = {"K": mr.kv_cache.k_buffers, "V": mr.kv_cache.v_buffers}
        before = {kind: [b.clone() for b in buffers] for kind, buffers in kv.items()}
        fb = ForwardBatch.init_new(decode)
        out = mr.forward(fb)
        assert out.can_run_graph
        replayed = out.logits_output.next_token_logits.clone()
        assert replayed.shape[0] == bs  # trimmed
        bucket = runner.bucket(bs)
        assert bucket == min(b for b in runner.capture_bs if b >= bs)
        # Padded rows write K and V at slot 0 only; every real row writes its own slot.
        written = set(decode.inputs.out_cache_loc.tolist())
        for kind, buffers in kv.items():
            for layer, (old, new) in enumerate(zip(before[kind], buffers, strict=True)):
                where = f"bs {bs} {kind} layer {layer}"
                changed = set((old != new).flatten(1).any(1).nonzero().flatten().tolist())
                assert changed <= written | {0}, f"{where}: padding wrote {changed - written - {0}}"
                assert written <= changed, f"{where}: slots {written - changed} not written"
        # The replay is the eager run of the same padded batch with the same graph metadata,
        # bit for bit; the unpadded eager run (other metadata) agrees within rounding.
        with torch.inference_mode():
            padded = mr.input_buffers.load_padded(fb, bucket, runner.fill)
            step = attention_step(mr.attn_backend, mr.attn_backend.plan_graph(padded), padded)
            ref = mr.model(padded, step).next_token_logits[:bs]
        diff = (replayed - ref).abs().max().item()
        assert torch.equal(replayed, ref), f"bs {bs} (bucket {bucket}): max |diff| {diff:.3g}"
        assert torch.allclose(replayed, eager, rtol=1e-5, atol=1e-5), bs
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1)), bs
        release(workers["reexec"], reqs)
    for graph, w in workers.items():
        w.close()
        contexts[graph].close()


def test_larger_batches_and_extends_run_eagerly_and_say_so_once(checkpoint, caplog) -> None:  # type: ignore[no-untyped-def]
    ctx = RuntimeContext()
    w = worker(checkpoint("dense-tied-hd64"), ctx, "reexec", cuda_graph_max_bs=4)
    mr = w.model_runner
    assert mr.decode_graph_runner is not None and mr.decode_graph_runner.capture_bs == [1, 2, 4]
    with caplog.at_level(logging.INFO, logger="execrt.core.runners"):
        for _ in range(2):
            reqs, decode = prefill(w, [[1, 2, 3]] * 5)
            out = mr.forward(ForwardBatch.init_new(decode))
            assert not out.can_run_graph
            release(w, reqs)
    fallbacks = [r.message for r in caplog.records if "falling back to eager" in r.message]
    assert len(fallbacks) == 2, fallbacks  # one extend notice, one too-large notice
    assert any("extend batches run eagerly (graphs capture decode)" in m for m in fallbacks)
    assert any("decode batch of 5 exceeds the largest graph (4)" in m for m in fallbacks)
    w.close()
    ctx.close()


def test_cleanup_then_recapture_replays_correctly(checkpoint) -> None:  # type: ignore[no-untyped-def]
    ctx = RuntimeContext()
    w = worker(checkpoint("dense-tied-hd64"), ctx, "reexec")
    mr = w.model_runner
    runner = mr.decode_graph_runner
    assert runner is not None
    reqs, decode = prefill(w, [[5, 6, 7], [8, 9]])
    first = mr.forward(ForwardBatch.init_new(decode)).logits_output
    first_logits = first.next_token_logits.clone()
    runner.cleanup()
    runner.cleanup()
    assert not any(runner.backend.has(ShapeKey(b)) for b in runner.capture_bs)
    runner.recapture()
    again = mr.forward(ForwardBatch.init_new(decode))
    assert again.can_run_graph and torch.equal(again.logits_output.next_token_logits, first_logits)
    w.close()
    ctx.close()
    assert not ctx.has("graph_backend")


def test_auto_and_explicit_graphs_with_a_backend_that_cannot_capture(checkpoint) -> None:  # type: ignore[no-untyped-def]
    ctx = RuntimeContext()
    w = make_worker(checkpoint("dense-tied-hd64"), ctx, attention_backend="torch_native")
    resolution = w.model_runner.resolution
    graph = next(r for r in resolution.resolutions if r.kind == "graph")
    assert (graph.requested, graph.chosen) == ("auto", None)
    reason = "attention backend 'torch_native' is not graph-capable: decode runs eagerly"
    assert graph.note == reason
    assert f"graph: requested 'auto' -> none ({reason})" in resolution.describe()
    assert w.model_runner.decode_graph_runner is None
    w.close()
    with pytest.raises(BackendUnavailableError, match="'torch_native' is not graph-capable"):
        make_worker(
            checkpoint("dense-tied-hd64"),
            ctx,
            attention_backend="torch_native",
            graph_backend="reexec",
        )
    # A named backend that the device refuses too says so beside the attention's reason (it
    # named the attention alone, so the user learned the second reason only after fixing it).
    with pytest.raises(BackendUnavailableError) as info:
        make_worker(
            checkpoint("dense-tied-hd64"),
            ctx,
            attention_backend="torch_native",
            graph_backend="full_cuda_graph",
        )
    assert info.value.reasons == [
        "attention backend 'torch_native' is not graph-capable",
        "device cpu unsupported (supported: cuda)",
    ]
    ctx.close()
    # An unknown name is reported as such, not as a capture problem of the attention backend.
    ctx = RuntimeContext()
    with pytest.raises(BackendUnavailableError, match=r"'nope' unavailable: not registered \("):
        make_worker(
            checkpoint("dense-tied-hd64"),
            ctx,
            attention_backend="torch_native",
            graph_backend="nope",
        )
    ctx.close()


@pytest.mark.parametrize("slow", [True, False])
def test_a_slow_capture_reports_each_bucket_and_a_fast_one_stays_quiet(  # type: ignore[no-untyped-def]
    checkpoint, monkeypatch, slow
) -> None:
    from execrt.core import runners

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    progress = logging.getLogger("execrt.progress")
    handler = Collect()
    # setLevel, not a patched attribute: the logger caches isEnabledFor answers, and an earlier
    # capture in this process may have cached INFO as off. Another test may also have disabled
    # existing loggers (a logging dictConfig).
    old_level = progress.level
    progress.setLevel(logging.INFO)
    monkeypatch.setattr(progress, "disabled", False)
    monkeypatch.setattr(runners, "SLOW_CAPTURE_S", 0.0 if slow else 1e9)
    progress.addHandler(handler)
    try:
        with RuntimeContext() as ctx:
            worker(checkpoint("dense-tied-hd64"), ctx, "reexec").close()
    finally:
        progress.removeHandler(handler)
        progress.setLevel(old_level)
    if not slow:
        assert lines == []
        return
    assert [line.rsplit(" done after ", 1)[0] for line in lines] == [
        f"graph capture: bucket {i} of 4 (batch size {bs})" for i, bs in enumerate([6, 4, 2, 1], 1)
    ]
    assert all(line.endswith(" s") for line in lines)
