"""Continuous-batching scheduler: admit prefills while KV slots last, decode everyone, retract."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from execrt.core.schedule import FinishReason, Req, ScheduleBatch, ScheduleMode
from execrt.core.worker import GenerationBatchResult, TpModelWorker

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    steps: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    retractions: int = 0


class Scheduler:
    """Runs requests to completion on one TpModelWorker.

    Each step is either an extend (prefill, chunked to ``max_prefill_tokens``) of waiting
    requests, preferred while slots and rows allow, or a decode of every running request.
    When the KV pool runs dry mid-decode the newest running request is retracted: its slots
    and row are freed and it re-queues at the front, to be re-prefilled with what it has
    generated so far. A request finishes on EOS, a stop token, ``max_new_tokens`` or the
    context limit, and its slots are freed at once.
    """

    def __init__(
        self,
        worker: TpModelWorker,
        *,
        max_prefill_tokens: int,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        mr = worker.model_runner
        self.worker = worker
        self.req_to_token_pool = mr.req_to_token_pool
        self.allocator = mr.token_to_kv_pool_allocator
        self.device = mr.device
        self.context_len = mr.context_len
        self.max_running = mr.max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.finished: list[Req] = []
        self.stats = SchedulerStats()
        #: Called as ``hook(req, token_id)`` for every token a request gains (for streaming).
        self.on_token: list[Callable[[Req, int], None]] = []

    # -- public -------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> None:
        """Run one forward pass (extend if possible, else decode)."""
        batch = self._schedule_extend() or self._schedule_decode()
        if batch is None:
            self._abort_unservable()
            return
        result = self.worker.forward_batch_generation(batch)
        self._process(batch, result)

    def run(self) -> list[Req]:
        """Step until every request finished; returns them in completion order."""
        while self.has_work:
            self.step()
        done, self.finished = self.finished, []
        return done

    # -- scheduling ---------------------------------------------------------------------------
    def _schedule_extend(self) -> ScheduleBatch | None:
        budget = self.max_prefill_tokens
        free_slots = self.allocator.available_size()
        free_rows = self.req_to_token_pool.available_size()
        picked: list[Req] = []
        lens: list[int] = []
        for req in self.waiting:
            if budget == 0 or len(self.running) + len(picked) >= self.max_running:
                break
            # Keep one slot per running or admitted request for the decode that follows; a
            # prompt that does not fit the budget or the free slots is prefilled in chunks.
            reserve = len(self.running) + len(picked) + 1
            n = min(req.seq_len - req.kv_len, budget, free_slots - reserve)
            needs_row = req.req_pool_idx is None
            if n < 1 or (needs_row and free_rows == 0):
                break
            picked.append(req)
            lens.append(n)
            budget -= n
            free_slots -= n
            free_rows -= int(needs_row)
        if not picked:
            return None
        batch = ScheduleBatch.for_extend(
            picked, lens, self.req_to_token_pool, self.allocator, self.device
        )
        assert batch is not None, "admission checked rows and slots"
        for _ in picked:
            self.waiting.popleft()
        # A request whose prompt did not fit the budget stays at the head, mid-prefill.
        for req, n in reversed(list(zip(picked, lens, strict=True))):
            if req.kv_len + n < req.seq_len:
                self.waiting.appendleft(req)
        return batch

    def _schedule_decode(self) -> ScheduleBatch | None:
        while self.running and self.allocator.available_size() < len(self.running):
            self._retract(self.running.pop())
        if not self.running:
            return None
        return ScheduleBatch.for_decode(
            list(self.running), self.req_to_token_pool, self.allocator, self.device
        )

    def _retract(self, req: Req) -> None:
        self._free(req)
        req.kv_len = 0
        req.num_retractions += 1
        self.stats.retractions += 1
        self.waiting.appendleft(req)
        logger.info("retracted request %s (KV cache full; %d tokens to redo)", req.rid, req.seq_len)

    def _abort_unservable(self) -> None:
        # Nothing could run. With nothing running, the head of the queue cannot fit even an
        # empty cache (minus what mid-prefill requests hold): it can never be served.
        if self.running or not self.waiting:
            return
        req = self.waiting.popleft()
        self._free(req)
        req.finish_reason = FinishReason.ABORT
        req.error = (
            f"request needs {req.seq_len + 1} KV slots but the cache holds {self.allocator.size}"
        )
        self.finished.append(req)

    # -- results ------------------------------------------------------------------------------
    def _process(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        self.stats.steps += 1
        is_decode = batch.mode == ScheduleMode.DECODE
        if is_decode:
            self.stats.decode_steps += 1
        else:
            self.stats.extend_steps += 1
        tokens = result.next_token_ids.tolist()
        for req, n, token in zip(batch.reqs, batch.extend_lens, tokens, strict=True):
            req.kv_len += n
            if req.kv_len < req.seq_len:
                continue  # mid-prefill chunk: its sample is meaningless
            req.output_ids.append(int(token))
            for hook in self.on_token:
                hook(req, int(token))
            self._check_finished(req)
            if req.finished:
                self._free(req)
                self.finished.append(req)
            elif not is_decode:
                self.running.append(req)
        if is_decode:
            self.running = [r for r in self.running if not r.finished]

    def _check_finished(self, req: Req) -> None:
        params = req.sampling_params
        last = req.output_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            req.finish_reason = FinishReason.STOP
        elif len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.context_len:
            req.finish_reason = FinishReason.LENGTH

    def _free(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        if req.kv_len:
            slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len]
            self.allocator.free(slots.to(torch.int64))
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
