"""The host's grid and tile arithmetic: plain ints, not Triton's constexpr functions."""

from __future__ import annotations

import pathlib
import re

import pytest

from execrt.kernels._triton import cdiv, next_power_of_2


@pytest.mark.parametrize("a", [0, 1, 2, 15, 16, 17, 151936, 2**40 + 3])
@pytest.mark.parametrize("b", [1, 2, 16, 1024, 3])
def test_cdiv_is_the_ceiling_of_the_quotient(a: int, b: int) -> None:
    q = cdiv(a, b)
    assert (q - 1) * b < a <= q * b  # exact in ints, also beyond float precision


@pytest.mark.parametrize("n", [0, 1, 2, 3, 64, 65, 1000, 151936])
def test_next_power_of_2_is_the_smallest_at_least_n(n: int) -> None:
    p = next_power_of_2(n)
    assert p >= max(n, 1) and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


def test_host_code_calls_neither_of_tritons_constexpr_helpers() -> None:
    """``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions (Triton >= 3.5):
    a few µs per host call, a dozen calls per layer of an eager prefill. Kernels use
    ``tl.cdiv``; host code uses ``execrt.kernels._triton``'s."""
    root = pathlib.Path(__file__).resolve().parents[2] / "execrt"
    found = [
        f"{path.relative_to(root)}:{i}"
        for path in root.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\btriton\.(cdiv|next_power_of_2)\(", line)
    ]
    assert not found, f"use execrt.kernels._triton's cdiv / next_power_of_2 at {found}"
