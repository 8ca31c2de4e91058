"""ForwardMode and StepInputs: what one scheduled step hands the worker, as one typed record."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class ForwardMode(IntEnum):
    """What one step processes; shared by the schedule, the batch and the attention step."""

    EXTEND = 1  # prefill of new tokens, possibly after a cached prefix (T >= B)
    DECODE = 2  # one new token per request (T == B)

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class StepInputs:
    """One step's device tensors and the host lists that describe them.

    T tokens of B requests. Request ``i`` processes ``extend_lens_cpu[i]`` new tokens after
    ``prefix_lens_cpu[i]`` cached ones (decode: one after ``seq_len - 1``); ``seq_lens`` counts
    both. ``out_cache_loc`` holds the KV slot each new token's K/V is written to, ``positions``
    its absolute position. The device tensors are int64; the host lists let backends plan
    without a device->host sync. The record travels by reference: the scheduling side builds
    it, the runner copies it into static buffers (``copy_into``), the graph runner pads it.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    out_cache_loc: torch.Tensor  # [T] int64
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

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
        return max(self.extend_lens_cpu, default=0)
