"""What the MoE dispatcher suite runs: problem sizes per device, the named routing scenarios,
and the draws of its generated test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from execrt.testing.suite import STANDARD_DTYPES


@dataclass(frozen=True)
class MoEProfile:
    num_experts: int
    hidden_size: int
    hidden_sizes: tuple[int, ...]  # the hidden-size axis
    intermediate_size: int
    num_tokens: int
    top_k: int
    dtypes: tuple[torch.dtype, ...]  # preference order for the primary dtype
    max_examples: int
    #: The expert-count axis (world size 1): not powers of two, and as many as real models have.
    expert_counts: tuple[int, ...] = (12, 60)
    #: Tokens per rank of the ``many_tokens`` scenario: one expert gets more rows than an int8
    #: or uint8 count holds.
    many_tokens: int = 300


# The odd hidden size 72 (not a multiple of 32 or of a power-of-two block): a dispatcher that
# declares no hidden_sizes takes every one.
CPU_PROFILE = MoEProfile(8, 64, (64, 72, 96), 32, 9, 2, STANDARD_DTYPES, 10)
CUDA_PROFILE = MoEProfile(
    16,
    1024,
    (1024, 2048),
    512,
    64,
    4,
    (torch.bfloat16, torch.float16, torch.float32),
    25,
    expert_counts=(60, 128),
)

#: Routing scenarios every world size runs (see ``routing``).
ROUTINGS = (
    "random",
    "balanced",
    "some_masked",
    "hot_expert",
    "empty_rank",
    "all_masked",
    "duplicates_within_rank",
    "zero_tokens",
    "many_tokens",
)
#: Scenarios whose routing weights do not sum to 1 per token (a model with norm_topk_prob
#: false): a dispatcher must apply them as given, never renormalise.
UNNORMALISED = frozenset({"balanced", "hot_expert", "duplicates_within_rank"})
#: The scenarios the generated test draws from (at any token count and top-k).
GENERATED_ROUTINGS = ("random", "some_masked", "hot_expert")


def routing(
    name: str, num_tokens: int, num_experts: int, top_k: int, world: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [T, K]`` int64 (-1 = none) and ``topk_weights [T, K]`` fp32 for a scenario."""
    t, e, k = num_tokens, num_experts, top_k
    per_rank = e // world
    ids = torch.zeros(t, k, dtype=torch.int64)
    for row in range(t):
        ids[row] = torch.randperm(e, generator=gen)[:k]
    if name == "balanced":  # every expert gets floor or ceil of T*K/E rows (K <= E)
        perm = torch.randperm(e, generator=gen)
        ids = perm[torch.arange(t * k).view(t, k) % e]
    elif name == "some_masked":
        ids[torch.rand(t, k, generator=gen) < 0.4] = -1
    elif name in ("hot_expert", "many_tokens"):  # every token picks the last expert (last rank)
        for row in range(t):
            others = torch.randperm(e - 1, generator=gen)[: k - 1]
            ids[row] = torch.cat([torch.tensor([e - 1]), others])
    elif name == "empty_rank":  # nothing reaches the last rank's experts (or the upper half)
        allowed = per_rank * (world - 1) if world > 1 else max(e // 2, k)
        for row in range(t):
            pick = torch.randperm(allowed, generator=gen)[:k]
            ids[row] = torch.cat([pick, torch.full((k - pick.numel(),), -1)])
    elif name == "all_masked":
        ids.fill_(-1)
    elif name == "duplicates_within_rank":  # a token's experts all live on one rank
        for row in range(t):
            rank = row % world
            pick = torch.randperm(per_rank, generator=gen)[: min(k, per_rank)] + rank * per_rank
            ids[row] = torch.cat([pick, torch.full((k - pick.numel(),), -1)])
    if name in UNNORMALISED:  # top-k of a softmax over every expert (norm_topk_prob false)
        weights = torch.softmax(torch.randn(t, e, generator=gen), -1)[:, :k].float()
    else:
        weights = torch.softmax(torch.randn(t, k, generator=gen), -1).float()
    return ids.long(), weights


def generated_draws(strategies: Any, profile: MoEProfile, max_top_k: int | None) -> dict[str, Any]:
    """The generated test's hypothesis strategies, by argument: a token count up to twice the
    profile's (0 included), a top-k up to 4 (and the declared maximum), a scenario."""
    return {
        "num_tokens": strategies.integers(0, 2 * profile.num_tokens),
        "top_k": strategies.integers(1, min(4, max_top_k or 4)),
        "scenario": strategies.sampled_from(GENERATED_ROUTINGS),
    }
