"""OpenAI request bodies read into one plan of engine requests, and refused with the field named.

Every field is known: those the server implements, those it accepts only at their neutral value
(``tools: []``, ``echo: false``, ...), and the rest, which are a 400 naming them. The
sampling fields go to the engine unchanged, so its validation messages are the ones a client
sees.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import orjson

from execrt.engine.client import TextCodec, chat_stop_ids
from execrt.serve.errors import APIError
from execrt.serve.tools import ToolPlan, parse_tools, template_tool_calls

Endpoint = Literal["completion", "chat"]

#: OpenAI request field -> the SamplingParams keyword the engine validates
SAMPLING_FIELDS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "logit_bias": "logit_bias",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "min_p": "min_p",
    "min_tokens": "min_tokens",
    "response_format": "response_format",
}
#: ``user`` and ``metadata`` are accepted and not used (nothing is stored: ``store`` is false).
_COMMON = {"model", "n", "stream", "stream_options", "stop", "user", "metadata", *SAMPLING_FIELDS}
FIELDS: dict[Endpoint, frozenset[str]] = {
    "completion": frozenset(_COMMON | {"prompt", "logprobs", "echo"}),
    "chat": frozenset(
        _COMMON
        | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs"}
        | {"tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"}
        | {"add_generation_prompt", "continue_final_message"}
    ),
}
#: Fields accepted only at a value that changes nothing (what clients send by default).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,),  # chat (completions implement it)
    "best_of": (1,),
    "suffix": ("",),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
}
#: chat's ``reasoning_effort`` values (OpenAI's), passed to the chat template
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_N = 64
MAX_STOPS = 16  # OpenAI allows 4; lm-eval's completions send a task's whole list
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Plan:
    """What one request asks for: prompts (token ids) x ``n`` choices each."""

    endpoint: Endpoint
    model: str | None
    prompts: list[list[int]]
    n: int
    stream: bool
    include_usage: bool
    stops: tuple[str, ...]
    sampling: dict[str, Any]  # SamplingParams keywords shared by every choice (seed apart)
    seed: int | None
    top_logprobs: int | None  # None: no log-probabilities
    #: completions' ``echo``: each choice's text (and log-probabilities) begins with its prompt
    echo: bool = False
    #: ``echo`` with ``max_tokens: 0``: the prompt alone (the engine's one token is dropped)
    prompt_only: bool = False
    #: per prompt, its text as the client sent it (None for token ids): what ``echo`` repeats
    prompt_texts: tuple[str | None, ...] = ()
    #: chat's ``tools`` (None: none given, or ``tool_choice: "none"``)
    tools: ToolPlan | None = None
    #: the request's name for the token budget, which an error about it names: chat takes
    #: ``max_completion_tokens`` and the older ``max_tokens``
    tokens_field: str = "max_tokens"

    @property
    def prompt_logprobs(self) -> int | None:
        """What each engine request asks of its prompt: an echo with log-probabilities
        scores the prompt's tokens too."""
        return self.top_logprobs if self.echo else None

    def choice_seed(self, choice: int) -> int | None:
        """Choice 0 takes ``seed`` itself (n=1 and n>1 agree on it); the others get distinct
        seeds derived from it (a Weyl step, which stays in [0, 2**63))."""
        if self.seed is None or choice == 0:
            return self.seed
        return (self.seed + choice * 0x9E3779B97F4A7C15) % (1 << 63)


def parse(
    body: object,
    endpoint: Endpoint,
    text: TextCodec,
    context_len: int,
    defaults: Mapping[str, Any] | None = None,
    vocab_size: int | None = None,
    max_len: int | None = None,
) -> Plan:
    """Read an OpenAI request body; APIError (400) naming the first field that is wrong.
    ``defaults``: SamplingParams keywords for the sampling fields the body leaves out (the
    model's generation config). ``vocab_size``: the model's; a chat template's end-of-turn
    id past it (never sampled) is not added to the stop tokens. ``max_len``: the longest
    request served (``ModelInfo.max_request_len``; default the context), which a chat answer
    without ``max_tokens`` stays within, so that a KV cache smaller than the context still
    serves such requests."""
    fields = _fields(body)
    _refuse_unknown(fields, endpoint)
    n = _int(fields, "n", 1, 1, MAX_N)
    stream = _bool(fields, "stream", False)
    include_usage = _stream_options(fields, stream)
    stops = _stops(fields.get("stop", ()))
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(f"model {model!r} must be a string", param="model")
    user = fields.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError(f"user {user!r} must be a string", param="user")
    metadata = fields.get("metadata", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise APIError(f"metadata {metadata!r} must map strings to strings", param="metadata")
    echo = prompt_only = False
    texts: tuple[str | None, ...] = ()
    tools: ToolPlan | None = None
    if endpoint == "completion":
        prompts, texts = _completion_prompts(fields.get("prompt"), text)
        logprobs = fields.get("logprobs")
        top = None if logprobs is None else _int(fields, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS)
        default_tokens = DEFAULT_COMPLETION_TOKENS
        echo = _bool(fields, "echo", False)
        if echo and _is_token(fields.get("max_tokens")) and fields["max_tokens"] == 0:
            fields["max_tokens"], prompt_only = 1, True  # scoring a prompt (lm-eval's way)
    else:
        tools = parse_tools(fields, lambda: _template_source(text))
        variables = _template_variables(fields)
        if tools is not None:  # the template renders them (transformers' tools=)
            variables = variables | {"tools": list(tools.tools)}
        ids, end_ids = _chat_prompt(fields.get("messages"), text, variables, fields)
        if tools is not None and tools.forced:
            if "response_format" in fields:
                raise APIError(
                    "response_format with a forced tool call (tool_choice) unsupported: the "
                    "call has its own schema",
                    param="response_format",
                )
            ids = ids + text.encode(tools.prompt_suffix, add_special_tokens=False)
            call = {"name": "tool_call", "schema": tools.call_schema()}
            fields["response_format"] = {"type": "json_schema", "json_schema": call}
        prompts = [ids]
        top = None
        if _bool(fields, "logprobs", False):
            top = _int(fields, "top_logprobs", 0, 0, MAX_CHAT_TOP_LOGPROBS)
        elif "top_logprobs" in fields:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if "max_completion_tokens" in fields:
            fields["max_tokens"] = fields["max_completion_tokens"]
        default_tokens = max(1, (max_len or context_len) - len(ids))
        given = fields.get("stop_token_ids", [])
        if isinstance(given, list) and all(_is_token(t) for t in given):
            # The template's end-of-turn tokens stop the answer too, unless the request
            # ignores EOS (a fixed-length benchmark): it then runs to max_tokens, as on the
            # completions endpoint. A wrong value is left for the engine to name.
            fields["stop_token_ids"] = chat_stop_ids(
                given, end_ids, ignore_eos=fields.get("ignore_eos") is True, vocab_size=vocab_size
            )
    if "logit_bias" in fields:
        fields["logit_bias"] = _logit_bias(fields["logit_bias"])
    schema = ""
    if "response_format" in fields:
        fields["response_format"], schema = _response_format(fields["response_format"])
    if not prompt_only:  # the longest request served: what /v1/models says (max_model_len)
        _check_room(prompts, fields, context_len if max_len is None else max_len)
    sampling = {SAMPLING_FIELDS[k]: v for k, v in fields.items() if k in SAMPLING_FIELDS}
    if schema:
        sampling["json_schema"] = schema
    sampling.setdefault("max_new_tokens", default_tokens)
    for key, value in (defaults or {}).items():
        sampling.setdefault(key, value)
    seed = sampling.pop("seed", None)
    chat_name = "max_completion_tokens" in fields or "max_tokens" not in fields
    return Plan(
        endpoint, model, prompts, n, stream, include_usage, stops, sampling, seed, top,
        echo, prompt_only, texts, tools,
        "max_completion_tokens" if endpoint == "chat" and chat_name else "max_tokens",
    )  # fmt: skip


TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "chat_template_kwargs"}
    | {"add_generation_prompt", "continue_final_message"}
)


def parse_tokenize(body: object, text: TextCodec) -> tuple[str | None, list[int]]:
    """``/tokenize``: ``{"prompt": str}`` (``add_special_tokens``, default true) or
    ``{"messages": [...]}`` through the chat template (``chat_template_kwargs``), as the
    completions and chat endpoints encode them. Returns ``(model, token ids)``."""
    fields = _fields(body, TOKENIZE_FIELDS, "/tokenize")
    model = fields.get("model")
    if ("prompt" in fields) == ("messages" in fields):
        raise APIError("give one of prompt (a string) and messages (a chat)", param="prompt")
    if "messages" in fields:
        variables = _template_variables(fields)
        return model, _chat_prompt(fields["messages"], text, variables, fields)[0]
    prompt = fields["prompt"]
    if not isinstance(prompt, str):
        raise APIError(f"prompt {prompt!r} must be a string", param="prompt")
    try:
        return model, text.encode(prompt, _bool(fields, "add_special_tokens", True))
    except ValueError as exc:
        raise APIError(str(exc), param="prompt") from None


def parse_detokenize(body: object, vocab_size: int) -> tuple[str | None, list[int]]:
    """``/detokenize``: ``{"tokens": [ids]}``, each id in the vocabulary."""
    fields = _fields(body, {"model", "tokens"}, "/detokenize")
    tokens = fields.get("tokens")
    if not isinstance(tokens, list) or not all(_is_token(t) for t in tokens):
        raise APIError(f"tokens {tokens!r} must be a list of token ids", param="tokens")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(f"token id {bad} out of range (vocab size {vocab_size})", param="tokens")
    return fields.get("model"), tokens


def _fields(body: object, known: Set[str] | None = None, endpoint: str = "") -> dict[str, Any]:
    """The body's fields that are given (null means "not given"); with ``known``, a field
    outside it is a 400 naming it (``endpoint`` says whose)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    fields = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(set(fields) - known) if known is not None else []
    if unknown:
        raise APIError(f"field {unknown[0]!r} is unsupported by {endpoint}", param=unknown[0])
    return fields


def _template_source(text: TextCodec) -> str | None:
    try:
        source = text.tokenizer_info().get("chat_template")
    except ValueError:  # no tokenizer
        return None
    return source if isinstance(source, str) else None


def _template_variables(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs``, and ``reasoning_effort`` as the template variable of that
    name (what reasoning models' templates read, as vLLM passes it; others ignore it)."""
    variables = fields.get("chat_template_kwargs", {})
    if not isinstance(variables, dict) or not all(isinstance(k, str) for k in variables):
        raise APIError(
            f"chat_template_kwargs {variables!r} must be an object (variable name -> value)",
            param="chat_template_kwargs",
        )
    effort = fields.get("reasoning_effort")
    if effort is None:
        return variables
    if effort not in REASONING_EFFORTS:
        raise APIError(
            f"reasoning_effort {effort!r} unsupported (supported: {', '.join(REASONING_EFFORTS)})",
            param="reasoning_effort",
        )
    return {"reasoning_effort": effort} | variables


#: OpenAI's error code for a prompt and completion beyond the context (LiteLLM, LangChain and
#: other clients recognise an overflow by it).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def engine_error(message: str, endpoint: Endpoint, tokens_field: str | None = None) -> APIError:
    """The engine's refusal as a 400, ``param`` the request field it is about; ``tokens_field``
    the request's name for the token budget (``Plan.tokens_field``; default the endpoint's)."""
    if tokens_field is None:
        tokens_field = "max_completion_tokens" if endpoint == "chat" else "max_tokens"
    first = message.split(" ", 1)[0]
    names = {v: k for k, v in SAMPLING_FIELDS.items()}
    if first in names:
        param: str | None = names[first]
        if param == "max_tokens":
            param = tokens_field
    elif first in ("prompt", "empty", "token", "text"):
        param = "prompt" if endpoint == "completion" else "messages"
    elif first == "top_logprobs":
        param = "logprobs" if endpoint == "completion" else "top_logprobs"
    elif first.startswith("prompt_logprobs"):  # asked for through completions' echo
        param = "echo"
    elif message.startswith("request needs up to"):  # more KV slots than the cache has
        param = tokens_field
    else:
        param = None
    # Name the request's own field, not the engine's keyword (max_tokens for max_new_tokens).
    message = re.sub(r"\bmax_new_tokens\b", tokens_field, message)
    if endpoint == "completion":  # the one case 0 is served
        message = re.sub(
            r"^max_tokens 0 [^;]*", r"\g<0> (0 with echo: true scores the prompt)", message
        )
    # In OpenAI's words, which clients look for, and its code; the engine's own after them.
    # A KV cache smaller than the context: the longest request served is one token more than
    # it holds (max_model_len).
    full = re.match(r"prompt of (\d+) tokens leaves no room in the context of (\d+)", message)
    holds = re.search(r"whole cache holds \(?(\d+)\)?", message)
    prompt = re.match(r"prompt of (\d+) tokens needs more KV slots", message)
    asked = re.match(r"request needs up to \d+ KV slots \(prompt (\d+) \+ \w+ (\d+)", message)
    if full is not None:
        said = _no_room(int(full[2]), int(full[1]), endpoint)
    elif holds is not None and prompt is not None:
        said = _no_room(int(holds[1]) + 1, int(prompt[1]), endpoint)
    elif holds is not None and asked is not None:
        said = _too_many(int(holds[1]) + 1, int(asked[1]), int(asked[2]), tokens_field)
    else:
        return APIError(message, param=param)
    return APIError(f"{said} ({message})", param=param, code=CONTEXT_LENGTH_EXCEEDED)


def _no_room(limit: int, prompt: int, endpoint: Endpoint) -> str:
    """OpenAI's words for a prompt that fills the longest request served."""
    return (
        f"This model's maximum context length is {limit} tokens. However, your "
        f"{'prompt' if endpoint == 'completion' else 'messages'} resulted in {prompt} "
        "tokens, which leaves no room for a completion"
    )


def _too_many(limit: int, prompt: int, wanted: int, name: str) -> str:
    """OpenAI's words for a token budget (``name``) past what the longest request served
    leaves after the prompt."""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt + wanted} tokens ({prompt} in the prompt, {wanted} in the completion): "
        f"{name} {wanted} is too large, at most {limit - prompt} can be generated"
    )


# -- fields -------------------------------------------------------------------------------------
def _refuse_unknown(fields: Mapping[str, Any], endpoint: Endpoint) -> None:
    for name, value in fields.items():
        if name in FIELDS[endpoint]:
            continue
        if name in NEUTRAL and any(_same(value, v) for v in NEUTRAL[name]):
            continue
        if name in NEUTRAL:
            raise APIError(
                f"field {name!r} = {value!r} is unsupported by this server (accepted only as "
                f"{' or '.join(repr(v) for v in NEUTRAL[name])})",
                param=name,
            )
        raise APIError(f"field {name!r} is unsupported by this server", param=name)


def _response_format(value: Any) -> tuple[str, str]:
    """``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}`` as the engine's ``response_format`` and
    ``json_schema`` (the schema as JSON text; "" without one). The schema itself is checked
    by the engine's limits (the request's 400 names what it lacks)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object") and set(value) == {"type"}:
        return str(kind), ""
    spec = value.get("json_schema") if kind == "json_schema" else None
    if isinstance(spec, dict) and set(value) == {"type", "json_schema"}:
        unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
        name = spec.get("name")
        if unknown:
            raise APIError(
                f"response_format.json_schema field {unknown[0]!r} unsupported",
                param="response_format",
            )
        if not isinstance(name, str) or not name:
            raise APIError(
                "response_format.json_schema.name must be a non-empty string",
                param="response_format",
            )
        if not isinstance(spec.get("schema", {}), dict):
            raise APIError(
                "response_format.json_schema.schema must be a JSON Schema object",
                param="response_format",
            )
        # No schema: any object. "strict" changes nothing: every answer follows the schema.
        schema = spec.get("schema") or {"type": "object"}
        # (key order kept: a closed object's keys are written in the schema's order)
        return "json_schema", orjson.dumps(schema).decode()
    raise APIError(
        f"response_format {value!r} unsupported (supported: {{'type': 'text'}}, "
        "{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name': ..., "
        "'schema': {...}}})",
        param="response_format",
    )


def _check_room(prompts: list[list[int]], fields: Mapping[str, Any], context_len: int) -> None:
    """A ``max_tokens`` that the context cannot hold after the longest prompt is a 400, as
    OpenAI and vLLM answer it (the engine would cut it to the context). A prompt that fills
    the context alone is left for the engine to name."""
    max_tokens = fields.get("max_tokens")
    if not _is_token(max_tokens) or not prompts:
        return
    longest = max(len(p) for p in prompts)
    room = context_len - longest
    if room > 0 and max_tokens > room:
        name = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
        message = _too_many(context_len, longest, max_tokens, name)
        raise APIError(message, param=name, code=CONTEXT_LENGTH_EXCEEDED)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b  # True is not 1 here
    return bool(a == b)


def _int(fields: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = fields.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise APIError(f"{name} {value!r} must be an integer in {lo}..{hi}", param=name)
    return value


def _bool(fields: Mapping[str, Any], name: str, default: bool, within: str = "") -> bool:
    """``fields[name]``, a JSON boolean; ``within``: the object ``fields`` is a field of,
    which the error names as its path (``stream_options.include_usage``)."""
    value = fields.get(name, default)
    if not isinstance(value, bool):
        path = f"{within}.{name}" if within else name
        raise APIError(f"{path} {value!r} must be true or false", param=path)
    return value


def _stream_options(fields: Mapping[str, Any], stream: bool) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise APIError("stream_options needs stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError(
            f"stream_options {options!r} unsupported (supported: {{'include_usage': bool}})",
            param="stream_options",
        )
    return _bool(options, "include_usage", False, within="stream_options")


#: A token id as a JSON key: ASCII digits (``int`` also reads other scripts' digits)
_TOKEN_KEY = re.compile(r"\s*-?[0-9]+\s*")


def _logit_bias(value: object) -> dict[int, Any]:
    """OpenAI's ``{"token id": bias}`` (JSON keys are strings) as ``{id: bias}``; the engine
    checks the ids against the vocabulary and the biases against [-100, 100]."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and _TOKEN_KEY.fullmatch(k) for k in value
    ):
        raise APIError(
            f"logit_bias {value!r} must map token ids (as strings) to biases", param="logit_bias"
        )
    return {int(k): v for k, v in value.items()}


def _stops(stop: object) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else stop
    if (
        not isinstance(stops, (list, tuple))
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise APIError(
            f"stop {stop!r} must be a non-empty string or a list of up to {MAX_STOPS}",
            param="stop",
        )
    return tuple(dict.fromkeys(stops))


def _completion_prompts(
    prompt: object, text: TextCodec
) -> tuple[list[list[int]], tuple[str | None, ...]]:
    """A string, a list of strings, a list of token ids, or a list of such lists: each
    prompt's ids, and its text where it came as text."""
    bad = APIError(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids",
        param="prompt",
    )
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise bad
    out = []
    for item in items:
        if isinstance(item, str):
            try:
                out.append(text.encode(item))
            except ValueError as exc:
                raise APIError(str(exc), param="prompt") from None
        elif isinstance(item, list) and all(_is_token(t) for t in item):
            out.append(list(item))
        else:
            raise bad
    return out, tuple(item if isinstance(item, str) else None for item in items)


def _is_token(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _chat_prompt(
    messages: object, text: TextCodec, variables: Mapping[str, Any], fields: Mapping[str, Any]
) -> tuple[list[int], tuple[int, ...]]:
    """The prompt ids and end-of-turn ids of ``messages``, with the request's
    ``add_generation_prompt`` (default true) and ``continue_final_message`` (default false:
    true continues the final assistant message, vLLM's assistant prefill)."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of messages", param="messages")
    plain = [_message(m, i) for i, m in enumerate(messages)]
    _check_tool_answers(plain)
    continued = _bool(fields, "continue_final_message", False)
    opening = _bool(fields, "add_generation_prompt", not continued)
    try:
        return text.chat_prompt(
            plain, variables, add_generation_prompt=opening, continue_final_message=continued
        )
    except ValueError as exc:
        message = str(exc)
        param = "chat_template_kwargs" if "is reserved: the renderer" in message else "messages"
        if "continue_final_message" in message:
            param = "continue_final_message"
        raise APIError(message, param=param) from None


#: The roles a message may have. ``developer`` (OpenAI's newer name for instructions) is
#: rendered as ``system``: chat templates know the one, not the other.
ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_tool_answers(messages: list[dict[str, Any]]) -> None:
    """Each ``tool`` message answers a call of an earlier assistant message: its
    ``tool_call_id`` is required and, where those calls carry ids, one of them."""
    calls: set[str] | None = None  # ids of the calls made so far (None: none made yet)
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = (calls or set()) | {c["id"] for c in message["tool_calls"] if c.get("id")}
        if message["role"] != "tool":
            continue
        call_id = message.get("tool_call_id")
        if call_id is None:
            raise APIError(
                f"messages[{i}] has role 'tool' but no 'tool_call_id' (the call it answers)",
                param=f"messages[{i}].tool_call_id",
            )
        if calls is None or (calls and call_id not in calls):
            raise APIError(
                f"messages[{i}].tool_call_id {call_id!r} answers no earlier assistant "
                f"tool call (made: {', '.join(sorted(calls)) if calls else 'none'}); a 'tool' "
                "message follows the assistant message whose tool_calls it answers",
                param=f"messages[{i}].tool_call_id",
            )


#: Message fields an answer carries that are neutral when empty (``annotations: []``).
_EMPTY_MESSAGE_FIELDS = frozenset({"annotations"})


def _message(message: object, index: int) -> dict[str, Any]:
    """One message as the template reads it: role and content (text parts joined), and an
    assistant's earlier ``tool_calls`` (arguments decoded) or a tool result's
    ``tool_call_id``."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(f"{where} must be an object with 'role' and 'content'", param=where)
    # An answer sent back as history (the client's ``message.model_dump()``) carries OpenAI's
    # output-only fields, null or empty: as at the top level, those mean "not given".
    message = {
        k: v
        for k, v in message.items()
        if not (v is None or (k in _EMPTY_MESSAGE_FIELDS and v == []))
    }
    unknown = set(message) - {"role", "content", "name", "tool_calls", "tool_call_id"}
    if unknown:
        name = sorted(unknown)[0]
        raise APIError(f"{where}: field {name!r} is unsupported", param=f"{where}.{name}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise APIError(f"{where}.role {role!r} must be a string", param=f"{where}.role")
    if role not in ROLES:
        hint = " (send tool results with role 'tool')" if role == "function" else ""
        raise APIError(
            f"{where}.role {role!r} is unsupported (supported: {', '.join(ROLES)}){hint}",
            param=f"{where}.role",
        )
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    calls = message.get("tool_calls")
    if calls is not None:
        out["tool_calls"] = template_tool_calls(calls, where)
        if content is None:  # a turn of calls alone
            content = ""
    out["content"] = _content(content, where)
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise APIError(
                f"{where}.tool_call_id {call_id!r} must be a string",
                param=f"{where}.tool_call_id",
            )
        out["tool_call_id"] = call_id
    return out


def _content(content: object, where: str) -> str:
    """A string, or a list of text parts (``{"type": "text", "text": ...}``) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(
        f"{where}.content must be a string or a list of text parts (other parts are unsupported)",
        param=f"{where}.content",
    )
