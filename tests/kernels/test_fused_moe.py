"""Fused-MoE Triton kernels (interpreter on CPU) against the naive float64 MoE loop."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from execrt.core.interfaces import ExpertMajorDispatchOutput, StandardDispatchOutput
from execrt.kernels.fused_moe import (
    GemmTile,
    MoEAlignment,
    MoEConfig,
    config_file_name,
    default_config,
    get_config,
    max_padded_pairs,
)
from execrt.kernels.fused_moe import config as config_module
from execrt.kernels.fused_moe import fused_experts as _fused_experts
from execrt.kernels.fused_moe import moe_align as _moe_align
from execrt.testing.oracles import compare, moe_oracle
from tests.conftest import requires_cuda
from tests.kernels.moe_cases import ROUTINGS, expert_weights, routing

pytest.importorskip("triton")

# The small cases run under the Triton interpreter on CPU machines and compiled on CUDA ones:
# inputs go to the kernels' device, results come back to the caller's.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    align = _moe_align(ids.to(DEVICE), num_experts, block_m)
    return MoEAlignment(*(t.to(ids.device) for t in align))


def fused_experts(d, w13: torch.Tensor, w2: torch.Tensor, config=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    home = d.hidden_states.device
    moved = dataclasses.replace(
        d,
        **{
            f.name: getattr(d, f.name).to(DEVICE)
            for f in dataclasses.fields(d)
            if isinstance(getattr(d, f.name), torch.Tensor)
        },
    )
    return _fused_experts(moved, w13.to(DEVICE), w2.to(DEVICE), config).to(home)


# Small tiles so tiny shapes still span several M-blocks and N-tiles, with ragged K (H=48 over
# BLOCK_K 32, I=40 over 16) and N (I=40 over BLOCK_N 16 wraps) edges.
H, I = 48, 40  # noqa: E741 - the intermediate size is I throughout the MoE code
SMALL = MoEConfig(16, GemmTile(16, 32, group_m=2), GemmTile(32, 16, group_m=1))
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``torch.empty`` the kernels' wrappers allocate starts as NaN / -7777, so an
    element a kernel forgets to write (or a consumer reads unwritten) shows up."""
    real = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = real(*args, **kwargs)  # type: ignore[call-overload]
        return t.fill_(float("nan") if t.is_floating_point() else -7777)

    monkeypatch.setattr(torch, "empty", empty)


def expected_alignment(ids: list[list[int]], e: int, block_m: int) -> tuple[list[int], list[int]]:
    """Segment layout from first principles: pairs of expert 0, padding, pairs of expert 1..."""
    flat = [i for row in ids for i in row]
    sentinel = len(flat)
    slots: list[int] = []
    blocks: list[int] = []
    for expert in range(e):
        pairs = [p for p, i in enumerate(flat) if i == expert]
        if not pairs:
            continue
        padded = -(-len(pairs) // block_m) * block_m
        slots += pairs + [sentinel] * (padded - len(pairs))
        blocks += [expert] * (padded // block_m)
    return slots, blocks


def check_alignment(ids: torch.Tensor, e: int, block_m: int) -> None:
    align = moe_align(ids, e, block_m)
    slots, blocks = expected_alignment(ids.tolist(), e, block_m)
    size = max_padded_pairs(ids.numel(), e, block_m)
    assert align.sorted_ids.shape == (size,) and align.expert_ids.shape == (size // block_m,)
    assert align.sorted_ids.dtype == align.expert_ids.dtype == torch.int32
    assert len(slots) <= size  # the fixed bound holds
    assert align.num_tokens_post_padded.tolist() == [len(slots)]
    sentinel = ids.numel()
    assert align.sorted_ids.tolist() == slots + [sentinel] * (size - len(slots))
    assert align.expert_ids.tolist() == blocks + [-1] * (size // block_m - len(blocks))


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(0, 24),
    e=st.integers(1, 20),
    k=st.integers(1, 4),
    block_m=st.sampled_from([16, 32]),
    drop=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_align_segments(t: int, e: int, k: int, block_m: int, drop: float, seed: int) -> None:
    k = min(k, e)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.randperm(e, generator=gen)[:k] for _ in range(t)]
        or [torch.zeros(k, dtype=torch.int64)]
    )[:t]
    ids[torch.rand(ids.shape, generator=gen) < drop] = -1
    check_alignment(ids, e, block_m)


def test_align_many_blocks_int32_and_out_of_range_ids() -> None:
    ids, _ = routing("some_nonlocal", 300, 128, 8)  # 2400 pairs: many scatter blocks
    check_alignment(ids.to(torch.int32), 128, 16)
    ids, _ = routing("one_expert", 70, 6, 3)  # one segment spans many M-blocks
    check_alignment(ids, 6, 32)
    wild = torch.tensor([[0, 7], [9, 1]])  # ids >= E are not local: dropped like -1
    align = moe_align(wild, 2, 16)
    assert align.sorted_ids.tolist()[:32] == [0] + [4] * 15 + [3] + [4] * 15
    assert align.expert_ids.tolist()[:2] == [0, 1]


def test_align_small_batch_bound() -> None:
    # T*K < E: at most T*K experts are hit, so the buffer is T*K*BLOCK_M, not E*(BLOCK_M-1).
    assert max_padded_pairs(8, 128, 16) == 8 * 16
    assert max_padded_pairs(2048, 128, 16) == 2048 + 128 * 15
    assert max_padded_pairs(0, 128, 16) == 0
    ids = torch.tensor([[5, 3, 9]])
    align = moe_align(ids, 128, 16)
    assert align.sorted_ids.shape == (48,) and align.num_tokens_post_padded.tolist() == [48]
    assert align.expert_ids.tolist() == [3, 5, 9]


def run_standard(
    name: str, t: int, e: int, k: int, dtype: torch.dtype, config: MoEConfig | None
) -> None:
    ids, w = routing(name, t, e, k, seed=t + e)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(e)).to(dtype)
    w13, w2 = expert_weights(e, H, I, dtype)
    out = fused_experts(StandardDispatchOutput(x, ids, w), w13, w2, config)
    assert out.shape == (t, H) and out.dtype == dtype
    ref = moe_oracle(x, ids, w, w13, w2)
    if name == "all_nonlocal":
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert compare(out, ref).ok(TOL[dtype]), compare(out, ref)


@pytest.mark.parametrize("name", ROUTINGS)
def test_standard_routings(name: str) -> None:
    run_standard(name, 9, 5, 2, torch.float32, SMALL)


@pytest.mark.parametrize(
    ("name", "t", "e", "k", "config"),
    [
        ("shuffled", 1, 12, 3, None),  # T*K < E, default config (tiles clamp to the shapes)
        ("one_expert", 40, 3, 2, SMALL),  # one expert's segment spans three M-blocks
        ("some_nonlocal", 13, 7, 3, SMALL),
    ],
)
def test_standard_shapes_fp16(name: str, t: int, e: int, k: int, config: MoEConfig) -> None:
    run_standard(name, t, e, k, torch.float16, config)


def test_standard_zero_tokens_int32_ids_and_strided_hidden() -> None:
    w13, w2 = expert_weights(4, H, I, torch.float32)
    empty = torch.zeros(0, 2, dtype=torch.int64)
    out = fused_experts(StandardDispatchOutput(torch.zeros(0, H), empty, empty.float()), w13, w2)
    assert out.shape == (0, H)
    ids, w = routing("shuffled", 6, 4, 2)
    wide = torch.randn(6, H + 16)
    x = wide[:, 8 : 8 + H]  # row stride H + 16
    out = fused_experts(StandardDispatchOutput(x, ids.int(), w), w13, w2, SMALL)
    assert compare(out, moe_oracle(x, ids, w, w13, w2)).ok(1e-5)


def test_standard_column_major_hidden() -> None:
    # A transposed [T, H] view (unit stride along T): the result must still be the right rows,
    # not the sum kernel's row-major writes through the view's column-major strides.
    w13, w2 = expert_weights(4, H, I, torch.float32)
    ids, w = routing("shuffled", 5, 4, 2)
    x = torch.randn(H, 5, generator=torch.Generator().manual_seed(3)).t()  # strides (1, 5)
    out = fused_experts(StandardDispatchOutput(x, ids, w), w13, w2, SMALL)
    assert compare(out, moe_oracle(x, ids, w, w13, w2)).ok(1e-5)


@pytest.mark.parametrize(("dtype", "poison"), [(torch.float32, 1e30), (torch.float16, 6e4)])
def test_expert_major_ignores_rows_past_count(dtype: torch.dtype, poison: float) -> None:
    e, slots = 4, 20  # two M-blocks per expert
    counts = torch.tensor([0, 20, 3, 17], dtype=torch.int32)
    x = torch.randn(e, slots, H, generator=torch.Generator().manual_seed(5)).to(dtype)
    for expert in range(e):
        x[expert, int(counts[expert]) :] = poison
    w13, w2 = expert_weights(e, H, I, dtype)
    out = fused_experts(ExpertMajorDispatchOutput(x, counts, num_tokens=10), w13, w2, SMALL)
    assert out.shape == x.shape and out.dtype == dtype
    for expert in range(1, e):
        c = int(counts[expert])
        ids = torch.full((c, 1), expert, dtype=torch.int64)
        ref = moe_oracle(x[expert, :c], ids, torch.ones(c, 1), w13, w2)  # unweighted
        assert compare(out[expert, :c], ref).ok(TOL[dtype]), expert


def test_invalid_inputs_are_named() -> None:
    w13, w2 = expert_weights(4, H, I, torch.float32)
    x = torch.zeros(2, H)
    ids, w = torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0)
    with pytest.raises(ValueError, match="top_k 0 unsupported"):
        fused_experts(StandardDispatchOutput(x, ids, w), w13, w2)
    ids, w = torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1)
    with pytest.raises(ValueError, match="dtypes"):
        fused_experts(StandardDispatchOutput(x.half(), ids, w), w13, w2)
    with pytest.raises(ValueError, match="disagree"):
        fused_experts(StandardDispatchOutput(x, ids, w), w13, w2[:, :, :8])
    with pytest.raises(ValueError, match="block_m 24 unsupported"):
        moe_align(ids, 4, 24)
    with pytest.raises(ValueError, match="block_n 48 unsupported"):
        GemmTile(48, 64)


def test_config_table_nearest_key(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    def cfg(block_m: int) -> dict[str, object]:
        return MoEConfig(block_m, GemmTile(32, 64), GemmTile(64, 64)).to_json()

    name = config_file_name(8, 64, "Fake GPU X", torch.bfloat16)
    assert name == "E=8,N=64,device_name=Fake_GPU_X,dtype=bfloat16.json"
    table = {"meta": {"tuned": False}, "configs": {"1": cfg(16), "64": cfg(32), "512": cfg(64)}}
    (tmp_path / name).write_text(json.dumps(table))
    monkeypatch.setattr(config_module, "CONFIG_DIR", str(tmp_path))
    config_module.load_config_table.cache_clear()
    picks = [get_config(8, 64, m, 2, torch.bfloat16, "Fake GPU X") for m in (1, 30, 40, 9999)]
    assert [c.block_m for c in picks] == [16, 16, 32, 64]
    # No table for this dtype: the batch-aware default, whose block_m grows with the rows.
    assert get_config(8, 64, 1, 2, torch.float16, "Fake GPU X") == default_config(1, 8, 2)
    config_module.load_config_table.cache_clear()


def test_default_config_grows_with_batch_and_shipped_tables_parse() -> None:
    sizes = [default_config(m, 128, 8).block_m for m in (1, 16, 256, 1024, 8192)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] >= 64
    files = [f for f in os.listdir(config_module.CONFIG_DIR) if f.endswith(".json")]
    assert files, "no shipped configs"
    for f in files:
        table = config_module.load_config_table(os.path.join(config_module.CONFIG_DIR, f))
        assert table and all(isinstance(c, MoEConfig) for c in table.values())


def test_package_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import execrt.kernels.fused_moe as m\n"
        "assert m.default_config(1, 8, 2).block_m == 16\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd())


# ----------------------------------------------------------------------------------------------
# GPU: real Qwen3-30B-A3B shapes in bf16, CUDA-graph capture
# ----------------------------------------------------------------------------------------------

REAL_E, REAL_H, REAL_I, REAL_K = 128, 2048, 768, 8


def real_problem(t: int) -> tuple[StandardDispatchOutput, torch.Tensor, torch.Tensor]:
    ids, w = routing("shuffled", t, REAL_E, REAL_K, seed=t)
    gen = torch.Generator(device="cuda").manual_seed(t)
    bf, dev = torch.bfloat16, "cuda"
    w13 = torch.randn(REAL_E, 2 * REAL_I, REAL_H, device=dev, generator=gen) * REAL_H**-0.5
    w2 = torch.randn(REAL_E, REAL_H, REAL_I, device=dev, generator=gen) * REAL_I**-0.5
    x = torch.randn(t, REAL_H, device=dev, generator=gen).to(bf)
    return StandardDispatchOutput(x, ids.to(dev), w.to(dev)), w13.to(bf), w2.to(bf)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 300])
def test_gpu_bf16_real_shapes(t: int) -> None:
    d, w13, w2 = real_problem(t)
    out = fused_experts(d, w13, w2)
    ref = moe_oracle(d.hidden_states, d.topk_ids, d.topk_weights, w13, w2)
    assert compare(out, ref).ok(1e-2), compare(out, ref)


@requires_cuda
@pytest.mark.gpu
def test_gpu_expert_major_bf16() -> None:
    e, slots = 16, 48
    counts = torch.tensor([(i * 7) % 49 for i in range(e)], dtype=torch.int32, device="cuda")
    x = torch.randn(e, slots, REAL_H, device="cuda", dtype=torch.bfloat16)
    for expert in range(e):
        x[expert, int(counts[expert]) :] = 3e38
    w13, w2 = (w.cuda() for w in expert_weights(e, REAL_H, REAL_I, torch.bfloat16))
    out = fused_experts(ExpertMajorDispatchOutput(x, counts, num_tokens=slots), w13, w2)
    for expert in range(e):
        c = int(counts[expert])
        if c:
            ids = torch.full((c, 1), expert, dtype=torch.int64, device="cuda")
            ones = torch.ones(c, 1, device="cuda")
            ref = moe_oracle(x[expert, :c], ids, ones, w13, w2)
            assert compare(out[expert, :c], ref).ok(1e-2), expert


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 48])
def test_gpu_graph_replay_bitwise_equals_eager_without_sync(t: int) -> None:
    d, w13, w2 = real_problem(t)
    d.topk_ids[0, 0] = -1  # a slot of another rank
    eager = fused_experts(d, w13, w2)  # compiles the kernels outside capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = fused_experts(d, w13, w2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(d, w13, w2)
    d.hidden_states.normal_()  # replay must read the new inputs
    graph.replay()
    fresh = fused_experts(d, w13, w2)
    torch.cuda.synchronize()
    assert torch.equal(again, eager)
    assert torch.equal(out, fresh)
