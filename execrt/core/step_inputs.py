"""A step's StepInputs from its requests, rows and slots: every host integer in one copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from execrt.core.memory import ReqToTokenPool
from execrt.core.staging import HostToDevice
from execrt.core.step import ForwardMode, StepInputs

if TYPE_CHECKING:
    from execrt.core.schedule import Req


def extend_inputs(
    stager: HostToDevice,
    pool: ReqToTokenPool,
    reqs: Sequence[Req],
    rows: list[int],
    lens: Sequence[int],
    slots: torch.Tensor,
) -> StepInputs:
    """An extend of ``lens[i]`` tokens of each request after its ``kv_len`` held ones, in
    ``rows[i]``; records ``slots`` (``[T]``, in token order) in the rows."""
    ids: list[int] = []
    token_rows: list[int] = []
    positions: list[int] = []
    for req, row, n in zip(reqs, rows, lens, strict=True):
        start = req.kv_len
        ids += req.fill_ids[start : start + n]
        token_rows += [row] * n
        positions += range(start, start + n)
    prefix = [r.kv_len for r in reqs]
    seq = [p + n for p, n in zip(prefix, lens, strict=True)]
    t, b = len(ids), len(reqs)
    dev = stager(ids + rows + seq + token_rows + positions)  # one host->device copy
    pos = dev[2 * b + 2 * t :]  # [T]
    pool.write_tokens(dev[2 * b + t : 2 * b + 2 * t], pos, slots)
    return StepInputs(
        mode=ForwardMode.EXTEND,
        input_ids=dev[:t],
        positions=pos,
        req_pool_indices=dev[t : t + b],
        seq_lens=dev[t + b : t + 2 * b],
        out_cache_loc=slots,
        seq_lens_cpu=seq,
        prefix_lens_cpu=prefix,
        extend_lens_cpu=list(lens),
    )


def decode_inputs(
    stager: HostToDevice,
    pool: ReqToTokenPool,
    reqs: Sequence[Req],
    rows: list[int],
    slots: torch.Tensor,
    input_ids: torch.Tensor | None,
) -> StepInputs:
    """A decode of one token per request (its last sampled one, or ``input_ids`` ``[B]`` on
    the device); records ``slots`` (``[B]``) in the rows."""
    b = len(reqs)
    seq = [r.scheduled_len for r in reqs]
    last = [] if input_ids is not None else [r.last_token_id for r in reqs]
    dev = stager(last + rows + seq)  # one host->device copy
    k = len(last)
    req_pool_indices, seq_lens = dev[k : k + b], dev[k + b :]  # [B], [B]
    positions = seq_lens - 1  # [B]: where each request's new token goes
    pool.write_tokens(req_pool_indices, positions, slots)
    return StepInputs(
        mode=ForwardMode.DECODE,
        input_ids=dev[:b] if input_ids is None else input_ids,
        positions=positions,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        out_cache_loc=slots,
        seq_lens_cpu=seq,
        prefix_lens_cpu=[s - 1 for s in seq],
        extend_lens_cpu=[1] * b,
    )
