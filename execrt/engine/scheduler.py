"""Continuous-batching scheduler: admit prefills while KV slots last, decode everyone, retract."""

from __future__ import annotations

import logging
import operator
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from execrt.core.errors import ExecrtError
from execrt.core.sampler import TokenConstraint
from execrt.core.schedule import FinishReason, Req, ScheduleBatch
from execrt.core.staging import stage_ints
from execrt.core.step import StepInputs
from execrt.core.worker import GenerationBatchResult, TpModelWorker
from execrt.engine.limits import kv_refusal, kv_slots_needed

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: A waiting request that shares at least this many uncached tokens with one picked for the
#: same extend waits a step, to find them cached instead of computing them twice.
DEDUP_MIN_TOKENS = 32
#: Prompt tokens per extend of the requests that want their prompt's logits (prompt
#: log-probabilities): 1024 rows of a 152k vocabulary are 311 MB of bf16 logits.
PROMPT_LOGIT_TOKENS = 1024


@dataclass
class Launched:
    """A step on the device whose results the scheduler has not processed yet."""

    batch: ScheduleBatch
    result: GenerationBatchResult


@dataclass
class SchedulerStats:
    steps: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    retractions: int = 0  # running requests retracted plus partial prefills given up
    prefix_query_tokens: int = 0  # tokens of every admitted request (again after a retraction)
    prefix_hit_tokens: int = 0  # of those, tokens found in the prefix cache
    #: Seconds the host waited for a step's tokens (for the device). With overlap, a host
    #: that keeps the device busy waits most of each step; one that waits ~0 is the bound.
    wait_s: float = 0.0


class Scheduler:
    """Runs requests to completion on one TpModelWorker.

    Each step is either an extend (prefill, chunked to ``max_prefill_tokens``) of waiting
    requests, preferred while slots and rows allow, or a decode of every running request.
    A request finishes on EOS, a stop token, ``max_new_tokens`` or the context limit, and
    gives its K/V to the prefix cache (without one, frees it) at once. Rows and slots come
    from ``worker.memory`` (a ``KVMemory``) and go back to it; the sizes from
    ``worker.limits``. "Available" slots are the free ones plus those the prefix cache holds
    unlocked (a reservation evicts what it is short of): the cache never takes room from a
    request.

    Admission. ``add`` aborts a request at once when it could not run even in an empty cache:
    ``kv_slots_needed(prompt, max_new_tokens, context_len) > cache size`` (or a prompt that
    fills the context). Every other request completes (unless a step raises), whatever the
    prefix cache holds.

    Prefix cache. A request that holds nothing is admitted on the longest cached prefix of
    its tokens but the last (``memory.admit``: locked, in its row, ``kv_len`` set to it); only
    the rest is charged to the prefill budget and to the slots. Locking shrinks what is
    available, so the room is re-read after each admission; a request that then does not fit
    lets go of its prefix again. In-batch dedup: a request that shares at least
    ``dedup_min_tokens`` uncached tokens with a request picked for the same extend ends the
    batch there, and finds them cached in a later step. Once an extend's results are in (its
    K/V written: with overlap, never earlier), each chunk's K/V goes to the cache
    (``memory.cache_prefix``); a finished request's K/V goes too (``release(keep=...)``).
    Retraction and aborts free only what a request owns; its cached prefix stays cached.

    Order. Requests are served oldest first (the order of ``add``). Invariants: ``running``
    is sorted by age and every running request is older than every waiting one; ``waiting``
    is sorted by age; at most one waiting request holds KV (a partial prefill), and it is
    the head of ``waiting``. Extends take requests from the head of ``waiting`` only, and a
    chunked (partial) prefill is always the last one picked, so both hold.

    Retraction. When a decode lacks available slots, victims are taken youngest first: first
    the partial prefill of the waiting head (it lets go of its slots, its lock and its row;
    it stays queued), then running requests from the newest (the same, and put back at the
    head of ``waiting``, to be re-prefilled with what they generated so far). The oldest
    running request O is never a victim: with everything else let go, O's cached and owned
    slots, ``seq_len - 1 <= kv_slots_needed - 1``, are all that is not available (no other
    lock remains), so at least one slot is. After a retraction (of a running request or of a
    partial prefill), until some request finishes,
    extends admit only requests that fit even if they and every running request grow to
    their full need (no ping-pong): nothing but growth and admissions makes fewer slots
    available (eviction moves evictable to free, and handing K/V to the cache keeps it
    locked or frees duplicates), and both are counted.

    Progress (why ``run`` terminates). (1) A step always runs a batch: with requests running,
    the decode above succeeds; with none running, the waiting head H is the only holder of
    rows, slots and locks, so every slot but its ``kv_len`` is available, and an extend of H
    gets ``n >= 1`` tokens because H keeps back a decode slot only when it continues after
    its prefill (``seq_len + 1 <= needed <= cache``) and never holds its last token. (2)
    Decode steps: O, the oldest unfinished request, is ``running[0]`` whenever anything runs,
    gains a token in every decode and is never retracted, so while it is the oldest at most
    ``min(max_new_tokens, context_len - prompt_len) - 1`` decodes happen. Hence
    ``D <= sum_i (min(M_i, C - P_i) - 1)`` over admitted requests. (3) Extend steps: each
    adds ``n >= 1`` tokens to the K/V some queued request holds (its picks' prefills), and
    only a finish or a retraction takes held tokens away. Handing the chunks to the cache
    frees duplicates only (tokens another pick of the same step computed, or, with
    overlap, the step before it; a long shared part waits instead: see the dedup), and the
    request then holds the cache's copy, so what it holds never shrinks. The tokens that can
    be held are bounded by the prompts and outputs of the requests (each at most
    ``kv_slots_needed``), so a run of consecutive extends is at most
    ``sum_i kv_slots_needed_i`` long, and there are at most ``D + 1`` runs:
    ``E <= (D + 1) * sum_i kv_slots_needed_i``. ``steps = D + E``.

    Errors. If a step raises (any BaseException, a KeyboardInterrupt too, wherever it comes
    from: scheduling, the forward, sampling, processing results, freeing, the prefix cache),
    the requests of the batches in flight are aborted with the error and the exception
    propagates. Before that, the scheduler recovers: only unfinished requests stay queued, a
    request whose retraction was cut short waits to be prefilled again, a waiting request
    other than the head lets go of a cached prefix an admission cut short left it, and
    ``memory.reconcile`` frees every slot and row that no queued request (nor the cache)
    holds. The other queued requests stay consistent.
    """

    def __init__(
        self,
        worker: TpModelWorker,
        *,
        max_prefill_tokens: int,
        eos_token_ids: Iterable[int] = (),
        overlap: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        self.worker = worker
        self.memory = worker.memory
        self.context_len = worker.limits.context_len
        self.max_running = worker.limits.max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        #: The logits' width: min_tokens bans only the stop tokens below it (a stop id
        #: outside the vocabulary is never sampled; indexing with it would fail).
        self.vocab_size = vocab_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.finished: list[Req] = []
        self.stats = SchedulerStats()
        # Set by a retraction, cleared when a request finishes (see _schedule_extend).
        self._hold_admission = False
        self.overlap = overlap
        self.dedup_min_tokens = DEDUP_MIN_TOKENS
        #: Prompt tokens per extend of the requests that want their prompt's logits: bounds
        #: the step's ``[rows, vocab]`` logits (and their log-softmax).
        self.prompt_logit_tokens = PROMPT_LOGIT_TOKENS
        self._inflight: Launched | None = None  # launched, results not yet processed
        #: Called as ``hook(req, token_id)`` for every token any request gains.
        self.on_token: list[Callable[[Req, int], None]] = []
        #: ``sinks[req](token_id)`` for every token ``req`` gains (streams, submitted requests):
        #: one dict lookup per token for the requests without one, instead of a call.
        self.sinks: dict[Req, Callable[[int], None]] = {}
        # Per unfinished request: (the tokens that stop it, the output length that ends it).
        self._rules: dict[Req, tuple[frozenset[int], int]] = {}
        #: Builds the token constraint of a request with a ``response_format`` (raises
        #: ValueError saying why it cannot); None: such requests are refused.
        self.constraints: Callable[[Req], TokenConstraint] | None = None

    # -- public -------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue ``req``, or finish it at once (``abort``) if it cannot fit an empty cache."""
        prompt_len = len(req.origin_input_ids)
        needed = self._slots_needed(req)
        error: str | None
        if prompt_len >= self.context_len:
            error = (
                f"prompt of {prompt_len} tokens leaves no room in the context of {self.context_len}"
            )
        elif needed > self.memory.total_slots:
            error = kv_refusal(
                prompt_len,
                req.sampling_params.max_new_tokens,
                self.context_len,
                self.memory.total_slots,
            )
        elif (error := self._constrain(req)) is None:
            self.waiting.append(req)
            return
        req.finish_reason = FinishReason.ABORT
        req.error = error
        self.finished.append(req)

    def _constrain(self, req: Req) -> str | None:
        """Give ``req`` the constraint its ``response_format`` asks for; why not, if not."""
        kind = req.sampling_params.response_format
        if kind == "text" or req.constraint is not None:
            return None
        if self.constraints is None:
            return f"response_format {kind!r} unsupported by this engine"
        try:
            req.constraint = self.constraints(req)
        except ValueError as exc:
            return str(exc)
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    def step(self) -> None:
        """Launch one forward pass (extend if possible, else decode) and process the results
        of the step before it.

        Overlap (``overlap=True``): while the GPU runs step N the host builds step N+1 and
        only then reads step N's tokens. Step N+1 is then either
        - an extend, admitted against the room step N leaves before its results are in (a
          request that finishes with step N gives its room back one step later). A candidate
          that step N computes a long part of (``dedup_min_tokens``) waits for step N's K/V
          to be cached, as it waits for a pick of its own step; or
        - a decode of the running requests, whose tokens of step N are still on the device
          (they feed step N+1 directly); a request that reaches ``max_new_tokens`` or the
          context with step N is left out, one that samples EOS at step N wastes one decode
          whose token is dropped. A decode holding a constrained request
          (``response_format``) waits for step N's results instead: its mask of allowed
          tokens depends on the token in flight.
        A retraction (to make room) waits for step N's results first. Each request's tokens
        are the same with and without overlap (its draw depends on its own seed and step);
        which step admits it may differ. A step that raises: see the class docstring
        ("Errors").
        """
        batch = self._guarded(self._schedule_overlapped)
        if batch is None:
            self._process_inflight()
            if not (self.waiting or self.running):
                return
            batch = self._guarded(self._schedule)
        launched = self._guarded(self._launch, batch, extra=batch)
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            self._guarded(self._process, previous)
        if not self.overlap:
            self._process_inflight()

    def drain(self) -> None:
        """Process the results of the step still in flight, if any (overlap scheduling)."""
        self._process_inflight()

    def run(self) -> list[Req]:
        """Step until every request finished; returns them in completion order."""
        while self.has_work:
            self.step()
        done, self.finished = self.finished, []
        return done

    def abort(self, reqs: Iterable[Req], error: str) -> None:
        """Finish every unfinished request of ``reqs`` with ``abort`` and ``error``, free what
        it holds, and drop all of ``reqs`` from the queues and the finished list."""
        targets = set(reqs)
        try:
            self.drain()  # tokens in flight belong to their requests first
        finally:  # even when that step failed: then it raises after this
            for req in targets:
                if not req.finished:
                    req.finish_reason = FinishReason.ABORT
                    req.error = error
                    self._free(req)
            self.waiting = deque(r for r in self.waiting if r not in targets)
            self.running = [r for r in self.running if r not in targets]
            self.finished = [r for r in self.finished if r not in targets]
            self._recover()

    # -- scheduling ---------------------------------------------------------------------------
    def _slots_needed(self, req: Req) -> int:
        return kv_slots_needed(
            len(req.origin_input_ids), req.sampling_params.max_new_tokens, self.context_len
        )

    def _schedule(self) -> ScheduleBatch:
        batch = self._schedule_extend() or self._schedule_decode()
        assert batch is not None, "a step can always run something (see the class docstring)"
        return batch

    def _batch(self, reqs: list[Req], inputs: StepInputs | None) -> ScheduleBatch:
        assert inputs is not None, "the scheduler counted the free rows and slots"
        return ScheduleBatch.of(reqs, inputs, self.memory.stager, self._stop_tokens)

    def _stop_tokens(self, req: Req) -> list[int]:
        """What ``min_tokens`` holds back: ``req``'s stop tokens that it could sample."""
        vocab = self.vocab_size
        return [t for t in self._rule(req)[0] if t >= 0 and (vocab is None or t < vocab)]

    def _schedule_extend(self, inflight: ScheduleBatch | None = None) -> ScheduleBatch | None:
        """The next extend, or None. ``inflight``: the step still running (overlap), whose
        results are not in: a candidate whose prompt it computes a long part of waits for
        them (its K/V in the cache), as one that a pick computes does."""
        memory = self.memory
        ahead = [] if inflight is None else inflight.reqs  # their kv_len counts the step
        budget = self.max_prefill_tokens
        spent = 0  # slots the picks take
        new_rows = 0  # picks that take a row when reserved (no cache hit)
        # Keep one slot per running request, and per admitted request that goes on decoding
        # after its prefill, for the decode that follows; a prompt that does not fit the
        # budget or the available slots is prefilled in chunks.
        reserve = len(self.running)
        # After a retraction, and until a request finishes, admit only what fits even if it and
        # every running request grow to their full need: anything more would be retracted again.
        hold = self._hold_admission and bool(self.running)
        growth_all = sum(self._slots_needed(r) - r.kv_len for r in self.running) if hold else 0
        picked: list[Req] = []
        lens: list[int] = []
        logit_budget = self.prompt_logit_tokens  # left for requests that want prompt logits
        for req in self.waiting:
            if budget == 0 or len(self.running) + len(picked) >= self.max_running:
                break
            fresh = not memory.holds(req)
            if fresh:
                if memory.available_rows == new_rows:
                    break  # the rows left are the picks'
                req.kv_len = memory.admit(req)  # locks a cached prefix: re-read what is left
                new_rows += int(not memory.holds(req))
            # Evictable slots count as free: a reservation evicts what it is short of.
            room = memory.available_slots - spent
            growth = self._slots_needed(req) - req.kv_len
            keep = int(req.seq_len + 1 <= self._slots_needed(req))
            n = min(req.seq_len - req.kv_len, budget, room - reserve - keep)
            if req.prompt_logits:
                n = min(n, logit_budget)
            if n < 1 or (hold and growth > memory.available_slots - growth_all):
                fits = False
            else:  # a pick computes a long part of this prompt: find it cached next
                fits = not (
                    self._computed_by_picks(req, picked, lens)
                    or self._computed_by_picks(req, ahead, [0] * len(ahead))
                )
            if not fits:
                if fresh:
                    self._free(req)  # undo the admission
                break
            if fresh:
                self._admitted(req)
            picked.append(req)
            lens.append(n)
            budget -= n
            spent += n
            reserve += keep
            growth_all += growth if hold else 0
            if req.prompt_logits:
                logit_budget -= n
                if req.kv_len + n < req.seq_len:
                    break  # a chunk: only the last pick may be one
        if not picked:
            return None
        batch = self._batch(picked, memory.reserve_extend(picked, lens))
        for _ in picked:
            self.waiting.popleft()
        # Only the last pick can be a chunk: it stays at the head, mid-prefill.
        req, n = picked[-1], lens[-1]
        if req.kv_len + n < req.seq_len:
            self.waiting.appendleft(req)
        return batch

    def _admitted(self, req: Req) -> None:
        """Count an admission: prefix-cache hits and the request's ``cached_tokens``."""
        if self.memory.prefix_cache is not None:  # without one, nothing is looked up
            self.stats.prefix_query_tokens += req.seq_len
        self.stats.prefix_hit_tokens += req.kv_len
        if req.num_retractions == 0:
            req.cached_tokens = min(req.kv_len, len(req.origin_input_ids))

    def _computed_by_picks(self, req: Req, picked: list[Req], lens: list[int]) -> bool:
        """True when a pick computes at least ``dedup_min_tokens`` of ``req``'s uncached
        prompt in this step: ``req`` then waits and hits them in the next (in-batch dedup).

        That is: the pick holds ``wanted = kv_len + dedup_min_tokens`` tokens after this step
        and its first ``wanted`` tokens are ``req``'s. Two token compares (where ``req``'s
        uncached part starts and ends) rule out almost every pick before the whole prefix is
        compared, so a step of many picks costs O(picks) per request, not O(picks x prompt).
        """
        if not picked or not self.memory.reuses or req.prompt_logits:
            return False  # (a request that wants its prompt's logits never reads the cache)
        wanted = req.kv_len + self.dedup_min_tokens
        if req.seq_len - 1 < wanted:  # the last token is never matched
            return False
        first, last = _token_at(req, req.kv_len), _token_at(req, wanted - 1)
        ids: list[int] | None = None
        for pick, n in zip(picked, lens, strict=True):
            if pick.kv_len + n < wanted:
                continue  # holds fewer than ``wanted`` tokens after this step
            if _token_at(pick, wanted - 1) != last or _token_at(pick, req.kv_len) != first:
                continue
            if ids is None:
                ids = req.fill_ids[:wanted]
            if pick.fill_ids[:wanted] == ids:
                return True
        return False

    def _schedule_overlapped(self) -> ScheduleBatch | None:
        """The decode that may start before the step in flight is processed, or None."""
        prev = self._inflight
        if not self.overlap or prev is None:
            return None
        if self.waiting and len(self.running) < self.max_running:
            # An extend may be due: build it now (None: decide with step N's results in hand).
            return self._schedule_extend(prev.batch)
        # Leave out those that the tokens in flight end by length (that is predictable).
        rules, rule = self._rules, self._rule
        reqs = [
            r
            for r in self.running
            if len(r.output_ids) + r.num_pending < (rules.get(r) or rule(r))[1]
        ]
        if not reqs or self.memory.available_slots < len(reqs):
            return None  # nothing left to run, or a retraction is due
        if any(r.constraint is not None for r in reqs):
            return None  # a constrained request's mask needs the token in flight
        # Adjusted draws (rare) whose adjustments change with the token: penalties (they
        # count the tokens so far, the one in flight on the device) and min_tokens' bans
        # (they may end with this step's token) are staged afresh, not advanced.
        restage = any(
            (p := r.sampling_params).adjusts
            and (p.penalized or p.min_tokens >= len(r.output_ids) + r.num_pending)
            for r in reqs
        )
        pb = prev.batch
        prev_ids = prev.result.next_token_ids  # [B_prev] on the device
        if (
            len(reqs) == len(pb.reqs)
            and all(pb.samples)
            and all(map(operator.is_, reqs, pb.reqs))
            and not restage
        ):
            # The steady state: the same rows feed their own samples, one token further each;
            # nothing per request is staged but the rows and lengths.
            seq = [s + 1 for s in pb.inputs.seq_lens_cpu]
            inputs = self.memory.reserve_decode(reqs, input_ids=prev_ids, seq_lens=seq)
            if inputs is None:
                return None
            return ScheduleBatch(reqs, inputs, pb.sampling_info.advanced(), [True] * len(reqs))
        rows = {id(r): i for i, (r, s) in enumerate(zip(pb.reqs, pb.samples, strict=True)) if s}
        if any(r.num_pending != int(id(r) in rows) for r in reqs):
            return None  # tokens in flight from an older step: not this simple case
        host = [0 if r.num_pending else r.last_token_id for r in reqs]
        src = [rows.get(id(r), -1) for r in reqs]
        staged_host, staged_src = stage_ints(self.memory.stager, (host, src))  # [B], [B]
        take = prev_ids[staged_src.clamp(min=0)]
        input_ids = torch.where(staged_src >= 0, take, staged_host)
        inputs = self.memory.reserve_decode(reqs, input_ids=input_ids)
        return None if inputs is None else self._batch(reqs, inputs)

    def _rule(self, req: Req) -> tuple[frozenset[int], int]:
        """``(stop tokens, output limit)`` of ``req``: it stops when it samples one of the
        tokens (EOS unless ``ignore_eos``, and its ``stop_token_ids``), and ends by length
        when its output reaches the limit: ``max_new_tokens``, or what fills the context."""
        rule = self._rules.get(req)
        if rule is None:
            params = req.sampling_params
            stops = frozenset(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= self.eos_token_ids
            limit = min(params.max_new_tokens, self.context_len - len(req.origin_input_ids))
            rule = self._rules[req] = (stops, limit)
        return rule

    def _schedule_decode(self) -> ScheduleBatch | None:
        if not self.running:
            return None
        while self.memory.available_slots < len(self.running):
            partial = next((r for r in self.waiting if self.memory.holds(r)), None)
            if partial is not None:
                self._retract(partial, requeue=False)
            else:
                assert len(self.running) > 1, "the oldest running request alone always fits"
                self._retract(self.running[-1], requeue=True)
            # Either way, hold admissions: a partial prefill let go and prefilled again at
            # once would take the slots the running requests grow into, and be let go again
            # at the next decode, over and over (its prefill thrown away each time).
            self._hold_admission = True
        reqs = list(self.running)
        return self._batch(reqs, self.memory.reserve_decode(reqs))

    def _retract(self, req: Req, *, requeue: bool) -> None:
        redo = req.kv_len
        if requeue:  # a running request goes back to the head; a partial prefill already is
            self.waiting.appendleft(req)  # first: a retraction cut short leaves it queued
            self.running.remove(req)
        self._free(req)
        req.num_retractions += 1
        self.stats.retractions += 1
        logger.info("retracted request %s (KV cache full; %d tokens to redo)", req.rid, redo)

    # -- launching and results ----------------------------------------------------------------
    def _launch(self, batch: ScheduleBatch) -> Launched:
        """Start ``batch`` on the device and account for it: K/V positions it writes, and a
        token in flight for every request whose sample is real."""
        result = self.worker.forward_batch_generation(batch)
        if batch.mode.is_decode():  # one token each, and every one is sampled
            for req in batch.reqs:
                req.kv_len += 1
                req.num_pending += 1
            return Launched(batch, result)
        lens = batch.inputs.extend_lens_cpu
        for req, n, sampled in zip(batch.reqs, lens, batch.samples, strict=True):
            req.kv_len += n
            if sampled:
                req.num_pending += 1
                self.running.append(req)
        return Launched(batch, result)

    def _process_inflight(self) -> None:
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._guarded(self._process, launched)

    def _process(self, launched: Launched) -> None:
        batch = launched.batch
        start = time.perf_counter()
        tokens = launched.result.token_ids()  # waits for this step's copy only
        self.stats.wait_s += time.perf_counter() - start
        self.stats.steps += 1
        if batch.mode.is_decode():
            self.stats.decode_steps += 1
        else:
            self.stats.extend_steps += 1
        extend = batch.mode.is_extend()
        computed = batch.inputs.seq_lens_cpu  # K/V of these tokens is written now
        hooks, sinks, check = self.on_token, self.sinks, self._check_finished
        finished = False
        for req, sampled, token, done in zip(
            batch.reqs, batch.samples, tokens, computed, strict=True
        ):
            if req.finish_reason is not None:
                continue  # a step past the request's end (overlap)
            if sampled:  # else a chunk: its sample is meaningless
                req.num_pending -= 1
                req.output_ids.append(token)
                if req.constraint is not None:
                    req.constraint.advance(token)
                for hook in hooks:
                    hook(req, token)
                sink = sinks.get(req)
                if sink is not None:
                    sink(token)
                check(req)
                if req.finish_reason is not None:  # finished first: if freeing fails,
                    finished = True  # recovery frees it
                    self.finished.append(req)
                    self._hold_admission = False
                    self._free(req, keep=done)  # its K/V goes to the prefix cache
                    continue
            if extend:
                self.memory.cache_prefix(req, done)
        if finished:
            self.running = [r for r in self.running if not r.finished]

    def _guarded(self, fn: Callable[..., T], *args: Any, extra: ScheduleBatch | None = None) -> T:
        """Run ``fn``; on any exception abort every batch in flight (and ``extra``), recover,
        then re-raise."""
        try:
            return fn(*args)
        except BaseException as exc:
            if not any(isinstance(a, Launched) for a in args):
                self._salvage_inflight()
            batches = [b for b in (extra, self._inflight and self._inflight.batch) if b]
            for arg in args:
                if isinstance(arg, Launched):
                    batches.append(arg.batch)
            self._inflight = None
            try:
                self._abort_batches(batches, f"step failed: {describe_exception(exc)}")
            finally:
                self._recover()
            raise

    def _salvage_inflight(self) -> None:
        """Keep the tokens of the step in flight when the next one fails to build or launch:
        they were computed, and a stream has promised every one. If reading them fails too,
        that step is aborted with the rest."""
        launched = self._inflight
        if launched is None:
            return
        try:
            self._process(launched)
        except BaseException:  # the first failure is the one to report
            return
        self._inflight = None

    def _check_finished(self, req: Req) -> None:
        stops, limit = self._rule(req)
        if req.output_ids[-1] in stops and len(req.output_ids) > req.sampling_params.min_tokens:
            req.finish_reason = FinishReason.STOP
        elif len(req.output_ids) >= limit:
            req.finish_reason = FinishReason.LENGTH

    def _abort_batches(self, batches: list[ScheduleBatch], error: str) -> None:
        for batch in batches:
            for req in batch.reqs:
                if not req.finished:  # finished first: if freeing fails, recovery frees it
                    req.finish_reason = FinishReason.ABORT
                    req.error = error
                    self.finished.append(req)
                    self._free(req)

    def _recover(self) -> None:
        """After an exception: only unfinished requests stay queued; one both waiting and
        running (a retraction cut short) waits; one that lost its KV starts over; memory
        frees whatever no queued request holds (see KVMemory.reconcile)."""
        self.waiting = deque(r for r in self.waiting if not r.finished)
        self._rules = {r: rule for r, rule in self._rules.items() if not r.finished}
        waiting = set(self.waiting)
        running = [r for r in self.running if not r.finished and r not in waiting]
        self.running = [r for r in running if self.memory.holds(r)]
        self.waiting.extendleft(reversed([r for r in running if not self.memory.holds(r)]))
        for i, req in enumerate(self.waiting):
            if not self.memory.holds(req):
                req.kv_len = req.num_pending = 0
            elif i and self.memory.held_tokens(req) == self.memory.cached_tokens(req):
                self._free(req)  # an admission cut short: it holds a cached prefix only
        self.memory.reconcile([*self.waiting, *self.running])

    def _free(self, req: Req, keep: int = 0) -> None:
        """Give back all ``req`` holds (the K/V of its first ``keep`` tokens to the prefix
        cache); it has no K/V and no token in flight afterwards."""
        req.kv_len = req.num_pending = 0
        if req.finished:
            self._rules.pop(req, None)
        self.memory.release(req, keep)


def _token_at(req: Req, i: int) -> int:
    """``req.fill_ids[i]`` without building the list."""
    prompt = req.origin_input_ids
    return prompt[i] if i < len(prompt) else req.output_ids[i - len(prompt)]


def describe_exception(exc: BaseException) -> str:
    """``RuntimeError: CUDA error ...`` or just ``KeyboardInterrupt`` when there is no text."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe_load_failure(exc: BaseException) -> str:
    """Why an engine could not be built: execrt's own errors (a bad configuration, model or
    backend) are already sentences for the user and keep no class name; anything else is
    ``describe_exception``'s."""
    if isinstance(exc, ExecrtError) and str(exc):
        return str(exc)
    return describe_exception(exc)
