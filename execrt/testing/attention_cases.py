"""Generated attention steps: the random decode and extend batches the attention suite draws."""

from __future__ import annotations

from typing import Any

from execrt.testing.attention_harness import Step
from execrt.testing.attention_scenarios import Profile


def draw_step(data: Any, profile: Profile, mode: str) -> Step:
    """One random ``mode`` step within ``profile``, drawn from hypothesis's ``st.data()``:
    1 to ``max_generated_batch`` requests, slots permuted or not; decode draws each context
    length (the new token included), extend each cached prefix and new-token count."""
    from hypothesis import strategies as st

    b = data.draw(st.integers(1, profile.max_generated_batch), label="batch size")
    lens = st.lists(st.integers(1, profile.max_generated_context), min_size=b, max_size=b)
    permuted = data.draw(st.booleans(), label="permuted slots")
    if mode == "decode":
        return Step.decode(data.draw(lens, label="context lens"), permuted=permuted)
    prefix = st.lists(st.integers(0, profile.max_generated_context), min_size=b, max_size=b)
    new = st.lists(st.integers(1, profile.max_generated_extend), min_size=b, max_size=b)
    return Step.extend(
        data.draw(prefix, label="prefix lens"),
        data.draw(new, label="extend lens"),
        permuted=permuted,
    )
