"""Routing scenarios and weights shared by the expert-compute tests (torch path and Triton)."""

from __future__ import annotations

import torch

ROUTINGS = ("shuffled", "balanced", "one_expert", "some_nonlocal", "all_nonlocal")


def routing(
    name: str, num_tokens: int, num_experts: int, top_k: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [T, K]`` int64 local ids (-1 = not here; never twice in one row) and
    ``topk_weights [T, K]`` fp32 for a named scenario."""
    gen = torch.Generator().manual_seed(seed)
    t, e, k = num_tokens, num_experts, top_k
    ids = torch.empty(t, k, dtype=torch.int64)
    for row in range(t):
        if name == "balanced":  # expert loads differ by at most one
            ids[row] = (torch.arange(k) + row * k) % e
        elif name == "one_expert":  # every token picks expert e-1, in a random slot
            ids[row] = torch.cat([torch.tensor([e - 1]), torch.randperm(e - 1, generator=gen)])[:k]
            ids[row] = ids[row][torch.randperm(k, generator=gen)]
        else:  # top-k picks in any order
            ids[row] = torch.randperm(e, generator=gen)[:k]
    if name == "some_nonlocal":
        ids.masked_fill_(torch.rand(t, k, generator=gen) < 0.4, -1)
    elif name == "all_nonlocal":
        ids.fill_(-1)
    weights = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return ids, weights


def expert_weights(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``, unit-scale outputs."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)
