"""SamplingParams: how one request samples and when it stops (torch-free, so that the sampler
can name its type without importing the scheduling side)."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeGuard


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampling reproducible and independent of what else is in the batch.
    Construction never raises: ``problems()`` lists what is wrong (the engine turns that into
    a result with ``finish_reason="error"``). Accepted types: ``int`` for ``max_new_tokens``,
    ``top_k`` and ``seed`` (or None); ``float`` or ``int`` for ``temperature`` and ``top_p``;
    a tuple or list of ``int`` for ``stop_token_ids`` (a list is stored as a tuple); ``bool``
    for ``ignore_eos``; ``logit_bias`` as ``{token id: bias}`` or ``(id, bias)`` pairs (stored
    as pairs sorted by id), each bias in [-100, 100] added to that token's logit before
    sampling (OpenAI's ``logit_bias``; log-probabilities stay the model's). A bool is not
    accepted where a number is; numpy integers and floats are (stored as Python ``int`` /
    ``float``), as they are for prompt token ids.

    Penalties and filters (the OpenAI, vLLM and SGLang meanings; each off at its default):
    - ``repetition_penalty`` (> 0, 1 = off): a token seen in the prompt or the output so far
      has its logit divided by it when positive, multiplied when not (CTRL's penalty);
    - ``frequency_penalty`` and ``presence_penalty`` (in [-2, 2]): subtracted from a token's
      logit, the first once per time the token occurs in the output so far, the second once
      if it occurs at all;
    - ``min_p`` (in [0, 1]): after temperature, tokens less likely than ``min_p`` times the
      likeliest are dropped (before top-k and top-p);
    - ``min_tokens`` (0..``max_new_tokens``): EOS and ``stop_token_ids`` cannot be sampled
      before the output has this many tokens.
    The draw applies the repetition penalty, then ``logit_bias``, the frequency and presence
    penalties and ``min_tokens`` (all additive), then ``response_format``'s mask, then
    temperature, ``min_p``, top-k and top-p. Log-probabilities stay the model's.

    ``response_format``: ``text`` (the default), ``json_object``: only tokens that keep the
    output a prefix of one JSON object may be drawn, and once it is complete only the end of
    the sequence (OpenAI's JSON mode), or ``json_schema``: the same for objects that match
    ``json_schema`` (a JSON Schema as JSON text; the subset ``engine.structured`` lists). Both
    need the model's tokenizer, and no ``min_tokens``. ``reasoning`` (``qwen3`` or
    ``deepseek_r1``, as ``execrt serve --reasoning-parser``): the answer reasons first, free
    text between ``<think>`` and ``</think>`` (qwen3: only if it begins with ``<think>``;
    deepseek_r1: from its start), and the format applies after it.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    response_format: str = "text"
    json_schema: str = ""
    reasoning: str = ""
    #: Derived once (the step loop reads them per request): whether the draw depends on the
    #: tokens so far (a repetition, frequency or presence penalty: each step must know the
    #: token before it), and whether the logits are adjusted at all before the draw.
    penalized: bool = field(init=False, repr=False, compare=False)
    adjusts: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):  # keep the params hashable and immutable
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias: Any = self.logit_bias
        if isinstance(bias, Mapping):
            bias = tuple(bias.items())
        if isinstance(bias, (list, tuple)):
            pairs = tuple(
                tuple(self._plain_number(x) for x in p) if isinstance(p, (list, tuple)) else p
                for p in bias
            )
            if all(isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) for p in pairs):
                pairs = tuple(sorted(pairs, key=lambda p: p[0]))
            object.__setattr__(self, "logit_bias", pairs)

        # numpy integers count as int (as they do for prompt token ids) and numpy floats as
        # float: stored as the plain Python values.
        for name in _NUMBERS:
            object.__setattr__(self, name, self._plain_number(getattr(self, name)))
        if isinstance(self.stop_token_ids, tuple):
            plain = tuple(self._plain_number(t) for t in self.stop_token_ids)
            object.__setattr__(self, "stop_token_ids", plain)
        penalized = (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
        object.__setattr__(self, "penalized", penalized)
        adjusts = (
            penalized
            or bool(self.logit_bias)
            or self.min_tokens != 0
            or self.min_p != 0
            or self.response_format != "text"
        )
        object.__setattr__(self, "adjusts", adjusts)

    def problems(self) -> list[str]:
        """Why these parameters are invalid (empty when they are fine).

        Types are checked before values, so no comparison can raise on a wrong type.
        """
        out = [
            _wrong_type(f.name, getattr(self, f.name), _TYPES[f.name][1])
            for f in fields(self)
            if f.init and not _TYPES[f.name][0](getattr(self, f.name))
        ]
        if out:
            return out
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens {self.max_new_tokens!r} must be an integer >= 1")
        elif not 0 <= self.min_tokens <= self.max_new_tokens:
            out.append(
                f"min_tokens {self.min_tokens!r} must be in 0..max_new_tokens "
                f"({self.max_new_tokens})"
            )
        # The sampler holds both in fp32 and divides logits by them: past these bounds a
        # temperature becomes inf (a masked logit then NaN) and a penalty sends a logit to inf.
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            out.append(
                f"temperature {self.temperature!r} must be a finite number >= 0, at most "
                f"{MAX_TEMPERATURE:g}"
            )
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"top_p {self.top_p!r} must be in (0, 1]")
        if not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            out.append(
                f"repetition_penalty {self.repetition_penalty!r} must be a finite number > 0 "
                f"(1 is off), in [{1 / MAX_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                out.append(f"{name} {getattr(self, name)!r} must be in [-2, 2]")
        if not 0.0 <= self.min_p <= 1.0:
            out.append(f"min_p {self.min_p!r} must be in [0, 1]")
        if self.response_format not in RESPONSE_FORMATS:
            out.append(
                f"response_format {self.response_format!r} unsupported "
                f"(supported: {', '.join(RESPONSE_FORMATS)})"
            )
        elif self.response_format != "text" and self.min_tokens:
            out.append(
                f"min_tokens {self.min_tokens!r} unsupported with response_format "
                f"{self.response_format!r} (the object may be complete sooner)"
            )
        elif self.reasoning not in REASONING:
            out.append(
                f"reasoning {self.reasoning!r} unsupported (supported: "
                f"{', '.join(repr(r) for r in REASONING)})"
            )
        elif (self.response_format == "json_schema") != bool(self.json_schema):
            out.append(
                "json_schema (a JSON Schema as JSON text) goes with response_format "
                f"'json_schema' and only with it (response_format {self.response_format!r})"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            out.append(f"seed {self.seed!r} must be in [0, 2**63)")
        negative = next((t for t in self.stop_token_ids if t < 0), None)
        if negative is not None:  # ids past the vocabulary are accepted: never sampled
            out.append(f"stop_token_ids token id {negative!r} unsupported (token ids >= 0)")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            out.append(f"logit_bias {dict(self.logit_bias)!r} names a token id twice")
        bad = [(t, b) for t, b in self.logit_bias if t < 0 or not -100.0 <= b <= 100.0]
        if bad:
            out.append(
                f"logit_bias ({bad[0][0]!r}, {bad[0][1]!r}) unsupported (token ids >= 0, "
                "biases in [-100, 100])"
            )
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @staticmethod
    def _plain_number(value: Any) -> Any:
        """A numpy (or other ``numbers``) integer as int, a real as float; anything else,
        bools and Python numbers included, unchanged (the type check judges it)."""
        if isinstance(value, bool | int | float) or not isinstance(value, numbers.Real):
            return value
        return operator.index(value) if isinstance(value, numbers.Integral) else float(value)


#: The largest temperature accepted: flat beyond it in fp32 for any logits a model gives.
MAX_TEMPERATURE = 1e6
#: ``repetition_penalty`` is accepted in [1 / this, this]: a logit divided or multiplied by
#: it stays finite in fp32.
MAX_REPETITION_PENALTY = 1e6
#: ``response_format`` values: plain text, one JSON object (JSON mode), one matching a schema
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
#: ``reasoning`` values: none, or how a reasoning model's answer reasons before its format
REASONING = ("", "qwen3", "deepseek_r1")
#: the markers around a reasoning model's reasoning (Qwen3's, DeepSeek-R1's)
THINK_TAGS = ("<think>", "</think>")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: The number fields (numpy values among them stored as Python ``int`` / ``float``).
_NUMBERS = (
    "max_new_tokens", "temperature", "top_k", "top_p", "seed", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "min_p", "min_tokens",
)  # fmt: skip

# Field -> (type check, accepted types as error messages name them). bool is an int subclass
# but is never accepted as a number.
_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "max_new_tokens": (_is_int, "int"),
    "temperature": (_is_number, "float or int"),
    "top_k": (_is_int, "int"),
    "top_p": (_is_number, "float or int"),
    "seed": (lambda v: v is None or _is_int(v), "int or None"),
    "stop_token_ids": (
        lambda v: isinstance(v, tuple) and all(_is_int(t) for t in v),
        "a tuple or list of int",
    ),
    "ignore_eos": (lambda v: isinstance(v, bool), "bool"),
    "logit_bias": (
        lambda v: v == () or _is_pairs(v) and all(_is_int(k) and _is_number(b) for k, b in v),
        "a dict of int -> float, or (int, float) pairs",
    ),
    "repetition_penalty": (_is_number, "float or int"),
    "frequency_penalty": (_is_number, "float or int"),
    "presence_penalty": (_is_number, "float or int"),
    "min_p": (_is_number, "float or int"),
    "min_tokens": (_is_int, "int"),
    "response_format": (lambda v: isinstance(v, str), "str"),
    "json_schema": (lambda v: isinstance(v, str), "str"),
    "reasoning": (lambda v: isinstance(v, str), "str"),
}


def _is_pairs(value: object) -> TypeGuard[tuple[tuple[Any, Any], ...]]:
    """A non-empty tuple of 2-tuples (what ``logit_bias`` is stored as)."""
    return (
        isinstance(value, tuple)
        and bool(value)
        and all(isinstance(p, tuple) and len(p) == 2 for p in value)
    )


def _wrong_type(name: str, value: object, accepted: str) -> str:
    if name == "logit_bias" and _is_pairs(value):
        # Stored as pairs whatever was given: name the first wrong entry, as it was written.
        key, bias = next(p for p in value if not (_is_int(p[0]) and _is_number(p[1])))
        what, got = ("bias", bias) if _is_int(key) else ("token id", key)
        return (
            f"logit_bias entry {key!r}: {bias!r} has a {what} of type {type(got).__name__} "
            f"(accepted: {accepted})"
        )
    if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
        # An integer past 64 bits, which a JSON reader (orjson) hands over as a float.
        return f"{name} {value:.4g} is out of range (accepted: {accepted} within 64 bits)"
    kind = type(value).__name__
    if isinstance(value, (tuple, list)):
        kind += " of " + ("/".join(sorted({type(v).__name__ for v in value})) or "nothing")
    return f"{name} {value!r} has type {kind} (accepted: {accepted})"
