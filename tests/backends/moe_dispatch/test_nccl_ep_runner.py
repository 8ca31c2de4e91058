"""nccl_ep end to end on CPU: a Qwen3-MoE worker with decode graphs (reexec) and the double."""

from __future__ import annotations

import dataclasses

import torch

from execrt.core.context import RuntimeContext
from execrt.core.interfaces import AttentionCapabilities
from execrt.core.plugins import hookimpl
from execrt.plugins.builtin import NCCL_EP_DISPATCH
from execrt.plugins.host import PluginHost
from execrt.testing.oracles import compare
from tests.drivers import make_worker, prefill_then_decode
from tests.testing import fake_backends

DOUBLE = "tests.backends.moe_dispatch.test_nccl_ep_conformance:double_dispatcher"
CPU_BF16 = frozenset({"cpu"}), frozenset({torch.bfloat16})


class Plugin:
    @hookimpl
    def execrt_register_backends(self, registry):  # type: ignore[no-untyped-def]
        registry.register(
            "attention",
            "static_graph_bf16",
            f"{fake_backends.__name__}:StaticGraphAttention",
            AttentionCapabilities(devices=CPU_BF16[0], dtypes=CPU_BF16[1], graph=True),
        )
        caps = dataclasses.replace(
            NCCL_EP_DISPATCH, devices=CPU_BF16[0], world_sizes=frozenset({1})
        )
        registry.register("moe_dispatch", "nccl_ep_double", DOUBLE, caps)


def run(path: str, dispatcher: str, graph: str) -> tuple[list[torch.Tensor], object]:
    host = PluginHost(autoload=False)
    assert host.add_plugin(Plugin(), "nccl-ep-double")
    context = RuntimeContext()
    worker = make_worker(
        path,
        context,
        host,
        attention_backend="static_graph_bf16",
        moe_dispatcher=dispatcher,
        graph_backend=graph,
        dtype="bfloat16",
        max_running_requests=4,
        max_prefill_tokens=32,
        kv_cache_tokens=256,
    )
    moe = worker.model_runner.moe_dispatcher
    prompts = [[3, 14, 15, 92], [65, 35], [89, 79, 32, 38, 46]]
    trace = prefill_then_decode(worker, prompts, steps=2)
    worker.close()
    context.close()  # the double's dispatcher asserts at close: no misuse, nothing leaked
    return trace.logits, moe


def test_decode_graphs_with_nccl_ep_match_eager_allreduce(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("moe-8x2")
    want, _ = run(path, "allreduce", "none")
    got, moe = run(path, "nccl_ep_double", "reexec")
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        cmp = compare(a, b.double())
        assert cmp.ok(2e-2), f"step {step}: {cmp}"  # bf16 paths differ by ~6e-3
    fake = moe.fake  # type: ignore[attr-defined]
    graph_updates = fake.ops("update")
    assert graph_updates, "the graph runner's buckets never reached the persistent handle"
    assert not [e for e in fake.ops("create_group", "create_handle", "update") if e.capturing]
    assert not fake.live_groups() and not fake.live_handles()
