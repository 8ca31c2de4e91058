"""Log-probabilities of sampled tokens for the requests that ask for them, read off each step's
logits right after sampling (before a later step can overwrite graph-static logits); and of
their prompt's tokens (each prompt row's logits, which the extends compute on request)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from execrt.core.schedule import Req, ScheduleBatch
from execrt.core.staging import DeviceToHost, HostCopy, copy_to_host, stage_ints
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

    def entry(self, i: int, token_id: int, top: int) -> TokenLogprobs:
        """Row ``i`` as ``token_id``'s log-probability and its ``top`` alternatives (at
        most the step's k)."""
        values = self.row(i)
        k = (self.width - 1) // 2
        alternatives = tuple((int(values[1 + k + j]), values[1 + j]) for j in range(min(top, k)))
        return TokenLogprobs(token_id, values[0], alternatives)


def _pack(logits: torch.Tensor, targets: torch.Tensor, top: int) -> torch.Tensor:
    """``[R, 1 + 2 top]`` fp32 (``_StepLogprobs``' rows) of ``logits [R, V]``: the
    log-probability of ``targets [R]``, then the ``top`` best log-probabilities and their ids."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    best = logp.topk(top, dim=-1)
    return torch.cat([logp.gather(1, targets[:, None]), best.values, best.indices.float()], dim=1)


@dataclass
class _Pending:
    top: int
    steps: deque[tuple[_StepLogprobs, int]] = field(default_factory=deque)


@dataclass
class _PromptPending:
    """A request's prompt log-probabilities so far: ``parts`` of consecutive prompt tokens
    (a step's values, its first row there, the token ids) from token 1 up to ``next``."""

    top: int
    end: int  # the prompt's length: tokens 1 .. end - 1 have a log-probability
    next: int = 1  # the next prompt token to score (row next - 1 predicts it)
    parts: list[tuple[_StepLogprobs, int, list[int]]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.next >= self.end


#: Rows per log-softmax of prompt logits: bounds the fp32 copy ([rows, vocab]) it makes.
PROMPT_ROWS_PER_PASS = 128


def _checked_top(top: int) -> int:
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs: top {top} out of range (0..{MAX_TOP_LOGPROBS})")
    return top


class LogprobWorker(TpModelWorker):
    """A TpModelWorker that also reports log-probabilities for the requests in ``watch``.

    Steps without such requests cost one dict check per row; with them, one log-softmax and
    top-k over those rows and one asynchronous copy to the host, read when the scheduler hands
    out the token (``take``), so the step's overlap with the next one is kept.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # TpModelWorker's arguments
        super().__init__(*args, **kwargs)
        self._watched: dict[Req, _Pending] = {}
        self._prompts: dict[Req, _PromptPending] = {}
        self._logprobs_to_host = DeviceToHost(self.limits.device, torch.float32, slots=4)

    def watch(self, req: Req, top: int) -> None:
        """Report ``req``'s tokens with their log-probabilities and ``top`` alternatives."""
        self._watched[req] = _Pending(_checked_top(top))

    def watch_prompt(self, req: Req, top: int) -> None:
        """Score ``req``'s prompt tokens (all but the first) with ``top`` alternatives each;
        the prefix cache then serves none of its prompt (``Req.prompt_logits``) until they
        are all computed."""
        pending = self._prompts[req] = _PromptPending(_checked_top(top), len(req.origin_input_ids))
        req.prompt_logits = not pending.complete

    def unwatch(self, req: Req) -> None:
        self._watched.pop(req, None)
        self._prompts.pop(req, None)
        req.prompt_logits = False

    def take_prompt(self, req: Req) -> list[TokenLogprobs] | None:
        """``req``'s prompt log-probabilities (tokens 1 .. end), once all are computed; each
        request's once. None before, after, and for a request not watched."""
        pending = self._prompts.get(req)
        if pending is None or not pending.complete:
            return None
        del self._prompts[req]
        return [
            step.entry(first + j, token_id, pending.top)
            for step, first, ids in pending.parts
            for j, token_id in enumerate(ids)
        ]

    def take(self, req: Req, token_id: int) -> TokenLogprobs | None:
        """The log-probabilities of the token ``req`` just gained (None if not watched)."""
        pending = self._watched.get(req)
        if pending is None or not pending.steps:
            return None
        step, row = pending.steps.popleft()
        return step.entry(row, token_id, pending.top)

    def forward_batch_generation(self, schedule_batch: ScheduleBatch) -> GenerationBatchResult:
        prompt = self._prompt_rows(schedule_batch) if self._prompts else None
        result = super().forward_batch_generation(schedule_batch)
        if self._watched:
            self._record(schedule_batch, result)
        if prompt is not None:
            self._record_prompts(*prompt, result)
        return result

    def _prompt_rows(
        self, batch: ScheduleBatch
    ) -> tuple[list[tuple[_PromptPending, int, list[int]]], torch.Tensor] | None:
        """Ask the extend ``batch`` for the logits of the prompt rows its watched requests
        still need (``batch.logit_rows``, staged with the tokens they predict in one copy);
        returns, per such request, its pending record, the first of its rows there and the
        prompt tokens those rows predict, and those tokens on the device."""
        if not batch.mode.is_extend():
            return None
        inputs = batch.inputs
        rows: list[int] = []
        wanted = []
        offset = 0
        for req, start, n in zip(
            batch.reqs, inputs.prefix_lens_cpu, inputs.extend_lens_cpu, strict=True
        ):
            pending = self._prompts.get(req)
            if pending is not None and not pending.complete:
                # Row p (a token at position p) predicts token p + 1; these rows are
                # positions start .. start + n - 1, and tokens 1 .. next - 1 are scored.
                lo, hi = max(start, pending.next - 1), min(start + n, pending.end - 1)
                if lo < hi:
                    wanted.append((pending, len(rows), req.origin_input_ids[lo + 1 : hi + 1]))
                    rows += range(offset + lo - start, offset + hi - start)
                    pending.next = hi + 1
                    req.prompt_logits = not pending.complete
            offset += n
        if not rows:
            return None
        targets = [t for _, _, ids in wanted for t in ids]
        batch.logit_rows, targets_t = stage_ints(self.stager, (rows, targets))
        return wanted, targets_t

    def _record_prompts(
        self,
        wanted: list[tuple[_PromptPending, int, list[int]]],
        targets: torch.Tensor,
        result: GenerationBatchResult,
    ) -> None:
        logits = result.logits_output.row_logits  # [R, V]
        if logits is None:
            raise RuntimeError(
                "logprobs: the model returned no logits for the prompt rows asked for "
                "(ForwardBatch.logit_rows -> LogitsOutput.row_logits); prompt log-probabilities "
                "need a model that computes them"
            )
        top = max(pending.top for pending, _, _ in wanted)
        per_pass = PROMPT_ROWS_PER_PASS  # bounds the fp32 log-softmax's [rows, V] copy
        chunks = [slice(lo, lo + per_pass) for lo in range(0, logits.shape[0], per_pass)]
        packed = [_pack(logits[rows], targets[rows], top) for rows in chunks]
        # Read when the request's first token is out, maybe many steps later: a copy of its own.
        step = _StepLogprobs(copy_to_host(torch.cat(packed)), 1 + 2 * top)
        for pending, first, ids in wanted:
            pending.parts.append((step, first, ids))

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
        packed = _pack(
            logits.index_select(0, index), result.next_token_ids.index_select(0, index), top
        )
        step = _StepLogprobs(self._logprobs_to_host.start(packed), 1 + 2 * top)
        for r, i in enumerate(rows):
            self._watched[batch.reqs[i]].steps.append((step, r))
