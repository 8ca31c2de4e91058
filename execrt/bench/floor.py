"""The floor of a benchmark run: the ideal time of its requests on a model shape, from the
workload's token lists alone (never the system's own hits), at a dense matmul rate and a copy
rate measured in the same run (``measure_roof``). ``bench prefix`` divides its runs' wall time
by it, ``bench serve`` its output throughput (``workload_floor``'s docstring says what it counts
and what could go below it)."""

from __future__ import annotations

import collections
import heapq
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from execrt.bench.common import measure_copy_rate
from execrt.bench.models import kv_bytes_per_step, prefill_flops, weight_bytes_per_step
from execrt.bench.timing import run_peak_tflops
from execrt.core.assembly import resolve_dtype
from execrt.models.config import ModelConfig


class Roof(NamedTuple):
    """What a floor divides by, measured in the run, and the bytes of one weight or K/V
    element in the engine's dtype."""

    tflops: float  # dense matmul rate
    gbps: float  # copy rate, read + write
    dtype_bytes: int


def measure_roof(device: torch.device, config: ModelConfig) -> Roof:
    """``device``'s matmul rate now, in the dtype its engine runs (``run_peak_tflops``, as
    ``bench decode``'s TTFT), and its copy rate."""
    dtype = resolve_dtype("auto", config.dtype, device)
    tflops = run_peak_tflops(device)
    return Roof(tflops, measure_copy_rate(device).gbps, dtype.itemsize)


class Served(NamedTuple):
    """A request as the floor counts it: its prompt and output length, and its output tokens
    where a later prompt of the run extends them (a chat's answers)."""

    prompt: Sequence[int]
    output_len: int
    output: Sequence[int] = ()


class Floor(NamedTuple):
    """``workload_floor``'s answer."""

    computed_tokens: int  # prompt tokens computed
    prefill_s: float
    decode_s: float
    first_token_s: tuple[float, ...]  # per request: its own prefill at the rates
    alone_s: tuple[float, ...]  # per request: its prefill and decode steps alone

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def workload_floor(
    config: ModelConfig,
    waves: Sequence[Sequence[Served]],
    roof: Roof,
    *,
    reuse: bool,
    slots: int | None = None,
) -> Floor:
    """The ideal time of ``waves`` on ``config`` at ``roof``'s rates. A wave's requests are
    submitted together, each wave once the one before has finished (a chat's turns).

    Per wave, the ideal schedule: one prefill step, then the decode steps (the first token
    comes from the prefill), the two summed because execrt runs them apart (an extend step
    stalls the decodes), each at its own roof with the other resource left out:
    - prefill: the FLOPs of the prompt tokens that must be computed at ``roof.tflops`` (at
      least one read of the weights). Without ``reuse`` every token; with it those no earlier
      prompt, nor answer (``Served.output`` less its last token, whose K/V is never computed),
      of the run computed, and at least each prompt's last token (its logits are needed);
    - decode: the weights once a step (MoE: the experts its batch touches) and every request
      the K/V of its prompt and made tokens, at ``roof.gbps``; ``slots`` requests at a time
      (None: all), longest first, a freed slot taken at once (``_decode_bytes``).
    Caps of the system under test (running requests, prefill chunks, KV pool) are ignored.
    What could go below it: a schedule overlapping prefill compute with decode traffic
    (bounded by the larger of ``prefill_s`` and ``decode_s`` only), and an attention kernel
    reading a shared prefix's K/V once for all the requests of a step."""
    flops_per_s, bytes_per_s = roof.tflops * 1e12, roof.gbps * 1e9
    kv_token = kv_bytes_per_step(config, 1, 1, roof.dtype_bytes)
    weights_1 = weight_bytes_per_step(config, 1, roof.dtype_bytes)
    computed = _Computed() if reuse else None
    prefill = decode = 0.0
    tokens = 0
    first: list[float] = []
    alone: list[float] = []
    for wave in waves:
        flops, wave_tokens = 0.0, 0
        for r in wave:
            cached = 0
            if computed is not None:
                cached = min(computed.match(r.prompt), max(len(r.prompt) - 1, 0))
                computed.add(r.prompt)
            new = len(r.prompt) - cached
            f = _extend_flops(config, new, cached)
            flops, wave_tokens = flops + f, wave_tokens + new
            read = weight_bytes_per_step(config, new, roof.dtype_bytes)
            first.append(max(f / flops_per_s, read / bytes_per_s))
            steps = r.output_len - 1
            own = steps * weights_1 + _kv_reads(len(r.prompt), steps) * kv_token
            alone.append(first[-1] + own / bytes_per_s)
        read = weight_bytes_per_step(config, wave_tokens, roof.dtype_bytes)
        prefill += max(flops / flops_per_s, read / bytes_per_s)
        decode += _decode_bytes(config, wave, slots, roof.dtype_bytes) / bytes_per_s
        tokens += wave_tokens
        if computed is not None:
            for r in (r for r in wave if r.output):
                computed.add([*r.prompt, *r.output[:-1]])
    return Floor(tokens, prefill, decode, tuple(first), tuple(alone))


class _Computed:
    """The token sequences whose K/V a run has computed, as a trie."""

    def __init__(self) -> None:
        self._root: dict[int, Any] = {}

    def match(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``' first tokens were computed."""
        node = self._root
        for n, t in enumerate(tokens):
            if t not in node:
                return n
            node = node[t]
        return len(tokens)

    def add(self, tokens: Sequence[int]) -> None:
        node = self._root
        for t in tokens:
            child = node.get(t)
            if child is None:
                child = node[t] = {}
            node = child


def _extend_flops(config: ModelConfig, new: int, cached: int) -> float:
    """FLOPs of ``new`` prompt tokens on ``cached`` ones: the whole prompt's less its cached
    part's (their attention on the cached keys stays), the LM head once."""
    lm_head = prefill_flops(config, 0)
    return prefill_flops(config, cached + new) - prefill_flops(config, cached) + lm_head


def _kv_reads(prompt: int, steps: int) -> int:
    """K/V tokens one request's ``steps`` decode steps read: step t its prompt and t made."""
    return steps * prompt + steps * (steps + 1) // 2


def _decode_bytes(
    config: ModelConfig, wave: Sequence[Served], slots: int | None, dtype_bytes: int
) -> float:
    """Bytes the decode steps of ``wave`` read: ``slots`` requests at a time (None: all, as
    ``bench throughput``'s roofline), longest first, a freed slot taken at the next step;
    each step reads the weights once for its batch, each request the K/V of its context."""
    steps = sorted((r.output_len - 1 for r in wave if r.output_len > 1), reverse=True)
    free = [0] * min(slots or len(steps), len(steps))  # the step from which each slot is free
    change: collections.Counter[int] = collections.Counter()  # step -> requests in - out
    for n in steps:
        start = heapq.heappop(free)
        change[start] += 1
        change[start + n] -= 1
        heapq.heappush(free, start + n)
    batches: collections.Counter[int] = collections.Counter()  # running -> steps
    running = 0
    for step in range(max(free, default=0)):
        running += change[step]
        batches[running] += 1
    weights = sum(n * weight_bytes_per_step(config, b, dtype_bytes) for b, n in batches.items())
    kv = sum(_kv_reads(len(r.prompt), r.output_len - 1) for r in wave if r.output_len > 1)
    return weights + kv * kv_bytes_per_step(config, 1, 1, dtype_bytes)
