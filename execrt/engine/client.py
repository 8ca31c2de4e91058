"""The EngineClient seam: what a front end (the HTTP server) asks of an engine it does not own.

Everything here is plain Python (no torch), so a front end can import it without the runtime,
and the engine behind it can later move to its own process without changing the front end:
requests and outputs are small picklable records, and outputs reach the front end through an
``OutputHolder`` that merges them when the reader is slower than the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from execrt.engine.limits import RequestLimits


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of one generated token under the model's raw distribution (before
    temperature, top-k and top-p), and the ``top`` most likely tokens with theirs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What the engine gave one request since its last output: new tokens (with their
    log-probabilities when asked for) and, on the last output, why it finished.

    ``finish_reason`` is None while the request runs, else ``stop`` / ``length`` / ``abort``
    / ``error`` (``error`` then says why). ``cached_tokens`` counts prompt tokens served from
    the prefix cache. ``prompt_logprobs`` (asked for with ``prompt_logprobs``) come once,
    with the first output: one per prompt token but the first, which has none.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load: KV slots, queues and prefix-cache counters (totals
    since start). ``kv_slots_cached`` are slots the prefix cache holds that a request could
    reclaim."""

    kv_slots_total: int
    kv_slots_free: int
    kv_slots_cached: int
    requests_running: int  # decoding, or part way through a prefill chunked over steps
    requests_waiting: int  # queued, holding no KV yet
    prefix_hit_tokens: int
    prefix_query_tokens: int
    retractions: int
    steps: int
    extend_steps: int = 0  # of ``steps``: prefill (extend) steps, the others decode

    @property
    def kv_usage(self) -> float:
        """The fraction of KV slots in use by requests (cached ones count as free)."""
        used = self.kv_slots_total - self.kv_slots_free - self.kv_slots_cached
        return used / self.kv_slots_total if self.kv_slots_total else 0.0


@dataclass(frozen=True)
class ModelInfo:
    """What a front end needs to know of the served model."""

    name: str
    context_len: int
    vocab_size: int
    has_tokenizer: bool
    has_chat_template: bool
    #: the checkpoint's recommended sampling (generation_config.json), SamplingParams keywords
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    #: the whole KV cache in tokens (None: not known; the context alone bounds a request)
    kv_slots_total: int | None = None

    @property
    def max_request_len(self) -> int:
        """The longest request (prompt and answer) served: the context, or one token more
        than the whole KV cache holds where that is less (the last token's K/V is never
        stored)."""
        if self.kv_slots_total is None:
            return self.context_len
        return min(self.context_len, self.kv_slots_total + 1)


@dataclass(frozen=True)
class EngineRequest:
    """One generation request as a front end hands it over.

    ``sampling`` holds ``SamplingParams`` keywords (``max_new_tokens``, ``temperature``, ...);
    the engine validates them and names what is wrong. ``top_logprobs`` None returns no
    log-probabilities; 0 returns the sampled token's only; k > 0 also the k most likely.
    ``prompt_logprobs`` likewise for the prompt's tokens (all but the first; computing them
    bypasses the prefix cache for this prompt).
    """

    request_id: str
    prompt_ids: list[int]
    sampling: Mapping[str, Any]
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None


class Detokenizer(ABC):
    """Turns a request's tokens into text pieces that never split a UTF-8 character."""

    @abstractmethod
    def push(self, token_ids: Sequence[int]) -> str:
        """The new text these tokens complete ("" while a character is incomplete)."""

    @abstractmethod
    def flush(self) -> str:
        """What is still held back (an incomplete character at the end, as U+FFFD)."""


class TextCodec(ABC):
    """The text side of a model: prompts to token ids, tokens to text."""

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids; ``add_special_tokens`` False leaves out what the tokenizer's
        post-processor adds (a BOS, say)."""

    def tokenizer_info(self) -> dict[str, Any]:
        """What a client needs to tokenize as the server does (``/tokenizer_info``: the
        special tokens' text and the chat template). Raises ValueError without a tokenizer."""
        raise ValueError("the model has no tokenizer.json")

    @abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str: ...

    @abstractmethod
    def token_text(self, token_id: int) -> str:
        """One token on its own, for log-probability listings."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text: a piece of a character that spans tokens
        (an emoji, CJK) is its own bytes, not U+FFFD's as ``token_text`` spells it. This
        default is ``token_text``'s UTF-8."""
        return self.token_text(token_id).encode()

    @abstractmethod
    def detokenizer(self) -> Detokenizer: ...

    @abstractmethod
    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> tuple[list[int], tuple[int, ...]]:
        """The prompt ids of a conversation through the chat template (``template_kwargs``:
        more variables for it; the two flags as ``codec.chat_prompt_ids``'s), and the token
        ids that end the assistant's turn. Raises ValueError naming what is wrong."""


def chat_stop_ids(
    given: Sequence[int], turn_ends: Sequence[int], *, ignore_eos: bool, vocab_size: int | None
) -> list[int]:
    """A chat request's stop ids: its own, then the template's end-of-turn ids, which are
    left out when it ignores EOS (an end of turn is one: it then runs to its token limit, as
    a completion does) and where they lie past the logits (``vocab_size``: never sampled)."""
    ends = () if ignore_eos else [t for t in turn_ends if vocab_size is None or t < vocab_size]
    return list(dict.fromkeys([*given, *ends]))


class EngineClient(ABC):
    """A handle on an engine for a front end that never touches torch.

    Every method may be called from any thread and returns at once: requests and aborts are
    queued for whoever steps the engine. Outputs arrive in the ``OutputHolder`` given to
    ``submit``.
    """

    @abstractmethod
    def ready(self) -> bool:
        """True once the model is loaded and requests are served."""

    @abstractmethod
    def load_error(self) -> str | None:
        """Why loading failed (None while loading or once ready)."""

    def stalled(self) -> str | None:
        """Why the engine, though ready, should take no new request now: its step in flight
        has run past ``step_timeout_s`` (a hung TP rank, a stuck kernel). None: it has not,
        or this client keeps no step watchdog (``engine.watchdog``)."""
        return None

    def rank_lost(self) -> str | None:
        """Which tensor-parallel rank went away, once one has (``rank 1 of 2 is gone``): the
        engine has stopped for good (``load_error()`` says so with the collective's error),
        and every request it ran ended with an error output. None: no rank was lost."""
        return None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the engine is ready or failed to load, up to ``timeout`` seconds;
        returns ``ready()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready() and self.load_error() is None:
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return self.ready()

    @abstractmethod
    def model_info(self) -> ModelInfo: ...

    @abstractmethod
    def text(self) -> TextCodec: ...

    @abstractmethod
    def check(self, request: EngineRequest) -> str | None:
        """Why ``request`` cannot be served (the engine's validation message), or None."""

    @abstractmethod
    def submit(self, request: EngineRequest, holder: OutputHolder) -> None:
        """Queue ``request``; ``holder`` receives its outputs, the last one finished."""

    @abstractmethod
    def abort(self, request_id: str, reason: str) -> None:
        """Finish the request now (if it still runs) and free its KV slots."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False when requests hold cached slots. Raises
        NotImplementedError when the engine has no prefix cache."""
        raise NotImplementedError("engine client: this engine has no prefix cache to flush")

    def serve_on(self, loop: asyncio.AbstractEventLoop | None) -> None:  # noqa: B027
        """The front end's event loop, from its thread, as it starts (``loop``) and stops
        (None): a client may read the engine's outputs on it instead of on a thread of its
        own. Nothing by default."""

    @abstractmethod
    def close(self) -> None: ...


class BackgroundEngineClient(EngineClient):
    """What the engine's own clients share: the engine loads in the background (a thread, a
    process) and then hands over what the front end reads without asking it again: the
    ``ModelInfo``, the ``TextCodec`` and the ``RequestLimits`` that ``check`` validates
    against; or ``_error``, why it could not.

    A subclass calls ``_loaded_with`` (then sets ``_loaded``) once the engine is built, sets
    ``_error`` and ``_loaded`` when it fails, and calls ``flushed`` with its engine's answer
    to a flush. It says whether the engine has a prefix cache (``_has_prefix_cache``) and how
    a flush reaches the engine (``_send_flush``).
    """

    def __init__(self) -> None:
        self._info: ModelInfo | None = None
        self._text: TextCodec | None = None
        self._limits: RequestLimits | None = None
        self._error: str | None = None
        self._lost: str | None = None  # rank_lost(), set with _error
        self._loaded = threading.Event()  # built, or failed to
        self._flushes: dict[int, Future[bool]] = {}
        self._flush_keys = itertools.count()

    def _loaded_with(self, info: ModelInfo, text: TextCodec, limits: RequestLimits) -> None:
        self._text, self._limits = text, limits
        self._info = info  # last: ready() from here on

    @abstractmethod
    def _has_prefix_cache(self) -> bool:
        """Whether the (loaded) engine has a prefix cache to flush."""

    @abstractmethod
    def _send_flush(self, key: int) -> bool:
        """Ask the engine to empty its prefix cache and answer ``flushed(key, ok)``; False
        when the request cannot reach it (the engine is gone)."""

    def flushed(self, key: int, ok: bool) -> None:
        """The engine's answer to flush ``key``: whether the prefix cache is empty now."""
        future = self._flushes.pop(key, None)
        if future is not None:
            future.set_result(ok)

    # -- EngineClient ------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the engine is built (or failed); returns ``ready()``."""
        self._loaded.wait(timeout)
        return self.ready()

    def ready(self) -> bool:
        return self._info is not None and self._error is None

    def load_error(self) -> str | None:
        return self._error

    def rank_lost(self) -> str | None:
        return self._lost

    def model_info(self) -> ModelInfo:
        assert self._info is not None, "model_info() before ready()"
        return self._info

    def text(self) -> TextCodec:
        assert self._text is not None, "text() before ready()"
        return self._text

    def check(self, request: EngineRequest) -> str | None:
        assert self._limits is not None, "check() before ready()"
        return self._limits.check(
            request.prompt_ids, request.sampling, request.top_logprobs, request.prompt_logprobs
        )

    def flush_cache(self) -> bool:
        """Empty the prefix cache between two steps (on every rank); blocks until done."""
        assert self._info is not None, "flush_cache() before ready()"
        if not self._has_prefix_cache():
            return super().flush_cache()  # NotImplementedError: no prefix cache
        key = next(self._flush_keys)
        done: Future[bool] = Future()
        self._flushes[key] = done
        if not self._send_flush(key):
            self._flushes.pop(key, None)
            raise RuntimeError(self._error or "the engine was closed")
        return done.result(timeout=120)


class Waker:
    """Wakes one asyncio reader, from any thread, at most once until it reads again: however
    many outputs arrive meanwhile, only one wake-up is scheduled on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._event = asyncio.Event()
        self._pending = False
        self._lock = threading.Lock()

    def notify(self) -> None:
        with self._lock:
            if self._pending:
                return
            self._pending = True
        if threading.get_ident() == self._loop_thread:
            self._event.set()
        else:
            _call_soon(self.loop, self._event.set)

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()
        with self._lock:
            self._pending = False


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between outputs, not yet read
    finished: float | None = None


class OutputHolder:
    """One request's outputs, between the engine's thread (``put``) and one reader (``take``).

    A single slot: an output that arrives before the reader took the last one is merged into
    it (tokens and log-probabilities appended, the finish taken over), so a slow reader gets
    larger pieces, never a growing queue. Stamps when tokens arrive, for latency metrics.
    """

    def __init__(self, waker: Waker | None = None) -> None:
        self._waker = waker
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None
        self.timing = _Timing(time.perf_counter())

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop of the reader (None: a reader without one)."""
        return self._waker.loop if self._waker is not None else None

    def put(self, output: RequestOutput, now: float | None = None) -> None:
        """Add ``output`` (from any thread); ``now`` stamps when it was produced."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            t = self.timing
            if output.token_ids:
                if t.first_token is None:
                    t.first_token = now
                elif t.last_token is not None:
                    t.gaps.append(now - t.last_token)
                t.last_token = now
            if output.finish_reason is not None:
                t.finished = now
            pending = self._pending
            if pending is None:
                self._pending = output
            else:
                _merge(pending, output)
        # An output already pending had woken the reader, which has not taken it yet.
        if pending is None and self._waker is not None:
            self._waker.notify()

    def take(self) -> RequestOutput | None:
        """Everything that arrived since the last ``take`` (merged), or None."""
        with self._lock:
            out, self._pending = self._pending, None
            return out

    def take_gaps(self) -> list[float]:
        """Inter-token gaps (seconds between outputs) recorded since the last call."""
        with self._lock:
            gaps, self.timing.gaps = self.timing.gaps, []
            return gaps


def _merge(into: RequestOutput, later: RequestOutput) -> None:
    into.token_ids.extend(later.token_ids)
    if later.logprobs is not None:
        into.logprobs = (into.logprobs or []) + later.logprobs
    into.finish_reason = later.finish_reason
    into.error = later.error
    into.prompt_tokens = later.prompt_tokens or into.prompt_tokens
    into.cached_tokens = later.cached_tokens or into.cached_tokens
    into.num_retractions = later.num_retractions
    if later.prompt_logprobs is not None:
        into.prompt_logprobs = later.prompt_logprobs


def deliver(outputs: Sequence[tuple[OutputHolder, RequestOutput]]) -> None:
    """Hand one engine step's outputs to their holders, from any thread: the holders of one
    asyncio loop get theirs in a single call on that loop (one wake-up of the loop per step,
    however many requests progressed; at once when called on that loop), the others at once."""
    now = time.perf_counter()
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputHolder, RequestOutput]]] = {}
    for holder, output in outputs:
        loop = holder.loop
        if loop is None:
            holder.put(output, now)
        else:
            by_loop.setdefault(loop, []).append((holder, output))
    try:
        here = asyncio.get_running_loop()  # called on a loop's thread (it reads the engine)
    except RuntimeError:
        here = None
    for loop, items in by_loop.items():
        if loop is here:
            _put_all(items, now)
        else:
            _call_soon(loop, _put_all, items, now)


def _put_all(items: list[tuple[OutputHolder, RequestOutput]], now: float) -> None:
    for holder, output in items:
        holder.put(output, now)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: its reader is gone, nothing to deliver
        pass
