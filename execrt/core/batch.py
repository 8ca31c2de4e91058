"""ForwardBatch: what one forward pass processes, and the one padding rule for decode graphs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from execrt.core.sampler import SamplingBatchInfo
from execrt.core.step import ForwardMode, StepInputs

if TYPE_CHECKING:
    from execrt.core.schedule import ScheduleBatch

__all__ = [
    "ForwardBatch",
    "ForwardMode",
    "LogitsOutput",
    "PaddedContext",
    "StepInputs",
    "padded_decode_batch",
]


@dataclass
class LogitsOutput:
    """What the model returns: next-token logits per request, optionally every token's."""

    next_token_logits: torch.Tensor  # [B, V] in the model's dtype (samplers read any float)
    full_logits: torch.Tensor | None = None  # [T, V] fp32 (extend, when asked for)
    #: [R, V] in the model's dtype: the logits of ``ForwardBatch.logit_rows`` (extend)
    row_logits: torch.Tensor | None = None
    #: [B] int64: the tokens already sampled, when a decode graph ran the sampler too
    next_token_ids: torch.Tensor | None = None


@dataclass
class ForwardBatch(StepInputs):
    """Per-step data of one forward pass: the step's inputs plus how to sample and pad.

    Holds tensors by reference; copies nothing. The pools are not here: a backend reaches them
    through its init record, and the attention plan travels beside the batch
    (``AttentionStep``), never inside it.
    """

    sampling_info: SamplingBatchInfo | None = None
    return_full_logits: bool = False
    #: [R] int64 on the device: rows of an extend whose logits are wanted beside each
    #: request's last (prompt log-probabilities), returned as ``LogitsOutput.row_logits``.
    logit_rows: torch.Tensor | None = None
    # Tokens that are real rather than graph padding (padded rows sit at the end).
    num_token_non_padded: int = -1
    # The same count on the device ([1] int64), set whenever rows may be padding: a captured
    # graph reads it at replay, so the MoE masks exactly this step's padding.
    num_token_non_padded_device: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.num_token_non_padded < 0:
            self.num_token_non_padded = self.num_tokens

    @classmethod
    def of(
        cls,
        inputs: StepInputs,
        sampling_info: SamplingBatchInfo | None = None,
        return_full_logits: bool = False,
        logit_rows: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """``inputs`` (by reference) with what the forward pass needs beside them."""
        return cls(
            inputs.mode,
            inputs.input_ids,
            inputs.positions,
            inputs.req_pool_indices,
            inputs.seq_lens,
            inputs.out_cache_loc,
            inputs.seq_lens_cpu,
            inputs.prefix_lens_cpu,
            inputs.extend_lens_cpu,
            sampling_info=sampling_info,
            return_full_logits=return_full_logits,
            logit_rows=logit_rows,
        )

    @classmethod
    def init_new(cls, schedule_batch: ScheduleBatch) -> ForwardBatch:
        """The forward batch of a scheduled step."""
        sb = schedule_batch
        return cls.of(sb.inputs, sb.sampling_info, sb.return_full_logits, sb.logit_rows)


# -- the one padding rule for decode graphs -------------------------------------------------------
# A padded row reads request row 0 (ReqToTokenPool's reserved row), writes its K/V to slot 0
# (the allocator's reserved slot), feeds token 0 at position ``fill - 1`` and has
# ``seq_len = fill``, the attention backend's ``graph_seq_len_fill_value``. The graph runner,
# the conformance harnesses and the tests all pad through ``padded_decode_batch``.


def padded_decode_batch(
    fb: ForwardBatch,
    padded_bs: int,
    seq_len_fill: int,
    out: StepInputs | None = None,
    out_count: torch.Tensor | None = None,
) -> ForwardBatch:
    """``fb`` (decode, B real rows) as a batch of ``padded_bs`` rows, real rows first.

    The device inputs are written into ``out`` (static buffers of at least ``padded_bs`` rows,
    e.g. ``InputBuffers.static``) and the real-row count into ``out_count`` ([1] int64), or
    into new tensors; the host mirrors are padded alike. Nothing is allocated when ``out`` and
    ``out_count`` are given.
    """
    if not fb.mode.is_decode():
        raise ValueError(f"padding: only decode batches are padded, got {fb.mode.name}")
    b = fb.batch_size
    if padded_bs < b:
        raise ValueError(f"padding: cannot pad a batch of {b} down to {padded_bs}")
    if seq_len_fill < 1:
        raise ValueError(f"padding: seq_len fill value {seq_len_fill} must be >= 1")

    def pad(src: torch.Tensor, buf: torch.Tensor | None, value: int) -> torch.Tensor:
        dst = src.new_empty(padded_bs) if buf is None else buf[:padded_bs]  # [padded_bs]
        if dst.data_ptr() != src.data_ptr():
            dst[:b].copy_(src, non_blocking=True)
        if padded_bs > b:  # an empty fill still costs a dispatch per tensor per step
            dst[b:].fill_(value)
        return dst

    if out_count is None:
        out_count = torch.full((1,), b, dtype=torch.int64, device=fb.input_ids.device)
    else:
        out_count.fill_(b)
    pads = padded_bs - b
    return dataclasses.replace(
        fb,
        input_ids=pad(fb.input_ids, None if out is None else out.input_ids, 0),
        positions=pad(fb.positions, None if out is None else out.positions, seq_len_fill - 1),
        req_pool_indices=pad(fb.req_pool_indices, None if out is None else out.req_pool_indices, 0),
        seq_lens=pad(fb.seq_lens, None if out is None else out.seq_lens, seq_len_fill),
        out_cache_loc=pad(fb.out_cache_loc, None if out is None else out.out_cache_loc, 0),
        seq_lens_cpu=list(fb.seq_lens_cpu) + [seq_len_fill] * pads,
        prefix_lens_cpu=list(fb.prefix_lens_cpu) + [seq_len_fill - 1] * pads,
        extend_lens_cpu=list(fb.extend_lens_cpu) + [1] * pads,
        num_token_non_padded=b,
        num_token_non_padded_device=out_count,
    )


@dataclass
class PaddedContext:
    """Every request's context as slot ids, padded to the longest one (padding reads slot 0).

    The simplest plan a gather-based attention backend needs; built on the device from
    ``req_to_token`` in one indexing operation.
    """

    slots: torch.Tensor  # [B, L_max] int64
    valid: torch.Tensor  # [B, L_max] bool
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]

    @classmethod
    def of(cls, fb: StepInputs, req_to_token: torch.Tensor) -> PaddedContext:
        """``req_to_token`` is the pool's table ``[R+1, C]``."""
        max_len = fb.max_seq_len
        rows = req_to_token[fb.req_pool_indices, :max_len]  # [B, L]
        valid = torch.arange(max_len, device=rows.device)[None, :] < fb.seq_lens[:, None]
        slots = torch.where(valid, rows.long(), 0)
        return cls(slots, valid, list(fb.prefix_lens_cpu), list(fb.extend_lens_cpu))

    def extend_segments(self) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """Per request of an extend batch: its rows of ``q`` / the output, its context slots
        ``[prefix + n]`` and the causal mask ``[n, prefix + n]`` (new token i, at position
        ``prefix + i``, sees positions ``0 .. prefix + i``)."""
        device = self.slots.device
        start = 0
        lens = zip(self.prefix_lens_cpu, self.extend_lens_cpu, strict=True)
        for b, (prefix, n) in enumerate(lens):
            q_pos = torch.arange(prefix, prefix + n, device=device)[:, None]  # [n, 1]
            mask = torch.arange(prefix + n, device=device)[None, :] <= q_pos  # [n, L]
            yield slice(start, start + n), self.slots[b, : prefix + n], mask
            start += n
