"""What a generate() call accepts as prompts and sampling parameters: numpy / torch integer
prompts are one prompt of Python ints, a bad prompt gets one problem naming its type."""

from __future__ import annotations

import pytest
import torch

from execrt.core.prompts import broadcast_sampling_params, prompt_token_ids, split_prompts
from execrt.core.schedule import SamplingParams

np = pytest.importorskip("numpy", reason="numpy prompts need numpy")
KINDS = "prompt must be text, a sequence of int token ids or a 1-D integer array / tensor, got"


@pytest.mark.parametrize(
    "prompt",
    [
        [5, 6, 7],
        (5, 6, 7),
        [np.int64(5), np.int32(6), np.uint8(7)],
        np.array([5, 6, 7]),
        np.array([5, 6, 7], dtype=np.uint16),
        torch.tensor([5, 6, 7]),
        torch.tensor([5, 6, 7], dtype=torch.int32),
    ],
    ids=repr,
)
def test_integer_prompts_of_every_kind_are_one_prompt_of_python_ints(prompt) -> None:
    batch, single = split_prompts(prompt)
    assert single and len(batch) == 1
    ids, problem = prompt_token_ids(batch[0])
    assert problem is None and ids == [5, 6, 7]
    assert all(type(t) is int for t in ids)


@pytest.mark.parametrize(
    "prompt, problem",
    [
        (np.array([[5, 6, 7]]), f"{KINDS} a 2-D ndarray of int64"),
        (torch.tensor(3), f"{KINDS} a 0-D Tensor of torch.int64"),
        (torch.tensor([1.5, 2.0]), f"{KINDS} a 1-D Tensor of torch.float32 holding float 1.5"),
        (np.array([True, False]), f"{KINDS} a 1-D ndarray of bool holding bool True"),
        ([True, 2], f"{KINDS} a list holding bool True"),
        ([1, "2", "3"], f"{KINDS} a list holding str '2'"),
        ({"ids": [1]}, f"{KINDS} dict"),
        (b"hello", f"{KINDS} bytes"),
        (5, f"{KINDS} int"),
    ],
    ids=repr,
)
def test_a_bad_prompt_is_one_prompt_with_one_problem_naming_its_type(prompt, problem) -> None:
    batch, single = split_prompts(prompt)
    assert single and len(batch) == 1  # not one error per element
    assert prompt_token_ids(batch[0]) == ([], problem)


def test_a_sequence_of_prompts_is_a_batch() -> None:
    prompts = ["text", [1, 2], np.array([3]), torch.tensor([4, 5])]
    batch, single = split_prompts(prompts)
    assert not single and batch == prompts
    assert [prompt_token_ids(p)[0] for p in batch[1:]] == [[1, 2], [3], [4, 5]]
    assert split_prompts([]) == ([], False)


def test_sampling_params_are_shared_per_prompt_or_reported_with_their_own_type() -> None:
    sp = SamplingParams(temperature=0)
    assert broadcast_sampling_params(sp, 2) == [sp, sp]
    assert broadcast_sampling_params(None, 1) == [SamplingParams()]
    assert broadcast_sampling_params([sp, None], 2) == [sp, None]
    # A dict is one (wrong) value for every prompt, not a list of its keys.
    assert broadcast_sampling_params({"temperature": 0}, 2) == [{"temperature": 0}] * 2
    with pytest.raises(ValueError, match="engine: 3 sampling_params for 2 prompts"):
        broadcast_sampling_params((sp, sp, sp), 2)


def test_engine_takes_numpy_and_tensor_prompts_and_names_a_bad_params_type() -> None:
    from execrt import Engine

    greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    with Engine(device="cpu") as engine:
        ref = engine.generate([5, 6, 7], greedy)
        assert engine.generate(np.array([5, 6, 7]), greedy).token_ids == ref.token_ids
        assert engine.generate(torch.tensor([5, 6, 7]), greedy).token_ids == ref.token_ids
        both = engine.generate([[np.int64(5), 6, 7], torch.tensor([5, 6, 7])], greedy)
        assert [r.token_ids for r in both] == [ref.token_ids] * 2
        bad = engine.generate(np.zeros((2, 3), dtype=np.int64), greedy)
        assert bad.finish_reason == "error" and "2-D ndarray" in (bad.error or "")
        wrong = engine.generate([5, 6, 7], {"temperature": 0.0})  # type: ignore[arg-type]
        assert wrong.finish_reason == "error" and "dict" in (wrong.error or "")


def test_text_problem_names_the_first_lone_surrogate_and_its_position() -> None:
    from execrt.core.prompts import text_problem

    assert text_problem("héllo ✓ 🎉") is None and text_problem("") is None
    assert text_problem("ab\ud800c\udfff") == (
        "text is not valid Unicode: character 2 is the lone surrogate '\\ud800'"
    )
    assert text_problem("\udc80") == (
        "text is not valid Unicode: character 0 is byte 0x80, which is not UTF-8"
    )
