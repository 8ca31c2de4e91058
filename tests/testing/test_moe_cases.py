"""The MoE suite's routing scenarios keep their promises, and its generated draws stay in range."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from execrt.testing.moe_cases import (
    CPU_PROFILE,
    GENERATED_ROUTINGS,
    ROUTINGS,
    UNNORMALISED,
    generated_draws,
    routing,
)

E, K = 8, 2


def draw(name: str, tokens: int = 12, world: int = 2, k: int = K) -> tuple[torch.Tensor, ...]:
    return routing(name, tokens, E, k, world, torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", ROUTINGS)
def test_every_scenario_gives_valid_ids_and_its_kind_of_weights(name: str) -> None:
    ids, weights = draw(name)
    assert ids.shape == weights.shape == (12, K)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ((ids >= -1) & (ids < E)).all()
    assert (weights > 0).all()
    if name in UNNORMALISED:  # the top-k of a softmax over all E experts: less than 1
        assert (weights.sum(1) < 0.999).all(), weights.sum(1)
    else:
        torch.testing.assert_close(weights.sum(1), torch.ones(12))
    for row in ids.tolist():  # a token never picks one expert twice
        picked = [e for e in row if e >= 0]
        assert len(picked) == len(set(picked)), row


def test_each_scenario_has_its_shape() -> None:
    per_rank = E // 2
    counts = torch.bincount(draw("balanced")[0].flatten(), minlength=E)
    assert counts.max() - counts.min() <= 1  # 24 picks over 8 experts: 3 each
    assert (draw("some_masked")[0] == -1).any() and (draw("random")[0] >= 0).all()
    assert (draw("hot_expert")[0] == E - 1).any(1).all()
    assert (draw("many_tokens", tokens=300)[0] == E - 1).any(1).all()  # 300 rows for one expert
    assert (draw("empty_rank")[0] < per_rank).all()  # nothing for rank 1's experts
    assert (draw("all_masked")[0] == -1).all()
    for row in draw("duplicates_within_rank")[0].tolist():
        assert len({e // per_rank for e in row if e >= 0}) == 1, row
    ids, weights = draw("random", tokens=0)
    assert ids.shape == weights.shape == (0, K)


def test_scenarios_are_reproducible_from_the_generator() -> None:
    for name in ROUTINGS:
        assert all(torch.equal(a, b) for a, b in zip(draw(name), draw(name), strict=True)), name


@settings(max_examples=40, deadline=None)
@given(data=st.data(), max_top_k=st.one_of(st.none(), st.integers(1, 8)))
def test_generated_draws_stay_within_the_profile_and_capabilities(data, max_top_k) -> None:  # type: ignore[no-untyped-def]
    draws = generated_draws(st, CPU_PROFILE, max_top_k)
    assert set(draws) == {"num_tokens", "top_k", "scenario"}
    tokens = data.draw(draws["num_tokens"])
    top_k = data.draw(draws["top_k"])
    assert 0 <= tokens <= 2 * CPU_PROFILE.num_tokens
    assert 1 <= top_k <= min(4, max_top_k or 4)
    assert data.draw(draws["scenario"]) in GENERATED_ROUTINGS
