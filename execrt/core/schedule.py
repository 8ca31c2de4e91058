"""The contract with the scheduling side: Req, SamplingParams and ScheduleBatch."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import Enum

import torch

from execrt.core.memory import ReqToTokenPool, TokenToKVPoolAllocator
from execrt.core.sampler import SamplingBatchInfo
from execrt.core.staging import HostToDevice
from execrt.core.step import ForwardMode, StepInputs, extend_positions


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampling reproducible and independent of what else is in the batch.
    Construction never raises: ``problems()`` lists what is wrong (the engine turns that into
    a result with ``finish_reason="error"``). Accepted types: ``int`` for ``max_new_tokens``,
    ``top_k`` and ``seed`` (or None); ``float`` or ``int`` for ``temperature`` and ``top_p``;
    a tuple or list of ``int`` for ``stop_token_ids`` (a list is stored as a tuple); ``bool``
    for ``ignore_eos``. A bool is not accepted where a number is.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):  # keep the params hashable and immutable
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def problems(self) -> list[str]:
        """Why these parameters are invalid (empty when they are fine).

        Types are checked before values, so no comparison can raise on a wrong type.
        """
        out = [
            _wrong_type(f.name, getattr(self, f.name), _TYPES[f.name][1])
            for f in fields(self)
            if not _TYPES[f.name][0](getattr(self, f.name))
        ]
        if out:
            return out
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens {self.max_new_tokens!r} must be an integer >= 1")
        # An int beyond the largest float is finite but cannot be sampled with (float() fails).
        if not 0.0 <= self.temperature <= sys.float_info.max:
            out.append(f"temperature {self.temperature!r} must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"top_p {self.top_p!r} must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            out.append(f"seed {self.seed!r} must be in [0, 2**63)")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
}


def _wrong_type(name: str, value: object, accepted: str) -> str:
    kind = type(value).__name__
    if isinstance(value, (tuple, list)):
        kind += " of " + ("/".join(sorted({type(v).__name__ for v in value})) or "nothing")
    return f"{name} {value!r} has type {kind} (accepted: {accepted})"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # could not be served (e.g. KV cache too small for it alone)
    ERROR = "error"  # rejected at submission


@dataclass(eq=False)
class Req:
    """One generation request and its progress.

    Tokens ``fill_ids[:kv_len]`` have their K/V in the cache, at slots
    ``req_to_token[req_pool_idx, :kv_len]``. ``num_pending`` tokens were sampled on the device
    but are not in ``output_ids`` yet (overlap scheduling); ``scheduled_len`` counts them.
    """

    rid: int
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    sampling_seed: int = 0
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_retractions: int = 0
    num_pending: int = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.origin_input_ids[-1]

    @property
    def seq_len(self) -> int:
        """Prompt plus the output tokens known on the host."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def scheduled_len(self) -> int:
        """Prompt plus every sampled token, including those still in flight."""
        return self.seq_len + self.num_pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ScheduleBatch:
    """One scheduled step: which requests, which tokens, where their K/V go.

    Tensors live on the runtime device. For EXTEND, request ``i`` processes
    ``extend_lens[i]`` new tokens after ``prefix_lens[i]`` cached ones; for DECODE, one token
    each. ``seq_lens`` counts the cached tokens plus this step's. ``samples[i]`` says whether
    request ``i``'s sampled token is real (a prefill chunk that does not end the prompt
    samples nothing). Built with a ``HostToDevice`` stager, every host list reaches the device
    in one non-blocking copy.
    """

    reqs: list[Req]
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    out_cache_loc: torch.Tensor  # [T] int64
    seq_lens_cpu: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    sampling_info: SamplingBatchInfo
    samples: list[bool]
    return_full_logits: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def inputs(self) -> StepInputs:
        if self.mode.is_decode():
            positions = self.seq_lens - 1  # [B]
        else:
            positions = extend_positions(self.prefix_lens, self.extend_lens, self.seq_lens.device)
        return StepInputs(
            self.mode, self.input_ids, positions, self.req_pool_indices, self.seq_lens,
            self.out_cache_loc, self.seq_lens_cpu, self.prefix_lens, self.extend_lens,
        )  # fmt: skip

    @classmethod
    def for_extend(
        cls,
        reqs: list[Req],
        extend_lens: list[int],
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        device: torch.device,
        stager: HostToDevice | None = None,
    ) -> ScheduleBatch | None:
        """Prefill ``extend_lens[i]`` tokens of each request after its cached ``kv_len``.

        Allocates request rows (for requests without one) and KV slots, and records the slots
        in ``req_to_token``. Returns None, having allocated nothing, when rows or slots are short.
        """
        total = sum(extend_lens)
        need_rows = sum(1 for r in reqs if r.req_pool_idx is None)
        if need_rows > req_to_token_pool.available_size() or total > allocator.available_size():
            return None
        slots = allocator.alloc(total)
        assert slots is not None
        new_rows = [r for r in reqs if r.req_pool_idx is None]
        try:
            return cls._build_extend(reqs, extend_lens, slots, req_to_token_pool, device, stager)
        except BaseException:
            # The caller never sees this batch: leave nothing allocated (device error, ^C).
            allocator.free(slots)
            for req in new_rows:
                if req.req_pool_idx is not None:
                    req_to_token_pool.free(req.req_pool_idx)
                    req.req_pool_idx = None
            raise

    @classmethod
    def _build_extend(
        cls,
        reqs: list[Req],
        extend_lens: list[int],
        slots: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        device: torch.device,
        stager: HostToDevice | None,
    ) -> ScheduleBatch:
        for req in reqs:
            assert req.num_pending == 0, "a prefill needs every sampled token on the host"
            if req.req_pool_idx is None:
                req.req_pool_idx = req_to_token_pool.alloc()
        input_ids: list[int] = []
        token_rows: list[int] = []
        token_pos: list[int] = []
        for req, n in zip(reqs, extend_lens, strict=True):
            input_ids.extend(req.fill_ids[req.kv_len : req.kv_len + n])
            token_rows.extend([_row(req)] * n)
            token_pos.extend(range(req.kv_len, req.kv_len + n))
        prefix = [r.kv_len for r in reqs]
        seq = [p + n for p, n in zip(prefix, extend_lens, strict=True)]
        t, b = len(input_ids), len(reqs)
        rows = [_row(r) for r in reqs]
        dev = stage_ints(stager, device, input_ids + rows + seq + token_rows + token_pos)
        req_to_token_pool.write_tokens(dev[2 * b + t : 2 * b + 2 * t], dev[2 * b + 2 * t :], slots)
        return cls(
            reqs=reqs,
            mode=ForwardMode.EXTEND,
            input_ids=dev[:t],
            req_pool_indices=dev[t : t + b],
            seq_lens=dev[t + b : t + 2 * b],
            out_cache_loc=slots,
            seq_lens_cpu=seq,
            prefix_lens=prefix,
            extend_lens=list(extend_lens),
            sampling_info=SamplingBatchInfo.from_reqs(reqs, device, stager),
            samples=[s == r.seq_len for s, r in zip(seq, reqs, strict=True)],
        )

    @classmethod
    def for_decode(
        cls,
        reqs: list[Req],
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        device: torch.device,
        stager: HostToDevice | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> ScheduleBatch | None:
        """One new token per request: its last sampled one, or ``input_ids`` (``[B]`` on the
        device) when some were sampled but not yet copied back (overlap scheduling).
        None when slots are short."""
        slots = allocator.alloc(len(reqs))
        if slots is None:
            return None
        try:
            return cls._build_decode(reqs, slots, req_to_token_pool, device, stager, input_ids)
        except BaseException:
            allocator.free(slots)  # the caller never sees this batch
            raise

    @classmethod
    def _build_decode(
        cls,
        reqs: list[Req],
        slots: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        device: torch.device,
        stager: HostToDevice | None,
        input_ids: torch.Tensor | None,
    ) -> ScheduleBatch:
        b = len(reqs)
        seq = [r.scheduled_len for r in reqs]
        for req, n in zip(reqs, seq, strict=True):
            assert req.req_pool_idx is not None and req.kv_len == n - 1
        last = [] if input_ids is not None else [r.last_token_id for r in reqs]
        rows = [_row(r) for r in reqs]
        dev = stage_ints(stager, device, last + rows + seq)
        off = len(last)
        pos = dev[off + b : off + 2 * b] - 1  # [B] where this step's K/V goes in each row
        req_to_token_pool.write_tokens(dev[off : off + b], pos, slots)
        return cls(
            reqs=reqs,
            mode=ForwardMode.DECODE,
            input_ids=dev[:b] if input_ids is None else input_ids,
            req_pool_indices=dev[off : off + b],
            seq_lens=dev[off + b : off + 2 * b],
            out_cache_loc=slots,
            seq_lens_cpu=seq,
            prefix_lens=[s - 1 for s in seq],
            extend_lens=[1] * b,
            sampling_info=SamplingBatchInfo.from_reqs(reqs, device, stager),
            samples=[True] * b,
        )


def _row(req: Req) -> int:
    assert req.req_pool_idx is not None
    return req.req_pool_idx


def stage_ints(
    stager: HostToDevice | None, device: torch.device, values: list[int]
) -> torch.Tensor:
    """``values`` as int64 on ``device``, through ``stager`` when there is one."""
    if stager is not None:
        return stager(values)
    return torch.tensor(values, dtype=torch.int64, device=device)
