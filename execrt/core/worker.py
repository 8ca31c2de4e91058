"""TpModelWorker: the entry from the scheduling side, ScheduleBatch in, sampled tokens out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from execrt.core.batch import ForwardBatch, LogitsOutput
from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.kv_memory import KVMemory
from execrt.core.model_runner import ModelRunner
from execrt.core.model_spec import ModelLoader
from execrt.core.parallel import ParallelState
from execrt.core.plugins import BackendRegistry
from execrt.core.schedule import ScheduleBatch
from execrt.core.selection import ResolutionReport
from execrt.core.staging import DeviceToHost, HostCopy, HostToDevice


@dataclass(frozen=True)
class WorkerLimits:
    """What the scheduling side may ask of one worker: the sizes it was built with."""

    context_len: int  # tokens per request, prompt and output together
    max_running_requests: int
    max_prefill_tokens: int
    device: torch.device


@dataclass
class GenerationBatchResult:
    """One step's outcome. ``next_token_ids`` stay on the device; their copy to the host is
    already under way, and ``token_ids()`` waits for that copy only. With graphs the logits
    view static memory the next step overwrites: read them before launching another step."""

    logits_output: LogitsOutput
    next_token_ids: torch.Tensor  # [B] int64
    can_run_graph: bool
    host_copy: HostCopy | None = None

    def token_ids(self) -> list[int]:
        if self.host_copy is None:
            return list(self.next_token_ids.tolist())
        return self.host_copy.tolist()


class TpModelWorker:
    """Builds the ForwardBatch, runs the ModelRunner, samples. One per rank.

    The scheduling side uses ``memory`` (rows and KV slots, reserved per step) and ``limits``.
    """

    def __init__(
        self,
        loader: ModelLoader,
        config: RuntimeConfig,
        context: RuntimeContext,
        registry: BackendRegistry,
    ) -> None:
        self.model_runner = ModelRunner(loader, config, context, registry)
        mr = self.model_runner
        device = mr.device
        self.limits = WorkerLimits(
            context_len=mr.context_len,
            max_running_requests=mr.max_running_requests,
            max_prefill_tokens=mr.config.max_prefill_tokens,  # resolved: 0 was auto
            device=device,
        )
        #: Stages a step's host-built integers to the device (pinned, non-blocking on CUDA).
        self.stager = HostToDevice(device)
        #: The one holder of request rows and KV slots.
        self.memory = KVMemory(mr.req_to_token_pool, mr.token_to_kv_pool_allocator, self.stager)
        self._to_host = DeviceToHost(device, torch.int64)

    @property
    def parallel(self) -> ParallelState:
        """This rank's place in the run: world size, rank, TP and EP groups."""
        return self.model_runner.parallel

    @property
    def resolution(self) -> ResolutionReport:
        """Which backends were requested, chosen and rejected, with reasons."""
        return self.model_runner.resolution

    def forward_batch_generation(self, schedule_batch: ScheduleBatch) -> GenerationBatchResult:
        """Launch one step; returns at once on CUDA (the host never waits for the GPU here)."""
        fb = ForwardBatch.init_new(schedule_batch)
        out = self.model_runner.forward(fb)
        next_ids = self.model_runner.sample(out.logits_output, fb)
        copy = self._to_host.start(next_ids)
        return GenerationBatchResult(out.logits_output, next_ids, out.can_run_graph, copy)

    def close(self) -> None:
        self.model_runner.close()
