"""nccl_ep under graphs, against the nccl.ep double: the NcclEpGraphResources lifecycle."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from execrt.backends.moe_dispatch.nccl_ep import NcclEpDispatcher
from execrt.backends.moe_dispatch.nccl_ep_native import NcclApi
from execrt.backends.moe_dispatch.nccl_ep_resources import NcclEpGraphResources
from execrt.core.context import RuntimeContext
from execrt.core.errors import ResourceError
from execrt.testing.oracles import compare, moe_oracle
from tests.backends.moe_dispatch.nccl_ep_driver import (
    BUCKETS,
    HIDDEN,
    LAYERS,
    NUM_EXPERTS,
    TOP_K,
    GraphDriver,
    StepOutput,
    ToyMoE,
    make_dispatcher,
)
from tests.doubles.nccl_ep import FakeNccl

NAME = "nccl_ep_graph_resources"
OWNER = "a graph backend"  # for tests that register resources by hand
CREATION = ("create_group", "create_handle", "update", "destroy_handle", "destroy_group")
TOLERANCE = 3e-2  # bf16 wires, the conformance suite's bf16 tolerance


@dataclass
class World:
    fake: FakeNccl
    context: RuntimeContext
    dispatcher: NcclEpDispatcher
    model: ToyMoE


@pytest.fixture
def world() -> Iterator[World]:
    fake = FakeNccl(seed=7)
    context = RuntimeContext()
    dispatcher = make_dispatcher(fake, context)
    yield World(fake, context, dispatcher, ToyMoE(dispatcher, context))
    dispatcher.close()
    context.close()


def check_against_oracle(model: ToyMoE, out: StepOutput, num_tokens: int) -> None:
    """Each layer's MoE output equals the naive MoE of that layer's actual input."""
    for layer, (w13, w2) in enumerate(model.weights):
        ids = model.ids[layer][:num_tokens]
        ref = moe_oracle(out.inputs[layer], ids, model.w[layer][:num_tokens], w13, w2)
        cmp = compare(out.moe[layer], ref)
        assert cmp.ok(TOLERANCE), f"T={num_tokens} layer {layer}: {cmp}"


def group_name(obj: object) -> str:
    return f"group#{obj.ptr:x}"  # type: ignore[attr-defined]


def handle_name(obj: object) -> str:
    return f"handle#{obj.ptr:x}"  # type: ignore[attr-defined]


@pytest.mark.parametrize("eager_run_first", [False, True], ids=["reexec", "eager-run-first"])
def test_full_lifecycle(world: World, eager_run_first: bool) -> None:
    fake, context, model = world.fake, world.context, world.model
    driver = GraphDriver(fake, context, model, eager_run_first=eager_run_first)
    driver.capture_all()
    res = driver.resources
    assert isinstance(res, NcclEpGraphResources) and context.get(NAME) is res
    assert context.owner_of(NAME) == "reexec graph backend"
    graph_group, graph_handle = group_name(res.group), handle_name(res.handle)

    # Lazily built in the first warm-up, once; never anything created, updated or destroyed
    # under capture.
    assert [e.op for e in fake.ops("create_group") if e.target == graph_group] == ["create_group"]
    creations = fake.ops(*CREATION)
    assert creations and not [e for e in creations if e.capturing], creations
    first_capture = next(i for i, e in enumerate(fake.events) if e.capturing)
    built_at = next(i for i, e in enumerate(fake.events) if e.target == graph_group)
    assert built_at < first_capture

    # One persistent handle, rebound per bucket outside capture over the same base pointer.
    base = res.topk_ids.data_ptr()
    binds = [e for e in fake.ops("create_handle", "update") if e.target == graph_handle]
    assert [(e.op, e.num_tokens) for e in binds] == [("create_handle", BUCKETS[0])] + [
        ("update", t) for t in BUCKETS[1:]
    ]
    assert {e.base_ptr for e in binds} == {base}
    assert res.bucket == BUCKETS[-1]
    assert (res.topk_ids[BUCKETS[-1] :] == -1).all(), "rows past the bucket must hold -1"

    # Captured work: every layer of every bucket dispatched on the graph handle, borrowing the
    # resources for exactly one layer each.
    captured = [e for e in fake.ops("dispatch") if e.capturing]
    assert [e.num_tokens for e in captured] == [t for t in BUCKETS for _ in range(LAYERS)]
    assert {e.target for e in captured} == {graph_handle}
    assert len(model.mid_layer) == len(model.after_combine)
    graph_layers = [b for b in model.mid_layer if b is not None]
    assert len(graph_layers) >= len(BUCKETS) * LAYERS
    assert len(set(graph_layers)) == len(graph_layers), "one borrow per layer"
    assert model.after_combine == [None] * len(model.after_combine)
    assert res.borrower is None and context.borrower_of(NAME) is None

    # Replays (reexec re-runs the forward) read new inputs, padding rows included, and run
    # exactly what the recorded graph would: every layer on the persistent graph handle,
    # nothing created, no eager handle; only a rebind (update outside capture, same base)
    # when the handle is bound to another bucket.
    eager_group = world.dispatcher._group
    for num_tokens, num_real in [(8, 8), (8, 5), (4, 4), (2, 1), (1, 1), (8, 3), (1, 1), (4, 1)]:
        model.refill(num_real)
        bound, start, mid = res.bucket, len(fake.events), len(model.mid_layer)
        out = driver.replay(num_tokens)
        assert out is driver.outputs[num_tokens]
        check_against_oracle(model, out, num_tokens)
        ran = [(e.op, e.target, e.num_tokens, e.capturing) for e in fake.events[start:]]
        rebind = [] if bound == num_tokens else [("update", graph_handle, num_tokens, False)]
        layer = [
            (op, graph_handle, num_tokens, False)
            for op in ("dispatch", "complete", "combine", "complete")
        ]
        assert ran == rebind + layer * LAYERS, f"replay of {num_tokens}: {ran}"
        assert all(e.base_ptr == base for e in fake.events[start:] if e.op == "update")
        assert res.bucket == num_tokens
        borrowers = model.mid_layer[mid:]
        assert len(borrowers) == LAYERS and None not in borrowers
        assert len(set(borrowers)) == LAYERS, "one borrow per layer"
        assert model.after_combine[mid:] == [None] * LAYERS
    assert world.dispatcher._group is eager_group, "a replay must never go eager"
    if not eager_run_first:
        assert eager_group is None

    # Cleanup: graphs reset, then handle before group; idempotent.
    before = len(fake.events)
    driver.cleanup()
    assert not any(driver.backend.has(k) for k in driver.outputs)  # type: ignore[arg-type]
    ends = [(e.op, e.target) for e in fake.events[before:]]
    assert ends == [("destroy_handle", graph_handle), ("destroy_group", graph_group)]
    assert res.closed and not context.has(NAME)
    world.dispatcher.close_graph_resources(res)
    driver.cleanup()
    assert len(fake.events) == before + 2, "a second close must do nothing"
    assert not fake.violations

    # Recapture: a new generation with its own group, correct again.
    driver.capture_all(BUCKETS[:2])
    again = driver.resources
    assert again is not res and again.generation == res.generation + 1
    assert group_name(again.group) != graph_group
    model.refill(3)
    check_against_oracle(model, driver.replay(4), 4)
    driver.cleanup()
    assert not fake.live_groups() or [group_name(g) for g in fake.live_groups()] == [
        group_name(world.dispatcher._group)
    ], "only the eager group may outlive the graph generations"
    assert not fake.violations


def test_eager_forward_of_a_warmed_bucket_uses_the_graph_state(world: World) -> None:
    """Outside capture a forward of the warmed bucket borrows the resources too (no new
    handle); any other size takes the eager path, which makes and destroys its own handle."""
    fake, context, model = world.fake, world.context, world.model
    driver = GraphDriver(fake, context, model, eager_run_first=False)
    driver.capture_all((4,))
    handles_before = len(fake.ops("create_handle"))
    model.refill(4)
    check_against_oracle(model, model.forward_fn(4)(), 4)
    assert len(fake.ops("create_handle")) == handles_before
    model.refill(2)
    check_against_oracle(model, model.forward_fn(2)(), 2)
    assert len(fake.ops("create_handle")) == handles_before + LAYERS
    assert len(fake.live_handles()) == 1  # the persistent graph handle only
    driver.cleanup()


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["eager", "graph"])
@pytest.mark.parametrize("bad", [NUM_EXPERTS, 99, -2])
def test_an_expert_id_out_of_range_is_named_with_the_accepted_range(
    world: World, path: str, bad: int
) -> None:
    if path == "graph":
        world.dispatcher.warm_up_graph_resources(registered(world), 4)
    x, ids, w = inputs(4)
    ids[2, 1] = bad
    before = len(world.fake.events)
    with pytest.raises(ValueError) as refused:
        world.dispatcher.dispatch(x, ids, w)
    assert str(refused.value) == (
        f"nccl_ep dispatcher: expert id {bad} in topk_ids unsupported (supported: -1, routed "
        "nowhere, or 0..7; 1 ids out of range)"
    )
    assert len(world.fake.events) == before, "nothing reached the library"
    if path == "graph":
        assert world.context.borrower_of(NAME) is None
    ids[2, 1] = -1  # the boundary values themselves are fine
    ids[0, 0] = NUM_EXPERTS - 1
    d = world.dispatcher.dispatch(x, ids, w)
    world.dispatcher.combine(torch.zeros_like(d.hidden_states), d)
    assert not world.fake.violations


@pytest.mark.parametrize(("experts", "ep_ok"), [(1024, True), (1032, False)])
def test_local_experts_are_capped_at_construction(experts: int, ep_ok: bool) -> None:
    fake, context = FakeNccl(), RuntimeContext()
    probe = make_dispatcher(fake, context)  # builds nothing native: only its init is wanted
    init = dataclasses.replace(probe.init, num_experts=experts)
    probe.close()
    if ep_ok:
        NcclEpDispatcher(init, NcclApi(fake.ep, fake.core, fake.is_capturing)).close()
    else:
        with pytest.raises(ValueError, match=r"1032 local experts per rank .*up to 1024"):
            NcclEpDispatcher(init, NcclApi(fake.ep, fake.core, fake.is_capturing))
    assert not fake.events
    context.close()


def registered(world: World, capacity: int = 8) -> NcclEpGraphResources:
    res = world.dispatcher.create_graph_resources(capacity, world.context)
    world.context.register(NAME, res, owner=OWNER, close=world.dispatcher.close_graph_resources)
    return res


def inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:TOP_K] for _ in range(num_tokens)])
    return x, ids, torch.full((num_tokens, TOP_K), 0.5)


def test_second_borrower_is_refused(world: World) -> None:
    res = registered(world)
    world.dispatcher.warm_up_graph_resources(res, 4)
    first = world.dispatcher.dispatch(*inputs(4))
    with pytest.raises(ResourceError, match="borrowed by"):
        world.dispatcher.dispatch(*inputs(4))
    assert res.borrower is not None and world.context.borrower_of(NAME) == res.borrower
    y = torch.zeros_like(first.hidden_states)
    world.dispatcher.combine(y, first)
    assert res.borrower is None and world.context.borrower_of(NAME) is None
    assert not world.fake.violations


def test_creation_during_capture_is_refused(world: World) -> None:
    fake, dispatcher = world.fake, world.dispatcher
    with fake.capture():  # no resources at all: the eager path may not run under capture
        with pytest.raises(ResourceError, match="under CUDA-graph capture needs graph resources"):
            dispatcher.dispatch(*inputs(4))
    res = registered(world)
    with fake.capture():  # registered but never warmed up: nothing may be built here
        with pytest.raises(ResourceError, match="not warmed up"):
            dispatcher.dispatch(*inputs(4))
        with pytest.raises(ResourceError, match="inside CUDA-graph capture"):
            dispatcher.warm_up_graph_resources(res, 4)
    dispatcher.warm_up_graph_resources(res, 4)
    with fake.capture():  # warmed for 4, asked for 2
        with pytest.raises(ResourceError, match="not warmed up"):
            dispatcher.dispatch(*inputs(2))
    assert not res.borrower and not fake.violations
    assert not [e for e in fake.events if e.capturing], "nothing reached the library in capture"


def test_close_while_borrowed_is_refused(world: World) -> None:
    res = registered(world)
    world.dispatcher.warm_up_graph_resources(res, 2)
    d = world.dispatcher.dispatch(*inputs(2))
    with pytest.raises(ResourceError, match="while borrowed"):
        world.dispatcher.close_graph_resources(res)
    with pytest.raises(ResourceError, match="while borrowed"):
        world.context.unregister(NAME, owner=OWNER)
    with pytest.raises(ResourceError, match="while graph resources are borrowed|borrowed by"):
        world.dispatcher.close()
    assert world.context.has(NAME) and not res.closed
    world.dispatcher.combine(torch.zeros_like(d.hidden_states), d)
    world.context.unregister(NAME, owner=OWNER)
    assert res.closed
    world.dispatcher.close_graph_resources(res)  # idempotent
    with pytest.raises(ResourceError, match="closed; a recapture creates a new generation"):
        world.dispatcher.warm_up_graph_resources(res, 2)
    assert not world.fake.violations


def test_one_open_generation_at_a_time(world: World) -> None:
    res = registered(world)
    with pytest.raises(ResourceError, match="still open"):
        world.dispatcher.create_graph_resources(8, world.context)
    with pytest.raises(ResourceError, match="RuntimeContext"):
        world.dispatcher.create_graph_resources(8, RuntimeContext())
    other = make_dispatcher(world.fake, world.context)
    with pytest.raises(ResourceError, match="not created by this dispatcher"):
        other.dispatch(*inputs(2))
    with pytest.raises(ResourceError, match="not created by this dispatcher"):
        other.warm_up_graph_resources(res, 2)
    other.close()


def test_dispatcher_close_closes_a_generation_left_open(world: World) -> None:
    res = registered(world)
    world.dispatcher.warm_up_graph_resources(res, 2)
    world.dispatcher.dispatch(*inputs(3))  # an eager forward too: its group must go as well
    world.dispatcher.close()
    assert res.closed and not world.fake.live_groups() and not world.fake.violations


@pytest.mark.parametrize(
    "case",
    [
        "tokens_over_capacity",
        "bucket_over_capacity",
        "fp32_hidden",
        "int32_ids",
        "bf16_weights",
        "wide_hidden",
        "wrong_top_k",
        "flat_hidden",
        "non_contiguous_hidden",
        "non_contiguous_ids",
        "expert_id_too_large",
        "expert_id_below_minus_one",
        "expert_output_shape",
        "expert_output_dtype",
        "expert_output_non_contiguous",
        "foreign_dispatch_output",
    ],
)
@pytest.mark.parametrize("path", ["eager", "graph"])
def test_bad_arguments_raise_before_the_library(world: World, case: str, path: str) -> None:
    dispatcher = world.dispatcher
    t = 4
    if path == "graph":
        dispatcher.warm_up_graph_resources(registered(world), t)
    x, ids, w = inputs(t)
    if case == "tokens_over_capacity":  # another size than the warmed bucket goes eager
        x, ids, w = inputs(17)
        call = lambda: dispatcher.dispatch(x, ids, w)  # noqa: E731
    elif case == "bucket_over_capacity":
        res = registered(world, capacity=8) if path == "eager" else world.context.get(NAME)
        call = lambda: dispatcher.warm_up_graph_resources(res, 9)  # noqa: E731
    elif case.startswith(("expert_output", "foreign")):
        d = dispatcher.dispatch(x, ids, w)
        y = torch.zeros_like(d.hidden_states)
        if case == "expert_output_shape":
            y = y[:, :-1]
        elif case == "expert_output_dtype":
            y = y.float()
        elif case == "expert_output_non_contiguous":
            y = y.transpose(0, 1).contiguous().transpose(0, 1)
        genuine = d
        if case == "foreign_dispatch_output":
            d = type(d)(d.hidden_states, d.expert_counts, d.num_tokens, state=None)
        call = lambda: dispatcher.combine(y, d)  # noqa: E731
    else:
        if case == "fp32_hidden":
            x = x.float()
        elif case == "int32_ids":
            ids = ids.int()
        elif case == "bf16_weights":
            w = w.bfloat16()
        elif case == "wide_hidden":
            x = torch.zeros(t, HIDDEN + 8, dtype=torch.bfloat16)
        elif case == "wrong_top_k":
            ids, w = ids[:, :1].contiguous(), w[:, :1].contiguous()
        elif case == "flat_hidden":
            x = x.flatten()
        elif case == "non_contiguous_hidden":
            x = torch.zeros(HIDDEN, t, dtype=torch.bfloat16).t()
        elif case == "non_contiguous_ids":
            ids = ids.t().contiguous().t()
        elif case == "expert_id_too_large":
            ids[t - 1, 0] = NUM_EXPERTS
        elif case == "expert_id_below_minus_one":
            ids[0, 1] = -2
        call = lambda: dispatcher.dispatch(x, ids, w)  # noqa: E731
    with pytest.raises(ValueError, match="nccl_ep dispatcher: "):
        call()
    assert not world.fake.violations, "the library was reached with bad arguments"
    if case == "foreign_dispatch_output":  # the genuine output can still be combined
        dispatcher.combine(torch.zeros_like(genuine.hidden_states), genuine)
    if path == "graph":
        res = world.context.get(NAME)
        assert res.borrower is None and world.context.borrower_of(NAME) is None
