"""Log-probabilities of sampled tokens for the requests that ask for them, read off each step's
logits right after sampling (before a later step can overwrite graph-static logits)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from execrt.core.schedule import Req, ScheduleBatch
from execrt.core.staging import DeviceToHost, HostCopy
from execrt.core.worker import GenerationBatchResult, TpModelWorker
from execrt.engine.client import TokenLogprobs
from execrt.engine.limits import MAX_TOP_LOGPROBS

__all__ = ["MAX_TOP_LOGPROBS", "LogprobWorker"]


@dataclass
class _StepLogprobs:
    """One step's values for the rows that asked, packed ``[R, 1 + 2k]`` float32: the sampled
    token's log-probability, then k top log-probabilities, then their token ids (exact in
    fp32: vocabularies stay below 2**24)."""

    copy: HostCopy
    width: int
    values: list[float] | None = None

    def row(self, i: int) -> list[float]:
        if self.values is None:
            self.values = [float(v) for v in self.copy.tolist()]
        return self.values[i * self.width : (i + 1) * self.width]


@dataclass
class _Pending:
    top: int
    steps: deque[tuple[_StepLogprobs, int, int]] = field(default_factory=deque)


class LogprobWorker(TpModelWorker):
    """A TpModelWorker that also reports log-probabilities for the requests in ``watch``.

    Steps without such requests cost one dict check per row; with them, one log-softmax and
    top-k over those rows and one asynchronous copy to the host, read when the scheduler hands
    out the token (``take``), so the step's overlap with the next one is kept.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # TpModelWorker's arguments
        super().__init__(*args, **kwargs)
        self._watched: dict[Req, _Pending] = {}
        self._logprobs_to_host = DeviceToHost(self.limits.device, torch.float32, slots=4)

    def watch(self, req: Req, top: int) -> None:
        """Report ``req``'s tokens with their log-probabilities and ``top`` alternatives."""
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs: top {top} out of range (0..{MAX_TOP_LOGPROBS})")
        self._watched[req] = _Pending(top)

    def unwatch(self, req: Req) -> None:
        self._watched.pop(req, None)

    def take(self, req: Req, token_id: int) -> TokenLogprobs | None:
        """The log-probabilities of the token ``req`` just gained (None if not watched)."""
        pending = self._watched.get(req)
        if pending is None or not pending.steps:
            return None
        step, row, top = pending.steps.popleft()
        values = step.row(row)
        alternatives = tuple(
            (int(values[1 + top + j]), values[1 + j]) for j in range(min(top, pending.top))
        )
        return TokenLogprobs(token_id, values[0], alternatives)

    def forward_batch_generation(self, schedule_batch: ScheduleBatch) -> GenerationBatchResult:
        result = super().forward_batch_generation(schedule_batch)
        if self._watched:
            self._record(schedule_batch, result)
        return result

    def _record(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        rows = [
            i
            for i, (req, sampled) in enumerate(zip(batch.reqs, batch.samples, strict=True))
            if sampled and req in self._watched
        ]
        if not rows:
            return
        top = max(self._watched[batch.reqs[i]].top for i in rows)
        logits = result.logits_output.next_token_logits  # [B, V]
        index = torch.tensor(rows, device=logits.device)
        logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [R, V]
        chosen = logp.gather(1, result.next_token_ids.index_select(0, index)[:, None])  # [R, 1]
        best = logp.topk(top, dim=-1)  # [R, top] values and ids
        packed = torch.cat([chosen, best.values, best.indices.float()], dim=1)  # [R, 1 + 2top]
        step = _StepLogprobs(self._logprobs_to_host.start(packed), 1 + 2 * top)
        for r, i in enumerate(rows):
            self._watched[batch.reqs[i]].steps.append((step, r, top))
