"""Softmax top-k routing: Triton kernel vs the torch reference vs an fp64 oracle."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from execrt.kernels.router import topk_softmax, topk_softmax_torch
from tests.kernels.helpers import DEVICE, assert_within_ulps, needs_cuda, replay_matches_eager

# The interpreter computes bfloat16 wrongly (see the attention suites); bf16 runs on a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def oracle(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, ...]:
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (60, 4), (128, 8), (16, 1), (5, 5)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_matches_reference_and_oracle(
    dtype: torch.dtype, experts: int, top_k: int, renormalize: bool, tokens: int
) -> None:
    gen = torch.Generator().manual_seed(experts * 1000 + top_k * 10 + tokens)
    # Distinct logits in every row (a random order of a 1/16 grid, exact in fp16 and bf16): with
    # ties torch.topk's order is unspecified, so the ids could not be compared.
    ranks = torch.stack([torch.randperm(experts + 3, generator=gen) for _ in range(tokens)])
    wide = ((ranks - experts / 2) / 16).to(dtype).to(DEVICE)
    logits = wide[:, :experts]  # a row stride wider than E
    ids, weights = topk_softmax(logits, top_k, renormalize, use_triton=True)
    assert ids.shape == weights.shape == (tokens, top_k)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    ref_ids, ref_weights = topk_softmax_torch(logits, top_k, renormalize)
    exact_ids, exact_weights = oracle(logits, top_k, renormalize)
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and torch.equal(ids.cpu(), exact_ids.cpu())
    # fp32: softmax and renormalisation cost a few ulps; fp16/bf16: both round once to the
    # logits' dtype from fp32 values a few fp32 ulps apart.
    ulps = 8 if dtype == torch.float32 else 1
    assert_within_ulps(weights, ref_weights, ulps, dtype)
    assert_within_ulps(weights, exact_weights, ulps, dtype)
    assert bool((weights[:, :-1] >= weights[:, 1:]).all()), "most probable first"
    if renormalize and dtype == torch.float32:
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(tokens), rtol=1e-6, atol=0)


def test_padded_rows_route_nowhere() -> None:
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    real = torch.tensor([3], device=DEVICE)
    ids, weights = topk_softmax(logits, 4, True, real, use_triton=True)
    ref_ids, ref_weights = topk_softmax_torch(logits, 4, True, real)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    assert bool((ids[3:] == -1).all()) and bool((ids[:3] >= 0).all())
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)
    none, _ = topk_softmax(logits, 4, True, torch.tensor([0], device=DEVICE), use_triton=True)
    assert bool((none == -1).all())


def test_ties_pick_the_lowest_expert_ids() -> None:
    logits = torch.zeros(2, 12, device=DEVICE)
    logits[1, 7] = 1.0  # one clear winner, then eleven equals
    ids, weights = topk_softmax(logits, 3, True, use_triton=True)
    assert ids.tolist() == [[0, 1, 2], [7, 0, 1]]
    torch.testing.assert_close(weights[0].cpu(), torch.full((3,), 1 / 3), rtol=1e-6, atol=0)


def test_extreme_logits_stay_finite() -> None:
    # exp(-57) and exp(-60) stay normal in fp32, exp(-120) and exp(-inf) are 0.
    logits = torch.tensor([[60.0, -60.0, 0.0, -float("inf"), 3.0]], device=DEVICE)
    ids, weights = topk_softmax(logits, 3, False, use_triton=True)
    ref_ids, ref_weights = topk_softmax_torch(logits, 3, False)
    assert ids.tolist() == ref_ids.tolist() == [[0, 4, 2]]
    assert bool(torch.isfinite(weights).all()) and float(weights[0, 0]) == 1.0
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=0)


def test_empty_batch() -> None:
    ids, weights = topk_softmax(torch.empty(0, 8, device=DEVICE), 2, True, use_triton=True)
    assert ids.shape == weights.shape == (0, 2)


@pytest.mark.parametrize(
    ("shape", "top_k", "match"),
    [((4,), 1, r"logits \(4,\) must be \[T, E\]"), ((2, 4), 5, "top_k 5 unsupported"),
     ((2, 4), 0, "top_k 0 unsupported")],
)  # fmt: skip
def test_bad_arguments_are_named(shape: tuple[int, ...], top_k: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        topk_softmax(torch.zeros(shape, device=DEVICE), top_k, True, use_triton=True)


@needs_cuda
def test_graph_replay_matches_eager() -> None:
    logits = torch.randn(9, 128, device="cuda", dtype=torch.bfloat16)
    real = torch.tensor([6], device="cuda")

    def route() -> tuple[torch.Tensor, torch.Tensor]:
        return topk_softmax(logits, 8, True, real, use_triton=True)

    fresh = [torch.randn(9, 128, dtype=torch.bfloat16), torch.tensor([4])]
    replay_matches_eager(route, [logits, real], fresh)
