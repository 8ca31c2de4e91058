"""Requests submitted one by one (``Engine.submit``): their tokens, gathered while the scheduler
steps, are handed to each request's callback once per step, then once more when it finishes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from execrt.core.schedule import Req
from execrt.engine.client import RequestOutput, TokenLogprobs
from execrt.engine.logprobs import LogprobWorker
from execrt.engine.scheduler import Scheduler
from execrt.engine.stats import cached_prompt_tokens

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


@dataclass
class _Tracked:
    req: Req
    on_output: OutputCallback | None
    logprobs: bool
    prompt_logprobs: bool = False  # not yet sent: they go with the first output
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)


class RequestTable:
    """Submitted requests by id. ``on_token`` is each one's token sink (``scheduler.sinks``);
    ``deliver`` (after each step, by the stepping thread) calls each callback with what its
    request gained, and finishes and forgets the requests that are done."""

    def __init__(self, scheduler: Scheduler, worker: LogprobWorker) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self._by_rid: dict[int, _Tracked] = {}
        self._by_req: dict[Req, _Tracked] = {}
        self._gained: list[_Tracked] = []

    def __len__(self) -> int:
        return len(self._by_rid)

    def track(
        self,
        req: Req,
        on_output: OutputCallback | None,
        top_logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> None:
        tracked = _Tracked(req, on_output, top_logprobs is not None, prompt_logprobs is not None)
        if top_logprobs is not None:
            self.worker.watch(req, top_logprobs)
        if prompt_logprobs is not None:
            self.worker.watch_prompt(req, prompt_logprobs)
        self._by_rid[req.rid] = tracked
        self._by_req[req] = tracked
        self.scheduler.sinks[req] = functools.partial(self.on_token, req)

    def get(self, rid: int) -> Req | None:
        tracked = self._by_rid.get(rid)
        return tracked.req if tracked else None

    def on_token(self, req: Req, token_id: int) -> None:
        tracked = self._by_req.get(req)
        if tracked is None:
            return
        if not tracked.new_ids:
            self._gained.append(tracked)
        tracked.new_ids.append(token_id)
        if tracked.logprobs:
            lp = self.worker.take(req, token_id)
            if lp is not None:
                tracked.new_logprobs.append(lp)

    def finish(self, req: Req) -> None:
        """Deliver ``req``'s last output now (it was aborted outside a step)."""
        tracked = self._by_req.get(req)
        if tracked is not None:
            self._finish(tracked)

    def deliver(self) -> None:
        gained, self._gained = self._gained, []
        for tracked in gained:
            if not tracked.req.finished:
                self._send(tracked, self._output(tracked))
        if not self._by_req:
            return
        done = [self._by_req[r] for r in self.scheduler.finished if r in self._by_req]
        if done:
            ids = {id(t.req) for t in done}
            self.scheduler.finished = [r for r in self.scheduler.finished if id(r) not in ids]
            for tracked in done:
                self._finish(tracked)

    def _finish(self, tracked: _Tracked) -> None:
        req = tracked.req
        del self._by_rid[req.rid], self._by_req[req]
        self.scheduler.sinks.pop(req, None)
        out = self._output(tracked)  # before unwatch: it may take the prompt's log-probs
        self.worker.unwatch(req)
        assert req.finish_reason is not None
        out.finish_reason = req.finish_reason.value
        out.error = req.error
        out.num_retractions = req.num_retractions
        self._send(tracked, out)

    def _output(self, tracked: _Tracked) -> RequestOutput:
        out = RequestOutput(
            tracked.new_ids,
            tracked.new_logprobs if tracked.logprobs else None,
            prompt_tokens=len(tracked.req.origin_input_ids),
            cached_tokens=cached_prompt_tokens(tracked.req),
        )
        tracked.new_ids, tracked.new_logprobs = [], []
        if tracked.prompt_logprobs:
            out.prompt_logprobs = self.worker.take_prompt(tracked.req)
            tracked.prompt_logprobs = out.prompt_logprobs is None
        return out

    @staticmethod
    def _send(tracked: _Tracked, out: RequestOutput) -> None:
        if tracked.on_output is None:
            return
        try:
            tracked.on_output(out)
        except Exception:  # a consumer's bug must not stop the engine or the other requests
            logger.exception("engine: output callback of request %s failed", tracked.req.rid)
