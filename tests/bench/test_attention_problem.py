"""The decode benchmark's problem: per-request lengths are checked before anything is built
(the problem itself allocates on a GPU)."""

from __future__ import annotations

import pytest
import torch

from execrt.bench.attention import DecodeProblem


@pytest.mark.parametrize(
    "lens", [[5], [5, 0, 3], [5, 3, 2, 1]], ids=["too-few", "a-zero-length", "too-many"]
)
def test_ragged_lengths_must_be_one_positive_length_per_request(lens: list[int]) -> None:
    with pytest.raises(ValueError, match=r"lens \[.*\] unsupported: must be 3 positive lengths"):
        DecodeProblem(3, 8, 4, 2, 16, torch.float32, lens=lens)
