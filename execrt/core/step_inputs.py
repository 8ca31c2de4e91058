"""A step's StepInputs from its requests, rows and slots: every host integer in one copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from execrt.core.memory import ReqToTokenPool
from execrt.core.staging import HostToDevice, stage_ints
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
    for req, n in zip(reqs, lens, strict=True):
        ids += _fill_ids(req, req.kv_len, n)
    prefix = [r.kv_len for r in reqs]
    seq = [p + n for p, n in zip(prefix, lens, strict=True)]
    # Token i of request b sits at position prefix[b] + (i - first[b]), first[b] its first
    # index in the step: positions = arange(T) - shift[b], shift[b] = first[b] - prefix[b].
    shift, first = [], 0
    for p, n in zip(prefix, lens, strict=True):
        shift.append(first - p)
        first += n
    # One host->device copy; [T], [B] x 4. The per-token rows and positions are built on the
    # device: T host ints are what an extend's staging costs.
    dev_ids, dev_rows, dev_seq, dev_lens, dev_shift = stage_ints(
        stager, (ids, rows, seq, list(lens), shift)
    )
    total = len(ids)
    token_rows = torch.repeat_interleave(dev_rows, dev_lens, output_size=total)  # [T]
    pos = torch.arange(total, device=dev_ids.device) - torch.repeat_interleave(
        dev_shift, dev_lens, output_size=total
    )  # [T]
    pool.write_tokens(token_rows, pos, slots)
    return StepInputs(
        mode=ForwardMode.EXTEND,
        input_ids=dev_ids,
        positions=pos,
        req_pool_indices=dev_rows,
        seq_lens=dev_seq,
        out_cache_loc=slots,
        seq_lens_cpu=seq,
        prefix_lens_cpu=prefix,
        extend_lens_cpu=list(lens),
    )


def _fill_ids(req: Req, start: int, n: int) -> list[int]:
    """``req.fill_ids[start : start + n]`` without building the whole list."""
    prompt = req.origin_input_ids
    if start + n <= len(prompt):
        return prompt[start : start + n]
    out = req.output_ids
    return prompt[start:] + out[max(0, start - len(prompt)) : start + n - len(prompt)]


def decode_inputs(
    stager: HostToDevice,
    pool: ReqToTokenPool,
    reqs: Sequence[Req],
    rows: list[int],
    slots: torch.Tensor,
    input_ids: torch.Tensor | None,
    seq: list[int] | None = None,
) -> StepInputs:
    """A decode of one token per request (its last sampled one, or ``input_ids`` ``[B]`` on
    the device); records ``slots`` (``[B]``) in the rows. ``seq``: each request's
    ``scheduled_len`` when the caller has them already."""
    b = len(reqs)
    if seq is None:
        seq = [r.scheduled_len for r in reqs]
    last = [] if input_ids is not None else [r.last_token_id for r in reqs]
    # One host->device copy; [B] each (last: [0] when the device has the tokens)
    dev_last, req_pool_indices, seq_lens = stage_ints(stager, (last, rows, seq))
    positions = seq_lens - 1  # [B]: where each request's new token goes
    pool.write_tokens(req_pool_indices, positions, slots)
    return StepInputs(
        mode=ForwardMode.DECODE,
        input_ids=dev_last if input_ids is None else input_ids,
        positions=positions,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        out_cache_loc=slots,
        seq_lens_cpu=seq,
        prefix_lens_cpu=[s - 1 for s in seq],
        extend_lens_cpu=[1] * b,
    )
