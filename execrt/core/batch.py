"""ForwardMode and ForwardBatch: what one forward pass processes, in device-tensor form."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Protocol

import torch

from execrt.core.memory import KVCache, ReqToTokenPool
from execrt.core.sampler import SamplingBatchInfo
from execrt.core.schedule import ScheduleBatch, ScheduleMode

if TYPE_CHECKING:
    from execrt.core.interfaces import AttentionBackend


class _HasPools(Protocol):
    req_to_token_pool: ReqToTokenPool
    kv_cache: KVCache
    attn_backend: AttentionBackend


@dataclass
class LogitsOutput:
    """What the model returns: next-token logits per request, optionally every token's."""

    next_token_logits: torch.Tensor  # [B, V] fp32
    full_logits: torch.Tensor | None = None  # [T, V] fp32 (extend, when asked for)


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill of new tokens, possibly after a cached prefix (T >= B)
    DECODE = 2  # one new token per request (T == B)
    IDLE = 3  # no tokens on this rank; still joins collectives

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """Per-step data of one forward pass. Holds tensors by reference; copies nothing.

    Shapes: T tokens, B requests. ``seq_lens`` counts each request's cached tokens plus this
    step's; ``out_cache_loc`` is where this step's tokens' K/V are written. Host mirrors
    (``*_cpu``) let backends plan without a device->host sync.
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
    req_to_token_pool: ReqToTokenPool
    kv_cache: KVCache
    attn_backend: AttentionBackend | None = None
    sampling_info: SamplingBatchInfo | None = None
    return_full_logits: bool = False
    # Tokens that are real rather than graph padding (padded rows sit at the end).
    num_token_non_padded: int = -1
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
    def init_new(cls, schedule_batch: ScheduleBatch, model_runner: _HasPools) -> ForwardBatch:
        """Build from a ScheduleBatch: tensors by reference, positions computed here.

        ``model_runner`` supplies the pools and the attention backend this batch refers to.
        """
        sb = schedule_batch
        device = sb.input_ids.device
        if sb.mode == ScheduleMode.DECODE:
            mode = ForwardMode.DECODE
            positions = sb.seq_lens - 1  # [B]
        else:
            mode = ForwardMode.EXTEND
            positions = extend_positions(sb.prefix_lens, sb.extend_lens, device)
        return cls(
            forward_mode=mode,
            batch_size=sb.batch_size,
            input_ids=sb.input_ids,
            positions=positions,
            req_pool_indices=sb.req_pool_indices,
            seq_lens=sb.seq_lens,
            out_cache_loc=sb.out_cache_loc,
            seq_lens_cpu=list(sb.seq_lens_cpu),
            extend_prefix_lens_cpu=list(sb.prefix_lens),
            extend_seq_lens_cpu=list(sb.extend_lens),
            req_to_token_pool=model_runner.req_to_token_pool,
            kv_cache=model_runner.kv_cache,
            attn_backend=model_runner.attn_backend,
            sampling_info=SamplingBatchInfo.from_reqs(sb.reqs, device),
            return_full_logits=sb.return_full_logits,
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
    def of(cls, fb: ForwardBatch) -> PaddedContext:
        max_len = fb.max_seq_len
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len]  # [B, L]
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


def extend_positions(
    prefix_lens: list[int], extend_lens: list[int], device: torch.device
) -> torch.Tensor:
    """Absolute positions of the new tokens: ``prefix .. prefix + n - 1`` per request. [T] int64."""
    if not extend_lens:
        return torch.zeros(0, dtype=torch.int64, device=device)
    lens = torch.tensor(extend_lens, dtype=torch.int64)
    starts = torch.tensor(prefix_lens, dtype=torch.int64) - (torch.cumsum(lens, 0) - lens)
    return (torch.arange(int(lens.sum())) + torch.repeat_interleave(starts, lens)).to(device)
