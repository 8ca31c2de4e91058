"""Capability records, the plan/attend seam of AttentionBackend, graph checks."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from torch import Tensor

from execrt.core.batch import ForwardBatch
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import (
    KV,
    AttentionBackend,
    AttentionBackendInit,
    AttentionCapabilities,
    AttentionLayer,
    AttentionRequirements,
    AttentionStep,
    DispatchFormat,
    ExpertMajorDispatchOutput,
    GraphCapabilities,
    GraphRequirements,
    MoEDispatcher,
    MoEDispatcherCapabilities,
    MoEDispatcherInit,
    MoERequirements,
    ShapeKey,
    StandardDispatchOutput,
)
from execrt.core.memory import KVCache, ReqToTokenPool
from execrt.core.parallel import ParallelState
from execrt.core.step import ForwardMode

CPU = torch.device("cpu")
FP32 = torch.float32


def attn_req(**overrides: Any) -> AttentionRequirements:
    fields: dict[str, Any] = dict(
        device="cpu", dtype=FP32, head_dim=64, num_q_heads=8, num_kv_heads=2
    )
    return AttentionRequirements(**(fields | overrides))


def moe_req(**overrides: Any) -> MoERequirements:
    fields: dict[str, Any] = dict(
        device="cpu",
        dtype=FP32,
        world_size=2,
        process_group_backend="gloo",
        num_experts=8,
        top_k=2,
        hidden_size=64,
    )
    return MoERequirements(**(fields | overrides))


# -- AttentionCapabilities.refusals ---------------------------------------------------------------
def test_default_attention_capabilities_accept_a_plain_request() -> None:
    assert AttentionCapabilities().refusals(attn_req()) == []
    assert AttentionCapabilities().refusals(attn_req(dtype=torch.bfloat16, device="cuda")) == []


def test_attention_device_and_dtype_refusals_list_what_is_supported() -> None:
    caps = AttentionCapabilities()
    assert caps.refusals(attn_req(device="xpu")) == [
        "device xpu unsupported (supported: cpu, cuda)"
    ]
    # dtypes are shown without the "torch." prefix, sorted by name.
    assert caps.refusals(attn_req(dtype=torch.float64)) == [
        "dtype float64 unsupported (supported: bfloat16, float16, float32)"
    ]


def test_head_dims_are_listed_in_numeric_not_string_order() -> None:
    caps = AttentionCapabilities(head_dims=frozenset({256, 8, 128, 16, 64}))
    assert caps.refusals(attn_req(head_dim=80)) == [
        "head_dim 80 unsupported (supported: 8, 16, 64, 128, 256)"
    ]
    assert caps.refusals(attn_req(head_dim=128)) == []


def test_any_means_no_restriction_on_head_dim_and_gqa_ratio() -> None:
    caps = AttentionCapabilities(head_dims=None, gqa_ratios=None)
    assert caps.refusals(attn_req(head_dim=7, num_q_heads=48, num_kv_heads=1)) == []


def test_gqa_ratio_is_checked_against_the_declared_ratios() -> None:
    caps = AttentionCapabilities(gqa_ratios=frozenset({1, 2, 4}))
    assert caps.refusals(attn_req(num_q_heads=8, num_kv_heads=2)) == []  # ratio 4
    assert caps.refusals(attn_req(num_q_heads=8, num_kv_heads=8)) == []  # ratio 1 (MHA)
    assert caps.refusals(attn_req(num_q_heads=32, num_kv_heads=4)) == [
        "GQA ratio 8 unsupported (supported: 1, 2, 4)"
    ]


@pytest.mark.parametrize(("num_q", "num_kv"), [(8, 3), (2, 4), (8, 0), (8, -2)])
def test_heads_that_do_not_divide_are_refused_without_a_ratio_check(
    num_q: int, num_kv: int
) -> None:
    caps = AttentionCapabilities(gqa_ratios=frozenset({1}))
    # One reason only: the ratio is meaningless when the heads do not divide (and no
    # ZeroDivisionError for 0 KV heads).
    assert caps.refusals(attn_req(num_q_heads=num_q, num_kv_heads=num_kv)) == [
        f"num_q_heads {num_q} not a multiple of num_kv_heads {num_kv}"
    ]


def test_graph_requirement_needs_the_graph_flag() -> None:
    assert AttentionCapabilities(graph=False).refusals(attn_req(graph=True)) == [
        "graph capture unsupported"
    ]
    assert AttentionCapabilities(graph=True).refusals(attn_req(graph=True)) == []
    assert AttentionCapabilities(graph=True).refusals(attn_req(graph=False)) == []


def test_every_attention_refusal_is_reported_in_field_order() -> None:
    caps = AttentionCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        head_dims=frozenset({128}),
        gqa_ratios=frozenset({1}),
    )
    reasons = caps.refusals(attn_req(graph=True))
    assert [r.split(" ")[0] for r in reasons] == ["device", "dtype", "head_dim", "GQA", "graph"]


# -- MoEDispatcherCapabilities.refusals -----------------------------------------------------------
def test_default_moe_capabilities_accept_any_world_size_and_hidden_size() -> None:
    caps = MoEDispatcherCapabilities()
    assert caps.refusals(moe_req(world_size=8, hidden_size=7168, top_k=8, num_experts=256)) == []
    assert caps.refusals(moe_req(world_size=1, process_group_backend="none")) == []


def test_moe_field_refusals_name_the_value_and_the_supported_set() -> None:
    caps = MoEDispatcherCapabilities(
        world_sizes=frozenset({8, 1, 2}),
        process_group_backends=frozenset({"nccl"}),
        hidden_sizes=frozenset({4096, 2048}),
    )
    assert caps.refusals(moe_req(world_size=4, hidden_size=1024)) == [
        "world size 4 unsupported (supported: 1, 2, 8)",
        "process group backend gloo unsupported (supported: nccl)",
        "hidden size 1024 unsupported (supported: 2048, 4096)",
    ]
    ok = moe_req(world_size=2, process_group_backend="nccl", hidden_size=2048)
    assert caps.refusals(ok) == []


def test_moe_default_backends_are_none_gloo_nccl() -> None:
    assert MoEDispatcherCapabilities().refusals(moe_req(process_group_backend="mpi")) == [
        "process group backend mpi unsupported (supported: gloo, nccl, none)"
    ]


def test_moe_top_k_limit_is_inclusive() -> None:
    caps = MoEDispatcherCapabilities(max_top_k=8)
    assert caps.refusals(moe_req(top_k=8)) == []
    assert caps.refusals(moe_req(top_k=9)) == ["top_k 9 unsupported (supported: <= 8)"]
    assert MoEDispatcherCapabilities(max_top_k=None).refusals(moe_req(top_k=64)) == []


def test_moe_experts_must_divide_over_the_world() -> None:
    caps = MoEDispatcherCapabilities()
    assert caps.refusals(moe_req(num_experts=6, world_size=4)) == [
        "num_experts 6 not divisible by world size 4"
    ]
    assert caps.refusals(moe_req(num_experts=12, world_size=4)) == []
    # A world size of 0 is treated as 1 rather than dividing by zero.
    assert caps.refusals(moe_req(num_experts=6, world_size=0)) == []


def test_moe_graph_flag() -> None:
    assert MoEDispatcherCapabilities().refusals(moe_req(graph=True)) == [
        "graph capture unsupported"
    ]
    assert MoEDispatcherCapabilities(graph=True).refusals(moe_req(graph=True)) == []


def test_moe_device_and_dtype_refusals() -> None:
    caps = MoEDispatcherCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({FP32}))
    assert caps.refusals(moe_req(dtype=torch.float16)) == [
        "device cpu unsupported (supported: cuda)",
        "dtype float16 unsupported (supported: float32)",
    ]


# -- GraphCapabilities ----------------------------------------------------------------------------
def test_graph_capabilities_default_to_cuda_only() -> None:
    assert GraphCapabilities().refusals(GraphRequirements("cuda")) == []
    assert GraphCapabilities().refusals(GraphRequirements("cpu")) == [
        "device cpu unsupported (supported: cuda)"
    ]
    assert (
        GraphCapabilities(devices=frozenset({"cpu", "cuda"})).refusals(GraphRequirements("cpu"))
        == []
    )


def test_capability_records_are_frozen_and_name_their_kind() -> None:
    assert AttentionCapabilities.kind == "attention"
    assert MoEDispatcherCapabilities.kind == "moe_dispatch"
    assert GraphCapabilities.kind == "graph"
    with pytest.raises(dataclasses.FrozenInstanceError):
        AttentionCapabilities().graph = True  # type: ignore[misc]


# -- Capabilities.as_dict -------------------------------------------------------------------------
def test_an_fp8_cache_is_refused_by_a_backend_that_does_not_list_it() -> None:
    fp8 = attn_req(dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    assert fp8.cache_dtype == torch.float8_e4m3fn and attn_req().cache_dtype == FP32
    assert AttentionCapabilities().refusals(fp8) == [
        "KV cache dtype float8_e4m3fn unsupported (supported: bfloat16, float16, float32)"
    ]
    reads_fp8 = AttentionCapabilities(kv_dtypes=frozenset({torch.float8_e4m3fn, torch.bfloat16}))
    assert reads_fp8.refusals(fp8) == []
    e5m2 = attn_req(dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2)
    assert reads_fp8.refusals(e5m2) == [
        "KV cache dtype float8_e5m2 unsupported (supported: bfloat16, float8_e4m3fn)"
    ]


def test_attention_as_dict_sorts_ints_numerically_and_dtypes_by_name() -> None:
    caps = AttentionCapabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=frozenset({256, 64, 128}),
        gqa_ratios=None,
        graph=True,
    )
    assert caps.as_dict() == {
        "devices": ["cpu", "cuda"],
        "dtypes": ["bfloat16", "float16"],
        "head_dims": [64, 128, 256],
        "gqa_ratios": None,
        "decode": True,
        "extend": True,
        "graph": True,
        "stores_kv": False,
        "kv_dtypes": ["bfloat16", "float16", "float32"],
    }


def test_moe_as_dict_gives_enum_values_and_is_json_serialisable() -> None:
    caps = MoEDispatcherCapabilities(
        output_format=DispatchFormat.EXPERT_MAJOR,
        world_sizes=frozenset({16, 2, 4}),
        max_top_k=8,
        replicated_tokens=False,
    )
    out = caps.as_dict()
    assert out["output_format"] == "expert_major" and type(out["output_format"]) is str
    assert out["world_sizes"] == [2, 4, 16]
    assert out["process_group_backends"] == ["gloo", "nccl", "none"]
    assert out["hidden_sizes"] is None and out["max_top_k"] == 8
    assert out["replicated_tokens"] is False
    assert "kind" not in out  # a class constant, not a field
    assert json.loads(json.dumps(out)) == out


def test_graph_as_dict_lists_every_field() -> None:
    assert GraphCapabilities(real_capture=False).as_dict() == {
        "devices": ["cuda"],
        "real_capture": False,
        "shared_memory_pool": True,
        "graph_resources": False,
    }


# -- AttentionBackend: plan once, attend per layer ----------------------------------------------
HQ, HKV, D, DV = 4, 2, 4, 3  # Dv != D, so a swapped k/v would not even fit
SIZE = 8


class Recorder(AttentionBackend):
    """Returns a plan naming the batch; attend records the plan and k/v it was handed."""

    def __init__(self, init: AttentionBackendInit) -> None:
        super().__init__(init)
        self.calls: list[tuple[object, tuple[torch.Tensor, torch.Tensor] | None]] = []

    def plan(self, fb: ForwardBatch) -> object:
        return ("plan", fb.batch_size)

    def attend(
        self, q: Tensor, layer: AttentionLayer, step: AttentionStep, kv: KV = None
    ) -> Tensor:
        self.calls.append((step.meta, kv))
        return torch.full((q.shape[0], layer.num_q_heads, layer.v_head_dim), 1.0)


def make_backend(stores_kv: bool = False) -> Recorder:
    cache = KVCache(SIZE, 2, HKV, D, FP32, CPU, v_head_dim=DV)
    init = AttentionBackendInit(
        capabilities=AttentionCapabilities(stores_kv=stores_kv),
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        v_head_dim=DV,
        num_layers=2,
        dtype=FP32,
        device=CPU,
        req_to_token_pool=ReqToTokenPool(2, 16, CPU),
        kv_cache=cache,
        max_batch_size=2,
        max_context_len=16,
        context=RuntimeContext(),
    )
    return Recorder(init)


def batch(mode: ForwardMode, slots: list[int], batch_size: int | None = None) -> ForwardBatch:
    t = len(slots)
    b = t if batch_size is None else batch_size
    return ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.zeros(t, dtype=torch.int64),
        req_pool_indices=torch.ones(b, dtype=torch.int64),
        seq_lens=torch.ones(b, dtype=torch.int64),
        out_cache_loc=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu=[1] * b,
        prefix_lens_cpu=[0] * b,
        extend_lens_cpu=[1] * b,
    )


LAYER = AttentionLayer(1, HQ, HKV, D, DV, scaling=0.5)


def test_the_plan_is_returned_not_written_into_the_batch() -> None:
    backend = make_backend()
    fb = batch(ForwardMode.DECODE, [5, 2])
    before = dataclasses.asdict(fb)
    meta = backend.plan(fb)
    assert meta == ("plan", 2)
    assert not hasattr(fb, "attn_metadata") and not hasattr(fb, "attn_backend")
    after = dataclasses.asdict(fb)
    assert before.keys() == after.keys()


def test_an_attention_step_carries_backend_plan_slots_and_mode() -> None:
    backend = make_backend()
    fb = batch(ForwardMode.EXTEND, [5, 2, 7])
    step = AttentionStep(backend, backend.plan(fb), fb.out_cache_loc, fb.mode)
    out = backend.attend(torch.zeros(3, HQ, D), LAYER, step)
    assert backend.calls == [(("plan", 3), None)]
    assert out.shape == (3, HQ, DV)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.meta = None  # type: ignore[misc]


def test_attention_backends_must_implement_plan_and_attend() -> None:
    assert AttentionBackend.__abstractmethods__ == {"plan", "attend"}


def test_the_base_keeps_what_its_init_record_holds() -> None:
    backend = make_backend()
    init = backend.init
    assert backend.kv_cache is init.kv_cache and backend.req_to_token_pool is init.req_to_token_pool
    assert (backend.num_q_heads, backend.num_kv_heads, backend.head_dim, backend.v_head_dim) == (
        HQ,
        HKV,
        D,
        DV,
    )
    assert backend.capabilities is init.capabilities and backend.graph_seq_len_fill_value == 1


def test_graph_hooks_are_unsupported_by_default_and_name_the_backend() -> None:
    backend = make_backend()
    with pytest.raises(NotImplementedError, match="^Recorder: graph capture unsupported$"):
        backend.init_graph_state(4, 4)
    with pytest.raises(NotImplementedError, match="^Recorder: graph capture unsupported$"):
        backend.plan_graph(batch(ForwardMode.DECODE, [1]))
    backend.close()
    backend.close()  # idempotent no-op
    # One that declares graph capture without the hooks is told what to implement.
    liar = make_backend()
    liar.capabilities = dataclasses.replace(liar.capabilities, graph=True)
    with pytest.raises(
        NotImplementedError,
        match=r"declares capabilities.graph = True but does "
        r"not implement plan_graph \(implement init_graph_state and plan_graph",
    ):
        liar.plan_graph(batch(ForwardMode.DECODE, [1]))


# -- check_graph_batch ----------------------------------------------------------------------------
def test_check_graph_batch_requires_init_graph_state_first() -> None:
    # Reported before anything about the batch itself.
    with pytest.raises(RuntimeError, match=r"^triton: init_graph_state\(\) was not called$"):
        AttentionBackend.check_graph_batch("triton", None, batch(ForwardMode.EXTEND, [1]))


def test_check_graph_batch_refuses_non_decode_batches() -> None:
    with pytest.raises(ValueError, match="^fi: graphs capture decode only, got EXTEND$"):
        AttentionBackend.check_graph_batch("fi", 8, batch(ForwardMode.EXTEND, [1]))


def test_check_graph_batch_bounds_the_batch_size_inclusively() -> None:
    AttentionBackend.check_graph_batch("x", 4, batch(ForwardMode.DECODE, [1, 2, 3, 4]))
    with pytest.raises(ValueError, match="^x: batch 5 exceeds graph max_bs 4$"):
        AttentionBackend.check_graph_batch("x", 4, batch(ForwardMode.DECODE, [1, 2, 3, 4, 5]))


# -- MoE dispatch records -------------------------------------------------------------------------
def moe_init(num_experts: int, world_size: int, rank: int) -> MoEDispatcherInit:
    return MoEDispatcherInit(
        capabilities=MoEDispatcherCapabilities(),
        num_experts=num_experts,
        top_k=2,
        hidden_size=16,
        dtype=FP32,
        device=CPU,
        max_tokens_per_rank=4,
        parallel=ParallelState(world_size=world_size, rank=rank, backend="gloo"),
        context=RuntimeContext(),
    )


@pytest.mark.parametrize(
    ("num_experts", "world", "rank", "local", "first"),
    [(12, 4, 0, 3, 0), (12, 4, 2, 3, 6), (12, 4, 3, 3, 9), (12, 1, 0, 12, 0), (64, 8, 7, 8, 56)],
)
def test_dispatcher_init_shards_experts_in_contiguous_blocks(
    num_experts: int, world: int, rank: int, local: int, first: int
) -> None:
    init = moe_init(num_experts, world, rank)
    assert (init.num_local_experts, init.first_local_expert) == (local, first)


def test_dispatcher_base_has_no_graph_resources_and_a_noop_close() -> None:
    class Passthrough(MoEDispatcher):
        def dispatch(
            self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
        ) -> StandardDispatchOutput:
            return StandardDispatchOutput(hidden_states, topk_ids, topk_weights)

        def combine(self, expert_output: torch.Tensor, dispatch_output: Any) -> torch.Tensor:
            return expert_output

    init = moe_init(4, 1, 0)
    d = Passthrough(init)
    assert d.init is init and d.capabilities is init.capabilities
    assert d.graph_resource_provider() is None
    d.close()
    d.close()


def test_dispatch_outputs_declare_their_format_as_a_class_constant() -> None:
    h = torch.zeros(2, 4)
    std = StandardDispatchOutput(h, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))
    em = ExpertMajorDispatchOutput(torch.zeros(3, 5, 4), torch.zeros(3, dtype=torch.int32), 2)
    assert std.format is DispatchFormat.STANDARD and em.format is DispatchFormat.EXPERT_MAJOR
    assert em.state is None and em.num_tokens == 2
    # ``format`` is not a field: it cannot be overridden per instance.
    assert "format" not in {f.name for f in dataclasses.fields(em)}
    with pytest.raises(TypeError):
        StandardDispatchOutput(h, h, h, format=DispatchFormat.EXPERT_MAJOR)  # type: ignore[call-arg]


def test_dispatch_format_is_a_string_enum() -> None:
    assert DispatchFormat("expert_major") is DispatchFormat.EXPERT_MAJOR
    assert DispatchFormat.STANDARD == "standard"
    with pytest.raises(ValueError):
        DispatchFormat("dense")


# -- ShapeKey -------------------------------------------------------------------------------------
def test_shape_keys_compare_and_hash_by_batch_size_and_variant() -> None:
    assert ShapeKey(8) == ShapeKey(8, "") and hash(ShapeKey(8)) == hash(ShapeKey(8, ""))
    assert ShapeKey(8) != ShapeKey(16) and ShapeKey(8) != ShapeKey(8, "moe")
    graphs = {ShapeKey(8): "a", ShapeKey(8, "moe"): "b"}
    assert graphs[ShapeKey(8, "")] == "a" and graphs[ShapeKey(8, "moe")] == "b"
    assert len({ShapeKey(1), ShapeKey(1), ShapeKey(2)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        ShapeKey(1).batch_size = 2  # type: ignore[misc]
