"""extend_inputs: every token's id, position and row against a plain-Python reference, for
fresh prompts, chunks after a prefix, and re-prefills that run into the generated tokens."""

from __future__ import annotations

import pytest
import torch

from execrt.core.memory import ReqToTokenPool
from execrt.core.schedule import Req, SamplingParams
from execrt.core.staging import HostToDevice
from execrt.core.step import ForwardMode
from execrt.core.step_inputs import extend_inputs

CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def _req(rid: int, prompt: list[int], outputs: list[int], kv_len: int) -> Req:
    req = Req(rid, prompt, SamplingParams())
    req.output_ids = list(outputs)
    req.kv_len = kv_len
    return req


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_extend_inputs_match_a_token_by_token_reference(device: torch.device) -> None:
    reqs = [
        _req(0, list(range(100, 110)), [], 0),  # a fresh prompt, whole
        _req(1, list(range(200, 230)), [], 12),  # a chunk after a cached prefix
        _req(2, list(range(300, 306)), [7, 8, 9, 10], 4),  # a re-prefill into its outputs
        _req(3, list(range(400, 405)), [1, 2, 3], 6),  # only generated tokens left
    ]
    lens = [10, 9, 5, 2]
    rows = [3, 1, 4, 2]
    pool = ReqToTokenPool(8, 64, device)
    total = sum(lens)
    slots = torch.arange(1000, 1000 + total, device=device)
    inputs = extend_inputs(HostToDevice(device), pool, reqs, rows, lens, slots)

    ids, positions, token_rows = [], [], []
    for req, row, n in zip(reqs, rows, lens, strict=True):
        ids += req.fill_ids[req.kv_len : req.kv_len + n]
        positions += range(req.kv_len, req.kv_len + n)
        token_rows += [row] * n
    assert inputs.mode == ForwardMode.EXTEND
    assert inputs.input_ids.tolist() == ids
    assert inputs.positions.tolist() == positions and inputs.positions.dtype == torch.int64
    assert inputs.req_pool_indices.tolist() == rows
    assert inputs.seq_lens.tolist() == inputs.seq_lens_cpu == [10, 21, 9, 8]
    assert inputs.prefix_lens_cpu == [0, 12, 4, 6] and inputs.extend_lens_cpu == lens
    table = pool.req_to_token.cpu()
    for i, (row, pos) in enumerate(zip(token_rows, positions, strict=True)):
        assert int(table[row, pos]) == 1000 + i
    assert int((table != 0).sum()) == total  # nothing else written
