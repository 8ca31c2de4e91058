"""SamplingParams validation, and ScheduleBatch: which requests of a step sample."""

from __future__ import annotations

import pytest
import torch

from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.core.staging import HostToDevice
from execrt.core.step import ForwardMode, StepInputs

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": "hot"}, "temperature 'hot' has type str (accepted: float or int)"),
        ({"temperature": True}, "temperature True has type bool (accepted: float or int)"),
        ({"top_p": None}, "top_p None has type NoneType (accepted: float or int)"),
        ({"top_k": 2.0}, "top_k 2.0 has type float (accepted: int)"),
        ({"seed": "1"}, "seed '1' has type str (accepted: int or None)"),
        ({"seed": False}, "seed False has type bool (accepted: int or None)"),
        ({"max_new_tokens": 2.0}, "max_new_tokens 2.0 has type float (accepted: int)"),
        # an integer past 64 bits, as orjson reads a JSON body's 10**30
        ({"max_new_tokens": 1e30}, "max_new_tokens 1e+30 is out of range (accepted: int within"),
        ({"seed": 2.0**64}, "seed 1.845e+19 is out of range (accepted: int or None within 64"),
        ({"max_new_tokens": True}, "max_new_tokens True has type bool (accepted: int)"),
        ({"ignore_eos": "no"}, "ignore_eos 'no' has type str (accepted: bool)"),
        ({"ignore_eos": 1}, "ignore_eos 1 has type int (accepted: bool)"),
        ({"stop_token_ids": 3}, "stop_token_ids 3 has type int (accepted: a tuple or list of int)"),
        ({"stop_token_ids": "12"}, "stop_token_ids '12' has type str"),
        ({"stop_token_ids": (1, "2")}, "stop_token_ids (1, '2') has type tuple of int/str"),
        ({"stop_token_ids": {1, 2}}, "stop_token_ids {1, 2} has type set"),
        ({"max_new_tokens": 0}, "max_new_tokens 0 must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature -0.5 must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature nan must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature inf must be a finite number >= 0"),
        # inf in the sampler's fp32 (a masked logit then NaN, the draw token 0)
        ({"temperature": 1e39}, "temperature 1e+39 must be a finite number >= 0, at most 1e+06"),
        ({"temperature": 1e6 * 1.01}, "temperature 1010000.0 must be a finite number >= 0"),
        # 0 in fp32, which sent every seen token's positive logit to inf
        ({"repetition_penalty": 1e-45}, "repetition_penalty 1e-45 must be a finite number > 0"),
        ({"repetition_penalty": 1e7}, "repetition_penalty 10000000.0 must be a finite number"),
        ({"top_p": 0}, "top_p 0 must be in (0, 1]"),
        # the entry as written, not the pairs it is stored as
        ({"logit_bias": {"7": 1.0}}, "logit_bias entry '7': 1.0 has a token id of type str"),
        ({"logit_bias": {7: "up"}}, "logit_bias entry 7: 'up' has a bias of type str"),
        ({"logit_bias": [0, 1]}, "logit_bias (0, 1) has type tuple of int"),  # it raised
        ({"seed": 2**63}, f"seed {2**63} must be in [0, 2**63)"),
    ],
)
def test_each_problem_names_field_value_and_what_is_accepted(kwargs, message) -> None:
    problems = SamplingParams(**kwargs).problems()  # construction itself never raises
    assert problems == [message] or (len(problems) == 1 and problems[0].startswith(message))


def test_types_are_checked_before_values_so_nothing_raises() -> None:
    sp = SamplingParams(max_new_tokens="9", temperature=None, top_p="x", seed=-1.0)
    names = [p.split()[0] for p in sp.problems()]
    assert names == ["max_new_tokens", "temperature", "top_p", "seed"]


def test_good_values_of_every_accepted_type() -> None:
    for sp in (
        SamplingParams(),
        SamplingParams(max_new_tokens=1, temperature=0, top_k=5, top_p=1, seed=0),
        SamplingParams(temperature=0.7, top_p=0.5, seed=2**63 - 1, stop_token_ids=(1, 2)),
        SamplingParams(stop_token_ids=[4, 5], ignore_eos=True),
        SamplingParams(temperature=1e6, repetition_penalty=1e-6),  # the bounds themselves
        SamplingParams(temperature=1e6, repetition_penalty=1e6),
    ):
        assert sp.problems() == []


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers() -> None:
    np = pytest.importorskip("numpy")
    sp = SamplingParams(
        max_new_tokens=np.int32(4),
        temperature=np.float32(0.5),
        top_k=np.uint8(2),
        top_p=np.float16(0.5),
        seed=np.int64(3),
        stop_token_ids=[np.int64(7), 8],
    )
    assert sp.problems() == []
    assert (sp.max_new_tokens, sp.temperature, sp.top_k, sp.top_p, sp.seed) == (4, 0.5, 2, 0.5, 3)
    assert sp.stop_token_ids == (7, 8) and type(sp.seed) is int and type(sp.top_p) is float
    assert SamplingParams(seed=np.int64(3)) == SamplingParams(seed=3)  # same hash, same draws
    [bool_problem] = SamplingParams(seed=np.bool_(True)).problems()
    assert bool_problem.endswith(" has type bool (accepted: int or None)")
    [float_problem] = SamplingParams(seed=np.float64(3.0)).problems()
    assert float_problem.endswith(" has type float64 (accepted: int or None)")


def test_a_list_of_stop_ids_is_stored_as_a_tuple() -> None:
    sp = SamplingParams(stop_token_ids=[4, 5])
    assert sp.stop_token_ids == (4, 5) and sp == SamplingParams(stop_token_ids=(4, 5))
    assert hash(sp) == hash(SamplingParams(stop_token_ids=(4, 5)))


def _inputs(mode: ForwardMode, seq: list[int], lens: list[int]) -> StepInputs:
    tokens, reqs = (
        torch.zeros(sum(lens), dtype=torch.int64),
        torch.ones(len(seq), dtype=torch.int64),
    )
    prefix = [s - n for s, n in zip(seq, lens, strict=True)]
    return StepInputs(mode, tokens, tokens, reqs, reqs, tokens, seq, prefix, lens)


def test_a_batch_samples_where_a_request_reaches_its_known_tokens() -> None:
    # A prefill chunk short of the prompt's end samples nothing; the one that ends it does.
    chunked = Req(0, [1, 2, 3, 4], SamplingParams(temperature=0.5), sampling_seed=9)
    whole = Req(1, [5, 6], SamplingParams())
    inputs = _inputs(ForwardMode.EXTEND, [2, 2], [2, 2])
    batch = ScheduleBatch.of([chunked, whole], inputs, HostToDevice(CPU))
    assert batch.samples == [False, True] and batch.inputs is inputs
    assert batch.mode is ForwardMode.EXTEND and batch.batch_size == 2
    assert batch.sampling_info.seeds.tolist() == [9, 0] and not batch.return_full_logits
    # A decode samples, also with a token still in flight (overlap scheduling).
    pending = Req(2, [7], SamplingParams(), output_ids=[8], kv_len=2, num_pending=1)
    decode = ScheduleBatch.of([pending], _inputs(ForwardMode.DECODE, [3], [1]), HostToDevice(CPU))
    assert decode.samples == [True] and decode.mode is ForwardMode.DECODE
