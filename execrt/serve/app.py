"""The OpenAI-compatible HTTP app: completions, chat completions, models (list and retrieve),
health, metrics.

It talks to the engine only through an ``EngineClient`` and never imports torch. Each choice
of a request is one engine request with its own ``OutputHolder``; the handler reads the
holders when woken, turns tokens into text (``ChoiceText``), and answers as one JSON document
or as server-sent events. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from execrt._version import __version__
from execrt.engine.client import (
    EngineClient,
    EngineRequest,
    OutputHolder,
    RequestOutput,
    TextCodec,
    TokenLogprobs,
    Waker,
)
from execrt.serve import GENERATION_CONFIGS
from execrt.serve.metrics import Metrics
from execrt.serve.protocol import (
    APIError,
    Endpoint,
    Plan,
    engine_error,
    parse,
    parse_detokenize,
    parse_tokenize,
)
from execrt.serve.reasoning import ReasoningText, check_parser
from execrt.serve.text import (
    ChoiceText,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
)
from execrt.serve.tools import ToolCallText

OBJECTS = {"completion": "text_completion", "chat": "chat.completion"}
ID_PREFIX = {"completion": "cmpl-", "chat": "chatcmpl-"}


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def create_app(
    client: EngineClient,
    *,
    close_client: bool = False,
    reasoning_parser: str = "none",
    generation_config: str = "auto",
) -> FastAPI:
    """The app over ``client`` (which may still be loading: requests get 503 until ready).
    ``close_client``: the app's shutdown (after the last connection closed) closes it.
    ``reasoning_parser``: how chat answers' reasoning is told from their content (see
    ``serve.reasoning``; ``none``: it is content). ``generation_config``: see
    GENERATION_CONFIGS."""
    check_parser(reasoning_parser)
    if generation_config not in GENERATION_CONFIGS:
        raise ValueError(
            f"generation_config {generation_config!r} unsupported "
            f"(supported: {', '.join(GENERATION_CONFIGS)})"
        )
    model_defaults = generation_config == "auto"

    jobs = LiveJobs()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        jobs.loop = asyncio.get_running_loop()
        client.serve_on(jobs.loop)
        yield
        client.serve_on(None)
        if close_client:
            await asyncio.to_thread(client.close)

    app = FastAPI(
        title="execrt", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.jobs = jobs
    metrics = Metrics(lambda: client.stats() if client.ready() else None)
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return json_response(exc.body(), exc.status)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health() -> Response:
        if not client.ready():
            return json_response(_unavailable(client).body(), 503)
        stall = _stalled(client)
        if stall is not None:  # a probe that fails here gets a hung rank restarted
            return json_response(stall.body(), stall.status)
        return json_response({"status": "ok"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Routing's own refusals (no such path, a method the path does not take) in OpenAI's
        # error shape too, so a client reads every error the same way.
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} on this server"
            error = APIError(message, status=404, type="not_found_error")
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
            error = APIError(message, status=405, type="invalid_request_error")
        else:
            error = APIError(str(exc.detail), status=exc.status_code)
        response = json_response(error.body(), error.status)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    started = int(time.time())  # the model card's "created": when this server began serving it

    def model_card() -> dict[str, Any]:
        info = _ready(client).model_info()
        model = {"id": info.name, "object": "model", "created": started, "owned_by": "execrt"}
        # The longest request served, so that a client sizing requests by it is not refused.
        return model | {"max_model_len": info.max_request_len}

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        card = model_card()
        _check_model(model, card["id"])
        return json_response(card)

    @app.get("/version")  # as vLLM answers it: clients and dashboards that ask which build runs
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        _serving(client)
        try:  # between two engine steps: wait off the event loop
            flushed = await asyncio.to_thread(_ready(client).flush_cache)
        except NotImplementedError as exc:
            raise APIError(str(exc), status=501, type="not_implemented") from None
        if not flushed:
            raise APIError("flush_cache: running requests hold cached KV slots", status=409)
        return json_response({"flushed": True})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        info = _ready(client).model_info()
        try:
            body = client.text().tokenizer_info()
        except ValueError as exc:
            raise APIError(f"tokenizer_info: {exc}") from None
        return json_response(body | {"model_max_length": info.context_len})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        info = _ready(client).model_info()
        model, ids = parse_tokenize(await _json_body(request), client.text())
        _check_model(model, info.name)
        return json_response(
            {"count": len(ids), "max_model_len": info.max_request_len, "tokens": ids}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        info = _ready(client).model_info()
        model, ids = parse_detokenize(await _json_body(request), info.vocab_size)
        _check_model(model, info.name)
        return json_response({"prompt": client.text().decode(ids)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(client, metrics, jobs, request, "completion", model_defaults)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(
            client, metrics, jobs, request, "chat", model_defaults, reasoning_parser
        )

    return app


#: Request bodies larger than this are parsed (their texts tokenized) off the event loop.
PARSE_OFF_LOOP_BYTES = 1 << 16


async def _json_body(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise APIError(f"the request body is not valid JSON ({exc})") from None
    except ClientDisconnect:  # gone before its body arrived: nothing to serve, nothing to log
        raise APIError("the client disconnected before sending the whole body") from None


def _check_model(model: object, served: str) -> None:
    """A request naming another model than the one served is a 404, as OpenAI answers."""
    if model is not None and model != served:
        raise APIError(
            f"model {model!r} does not exist (this server serves {served!r})",
            param="model",
            status=404,
            code="model_not_found",
        )


def _unavailable(client: EngineClient) -> APIError:
    lost = _rank_lost(client)
    if lost is not None:
        return lost
    error = client.load_error()
    message = f"the engine is not serving: {error}" if error else "the model is loading"
    return APIError(message, status=503, type="service_unavailable", code="model_not_ready")


def _rank_lost(client: EngineClient) -> APIError | None:
    """The 503 of an engine that lost a tensor-parallel rank, for good, or None. It names the
    rank but not the collective's error (addresses, source paths), which the log has."""
    lost = client.rank_lost()
    if lost is None:
        return None
    message = (
        f"a tensor-parallel rank was lost ({lost}): this server cannot serve any more "
        "requests and must be restarted"
    )
    return APIError(message, status=503, type="service_unavailable", code="rank_lost")


def _ready(client: EngineClient) -> EngineClient:
    if not client.ready():
        raise _unavailable(client)
    return client


def _stalled(client: EngineClient) -> APIError | None:
    """The 503 of an engine whose step has run past its ``step_timeout_s`` (hung), or None."""
    why = client.stalled()
    if why is None:
        return None
    return APIError(why, status=503, type="service_unavailable", code="engine_stalled")


def _serving(client: EngineClient) -> EngineClient:
    """``client``, ready and taking new requests: a request that would wait behind a hung
    step is refused instead (those already in the engine wait for it)."""
    stall = _stalled(_ready(client))
    if stall is not None:
        raise stall
    return client


class LiveJobs:
    """The jobs the app is serving, so that a shutdown can end them at once (``close``)
    instead of waiting for every answer to run its course."""

    def __init__(self) -> None:
        # Weak: a job leaves when its answer is done with (a finished one still held only
        # aborts nothing)
        self.jobs: weakref.WeakSet[Job] = weakref.WeakSet()
        self.closing: str | None = None  # why no new job is taken
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's, once it serves

    def close(self, reason: str) -> None:
        """Refuse new jobs and abort what every job still runs, with ``reason``: each
        choice then ends with that error (streams: an error event, then ``[DONE]``), so the
        connections close and the server can exit. Safe from any thread (and from a signal
        handler): the work runs on the app's event loop."""
        if self.loop is None or self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self.loop.call_soon_threadsafe(self._close, reason)

    def _close(self, reason: str) -> None:
        self.closing = reason
        for job in list(self.jobs):
            job.abort_running(reason)

    def check_open(self) -> None:
        if self.closing is not None:
            raise _stopping(self.closing)


def _stopping(message: str) -> APIError:
    """The 503 of a request the server's shutdown refused or aborted (a client may retry
    elsewhere)."""
    return APIError(message, status=503, type="service_unavailable")


async def _generate(
    client: EngineClient,
    metrics: Metrics,
    jobs: LiveJobs,
    request: Request,
    endpoint: Endpoint,
    model_defaults: bool,
    reasoning_parser: str = "none",
) -> Response:
    _serving(client)
    jobs.check_open()
    body = await _json_body(request)
    info = client.model_info()
    defaults = dict(info.sampling_defaults) if model_defaults else None
    args = (
        body, endpoint, client.text(), info.context_len, defaults, info.vocab_size,
        info.max_request_len,
    )  # fmt: skip
    if len(await request.body()) > PARSE_OFF_LOOP_BYTES:  # the body is cached: no new read
        # Tokenizing megabytes of text takes seconds, which every other stream and /health
        # would wait out on the event loop; the tokenizer lets go of the GIL meanwhile.
        plan = await asyncio.to_thread(parse, *args)
    else:
        plan = parse(*args)
    _check_model(plan.model, info.name)
    jobs.check_open()
    _serving(client)  # parsing a large body took a while
    job = Job(client, metrics, plan, info.name, reasoning_parser)
    job.submit()
    jobs.jobs.add(job)
    if plan.stream:
        return EventSourceResponse(job.events(), headers=STREAM_HEADERS)
    return await job.respond(request)


@dataclass
class _Choice:
    index: int
    request: EngineRequest
    holder: OutputHolder
    text: ChoiceText
    counts_prompt: bool  # the first choice of its prompt: counts the prompt in metrics
    echo: str | None = None  # the prompt's text, when the choice begins with it
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    parts: list[str] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    started: bool = False  # an update was made
    calls: ToolCallText | None = None  # chat with tools: the text's calls held back
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # once done
    thinking: ReasoningText | None = None  # chat with a reasoning parser
    reasoning: list[str] = field(default_factory=list)  # its reasoning (one JSON document)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Update:
    choice: _Choice
    text: str
    logprobs: list[TokenLogprobs]
    first: bool = False  # the choice's first: an echo goes before it
    reasoning: str = ""  # chat with a reasoning parser: reasoning to send before ``text``


class Job:
    """One HTTP request: ``len(prompts) * n`` engine requests, read as they progress."""

    def __init__(
        self,
        client: EngineClient,
        metrics: Metrics,
        plan: Plan,
        model: str,
        reasoning_parser: str = "none",
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.plan = plan
        self.model = model
        self.codec: TextCodec = client.text()
        self.id = ID_PREFIX[plan.endpoint] + uuid.uuid4().hex
        self.created = int(time.time())
        self.waker = Waker()
        self.stopped: str | None = None  # why the server aborted what this job runs
        self._template: tuple[bytes, bytes, bytes] | None = None  # of _text_chunk
        self.choices: list[_Choice] = []
        shared = dict(plan.sampling)
        forced = plan.tools is not None and bool(plan.tools.forced)  # (the prompt opened it)
        if plan.endpoint == "chat" and reasoning_parser != "none" and not forced:
            if shared.get("response_format", "text") != "text":
                shared["reasoning"] = reasoning_parser  # the format applies after it
        for p, prompt in enumerate(plan.prompts):
            for c in range(plan.n):
                index = p * plan.n + c
                sampling = dict(shared, seed=plan.choice_seed(c))
                req = EngineRequest(
                    f"{self.id}-{index}", prompt, sampling, plan.top_logprobs, plan.prompt_logprobs
                )
                if c == 0:  # the others differ by their derived seed only
                    problem = client.check(req)
                    if problem is not None:
                        raise engine_error(problem, plan.endpoint, plan.tokens_field)
                text = ChoiceText(
                    self.codec.detokenizer(), plan.stops, plan.sampling.get("min_tokens", 0)
                )
                choice = _Choice(index, req, OutputHolder(self.waker), text, c == 0)
                if plan.tools is not None:
                    choice.calls = ToolCallText(plan.tools.format, plan.tools.prompt_suffix)
                if plan.endpoint == "chat" and reasoning_parser != "none":
                    choice.thinking = ReasoningText(reasoning_parser)
                if plan.echo:  # the client's own text, else the ids decoded
                    given = plan.prompt_texts[p] if p < len(plan.prompt_texts) else None
                    choice.echo = self.codec.decode(prompt) if given is None else given
                self.choices.append(choice)

    def submit(self) -> None:
        for choice in self.choices:
            self.client.submit(choice.request, choice.holder)

    def abort_running(self, reason: str) -> None:
        """Ask the engine to abort every unfinished choice: each then ends through its
        output, as an error naming ``reason`` (``abort_unfinished`` ends them here, for a
        client that went away and reads nothing more)."""
        self.stopped = reason
        for choice in self.choices:
            if not choice.done:
                self.client.abort(choice.request.request_id, reason)

    def abort_unfinished(self, reason: str) -> None:
        for choice in self.choices:
            if not choice.done:
                choice.finish_reason = "abort"
                self.client.abort(choice.request.request_id, reason)
                self._count(choice)

    async def updates(self) -> AsyncIterator[_Update]:
        """Each choice's progress, as the engine makes it, until every choice is done."""
        while True:
            for choice in self.choices:
                if choice.done:
                    continue
                out = choice.holder.take()
                if out is not None:
                    yield self._apply(choice, out)
            if all(c.done for c in self.choices):
                return
            await self.waker.wait()

    def _apply(self, choice: _Choice, out: RequestOutput) -> _Update:
        ids, lps = ([], None) if self.plan.prompt_only else (out.token_ids, out.logprobs)
        text, logprobs = choice.text.feed(ids, lps)
        first, choice.started = not choice.started, True
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        choice.cached_tokens = out.cached_tokens
        self.metrics.gaps(choice.holder.take_gaps())
        if choice.text.stopped:
            choice.finish_reason = "stop"  # a stop string: the engine need not go on
            self.client.abort(choice.request.request_id, "stop string matched")
        elif out.finished:
            rest, last = choice.text.finish()
            text, logprobs = text + rest, logprobs + last
            if out.finish_reason in ("abort", "error"):
                choice.finish_reason, choice.error = "error", out.error or "request aborted"
            else:
                choice.finish_reason = out.finish_reason
        reasoning = ""
        if choice.thinking is not None:
            reasoning, text = choice.thinking.feed(text)
            if choice.done:
                more_reasoning, more_text = choice.thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if choice.calls is not None:
            text = choice.calls.feed(text)
            if choice.done:
                rest, choice.tool_calls = choice.calls.finish()
                text += rest
                if choice.tool_calls and choice.finish_reason == "stop":
                    choice.finish_reason = "tool_calls"
        if choice.done:
            self._count(choice)
        return _Update(choice, text, logprobs, first, reasoning)

    def _failure(self, choice: _Choice) -> APIError:
        """The error of a choice that the engine failed while running it: ``rank_lost``'s
        503 when a TP rank went away (the step's own error quotes the collective's), a 503
        naming the shutdown where the server aborted it (a client may retry elsewhere), else
        a 500 with the engine's message."""
        lost = _rank_lost(self.client)
        if lost is not None:
            return lost
        if self.stopped is not None:
            return _stopping(choice.error or self.stopped)
        return APIError(choice.error or "request failed", status=500, type="server_error")

    def _count(self, choice: _Choice) -> None:
        t = choice.holder.timing
        end = t.finished or time.perf_counter()
        self.metrics.finished(
            choice.finish_reason or "abort",
            len(choice.request.prompt_ids) if choice.counts_prompt else 0,
            choice.text.tokens,
            None if t.first_token is None else t.first_token - t.arrival,
            end - t.arrival,
        )

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.plan.prompts)
        completion = sum(c.text.tokens for c in self.choices)
        cached = sum(c.cached_tokens for c in self.choices if c.counts_prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -- one JSON document ---------------------------------------------------------------------
    async def respond(self, request: Request) -> Response:
        """Wait for every choice (aborting them if the client goes away) and answer."""
        run = asyncio.ensure_future(self._collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not run.done():
                run.cancel()
            self.abort_unfinished("the client disconnected")
        if not run.done() or run.cancelled():
            return Response(status_code=499)  # nobody reads it
        run.result()
        failed = next((c for c in self.choices if c.finish_reason == "error"), None)
        if failed is not None:  # check() let it in: the engine failed while running it
            raise self._failure(failed)
        return json_response(
            {
                "id": self.id,
                "object": OBJECTS[self.plan.endpoint],
                "created": self.created,
                "model": self.model,
                "choices": [self._final_choice(c) for c in self.choices],
                "usage": self.usage(),
            }
        )

    async def _collect(self) -> None:
        async for update in self.updates():
            update.choice.parts.append(update.text)
            update.choice.reasoning.append(update.reasoning)

    def _final_choice(self, choice: _Choice) -> dict[str, Any]:
        echo, echo_lp = self._echo(choice)
        text = echo + "".join(choice.parts)
        starts = choice.text.offsets
        if echo_lp is None:
            logprobs = self._logprobs(choice.text.logprobs, starts=starts)
        else:  # the completion's offsets count on from the echoed prompt's text
            later = self._logprobs(choice.text.logprobs, len(echo), starts)
            logprobs = join_logprobs(echo_lp, later)
        if self.plan.endpoint == "completion":
            body: dict[str, Any] = {"index": choice.index, "text": text}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if choice.tool_calls:
                message = {"role": "assistant", "content": text.rstrip() or None}
                message["tool_calls"] = choice.tool_calls
            if choice.thinking is not None:
                message["reasoning_content"] = "".join(choice.reasoning) or None
            body = {"index": choice.index, "message": message}
        return body | {"logprobs": logprobs, "finish_reason": choice.finish_reason}

    def _echo(self, choice: _Choice) -> tuple[str, dict[str, Any] | None]:
        """The text and log-probabilities a choice begins with: its prompt under ``echo``."""
        top = self.plan.top_logprobs
        if choice.echo is None:
            return "", None
        if top is None:
            return choice.echo, None
        prompt = choice.request.prompt_ids
        return choice.echo, echo_logprobs(prompt, choice.prompt_logprobs, self.codec, top)

    def _logprobs(
        self, logprobs: list[TokenLogprobs], offset: int = 0, starts: list[int] | None = None
    ) -> Any:
        top = self.plan.top_logprobs
        if top is None:
            return None
        if self.plan.endpoint == "completion":
            return completion_logprobs(logprobs, self.codec, top, offset, starts)
        return chat_logprobs(logprobs, self.codec, top)

    # -- server-sent events --------------------------------------------------------------------
    async def events(self) -> AsyncIterator[bytes]:
        """The SSE stream: chunks as choices progress, the usage chunk when asked for, then
        ``[DONE]``. Closing it early (the client went away) aborts what still runs."""
        try:
            chat = self.plan.endpoint == "chat"
            if chat:
                for choice in self.choices:
                    delta = {"role": "assistant", "content": ""}
                    yield self._chunk(choice.index, {"delta": delta})
            async for u in self.updates():
                c = u.choice
                if u.reasoning:  # before the content of the same update
                    yield self._chunk(c.index, {"delta": {"reasoning_content": u.reasoning}})
                text, echo_lp = u.text, None
                if u.first and c.echo is not None:  # the prompt first (completions' echo)
                    echo, echo_lp = self._echo(c)
                    text = echo + text
                if not u.logprobs and echo_lp is None and not c.done:  # text only
                    if text:
                        yield self._text_chunk(c.index, text)
                    continue
                lp = None
                if u.logprobs:
                    starts = c.text.offsets[len(c.text.offsets) - len(u.logprobs) :]
                    # the completion's text begins after the echoed prompt's
                    lp = self._logprobs(u.logprobs, len(c.echo or ""), starts)
                if echo_lp is not None:
                    lp = echo_lp if lp is None else join_logprobs(echo_lp, lp)
                content = bool(text or u.logprobs or echo_lp)
                if c.finish_reason == "error":
                    if content:
                        yield self._chunk(c.index, self._piece(text, lp))
                    yield _sse(self._failure(c).body())
                elif chat:
                    if content:
                        yield self._chunk(c.index, self._piece(text, lp))
                    if c.tool_calls:  # whole, in one delta, once the choice ends
                        calls = [{"index": i} | call for i, call in enumerate(c.tool_calls)]
                        yield self._chunk(c.index, {"delta": {"tool_calls": calls}})
                    if c.done:  # an empty delta ends the choice
                        yield self._chunk(c.index, {"delta": {}, "finish_reason": c.finish_reason})
                elif content or c.done:  # the last piece carries the finish reason
                    body = self._piece(text, lp) | {"finish_reason": c.finish_reason}
                    yield self._chunk(c.index, body)
            if self.plan.include_usage:
                yield _sse(self._envelope([]) | {"usage": self.usage()})
            yield format_sse_event(data_str="[DONE]")
        finally:
            self.abort_unfinished("the client disconnected")

    def _text_chunk(self, index: int, text: str) -> bytes:
        """``_chunk(index, _piece(text, None))``, the same bytes, from a template of the job's
        constant parts (one orjson call on the text instead of on a chunk of dicts)."""
        if self._template is None:
            head = orjson.dumps(self._envelope([]))[: -len(b"[]}")]  # ..."choices":
            usage = b',"usage":null' if self.plan.include_usage else b""
            if self.plan.endpoint == "chat":
                body, end = b',"delta":{"content":', b'},"logprobs":null,"finish_reason":null}]'
            else:
                body, end = b',"text":', b',"logprobs":null,"finish_reason":null}]'
            self._template = (b"data: " + head + b'[{"index":', body, end + usage + b"}\n\n")
        head, body, end = self._template
        return b"".join((head, str(index).encode(), body, orjson.dumps(text), end))

    def _piece(self, text: str, logprobs: Any) -> dict[str, Any]:
        if self.plan.endpoint == "chat":
            return {"delta": {"content": text}, "logprobs": logprobs}
        return {"text": text, "logprobs": logprobs}

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.plan.endpoint == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, index: int, body: dict[str, Any]) -> bytes:
        choice = {"index": index, **body}
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
        chunk = self._envelope([choice])
        if self.plan.include_usage:
            chunk["usage"] = None
        return _sse(chunk)


#: A stream is never cached or buffered on its way (nginx holds an event stream back unless
#: told not to by ``X-Accel-Buffering``).
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(body: Any) -> bytes:
    return format_sse_event(data_str=orjson.dumps(body).decode())


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
