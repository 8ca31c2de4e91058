"""Sampler: greedy, temperature, top-k, top-p, with per-request seeds that ignore batch makeup."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from execrt.core.staging import stage_floats, stage_ints

if TYPE_CHECKING:
    from execrt.core.sampling_params import SamplingParams
    from execrt.core.staging import HostToDevice


class TokenConstraint(Protocol):
    """Which tokens a request may draw next (``response_format``), and its progress."""

    def allowed(self, device: torch.device | None = None) -> torch.Tensor:
        """``[V]`` bool on ``device`` (None: the host): the tokens allowed now (never none)."""
        ...

    def advance(self, token: int) -> None:
        """The request drew ``token``."""
        ...


class SamplingRequest(Protocol):
    """What sampling reads of a request (``core.schedule.Req`` is one): its parameters, seed,
    how many tokens it has sampled (in flight included) and, for its penalties, which tokens
    its prompt and output hold."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def sampling_seed(self) -> int: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def num_pending(self) -> int: ...
    @property
    def output_counts(self) -> Mapping[int, int]: ...
    @property
    def seen_tokens(self) -> Set[int]: ...
    @property
    def constraint(self) -> TokenConstraint | None: ...


_R = TypeVar("_R", bound=SamplingRequest)
_M32 = 0xFFFFFFFF
_I64_MAX = 2**63 - 1


@dataclass
class SamplingBatchInfo:
    """Sampling parameters of one batch as device tensors, one row per request."""

    temperatures: torch.Tensor  # [B] fp32; 0 = greedy
    top_ks: torch.Tensor  # [B] int64; <= 0 = off
    top_ps: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: index of the token being sampled (output length so far)
    all_greedy: bool
    #: (rows, token ids, values), each [N] on the device, added to the logits before the draw:
    #: the rows' ``logit_bias``, and -inf on the stop tokens of a row short of its
    #: ``min_tokens``. None when no row has any.
    logit_adds: Sparse | None = None
    #: The repetition, frequency and presence penalties of the rows that have any (None: no
    #: row has), token in flight included.
    penalties: Penalties | None = None
    #: [B] fp32 ``min_p`` per row (0 = off); None when no row sets one.
    min_ps: torch.Tensor | None = None
    #: (rows [R] int64, masks [R, V] bool) on the device: the tokens each constrained row
    #: (``response_format``) may draw; None when no row is constrained.
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def adjusted(self) -> bool:
        """Whether the draw changes the logits first (``adjust_logits``): a decode graph's
        draw, made from the parameter tensors alone, does not stand for such a batch."""
        return not (
            self.logit_adds is None
            and self.penalties is None
            and self.min_ps is None
            and self.allowed is None
        )

    @classmethod
    def from_reqs(
        cls,
        reqs: Sequence[_R],
        device: torch.device,
        stager: HostToDevice | None = None,
        stop_tokens: Callable[[_R], Collection[int]] | None = None,
        last_ids: torch.Tensor | None = None,
    ) -> SamplingBatchInfo:
        """One row per request. ``steps`` counts tokens still in flight too, so a seeded draw
        is the same whether or not the host has seen the previous token yet. An all-greedy
        batch needs no parameter tensors: argmax is all the sampler does. ``stop_tokens``: a
        request's EOS and stop tokens, which ``min_tokens`` holds back (None: no request has
        any). ``last_ids`` ``[B]`` on the device: each row's last token (a decode's input),
        which the penalties count for a request whose last token is still in flight."""
        params = [r.sampling_params for r in reqs]
        adjusted = [row for row, p in enumerate(params) if p.adjusts]  # usually none
        logit_adds = _logit_adds(reqs, adjusted, stop_tokens, device, stager)
        penalties = Penalties.of(reqs, adjusted, last_ids, device, stager)
        allowed = _allowed(reqs, adjusted, device)
        if all(p.greedy for p in params):
            none = torch.empty(0)  # host-side placeholders: no device work per step
            return cls(
                none, none.long(), none, none.long(), none.long(), True, logit_adds, penalties,
                allowed=allowed,
            )  # fmt: skip
        # Any int is a valid top_k: <= 0 is off, beyond the vocabulary keeps every token; clamp
        # it so that one outside int64 still fits the device tensor and means the same.
        ints = (
            [max(-_I64_MAX, min(p.top_k, _I64_MAX)) for p in params],
            [r.sampling_seed for r in reqs],
            [len(r.output_ids) + r.num_pending for r in reqs],
        )
        floats = [[float(p.temperature) for p in params], [float(p.top_p) for p in params]]
        with_min_p = any(p.adjusts and p.min_p for p in params)
        if with_min_p:
            floats.append([float(p.min_p) for p in params])
        top_ks, seeds, steps = _ints(ints, device, stager)
        temperatures, top_ps, *rest = _floats(floats, device, stager)
        min_ps = rest[0] if with_min_p else None
        return cls(
            temperatures, top_ks, top_ps, seeds, steps, False, logit_adds, penalties, min_ps,
            allowed,
        )  # fmt: skip

    def advanced(self) -> SamplingBatchInfo:
        """The same rows one token later (``steps + 1``, on the device: nothing is staged):
        the next decode of the same requests when each of them sampled in this one. Only for
        rows whose adjustments do not change from token to token (no penalty, no
        ``min_tokens`` still to reach): the scheduler builds the others afresh."""
        if self.all_greedy:
            return self
        return replace(self, steps=self.steps + 1)  # [B]


#: (rows, token ids, values) of a sparse per-row adjustment of ``[B, V]`` logits.
Sparse = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _allowed(
    reqs: Sequence[_R], rows: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The constrained rows among ``rows`` and their masks of allowed tokens, on the device."""
    constrained = [(row, c) for row in rows if (c := reqs[row].constraint) is not None]
    if not constrained:
        return None
    masks = torch.stack([c.allowed(device) for _, c in constrained])  # [R, V]
    at = torch.tensor([row for row, _ in constrained], dtype=torch.int64)
    return at.to(device, non_blocking=True), masks


def _logit_adds(
    reqs: Sequence[_R],
    rows: Sequence[int],
    stop_tokens: Callable[[_R], Collection[int]] | None,
    device: torch.device,
    stager: HostToDevice | None,
) -> Sparse | None:
    """The additive entries of ``rows``: their logit biases and min_tokens' bans."""
    at: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for row in rows:
        r = reqs[row]
        p = r.sampling_params
        for token, bias in p.logit_bias:
            at.append(row)
            ids.append(token)
            values.append(float(bias))
        if p.min_tokens > len(r.output_ids) + r.num_pending and stop_tokens is not None:
            banned = list(stop_tokens(r))
            at += [row] * len(banned)
            ids += banned
            values += [-math.inf] * len(banned)
    if not at:
        return None
    rows_t, ids_t = _ints((at, ids), device, stager)
    (values_t,) = _floats((values,), device, stager)
    return rows_t, ids_t, values_t


@dataclass
class Penalties:
    """The penalised rows of a batch, densely over the vocabulary when applied.

    Per penalised row ``i`` (batch row ``rows[i]``): the tokens its output holds and how often
    (``counts``: (i, token, count) entries; only a row with a frequency or presence penalty
    has them), the tokens its prompt and output hold (``seen``: (i, token) entries; only a
    row with a repetition penalty), and ``pending[i]``, its last token when that is still in
    flight (-1 otherwise; a device value the host has not seen, counted on the device)."""

    rows: torch.Tensor  # [P] int64
    counts: Sparse
    seen: tuple[torch.Tensor, torch.Tensor]
    pending: torch.Tensor  # [P] int64
    repetition: torch.Tensor  # [P] fp32
    frequency: torch.Tensor  # [P] fp32
    presence: torch.Tensor  # [P] fp32

    @classmethod
    def of(
        cls,
        reqs: Sequence[SamplingRequest],
        rows: Sequence[int],
        last_ids: torch.Tensor | None,
        device: torch.device,
        stager: HostToDevice | None,
    ) -> Penalties | None:
        penalised = [row for row in rows if reqs[row].sampling_params.penalized]
        if not penalised:
            return None
        count_at: list[int] = []
        count_ids: list[int] = []
        counts: list[float] = []
        seen_at: list[int] = []
        seen_ids: list[int] = []
        for i, row in enumerate(penalised):
            r = reqs[row]
            p = r.sampling_params
            if p.frequency_penalty or p.presence_penalty:  # they read the output's counts
                output = r.output_counts
                count_at += [i] * len(output)
                count_ids += output.keys()
                counts += map(float, output.values())
            if p.repetition_penalty != 1.0:  # it reads the prompt's tokens too
                seen = r.seen_tokens
                seen_at += [i] * len(seen)
                seen_ids += seen
        in_flight = [int(reqs[row].num_pending > 0) for row in penalised]
        if any(in_flight) and last_ids is None:
            raise ValueError("penalties: a request's last token is in flight but not given")
        params = [reqs[row].sampling_params for row in penalised]
        rows_t, count_at_t, count_ids_t, seen_at_t, seen_ids_t, flags = _ints(
            (penalised, count_at, count_ids, seen_at, seen_ids, in_flight), device, stager
        )
        counts_t, rep, freq, pres = _floats(
            (
                counts,
                [float(p.repetition_penalty) for p in params],
                [float(p.frequency_penalty) for p in params],
                [float(p.presence_penalty) for p in params],
            ),
            device,
            stager,
        )
        if last_ids is None:
            pending = torch.full_like(rows_t, -1)
        else:
            pending = torch.where(flags > 0, last_ids[rows_t], torch.full_like(rows_t, -1))
        return cls(
            rows_t, (count_at_t, count_ids_t, counts_t), (seen_at_t, seen_ids_t), pending,
            rep, freq, pres,
        )  # fmt: skip

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise the rows of fp32 ``logits [B, V]`` in place: the repetition penalty on
        every token seen, then the frequency and presence penalties on the output's."""
        sub = logits[self.rows]  # [P, V]
        counts = torch.zeros_like(sub)
        at, ids, values = self.counts
        counts.index_put_((at, ids), values, accumulate=True)
        seen = torch.zeros_like(sub, dtype=torch.bool)
        seen[self.seen] = True
        # The token in flight: counted once more and seen (rows without one add nothing).
        rows = torch.arange(sub.shape[0], device=sub.device)
        flying = self.pending >= 0
        token = self.pending.clamp(min=0)
        counts.index_put_((rows, token), flying.float(), accumulate=True)
        seen[rows, token] |= flying
        rep = self.repetition[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0)
        logits[self.rows] = sub


def _ints(
    segments: Sequence[Sequence[int]], device: torch.device, stager: HostToDevice | None
) -> list[torch.Tensor]:
    """``segments`` as int64 tensors on ``device``: through ``stager`` in one copy (each
    starting 16-byte aligned, see staging.ALIGN_BYTES), else one tensor each."""
    if stager is not None:
        return stage_ints(stager, segments)
    return [torch.tensor(list(s), dtype=torch.int64, device=device) for s in segments]


def _floats(
    segments: Sequence[Sequence[float]], device: torch.device, stager: HostToDevice | None
) -> list[torch.Tensor]:
    if stager is not None:
        return stage_floats(stager, segments)
    return [torch.tensor(list(s), dtype=torch.float32, device=device) for s in segments]


def adjust_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """``logits [B, V]`` after the rows' repetition penalties, additive adjustments, masks of
    allowed tokens and ``min_p`` (fp32, a new tensor); ``logits`` itself when the batch has
    none.

    ``min_p`` keeps a token when ``p >= min_p * p_max`` after temperature, i.e. when its logit
    is at least ``max + T * ln(min_p)``: the others become -inf. A greedy row (T = 0) keeps its
    maxima, so its argmax is unchanged."""
    if not info.adjusted:
        return logits
    out = logits.float().clone()
    if info.penalties is not None:
        info.penalties.apply(out)
    if info.logit_adds is not None:
        rows, ids, values = info.logit_adds
        out.index_put_((rows, ids), values, accumulate=True)
    if info.allowed is not None:
        rows, masks = info.allowed
        out[rows] = out[rows].masked_fill(~masks, -math.inf)
    if info.min_ps is not None:
        temps = info.temperatures.clamp(min=0.0)
        log_min_p = torch.log(info.min_ps.clamp(min=torch.finfo(torch.float32).tiny))
        floor = out.amax(dim=-1) + temps * log_min_p  # [B]
        floor = torch.where(info.min_ps > 0, floor, torch.full_like(floor, -math.inf))
        out = out.masked_fill(out < floor[:, None], -math.inf)
    return out


#: A fused draw the Sampler can be given (``execrt.kernels.sampling.fused_sample`` is one):
#: ``(logits [B, V], info) -> token ids [B]`` int64, the same tokens as ``Sampler.sample_torch``
#: for the same seeds. It must handle greedy and sampled rows from ``info``'s tensors alone.
SampleFn = Callable[[torch.Tensor, SamplingBatchInfo], torch.Tensor]


class Sampler:
    """Turns next-token logits into token ids.

    Random draws come from a counter-based hash of (seed, step, token id): a seeded request
    samples the same tokens whatever else shares its batch and on any device.

    The draw: a row is greedy (``argmax``, the lowest id among equal maxima) when its
    temperature is 0 or its top_k is 1. Otherwise the tokens are ranked by probability after
    temperature, the lowest id first among equal probabilities; top_k keeps the first
    ``top_k`` of them (``<= 0`` or beyond the vocabulary: all), top_p the longest prefix of
    those whose mass before each token is below ``top_p`` times the top-k set's mass (top-p
    over the top-k set renormalised, as vLLM, SGLang and transformers apply both; the first
    token always; ``>= 1``: all); the
    token is the kept one with the largest ``p / E``, ``E`` an Exp(1) draw from the hash (the
    exponential race, a sample from the kept probabilities renormalised).

    ``sample_fn`` (optional) replaces the torch draw by a fused one (see ``SampleFn``); the
    core never imports the kernels, so whoever builds the runner passes it in.
    """

    def __init__(self, sample_fn: SampleFn | None = None) -> None:
        self.sample_fn = sample_fn

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """``logits [B, V]`` (any float dtype) -> token ids ``[B]`` int64, after the rows'
        penalties, biases and ``min_p`` (``adjust_logits``)."""
        logits = adjust_logits(logits, info)
        if info.all_greedy:  # a host flag: no parameter tensors exist for such a batch
            return torch.argmax(logits, dim=-1)
        return self.sample(logits, info)

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """The draw from ``info``'s tensors alone, greedy rows included (``all_greedy`` is not
        read): no host sync and fixed shapes, so it can be captured in a CUDA graph."""
        if self.sample_fn is not None:
            return self.sample_fn(logits, info)
        return self.sample_torch(logits, info)

    @classmethod
    def sample_torch(cls, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """The torch draw (the reference the fused kernels are tested against)."""
        greedy_ids = torch.argmax(logits, dim=-1)
        probs = cls.filtered_probs(logits, info)
        noise = exponential_noise(info.seeds, info.steps, logits.shape[-1])  # [B, V]
        sampled = torch.argmax(probs / noise, dim=-1)
        is_greedy = (info.temperatures == 0) | (info.top_ks == 1)
        return torch.where(is_greedy, greedy_ids, sampled)

    @staticmethod
    def filtered_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Probabilities after temperature, top-k and top-p (zeros outside the kept set)."""
        temps = torch.where(
            info.temperatures > 0, info.temperatures, torch.ones_like(info.temperatures)
        )
        # Shift by the row maximum before dividing: a tiny temperature would otherwise turn the
        # logits into inf and the softmax into NaN (the row's top logit becomes 0, the rest <= 0).
        scores = logits.float()
        shifted = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.softmax(shifted / temps[:, None], dim=-1)  # [B, V]
        # Stable: equal probabilities rank by token id, so the kept set is a function of the
        # row alone (the fused kernels rank the same way).
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]  # [1, V]
        k = torch.where(info.top_ks > 0, info.top_ks, torch.full_like(info.top_ks, probs.shape[-1]))
        keep = rank < k[:, None]
        # Top-p applies to the top-k set renormalised (as vLLM, SGLang and transformers do):
        # keep a token while the mass before it is below top_p times the set's mass (the whole
        # row's, 1, when top_k keeps every token). The first token always stays, even for a
        # top_p that fp32 rounds to 0 (below ~1.4e-45); top_p >= 1 keeps every token, also
        # those after an fp32 cumsum that has already reached 1.
        cumsum = torch.cumsum(sorted_probs, dim=-1)
        mass_before = cumsum - sorted_probs
        cut = k < probs.shape[-1]  # top_k keeps fewer than every token
        top_k_mass = cumsum.gather(-1, (k.clamp(max=probs.shape[-1]) - 1)[:, None])
        top_ps = info.top_ps[:, None]
        p_lim = torch.where(cut[:, None], top_ps * top_k_mass, top_ps)
        keep &= (mass_before < p_lim) | (rank == 0) | (top_ps >= 1)
        kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        return torch.zeros_like(probs).scatter_(-1, order, kept)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # An avalanche mix on values < 2**32; every product stays below 2**63 so int64 never wraps.
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) draws ``[B, V]`` fp32, a pure function of (seed, step, token id)."""
    ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]  # [1, V]
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(_mix32(lo ^ 0x9E3779B9) ^ hi)  # [B]
    key = _mix32((key ^ (steps & _M32)) & _M32)
    h = _mix32((_mix32(ids ^ 0x85EBCA6B) ^ key[:, None]) & _M32)
    h = _mix32((h + key[:, None]) & _M32)
    # 23 bits keep (x + 0.5) / 2**23 exactly representable in fp32, so u is never 0 or 1.
    return ((h >> 9).float() + 0.5) / float(1 << 23)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws: ``argmax(p / E)`` is a sample from ``p`` (the exponential race)."""
    return -torch.log(uniform_noise(seeds, steps, vocab))
