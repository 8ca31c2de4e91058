"""Runners: how one forward executes. EagerRunner runs the model directly from static buffers."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from execrt.core.batch import ForwardBatch, LogitsOutput

if TYPE_CHECKING:
    from execrt.core.model_runner import ModelRunner


class InputBuffers:
    """Static per-step input tensors; eager and graph paths share their storage.

    Token-axis buffers hold ``max_num_tokens`` entries, request-axis buffers ``max_bs``.
    ``load`` copies a batch into their prefixes and returns a ForwardBatch viewing them, so the
    addresses a captured graph reads stay fixed.
    """

    TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")
    REQUEST_FIELDS = ("req_pool_indices", "seq_lens")

    def __init__(self, max_bs: int, max_num_tokens: int, device: torch.device) -> None:
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.buffers = {
            name: torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
            for name in self.TOKEN_FIELDS
        } | {
            name: torch.zeros(max_bs, dtype=torch.int64, device=device)
            for name in self.REQUEST_FIELDS
        }

    def load(self, fb: ForwardBatch) -> ForwardBatch:
        t, b = fb.num_tokens, fb.batch_size
        if t > self.max_num_tokens or b > self.max_bs:
            raise ValueError(
                f"input buffers: batch of {b} requests / {t} tokens exceeds the static buffers "
                f"({self.max_bs} / {self.max_num_tokens}); raise max_running_requests or "
                "max_prefill_tokens"
            )
        views: dict[str, Any] = {}
        for name in self.TOKEN_FIELDS:
            views[name] = self.buffers[name][:t]
            views[name].copy_(getattr(fb, name), non_blocking=True)
        for name in self.REQUEST_FIELDS:
            views[name] = self.buffers[name][:b]
            views[name].copy_(getattr(fb, name), non_blocking=True)
        return dataclasses.replace(fb, **views)


class EagerRunner:
    """Runs a batch without graphs: load inputs, prepare attention metadata, run the model."""

    def __init__(self, model_runner: ModelRunner, max_bs: int, max_num_tokens: int) -> None:
        self.model_runner = model_runner
        self.buffers = InputBuffers(max_bs, max_num_tokens, model_runner.device)

    def load_batch(self, fb: ForwardBatch) -> ForwardBatch:
        return self.buffers.load(fb)

    def execute(self, fb: ForwardBatch) -> LogitsOutput:
        mr = self.model_runner
        fb = self.load_batch(fb)
        mr.attn_backend.init_forward_metadata(fb)
        return mr.model(fb.input_ids, fb.positions, fb)  # type: ignore[no-any-return]
