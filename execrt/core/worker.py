"""TpModelWorker: the entry from the scheduling side, ScheduleBatch in, sampled tokens out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from execrt.core.batch import ForwardBatch, LogitsOutput
from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.model_runner import ModelRunner
from execrt.core.model_spec import ModelLoader
from execrt.core.plugins import BackendRegistry
from execrt.core.schedule import ScheduleBatch


@dataclass
class GenerationBatchResult:
    logits_output: LogitsOutput
    next_token_ids: torch.Tensor  # [B] int64
    can_run_graph: bool


class TpModelWorker:
    """Builds the ForwardBatch, runs the ModelRunner, samples. One per rank."""

    def __init__(
        self,
        loader: ModelLoader,
        config: RuntimeConfig,
        context: RuntimeContext,
        registry: BackendRegistry,
    ) -> None:
        self.model_runner = ModelRunner(loader, config, context, registry)

    def forward_batch_generation(self, schedule_batch: ScheduleBatch) -> GenerationBatchResult:
        fb = ForwardBatch.init_new(schedule_batch, self.model_runner.attn_backend)
        out = self.model_runner.forward(fb)
        next_ids = self.model_runner.sample(out.logits_output, fb)
        return GenerationBatchResult(out.logits_output, next_ids, out.can_run_graph)

    def close(self) -> None:
        self.model_runner.close()
