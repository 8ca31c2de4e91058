"""nccl_ep on a GPU machine: the availability reasons there, and real NCCL EP when it can run.

Run on the GPU machine: ``python -m pytest tests/backends/moe_dispatch/test_nccl_ep_gpu.py -rs``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from execrt.backends.moe_dispatch import nccl_ep_probe as probe
from execrt.core.interfaces import MoERequirements
from execrt.inventory import usability
from execrt.plugins.host import PluginHost

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def expected_reasons() -> list[str]:
    """What the probe must say here, derived from the machine without the probe's help."""
    out = []
    if importlib.util.find_spec("nccl") is None or importlib.util.find_spec("nccl.ep") is None:
        out.append("module 'nccl.ep' not installed (pip install execrt[nccl-ep])")
    version = torch.cuda.nccl.version()[:3]
    if tuple(version[:2]) < (2, 29):
        out.append(f"NCCL {'.'.join(map(str, version))} loaded by torch; NCCL EP needs >= 2.29")
    return out


def test_the_probe_names_what_is_missing_here() -> None:
    expected = expected_reasons()
    spec = PluginHost(autoload=False).registry.get("moe_dispatch", "nccl_ep")
    reasons = spec.refusals(MoERequirements("cuda", torch.bfloat16, 1, "none", 8, 2, 2048))
    usable, shown = usability(spec)  # what `execrt backends` prints
    print("nccl_ep refusals here:", reasons)
    for want in expected:
        assert any(r.startswith(want) for r in reasons), (want, reasons)
        assert any(r.startswith(f"cuda: {want}") for r in shown), (want, shown)
    assert usable == (not reasons)


def test_execrt_backends_prints_the_reasons() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "execrt", "backends", "--kind", "moe_dispatch"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(row for row in out.splitlines() if " nccl_ep " in row)
    print(line)
    for want in expected_reasons():
        assert want in line, (want, line)


def test_real_nccl_ep_graph_lifecycle_world_size_1() -> None:
    """With NCCL EP usable here: real CUDA graphs over the persistent handle, one rank."""
    problems = probe.environment_problems(probe.probe_environment())
    if problems:
        pytest.skip("NCCL EP cannot run here: " + "; ".join(problems))
    from execrt.backends.graph.full_cuda_graph import FullCudaGraphBackend
    from execrt.backends.moe_dispatch.nccl_ep import NcclEpDispatcher
    from execrt.core.context import RuntimeContext
    from execrt.core.experts import run_experts
    from execrt.core.interfaces import GraphBackendInit, MoEDispatcherInit, ShapeKey
    from execrt.core.parallel import ParallelState
    from execrt.plugins.builtin import FULL_CUDA_GRAPH, NCCL_EP_DISPATCH
    from execrt.testing.moe_cases import routing
    from execrt.testing.moe_harness import expert_weights
    from execrt.testing.oracles import compare, moe_oracle

    e, k, h, inter, cap = 8, 2, 2048, 512, 32
    dev = torch.device("cuda", torch.cuda.current_device())
    context = RuntimeContext()
    init = MoEDispatcherInit(
        capabilities=NCCL_EP_DISPATCH,
        num_experts=e,
        top_k=k,
        hidden_size=h,
        dtype=torch.bfloat16,
        device=dev,
        max_tokens_per_rank=64,
        parallel=ParallelState.single(),
        context=context,
    )
    dispatcher = NcclEpDispatcher(init)
    w13, w2 = (t.to(dev) for t in expert_weights(e, h, inter, torch.bfloat16, 0))
    gen = torch.Generator().manual_seed(0)
    try:
        # Eager first.
        x = torch.randn(5, h, generator=gen).to(torch.bfloat16)
        ids, w = routing("some_masked", 5, e, k, 1, gen)
        d = dispatcher.dispatch(x.to(dev), ids.to(dev), w.to(dev))
        out = dispatcher.combine(run_experts(d, w13, w2), d)
        assert compare(out, moe_oracle(x, ids, w, w13.cpu(), w2.cpu()).to(dev)).ok(3e-2)
        # Graphs through FullCudaGraphBackend, which runs the provider's lifecycle.
        backend = FullCudaGraphBackend(
            GraphBackendInit(FULL_CUDA_GRAPH, dev, context, dispatcher.graph_resource_provider())
        )
        static_x = torch.zeros(cap, h, dtype=torch.bfloat16, device=dev)
        static_ids = torch.full((cap, k), -1, dtype=torch.int64, device=dev)
        static_w = torch.zeros(cap, k, device=dev)
        with backend.capture_session():
            for t in (32, 8, 1):

                def step(t: int = t) -> torch.Tensor:
                    d = dispatcher.dispatch(static_x[:t], static_ids[:t], static_w[:t])
                    return dispatcher.combine(run_experts(d, w13, w2), d)

                backend.capture(ShapeKey(t), step)
        res = context.get(dispatcher.resource_name)
        for t in (1, 8, 32, 1):
            x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
            ids, w = routing("some_masked", t, e, k, 1, gen)
            static_x[:t].copy_(x)
            static_ids[:t].copy_(ids)
            static_w[:t].copy_(w)
            out = backend.replay(ShapeKey(t))
            torch.cuda.synchronize()
            cmp = compare(out, moe_oracle(x, ids, w, w13.cpu(), w2.cpu()).to(dev))
            assert cmp.ok(3e-2), (t, cmp)
        backend.cleanup()
        assert res.closed and not context.has(dispatcher.resource_name)
    finally:
        dispatcher.close()
        context.close()
