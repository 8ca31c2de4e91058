"""ForwardMode and ForwardBatch: what one forward pass processes, in device-tensor form."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from execrt.core.sampler import SamplingBatchInfo
from execrt.core.schedule import ScheduleBatch
from execrt.core.step import ForwardMode

if TYPE_CHECKING:
    from execrt.core.interfaces import AttentionBackend

__all__ = ["ForwardBatch", "ForwardMode", "LogitsOutput", "PaddedContext", "padded_decode_batch"]


@dataclass
class LogitsOutput:
    """What the model returns: next-token logits per request, optionally every token's."""

    next_token_logits: torch.Tensor  # [B, V] fp32
    full_logits: torch.Tensor | None = None  # [T, V] fp32 (extend, when asked for)


@dataclass
class ForwardBatch:
    """Per-step data of one forward pass. Holds tensors by reference; copies nothing.

    Shapes: T tokens, B requests. ``seq_lens`` counts each request's cached tokens plus this
    step's; ``out_cache_loc`` is where this step's tokens' K/V are written. Host mirrors
    (``*_cpu``) let backends plan without a device->host sync. The pools are not here: a
    backend reaches them through its init record.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    out_cache_loc: torch.Tensor  # [T] int64
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    attn_backend: AttentionBackend | None = None
    sampling_info: SamplingBatchInfo | None = None
    return_full_logits: bool = False
    # Tokens that are real rather than graph padding (padded rows sit at the end).
    num_token_non_padded: int = -1
    # The same count on the device ([1] int64), set whenever rows may be padding: a captured
    # graph reads it at replay, so the MoE masks exactly this step's padding.
    num_token_non_padded_device: torch.Tensor | None = None
    # Backend-owned per-step metadata (set by attn_backend.init_forward_metadata).
    attn_metadata: Any = None

    def __post_init__(self) -> None:
        if self.num_token_non_padded < 0:
            self.num_token_non_padded = int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens_sum(self) -> int:
        return sum(self.seq_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_seq_lens_cpu, default=0)

    @classmethod
    def init_new(
        cls, schedule_batch: ScheduleBatch, attn_backend: AttentionBackend | None
    ) -> ForwardBatch:
        """Build from a ScheduleBatch: its StepInputs' tensors by reference."""
        sb = schedule_batch
        inputs = sb.inputs
        return cls(
            forward_mode=inputs.mode,
            batch_size=inputs.batch_size,
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            req_pool_indices=inputs.req_pool_indices,
            seq_lens=inputs.seq_lens,
            out_cache_loc=inputs.out_cache_loc,
            seq_lens_cpu=list(inputs.seq_lens_cpu),
            extend_prefix_lens_cpu=list(inputs.prefix_lens_cpu),
            extend_seq_lens_cpu=list(inputs.extend_lens_cpu),
            attn_backend=attn_backend,
            sampling_info=sb.sampling_info,
            return_full_logits=sb.return_full_logits,
        )


# -- the one padding rule for decode graphs -------------------------------------------------------
# A padded row reads request row 0 (ReqToTokenPool's reserved row), writes its K/V to slot 0
# (the allocator's reserved slot), feeds token 0 at position ``fill - 1`` and has
# ``seq_len = fill``, the attention backend's ``graph_seq_len_fill_value``. The graph runner,
# the conformance harnesses and the tests all pad through ``padded_decode_batch``.
INPUT_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
PAD_VALUES = {"input_ids": 0, "req_pool_indices": 0, "out_cache_loc": 0}


def padded_decode_batch(
    fb: ForwardBatch,
    padded_bs: int,
    seq_len_fill: int,
    out: Mapping[str, torch.Tensor] | None = None,
) -> ForwardBatch:
    """``fb`` (decode, B real rows) as a batch of ``padded_bs`` rows, real rows first.

    The device inputs are written into ``out`` (buffers of at least ``padded_bs`` rows, keyed
    by ``INPUT_FIELDS``; ``out["num_token_non_padded"]`` [1] when present) or into new
    tensors; the host mirrors are padded alike. Nothing is allocated when ``out`` is given.
    """
    if not fb.forward_mode.is_decode():
        raise ValueError(f"padding: only decode batches are padded, got {fb.forward_mode.name}")
    b = fb.batch_size
    if padded_bs < b:
        raise ValueError(f"padding: cannot pad a batch of {b} down to {padded_bs}")
    if seq_len_fill < 1:
        raise ValueError(f"padding: seq_len fill value {seq_len_fill} must be >= 1")
    pad_values = PAD_VALUES | {"seq_lens": seq_len_fill, "positions": seq_len_fill - 1}
    views: dict[str, Any] = {}
    for name in INPUT_FIELDS:
        src = getattr(fb, name)  # [B]
        dst = src.new_empty(padded_bs) if out is None else out[name][:padded_bs]
        if dst.data_ptr() != src.data_ptr():
            dst[:b].copy_(src, non_blocking=True)
        dst[b:].fill_(pad_values[name])
        views[name] = dst
    count = None if out is None else out.get("num_token_non_padded")
    if count is None:
        count = torch.full((1,), b, dtype=torch.int64, device=fb.input_ids.device)
    else:
        count.fill_(b)
    pads = padded_bs - b
    return dataclasses.replace(
        fb,
        batch_size=padded_bs,
        seq_lens_cpu=list(fb.seq_lens_cpu) + [seq_len_fill] * pads,
        extend_prefix_lens_cpu=list(fb.extend_prefix_lens_cpu) + [seq_len_fill - 1] * pads,
        extend_seq_lens_cpu=list(fb.extend_seq_lens_cpu) + [1] * pads,
        num_token_non_padded=b,
        num_token_non_padded_device=count,
        attn_metadata=None,
        **views,
    )


@dataclass
class PaddedContext:
    """Every request's context as slot ids, padded to the longest one (padding reads slot 0).

    The simplest metadata a gather-based attention backend needs; built on the device from
    ``req_to_token`` in one indexing operation.
    """

    slots: torch.Tensor  # [B, L_max] int64
    valid: torch.Tensor  # [B, L_max] bool

    @classmethod
    def of(cls, fb: ForwardBatch, req_to_token: torch.Tensor) -> PaddedContext:
        """``req_to_token`` is the pool's table ``[R+1, C]``."""
        max_len = fb.max_seq_len
        rows = req_to_token[fb.req_pool_indices, :max_len]  # [B, L]
        valid = torch.arange(max_len, device=rows.device)[None, :] < fb.seq_lens[:, None]
        return cls(torch.where(valid, rows.long(), 0), valid)

    def extend_segments(
        self, fb: ForwardBatch
    ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """Per request of an extend batch: its rows of ``q`` / the output, its context slots
        ``[prefix + n]`` and the causal mask ``[n, prefix + n]`` (new token i, at position
        ``prefix + i``, sees positions ``0 .. prefix + i``)."""
        device = self.slots.device
        start = 0
        lens = zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True)
        for b, (prefix, n) in enumerate(lens):
            q_pos = torch.arange(prefix, prefix + n, device=device)[:, None]  # [n, 1]
            mask = torch.arange(prefix + n, device=device)[None, :] <= q_pos  # [n, L]
            yield slice(start, start + n), self.slots[b, : prefix + n], mask
            start += n
