"""What a request must fit in (the vocabulary, the context, the whole KV cache), as one small
picklable record: the Engine validates submissions with it, and a front end in another process
gets a copy at start-up, so that it refuses a bad request with the engine's own message without
asking the engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from execrt.core.prompts import prompt_token_ids
from execrt.core.schedule import SamplingParams
from execrt.engine.json_grammar import schema_grammar

#: The most alternatives one token may list (OpenAI's chat limit).
MAX_TOP_LOGPROBS = 20


def kv_slots_needed(prompt_len: int, max_new_tokens: int, context_len: int) -> int:
    """The most KV slots one request can hold at once: every token but the last it generates.

    A request stops after ``max_new_tokens`` tokens or when prompt plus output reaches
    ``context_len``; the final sampled token is never fed back, so its K/V is never stored.
    """
    return min(prompt_len + max_new_tokens, context_len) - 1


def kv_refusal(prompt_len: int, max_new_tokens: int, context_len: int, total: int) -> str:
    """Why a request that needs more KV slots than the whole cache holds is refused."""
    needed = kv_slots_needed(prompt_len, max_new_tokens, context_len)
    if kv_slots_needed(prompt_len, 1, context_len) > total:  # no max_new_tokens makes it fit
        return (
            f"prompt of {prompt_len} tokens needs more KV slots than the whole cache holds "
            f"({total}); shorten the prompt, or raise kv_cache_tokens (EXECRT_KV_CACHE_TOKENS) "
            f"to at least {needed}"
        )
    return (
        f"request needs up to {needed} KV slots (prompt {prompt_len} + max_new_tokens "
        f"{max_new_tokens} - 1, capped by the context of {context_len}) but the whole cache "
        f"holds {total}; lower max_new_tokens, or raise kv_cache_tokens "
        f"(EXECRT_KV_CACHE_TOKENS) to at least {needed}"
    )


def top_logprobs_problems(top: object, name: str = "top_logprobs") -> list[str]:
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        return [f"{name} {top!r} must be an integer in 0..{MAX_TOP_LOGPROBS}"]
    return []


@dataclass(frozen=True)
class RequestLimits:
    """One engine's limits on a request."""

    vocab_size: int
    context_len: int
    kv_slots_total: int
    #: None when the model scores prompt rows (prompt log-probabilities), else why not
    no_prompt_logits: str | None = None
    #: None when a response_format can be followed (a tokenizer), else why not
    no_response_format: str | None = None
    #: <think> and </think> are single tokens of the vocabulary (``reasoning`` needs them
    #: under a response_format)
    think_tokens: bool = True

    def params_problems(self, sp: SamplingParams) -> list[str]:
        """What valid params ask that this model cannot give: a ``logit_bias`` token outside
        its vocabulary, a ``json_schema`` that is not JSON or uses what JSON mode lacks."""
        problems = []
        bad = next((t for t, _ in sp.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            problems.append(
                f"logit_bias token id {bad} out of range (vocab size {self.vocab_size})"
            )
        if (problem := self.format_problem(sp)) is not None:
            problems.append(problem)
        return problems

    def format_problem(self, sp: SamplingParams) -> str | None:
        """Why this model cannot follow ``sp``'s ``response_format`` (with its ``reasoning``),
        or None: checked before a request is queued, and again when its constraint is built."""
        if sp.response_format == "text":
            return None
        if self.no_response_format is not None:
            return f"response_format {sp.response_format!r} {self.no_response_format}"
        if sp.reasoning and not self.think_tokens:
            return (
                f"response_format {sp.response_format!r} with reasoning {sp.reasoning!r} needs "
                "<think> and </think> as single tokens of the model's vocabulary (this "
                "tokenizer has no such tokens)"
            )
        if sp.response_format == "json_schema":
            try:
                schema_grammar(sp.json_schema)
            except ValueError as exc:
                return f"response_format {exc}"
        return None

    def logprob_problems(self, top_logprobs: object, prompt_logprobs: object) -> list[str]:
        """What is wrong with a request's ``top_logprobs`` / ``prompt_logprobs`` (None: not
        asked for) here."""
        problems = []
        if top_logprobs is not None:
            problems += top_logprobs_problems(top_logprobs)
        if prompt_logprobs is not None:
            problems += top_logprobs_problems(prompt_logprobs, "prompt_logprobs")
            if self.no_prompt_logits is not None:
                problems.append(self.no_prompt_logits)
        return problems

    def token_problems(self, ids: Sequence[int]) -> list[str]:
        """What is wrong with prompt ``ids`` (already plain ints) for this model."""
        problems = []
        # min/max first (C speed); the first bad id only when there is one.
        if ids and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            problems.append(f"token id {bad} out of range (vocab size {self.vocab_size})")
        if len(ids) >= self.context_len:
            problems.append(
                f"prompt of {len(ids)} tokens leaves no room in the context of {self.context_len}"
            )
        return problems

    def kv_problem(self, prompt_len: int, max_new_tokens: int) -> str | None:
        """Why a valid request could not run even alone in an empty KV cache, or None."""
        needed = kv_slots_needed(prompt_len, max_new_tokens, self.context_len)
        if needed > self.kv_slots_total:
            return kv_refusal(prompt_len, max_new_tokens, self.context_len, self.kv_slots_total)
        return None

    def check(
        self,
        prompt_ids: object,
        sampling: Mapping[str, Any],
        top_logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> str | None:
        """What ``Engine.validate`` says of a token-id prompt with these ``SamplingParams``
        keywords (None: it would be served), without the engine."""
        try:
            sp = SamplingParams(**sampling)
        except TypeError as exc:
            return f"sampling: {exc}"
        problems = sp.problems() or self.params_problems(sp)
        ids, problem = prompt_token_ids(prompt_ids)
        if problem is not None:
            problems.append(problem)
        if not ids and not problems:
            problems.append("empty prompt")
        problems += self.token_problems(ids)
        problems += self.logprob_problems(top_logprobs, prompt_logprobs)
        if problems:
            return "; ".join(problems)
        return self.kv_problem(len(ids), sp.max_new_tokens)
