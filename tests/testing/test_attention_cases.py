"""The attention suite's generated steps stay within the device profile."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execrt.testing.attention_cases import draw_step
from execrt.testing.attention_scenarios import CPU_PROFILE, CUDA_PROFILE


@settings(max_examples=60, deadline=None)
@given(data=st.data(), cuda=st.booleans())
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_drawn_steps_fit_the_profile(mode: str, data, cuda: bool) -> None:  # type: ignore[no-untyped-def]
    prof = CUDA_PROFILE if cuda else CPU_PROFILE
    step = draw_step(data, prof, mode)
    assert step.mode == mode
    assert 1 <= step.batch_size <= prof.max_generated_batch
    assert len(step.extend_lens) == step.batch_size
    if mode == "decode":  # one new token on a context of 1..max (the new token included)
        assert step.extend_lens == (1,) * step.batch_size
        assert all(0 <= p < prof.max_generated_context for p in step.prefix_lens)
    else:
        assert all(0 <= p <= prof.max_generated_context for p in step.prefix_lens)
        assert all(1 <= n <= prof.max_generated_extend for n in step.extend_lens)
    assert step.padded_rows == 0
