"""The contract with the scheduling side: Req, SamplingParams and ScheduleBatch."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import Enum, IntEnum

import torch

from execrt.core.memory import ReqToTokenPool, TokenToKVPoolAllocator


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
        if not 0.0 <= self.temperature < math.inf:
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
    ``req_to_token[req_pool_idx, :kv_len]``.
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

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ForwardMode(IntEnum):
    """What one step processes; shared by ScheduleBatch and ForwardBatch."""

    EXTEND = 1  # prefill of new tokens, possibly after a cached prefix (T >= B)
    DECODE = 2  # one new token per request (T == B)
    IDLE = 3  # no tokens on this rank; still joins collectives

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ScheduleBatch:
    """One scheduled step: which requests, which tokens, where their K/V go.

    Tensors live on the runtime device. For EXTEND, request ``i`` processes
    ``extend_lens[i]`` new tokens after ``prefix_lens[i]`` cached ones; for DECODE, one token
    each. ``seq_lens`` counts the cached tokens plus this step's.
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
    return_full_logits: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @classmethod
    def for_extend(
        cls,
        reqs: list[Req],
        extend_lens: list[int],
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        device: torch.device,
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
            return cls._build_extend(reqs, extend_lens, slots, req_to_token_pool, allocator, device)
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
        allocator: TokenToKVPoolAllocator,
        device: torch.device,
    ) -> ScheduleBatch:
        for req in reqs:
            if req.req_pool_idx is None:
                req.req_pool_idx = req_to_token_pool.alloc()
        input_ids: list[int] = []
        offset = 0
        for req, n in zip(reqs, extend_lens, strict=True):
            assert req.req_pool_idx is not None
            input_ids.extend(req.fill_ids[req.kv_len : req.kv_len + n])
            req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots[offset : offset + n])
            offset += n
        prefix = [r.kv_len for r in reqs]
        seq = [p + n for p, n in zip(prefix, extend_lens, strict=True)]
        return cls(
            reqs=reqs,
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            req_pool_indices=_rows(reqs, device),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=device),
            out_cache_loc=slots,
            seq_lens_cpu=seq,
            prefix_lens=prefix,
            extend_lens=list(extend_lens),
        )

    @classmethod
    def for_decode(
        cls,
        reqs: list[Req],
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        device: torch.device,
    ) -> ScheduleBatch | None:
        """One new token per request (its last sampled one). None when slots are short."""
        slots = allocator.alloc(len(reqs))
        if slots is None:
            return None
        try:
            return cls._build_decode(reqs, slots, req_to_token_pool, allocator, device)
        except BaseException:
            allocator.free(slots)  # the caller never sees this batch
            raise

    @classmethod
    def _build_decode(
        cls,
        reqs: list[Req],
        slots: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        device: torch.device,
    ) -> ScheduleBatch:
        for i, req in enumerate(reqs):
            assert req.req_pool_idx is not None and req.kv_len == req.seq_len - 1
            req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots[i : i + 1])
        seq = [r.seq_len for r in reqs]
        return cls(
            reqs=reqs,
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor(
                [r.fill_ids[-1] for r in reqs], dtype=torch.int64, device=device
            ),
            req_pool_indices=_rows(reqs, device),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=device),
            out_cache_loc=slots,
            seq_lens_cpu=seq,
            prefix_lens=[s - 1 for s in seq],
            extend_lens=[1] * len(reqs),
        )


def _rows(reqs: list[Req], device: torch.device) -> torch.Tensor:
    return torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=device)
