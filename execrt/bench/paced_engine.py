"""A stand-in for the Engine behind the engine clients, for measuring the front end alone: no
model, each step takes a fixed time and gives every running request one token.

It offers what ``run_commands`` and the engine process use of an Engine (``submit``,
``abort_request``, ``step``, ``has_work``, ``stats``, ``limits``, ``flush_cache``, the model's
description), so ``ProcessEngineClient(functools.partial(PacedEngine, step_s=0.002))`` serves
it exactly as it serves a real engine: commands over the pipe, one output message per step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from execrt.core.schedule import SamplingParams
from execrt.engine.client import EngineStats, RequestOutput
from execrt.engine.limits import RequestLimits


@dataclass
class _Running:
    on_output: Callable[[RequestOutput], None] | None
    prompt_tokens: int
    left: int
    token: int


class PacedEngine:
    """Steps of ``step_s`` seconds (paced against a deadline: a late step does not make the
    next one shorter). Token ids cycle through the vocabulary; ``tokenizer`` (a
    ``tokenizers.Tokenizer``, optional) makes the front end detokenize real text."""

    def __init__(
        self,
        step_s: float = 0.002,
        *,
        vocab_size: int = 50_000,
        context_len: int = 8192,
        tokenizer: Any = None,
    ) -> None:
        self.step_s = step_s
        self.tokenizer = tokenizer
        self.chat_template = None
        self.model_path = "paced"
        self.model_note = f"a paced stand-in ({step_s * 1e3:g} ms steps)"
        self.model_config = SimpleNamespace(vocab_size=vocab_size)
        self.parallel = SimpleNamespace(world_size=1, rank=0)
        memory = SimpleNamespace(prefix_cache=None, cached_slots=0)
        self.worker = SimpleNamespace(
            limits=SimpleNamespace(context_len=context_len), memory=memory
        )
        self.limits = RequestLimits(vocab_size, context_len, 1 << 30)
        self._running: dict[int, _Running] = {}
        self._rids = itertools.count()
        self._deadline: float | None = None
        self.steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self._running)

    def submit(
        self,
        prompt: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        top_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> int:
        sp = sampling_params or SamplingParams()
        if not self._running:  # idle until now: the next step takes a whole step from here
            self._deadline = None
        rid = next(self._rids)
        first = (len(prompt) * 31 + rid) % self.model_config.vocab_size
        self._running[rid] = _Running(on_output, len(prompt), sp.max_new_tokens, first)
        return rid

    def abort_request(self, rid: int, reason: str = "aborted") -> None:
        r = self._running.pop(rid, None)
        if r is not None and r.on_output is not None:
            r.on_output(RequestOutput([], finish_reason="abort", error=reason))

    def step(self) -> bool:
        if not self._running:
            self._deadline = None
            return False
        now = time.perf_counter()
        self._deadline = (self._deadline or now) + self.step_s
        if self._deadline > now:
            time.sleep(self._deadline - now)
        else:
            self._deadline = now
        self.steps += 1
        vocab = self.model_config.vocab_size
        for rid, r in list(self._running.items()):
            r.left -= 1
            out = RequestOutput([r.token], prompt_tokens=r.prompt_tokens)
            r.token = (r.token * 7 + 13) % vocab
            if r.left == 0:
                out.finish_reason = "length"
                del self._running[rid]
            if r.on_output is not None:
                r.on_output(out)
        return True

    def stats(self) -> EngineStats:
        n = len(self._running)
        return EngineStats(1 << 30, 1 << 30, 0, n, 0, 0, 0, 0, self.steps)

    def flush_cache(self) -> int:
        return 0

    def close(self) -> list[str]:
        self._running.clear()
        return []
