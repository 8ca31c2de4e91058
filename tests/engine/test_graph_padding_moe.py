"""Padded decode-graph rows route to no expert, in a whole Qwen3-MoE model (reexec, CPU).

The graph runner pads a decode batch up to its bucket; the model's router must send the
padding rows (at or past ``num_token_non_padded``, a device count the replay reads) nowhere,
or they would add load to experts and, with EP, traffic between ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from execrt.core.batch import ForwardBatch
from execrt.core.context import RuntimeContext
from execrt.models.layers import SparseMoE
from tests.drivers import STATIC_GRAPH, graph_attention_host, make_worker, prefill, release


@pytest.mark.parametrize("name", ["moe-8x2", "moe-mixed-layers"])
def test_padded_rows_get_topk_id_minus_one_in_every_replay(checkpoint, name) -> None:  # type: ignore[no-untyped-def]
    ctx = RuntimeContext()
    w = make_worker(
        checkpoint(name),
        ctx,
        graph_attention_host(),
        attention_backend=STATIC_GRAPH,
        graph_backend="reexec",
        moe_dispatcher="allreduce",
        max_running_requests=6,
        kv_cache_tokens=256,
    )
    mr = w.model_runner
    runner, dispatcher = mr.decode_graph_runner, mr.moe_dispatcher
    assert runner is not None and runner.capture_bs == [1, 2, 4, 6]
    moe_layers = [m for m in mr.model.modules() if isinstance(m, SparseMoE)]
    assert moe_layers and all(m.dispatcher is dispatcher for m in moe_layers)
    num_experts = dispatcher.init.num_experts
    seen: list[torch.Tensor] = []  # topk_ids [T, K] of every dispatch, in call order
    dispatch = dispatcher.dispatch

    def recording(hidden: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor) -> Any:
        seen.append(topk_ids.clone())
        return dispatch(hidden, topk_ids, weights)

    dispatcher.dispatch = recording  # type: ignore[method-assign]

    # Capture runs every bucket on padding rows only: nothing may be routed.
    runner.recapture()
    assert [ids.shape[0] for ids in seen] == [b for b in (6, 4, 2, 1) for _ in moe_layers]
    assert all(bool((ids == -1).all()) for ids in seen), "capture routed padding rows"

    # Replays: the same bucket with another count of real rows masks exactly the new padding.
    for bs in (3, 4, 1, 5, 3):
        reqs, decode = prefill(w, [[7 + bs, 3, 11 * bs]] * bs)
        seen.clear()
        out = mr.forward(ForwardBatch.init_new(decode))
        assert out.can_run_graph
        bucket = runner.bucket(bs)
        assert len(seen) == len(moe_layers), f"bs {bs}: {len(seen)} dispatches"
        for layer, ids in enumerate(seen):
            where = f"bs {bs} (bucket {bucket}) MoE layer {layer}"
            assert ids.shape == (bucket, moe_layers[layer].top_k), where
            real, padding = ids[:bs], ids[bs:]
            assert bool(((real >= 0) & (real < num_experts)).all()), f"{where}: {real.tolist()}"
            assert bool((padding == -1).all()), f"{where}: padding routed to {padding.tolist()}"
        release(w, reqs)
    w.close()
    ctx.close()
