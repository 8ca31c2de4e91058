"""The built-in plugin: registers every built-in backend through the same hook as third parties."""

from __future__ import annotations

from typing import Any

import torch

from execrt.core.interfaces import (
    FP8_DTYPES,
    AttentionCapabilities,
    DispatchFormat,
    GraphCapabilities,
    MoEDispatcherCapabilities,
)
from execrt.core.plugins import BackendRegistry, hookimpl
from execrt.core.prefix_cache import PrefixCacheCapabilities
from execrt.kernels._triton import INTERPRETER_HINT, runs_on

_HALF = frozenset({torch.float16, torch.bfloat16})
_ALL_FLOAT = _HALF | {torch.float32}

TORCH_NATIVE_ATTENTION = AttentionCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=_ALL_FLOAT,
    graph=False,
    kv_dtypes=_ALL_FLOAT | FP8_DTYPES,
)
TRITON_ATTENTION = AttentionCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=_ALL_FLOAT,
    head_dims=frozenset({64, 96, 128, 256}),
    graph=True,
    kv_dtypes=_ALL_FLOAT | FP8_DTYPES,
)
FLASHINFER_ATTENTION = AttentionCapabilities(
    devices=frozenset({"cuda"}),
    dtypes=_HALF,
    head_dims=frozenset({64, 128, 256}),
    graph=True,
    kv_dtypes=_HALF | FP8_DTYPES,
)
# Capturable: no host sync, and its one collective (all-reduce) is legal inside a CUDA graph.
ALLREDUCE_DISPATCH = MoEDispatcherCapabilities(graph=True)
ALL_TO_ALL_DISPATCH = MoEDispatcherCapabilities(
    output_format=DispatchFormat.EXPERT_MAJOR, graph=False, replicated_tokens=False
)
ALL_TO_ALL_FIXED_DISPATCH = MoEDispatcherCapabilities(
    output_format=DispatchFormat.EXPERT_MAJOR, graph=True, replicated_tokens=False
)
NCCL_EP_DISPATCH = MoEDispatcherCapabilities(
    output_format=DispatchFormat.EXPERT_MAJOR,
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.bfloat16}),
    world_sizes=frozenset({1, 2, 4, 8, 16, 32, 64}),  # NCCL EP: up to 8 nodes x 8 GPUs
    process_group_backends=frozenset({"none", "nccl"}),
    max_top_k=32,
    graph=True,
    replicated_tokens=False,
)
REEXEC_GRAPH = GraphCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    real_capture=False,
    shared_memory_pool=False,
    graph_resources=True,
)
FULL_CUDA_GRAPH = GraphCapabilities(
    devices=frozenset({"cuda"}), real_capture=True, shared_memory_pool=True, graph_resources=True
)
RADIX_PREFIX_CACHE = PrefixCacheCapabilities(
    devices=frozenset({"cpu", "cuda"}), page_sizes=frozenset({1})
)


def _triton_check(req: Any) -> list[str]:
    if req.device == "cpu" and not runs_on(torch.device("cpu")):
        return [f"on cpu it runs only under {INTERPRETER_HINT}; slow"]
    if req.device == "cpu" and req.dtype == torch.bfloat16:
        return ["the Triton interpreter computes bfloat16 wrongly; use float16 or float32 on cpu"]
    return _cuda_check(req)


def _nccl_ep_check(req: Any) -> list[str]:
    # The probe names the NCCL versions found without loading libnccl_ep.so.
    from execrt.backends.moe_dispatch.nccl_ep_probe import availability_problems

    return availability_problems(req)


def _cuda_check(req: Any) -> list[str]:
    if req.device == "cuda" and not torch.cuda.is_available():
        return ["no CUDA device visible"]
    return []


@hookimpl
def execrt_register_backends(registry: BackendRegistry) -> None:
    registry.register(
        "attention",
        "torch_native",
        "execrt.backends.attention.torch_native:TorchNativeAttnBackend",
        TORCH_NATIVE_ATTENTION,
        priority=10,
        description="PyTorch over gathered K/V; reference, any device",
    )
    registry.register(
        "attention",
        "triton",
        "execrt.backends.attention.triton:TritonAttnBackend",
        TRITON_ATTENTION,
        requires=("triton",),
        install_hint="pip install execrt[triton]",
        # First for auto: it matches FlashInfer on the H200 (decode 0.99-1.06x, extend
        # 0.88-1.15x, docs/kernels.md) and its graph path is covered end to end.
        priority=30,
        auto_devices=frozenset({"cuda"}),
        check=_triton_check,
        description="split-KV paged decode and causal extend kernels in Triton",
    )
    registry.register(
        "attention",
        "flashinfer",
        "execrt.backends.attention.flashinfer:FlashInferAttnBackend",
        FLASHINFER_ATTENTION,
        requires=("flashinfer",),
        install_hint="pip install execrt[flashinfer]",
        priority=20,
        check=_cuda_check,
        description="FlashInfer paged decode / prefill wrappers (page size 1)",
    )
    registry.register(
        "moe_dispatch",
        "allreduce",
        "execrt.backends.moe_dispatch.allreduce:AllReduceDispatcher",
        ALLREDUCE_DISPATCH,
        priority=10,
        description="no dispatch traffic; combine all-reduces partial expert outputs",
    )
    registry.register(
        "moe_dispatch",
        "all_to_all",
        "execrt.backends.moe_dispatch.all_to_all:AllToAllDispatcher",
        ALL_TO_ALL_DISPATCH,
        # Below allreduce: attention is replicated today, so every rank would ship every token
        # and run P times the expert work that allreduce does; worth it once tokens are per rank.
        priority=5,
        description="per-rank tokens to their experts' ranks and back (all_to_all_single)",
    )
    registry.register(
        "moe_dispatch",
        "all_to_all_fixed",
        "execrt.backends.moe_dispatch.all_to_all_fixed:FixedCapacityAllToAllDispatcher",
        ALL_TO_ALL_FIXED_DISPATCH,
        priority=4,
        # Its buffers scale with max_tokens_per_rank on every call: chosen by name only.
        auto_devices=frozenset(),
        description="all_to_all in fixed-capacity buffers: graph-capturable, drops counted",
    )
    registry.register(
        "moe_dispatch",
        "nccl_ep",
        "execrt.backends.moe_dispatch.nccl_ep:NcclEpDispatcher",
        NCCL_EP_DISPATCH,
        install_hint="pip install execrt[nccl-ep]",
        priority=3,
        # Its LL buffers scale with max_tokens_per_rank (E_local x P*C x H): chosen by name only.
        auto_devices=frozenset(),
        check=_nccl_ep_check,
        description="NCCL EP low-latency dispatch/combine, expert-major; CUDA-graph resources",
    )
    registry.register(
        "graph",
        "reexec",
        "execrt.backends.graph.reexec:ReexecGraphBackend",
        REEXEC_GRAPH,
        priority=0,
        auto_devices=frozenset(),  # a testing aid: "auto" never picks it
        description="re-executes the captured function on replay; CPU testing of graph runners",
    )
    registry.register(
        "graph",
        "full_cuda_graph",
        "execrt.backends.graph.full_cuda_graph:FullCudaGraphBackend",
        FULL_CUDA_GRAPH,
        priority=10,
        check=_cuda_check,
        description="one torch.cuda.CUDAGraph per shape key, all in one shared memory pool",
    )
    registry.register(
        "prefix_cache",
        "radix",
        "execrt.backends.prefix_cache.radix:RadixCache",
        RADIX_PREFIX_CACHE,
        priority=10,
        description="radix tree over token ids (page size 1); LRU eviction of unlocked leaves",
    )
