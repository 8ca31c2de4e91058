"""FakeNccl: a CPU test double of ``nccl.ep`` (nccl-extensions 0.1.0) and the ``nccl.core`` bits.

The double follows the public surface of the real modules name for name and signature for
signature (``tests/backends/moe_dispatch/test_nccl_ep_real_api.py`` compares them with the real
package, which the test extra installs), so a backend written against it runs unchanged on the
real library.
It emulates the low-latency (LL) expert-major path at world size 1 with torch on any device:

- ``dispatch`` places each routed (token, k) copy in a slot of ``recv[e]`` drawn at random, as
  arrivals over the network would: compare received rows as per-expert multisets, never by slot.
  Rows past ``expert_counters[e]`` are poisoned with NaN: whoever reads them is caught.
- ``combine`` computes ``out[t] = sum_k w[t, k] * y[e(t, k), slot(t, k)]`` in fp32 (the weights
  are applied here, as the real kernel does), then casts to the output dtype.
- ``send_only`` stages an operation; its outputs appear at ``complete``, which also checks that
  the caller kept every descriptor alive until then.

Where the real library aborts the process (a C ``assert``), the double raises ``FakeNcclAbort``
and records it in ``violations``: a test asserts that the backend refused first. Every create,
update, dispatch, combine, complete and destroy is recorded in ``events`` with whether a capture
was active (``FakeNccl.capture()`` marks one on CPU; a real CUDA capture counts too).
Public members the real classes lack are the double's own helpers, listed (and checked) in
``DOUBLE_ONLY``.
"""

from __future__ import annotations

import ctypes
import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from packaging.version import Version

__all__ = ["DOUBLE_ONLY", "EpEvent", "FakeNccl", "FakeNcclAbort"]

#: Members of the double's classes that the real ones lack: test helpers a backend must not use.
DOUBLE_ONLY = {"Group": frozenset({"live"}), "Handle": frozenset({"live"})}
_TENSOR_MAGIC = 0xCAFECAFE
_MAX_TOPK = 32  # MAX_NUM_TOPK of NCCL EP 0.2
_IDS = itertools.count(0x1000, 0x40)  # fake native addresses


class FakeNcclAbort(AssertionError):
    """Where the real library would abort the process (a failed C assert)."""


@dataclass(frozen=True)
class EpEvent:
    """One native call: what, on which object, whether a capture was active, rows routed."""

    op: str  # create_group, create_handle, update, dispatch, combine, complete, destroy_*
    target: str  # "group#1", "handle#3"
    capturing: bool
    num_tokens: int | None = None
    base_ptr: int | None = None  # topk_idx data pointer for create_handle / update


# ---------------------------------------------------------------------------------------------
# Enums and configuration records (values and fields mirror nccl.ep 0.1.0)
# ---------------------------------------------------------------------------------------------
class Algorithm(IntEnum):
    LOW_LATENCY = 0
    HIGH_THROUGHPUT = 1


class Layout(IntEnum):
    UNSET = 0
    EXPERT_MAJOR = 1
    RANK_MAJOR = 2
    FLAT = 3


class PassDir(IntEnum):
    FWD = 0
    BWD = 1


class OverflowPolicy(IntEnum):
    AUTO = 0
    TRAP = 1
    DROP = 2


class ZeroCopyMode(IntEnum):
    AUTO = 0
    OFF = 1
    ON = 2


class ExpertIdKind(IntEnum):
    AUTO = 0
    LOCAL = 1
    GLOBAL = 2


class DispatchQuantizationRecipe(IntEnum):
    NONE = 0
    FWD = 1
    DS_FP8E3M4 = 2


class CombineQuantizationRecipe(IntEnum):
    NONE = 0
    NVFP4 = 1


class NcclDataType(IntEnum):
    """``nccl.core.NcclDataType``: ncclDataType_t values (what ``Tensor.datatype`` reports)."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT8E4M3 = 10
    FLOAT8E5M2 = 11


def _torch_dtypes() -> dict[torch.dtype, NcclDataType]:
    """The torch dtypes nccl4py maps, and to what (bool travels as its byte)."""
    out = {
        torch.bool: NcclDataType.UINT8,
        torch.int8: NcclDataType.INT8,
        torch.uint8: NcclDataType.UINT8,
        torch.int32: NcclDataType.INT32,
        torch.int64: NcclDataType.INT64,
        torch.float16: NcclDataType.FLOAT16,
        torch.float32: NcclDataType.FLOAT32,
        torch.float64: NcclDataType.FLOAT64,
        torch.bfloat16: NcclDataType.BFLOAT16,
    }
    for name, value in (
        ("uint32", NcclDataType.UINT32),
        ("uint64", NcclDataType.UINT64),
        ("float8_e4m3fn", NcclDataType.FLOAT8E4M3),
        ("float8_e5m2", NcclDataType.FLOAT8E5M2),
    ):
        if hasattr(torch, name):  # newer torch only
            out[getattr(torch, name)] = value
    return out


_DTYPES = _torch_dtypes()

AllocFn = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p
)
FreeFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


@dataclass(kw_only=True)
class AllocConfig:
    alloc_fn: int = 0
    free_fn: int = 0
    context: int = 0


@dataclass(kw_only=True)
class GroupConfig:
    algorithm: Algorithm = Algorithm.LOW_LATENCY
    num_experts: int = 0
    max_dispatch_tokens_per_rank: int = 0
    max_recv_tokens_per_rank: int = 0
    max_token_bytes: int = 0
    rdma_buffer_size: int = 0
    num_qp_per_rank: int = 0
    num_channels: int = 0
    max_num_sms: int = 0
    alloc: AllocConfig = field(default_factory=AllocConfig)
    enable_mask: bool = False
    timeout_ns: int = 0
    zero_copy: ZeroCopyMode = ZeroCopyMode.AUTO
    overflow_policy: OverflowPolicy = OverflowPolicy.AUTO
    num_topk: int = 0


@dataclass(kw_only=True)
class HandleConfig:
    dispatch_output_per_expert_alignment: int = 0


@dataclass(kw_only=True)
class DispatchConfig:
    send_only: int = 0
    round_scales: int = 0
    pass_direction: PassDir = PassDir.FWD
    quantization_recipe: DispatchQuantizationRecipe = DispatchQuantizationRecipe.NONE


@dataclass(kw_only=True)
class CombineConfig:
    send_only: int = 0
    pass_direction: PassDir = PassDir.FWD
    quantization_recipe: CombineQuantizationRecipe = CombineQuantizationRecipe.NONE


@dataclass(kw_only=True)
class LayoutInfo:
    expert_counters: Tensor | None = None
    src_rank_counters: Tensor | None = None
    expert_offsets: Tensor | None = None
    recv_total_counter: Tensor | None = None
    recv_topk_idx_kind: ExpertIdKind = ExpertIdKind.AUTO


@dataclass(kw_only=True)
class DispatchInputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None


@dataclass(kw_only=True)
class DispatchOutputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None
    topk_idx: Tensor | None = None


@dataclass(kw_only=True)
class CombineInputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None


@dataclass(kw_only=True)
class CombineOutputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None


class Tensor:
    """``ncclEpTensor_t`` descriptor of a torch tensor (the double does not take raw pointers)."""

    def __init__(
        self,
        buffer: Any,
        *,
        dtype: Any = None,
        shape: tuple[int, ...] | None = None,
        window: Any = None,
        window_offset: int | None = None,
    ) -> None:
        if not isinstance(buffer, torch.Tensor):
            raise NotImplementedError("nccl.ep double: Tensor wraps torch tensors only")
        if dtype is not None or shape is not None:
            raise ValueError("`dtype`/`shape` are only valid with a raw integer pointer")
        if window is not None or window_offset is not None:
            raise NotImplementedError("nccl.ep double: window-backed tensors are not emulated")
        if buffer.dim() == 0:
            raise ValueError("Tensor requires at least one dimension")
        if buffer.dtype not in _DTYPES:  # nccl4py refuses it in Python (NcclInvalid)
            raise ValueError(f"nccl.ep double: no NCCL data type for {buffer.dtype}")
        if not buffer.is_contiguous():
            # The descriptor holds a pointer and sizes only: a strided view would be read as
            # if it were dense, i.e. the wrong elements.
            raise FakeNcclAbort(f"nccl.ep: non-contiguous tensor {tuple(buffer.stride())}")
        self._buffer = buffer
        self._sizes = tuple(buffer.shape)
        self._datatype = _DTYPES[buffer.dtype]
        self._ptr = next(_IDS)

    @property
    def ptr(self) -> int:
        return self._ptr

    @property
    def ndim(self) -> int:
        return len(self._sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def datatype(self) -> NcclDataType:
        return self._datatype

    @property
    def data(self) -> int:
        return int(self._buffer.data_ptr())

    @property
    def buffer(self) -> torch.Tensor:
        return self._buffer

    def __repr__(self) -> str:
        return f"<Tensor sizes={self._sizes} dtype={self._datatype.name} data={self.data:#x}>"


# ---------------------------------------------------------------------------------------------
# nccl.core: the communicator
# ---------------------------------------------------------------------------------------------
_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)


class UniqueId:
    """``nccl.core.UniqueId``: 128 opaque bytes; ``UniqueId()`` is the empty (zero) id."""

    def __init__(self, _internal: bytes | None = None) -> None:
        self._bytes = bytes(_UNIQUE_ID_BYTES) if _internal is None else bytes(_internal)
        if len(self._bytes) != _UNIQUE_ID_BYTES:
            raise ValueError(f"a UniqueId holds {_UNIQUE_ID_BYTES} bytes, got {len(self._bytes)}")

    def __bytes__(self) -> bytes:
        return self._bytes

    @staticmethod
    def from_bytes(b: bytes | bytearray | memoryview) -> UniqueId:
        return UniqueId(bytes(b))

    @property
    def as_bytes(self) -> bytes:
        return self._bytes


def _get_unique_id(empty: bool = False) -> UniqueId:
    if empty:
        return UniqueId()
    return UniqueId(b"fake-nccl-uid".ljust(_UNIQUE_ID_BYTES, b"\0"))


@dataclass(frozen=True)
class LibraryInfo:
    version: Version
    cuda_variant: Version | None
    path: Path | None


@dataclass(frozen=True)
class VersionInfo:
    nccl4py: Version
    nccl_bindings: Version
    libnccl: LibraryInfo | None


class _Communicator:
    """``nccl.core.Communicator`` of one rank; the double knows world size 1 only."""

    _world: ClassVar[FakeNccl]

    def __init__(self, ptr: int | None = None) -> None:
        self._ptr = 0 if ptr is None else int(ptr)
        self._nranks = 1 if self._ptr else None
        self._rank = 0 if self._ptr else None
        if self._ptr:
            self._world.communicators.append(self)

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: Any, config: Any = None) -> _Communicator:
        if nranks != 1 or rank != 0:
            raise NotImplementedError(
                f"nccl.core double: world size 1 only (asked for rank {rank} of {nranks})"
            )
        return cls(next(_IDS))

    @property
    def ptr(self) -> int:
        return self._ptr

    @property
    def is_valid(self) -> bool:
        return bool(self._ptr)

    @property
    def nranks(self) -> int:
        return int(self._nranks or 0)

    @property
    def rank(self) -> int:
        return int(self._rank or 0)

    @property
    def device_api_support(self) -> bool:
        return self._world.device_api

    def destroy(self) -> None:
        if self._ptr:
            self._world.record("destroy_comm", f"comm#{self._ptr:x}")
        self._ptr = 0


# ---------------------------------------------------------------------------------------------
# nccl.ep: group and handle
# ---------------------------------------------------------------------------------------------
@dataclass
class _Staged:
    """A ``send_only`` operation waiting for ``complete``: weak references to the caller's
    descriptors (they must stay alive) and the write to perform then."""

    op: str
    descriptors: list[weakref.ref[Any]]
    finish: Any  # Callable[[], None]


class _Group:
    _world: ClassVar[FakeNccl]
    _handle_cls: ClassVar[type[_Handle]]

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr
        self._config: GroupConfig | None = None
        self._handles: set[_Handle] = set()
        self._nranks, self._rank = 1, 0

    @classmethod
    def create(cls, comm: Any, config: GroupConfig) -> _Group:
        world = cls._world
        group = cls(next(_IDS))
        world.record("create_group", group._name())
        world.require(comm.ptr != 0, "ncclEpCreateGroup: invalid communicator")
        world.require(comm.device_api_support, "NCCL EP requires NCCL Device API support")
        world.require(not world.is_capturing(), "ncclEpCreateGroup inside CUDA-graph capture")
        world.require(
            config.algorithm == Algorithm.LOW_LATENCY, "the double emulates LOW_LATENCY only"
        )
        world.require(config.num_experts > 0, "num_experts must be > 0")
        world.require(config.num_experts % comm.nranks == 0, "num_experts % nRanks != 0")
        world.require(config.max_dispatch_tokens_per_rank > 0, "max_dispatch_tokens_per_rank == 0")
        world.require(config.max_token_bytes > 0, "max_token_bytes == 0")
        world.require(0 <= config.num_topk <= _MAX_TOPK, f"num_topk > {_MAX_TOPK}")
        group._config = config
        group._nranks, group._rank = comm.nranks, comm.rank
        world.groups.append(group)
        return group

    def _name(self) -> str:
        return f"group#{self._ptr:x}"

    @property
    def ptr(self) -> int:
        if not self._ptr:
            raise RuntimeError("Cannot read ptr: Group is not initialized or has been destroyed")
        return self._ptr

    @property
    def live(self) -> bool:
        return bool(self._ptr)

    def create_handle(
        self,
        layout: Layout,
        topk_idx: Tensor,
        *,
        layout_info: LayoutInfo | None = None,
        config: HandleConfig | None = None,
        stream: Any,
    ) -> _Handle:
        world = self._world
        assert self._config is not None
        handle = self._handle_cls(next(_IDS))
        handle._group = self
        rows = topk_idx.sizes[0] if topk_idx.ndim == 2 else None
        world.record("create_handle", handle._name(), rows, topk_idx.data)
        world.require(bool(self._ptr), "create_handle on a destroyed group")
        world.require(not world.is_capturing(), "ncclEpCreateHandle inside CUDA-graph capture")
        world.require(
            layout == Layout.EXPERT_MAJOR, f"the double emulates EXPERT_MAJOR, got {layout}"
        )
        world.require(layout_info is None, "LL mode: layout_info must be NULL at handle creation")
        handle._bind(topk_idx, first=True)
        self._handles.add(handle)
        world.handles.append(handle)
        return handle

    def destroy(self) -> None:
        if not self._ptr:
            return
        world = self._world
        world.record("destroy_group", self._name())
        world.require(not world.is_capturing(), "ncclEpGroupDestroy inside CUDA-graph capture")
        live = [h for h in self._handles if h.live]
        world.require(not live, f"group destroyed before its {len(live)} live handle(s)")
        self._ptr = 0

    def __repr__(self) -> str:
        return f"<Group ptr={self._ptr:#x}>" if self._ptr else "<Group destroyed>"


class _Handle:
    _world: ClassVar[FakeNccl]

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr
        self._group: _Group | None = None
        self._topk: Tensor | None = None
        self._base_ptr = 0
        self._staged: _Staged | None = None
        self._routes: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per local expert
        self._num_tokens = 0
        self._top_k = 0

    def _name(self) -> str:
        return f"handle#{self._ptr:x}"

    @property
    def ptr(self) -> int:
        if not self._ptr:
            raise RuntimeError("Cannot read ptr: Handle is not initialized or has been destroyed")
        return self._ptr

    @property
    def live(self) -> bool:
        return bool(self._ptr)

    def _bind(self, topk_idx: Tensor, *, first: bool) -> None:
        world, group = self._world, self._group
        assert group is not None and group._config is not None
        cfg = group._config
        world.require(topk_idx.ndim == 2, f"topk_idx must be 2-D, got {topk_idx.sizes}")
        int_ids = (NcclDataType.INT64, NcclDataType.INT32)
        world.require(topk_idx.datatype in int_ids, "topk_idx must be int32/int64")
        rows, k = topk_idx.sizes
        world.require(
            rows <= cfg.max_dispatch_tokens_per_rank,
            f"num_tokens {rows} > max_dispatch_tokens_per_rank {cfg.max_dispatch_tokens_per_rank}",
        )
        world.require(1 <= k <= _MAX_TOPK, f"top_k {k} outside [1, {_MAX_TOPK}]")
        world.require(cfg.num_topk == 0 or k <= cfg.num_topk, f"top_k {k} > num_topk")
        if not first:
            world.require(k == self._top_k, f"update changed top_k {self._top_k} -> {k}")
            # Captured kernels hold the routing pointer: a new base would go unseen on replay.
            world.require(
                topk_idx.data == self._base_ptr,
                f"update moved topk_idx from {self._base_ptr:#x} to {topk_idx.data:#x}",
            )
        self._topk, self._base_ptr = topk_idx, topk_idx.data
        self._num_tokens, self._top_k = rows, k

    def update(
        self, topk_idx: Tensor, *, layout_info: LayoutInfo | None = None, stream: Any
    ) -> None:
        world = self._world
        rows = topk_idx.sizes[0] if topk_idx.ndim == 2 else None
        world.record("update", self._name(), rows, topk_idx.data)
        world.require(bool(self._ptr), "update on a destroyed handle")
        world.require(not world.is_capturing(), "ncclEpUpdateHandle inside CUDA-graph capture")
        world.require(layout_info is None, "LL mode: layout_info must be NULL at update")
        world.require(self._staged is None, "update while a staged operation is pending")
        self._bind(topk_idx, first=False)

    def dispatch(
        self,
        inputs: DispatchInputs,
        outputs: DispatchOutputs,
        *,
        layout_info: LayoutInfo | None = None,
        config: DispatchConfig | None = None,
        stream: Any,
    ) -> None:
        world, group = self._world, self._group
        world.record("dispatch", self._name(), self._num_tokens)
        world.require(bool(self._ptr), "dispatch on a destroyed handle")
        world.require(self._staged is None, "dispatch while a staged operation is pending")
        assert group is not None and group._config is not None and self._topk is not None
        cfg, config = group._config, config or DispatchConfig()
        world.require(config.quantization_recipe == DispatchQuantizationRecipe.NONE, "BF16 only")
        x, recv = inputs.tokens, outputs.tokens
        world.require(x is not None and recv is not None, "dispatch tokens are required")
        assert x is not None and recv is not None
        e_local = cfg.num_experts // group._nranks
        world.require(x.ndim == 2 and x.sizes[0] == self._num_tokens, "x.sizes[0] != num_tokens")
        world.require(x.datatype == NcclDataType.BFLOAT16, "LL dispatch tokens must be bf16")
        hidden = x.sizes[1]
        row_bytes = hidden * 2
        world.require(row_bytes % 16 == 0, f"token row of {row_bytes} bytes not 16-byte aligned")
        world.require(row_bytes <= cfg.max_token_bytes, "token row exceeds max_token_bytes")
        want = (e_local, group._nranks * cfg.max_dispatch_tokens_per_rank, hidden)
        world.require(recv.sizes == want, f"recv tokens {recv.sizes} != {want}")
        world.require(recv.datatype == NcclDataType.BFLOAT16, "recv tokens must be bf16")
        counters = layout_info.expert_counters if layout_info is not None else None
        world.require(counters is not None, "LL expert-major dispatch needs expert_counters")
        assert counters is not None
        world.require(counters.sizes == (e_local,), f"expert_counters {counters.sizes}")
        world.require(counters.datatype == NcclDataType.INT32, "expert_counters must be int32")

        # The kernel reads routing and tokens now, through the handle's stored pointer.
        ids = self._topk.buffer[: self._num_tokens].long().cpu()  # [T, K]
        # The LL kernel sends to rank id // E_local unchecked (any negative id routes nowhere).
        in_range = bool((ids < cfg.num_experts).all())
        world.require(in_range, f"expert id >= num_experts {cfg.num_experts}: no such rank")
        tokens = x.buffer.clone()  # [T, H]
        first = group._rank * e_local
        routes = []
        for e in range(e_local):
            token, slot_k = torch.nonzero(ids == first + e, as_tuple=True)
            order = torch.randperm(token.numel(), generator=world.generator)  # arrival order
            routes.append((token[order], slot_k[order]))

        # Device memory outlives the descriptors; the closure holds buffers, never descriptors.
        out, counts = recv.buffer, counters.buffer

        def finish() -> None:
            for e, (token, _) in enumerate(routes):
                n = token.numel()
                out[e, n:] = float("nan")  # undefined rows: make reading them visible
                out[e, :n] = tokens[token.to(tokens.device)].to(out.device)
                counts[e] = n
            self._routes = routes

        self._stage(
            "dispatch", config.send_only, [inputs, outputs, layout_info, x, recv, counters], finish
        )

    def combine(
        self,
        inputs: CombineInputs,
        outputs: CombineOutputs,
        *,
        config: CombineConfig | None = None,
        stream: Any,
    ) -> None:
        world, group = self._world, self._group
        world.record("combine", self._name(), self._num_tokens)
        world.require(bool(self._ptr), "combine on a destroyed handle")
        world.require(self._staged is None, "combine while a staged operation is pending")
        world.require(self._routes is not None, "combine without a completed dispatch")
        assert group is not None and group._config is not None and self._routes is not None
        cfg, config = group._config, config or CombineConfig()
        world.require(config.quantization_recipe == CombineQuantizationRecipe.NONE, "BF16 only")
        y, out, w = inputs.tokens, outputs.tokens, outputs.topk_weights
        world.require(y is not None and out is not None, "combine tokens are required")
        world.require(w is not None, "LL expert-major combine needs outputs.topk_weights")
        assert y is not None and out is not None and w is not None
        e_local = cfg.num_experts // group._nranks
        rows = group._nranks * cfg.max_dispatch_tokens_per_rank
        world.require(y.ndim == 3 and y.sizes[:2] == (e_local, rows), f"combine input {y.sizes}")
        world.require(y.datatype == NcclDataType.BFLOAT16, "combine input must be bf16")
        hidden = y.sizes[2]
        world.require(out.sizes == (self._num_tokens, hidden), f"combine output {out.sizes}")
        world.require(out.datatype == NcclDataType.BFLOAT16, "combine output must be bf16")
        world.require(w.sizes == (self._num_tokens, self._top_k), f"topk_weights {w.sizes}")
        world.require(w.datatype == NcclDataType.FLOAT32, "topk_weights must be fp32")
        routes = self._routes
        expert_rows = y.buffer.clone()  # [E_local, P*C, H]
        weights = w.buffer.clone().float()  # [T, K]

        target, num_tokens = out.buffer, self._num_tokens

        def finish() -> None:
            acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=target.device)
            for e, (token, slot_k) in enumerate(routes):
                n = token.numel()
                if n == 0:
                    continue
                token, slot_k = token.to(acc.device), slot_k.to(acc.device)
                contrib = expert_rows[e, :n].float() * weights[token, slot_k][:, None]  # [n, H]
                acc.index_add_(0, token, contrib)
            target.copy_(acc.to(target.dtype))

        self._stage("combine", config.send_only, [inputs, outputs, y, out, w], finish)

    def _stage(self, op: str, send_only: int, descriptors: list[Any], finish: Any) -> None:
        if send_only:
            refs = [weakref.ref(d) for d in descriptors if d is not None]
            self._staged = _Staged(op, refs, finish)
        else:
            finish()

    def complete(self, *, config: int = 0, stream: Any) -> None:
        world = self._world
        staged = self._staged
        world.record("complete", self._name(), self._num_tokens)
        world.require(bool(self._ptr), "complete on a destroyed handle")
        world.require(config == 0, "complete: config must be 0")
        world.require(staged is not None, "complete without a staged (send_only) operation")
        assert staged is not None
        self._staged = None
        dead = sum(ref() is None for ref in staged.descriptors)
        world.require(not dead, f"{dead} {staged.op} descriptor(s) freed before complete")
        staged.finish()

    def destroy(self) -> None:
        if not self._ptr:
            return
        world = self._world
        world.record("destroy_handle", self._name())
        world.require(not world.is_capturing(), "ncclEpHandleDestroy inside CUDA-graph capture")
        world.require(self._staged is None, "handle destroyed with a staged operation pending")
        self._ptr = 0
        self._topk = None

    def __repr__(self) -> str:
        return f"<Handle ptr={self._ptr:#x}>" if self._ptr else "<Handle destroyed>"


# ---------------------------------------------------------------------------------------------
# The world: one fake process with its modules, events and capture flag
# ---------------------------------------------------------------------------------------------
class FakeNccl:
    """One fake process: ``.ep``, ``.core`` and ``.interop`` (``nccl.ep.interop.torch``) module
    objects, the event log, a capture flag.

    ``nccl_version`` is what ``core.get_version()`` reports for the loaded libnccl.
    """

    def __init__(
        self, *, nccl_version: str = "2.30.7", device_api: bool = True, seed: int = 0
    ) -> None:
        self.nccl_version = Version(nccl_version)
        self.device_api = device_api
        self.generator = torch.Generator().manual_seed(seed)
        self.events: list[EpEvent] = []
        self.violations: list[str] = []
        self.groups: list[_Group] = []
        self.handles: list[_Handle] = []
        self.communicators: list[_Communicator] = []
        self._capturing = False
        self.ep = self._ep_module()
        self.core = self._core_module()
        self.interop = self._interop_module()  # nccl.ep.interop.torch

    # -- capture ------------------------------------------------------------------------------
    @contextmanager
    def capture(self) -> Iterator[None]:
        """Mark a CUDA-graph capture as active (what ``torch.cuda.graph`` is on a GPU)."""
        if self._capturing:
            raise RuntimeError("nccl.ep double: captures do not nest")
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def is_capturing(self) -> bool:
        if self._capturing:
            return True
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    # -- bookkeeping --------------------------------------------------------------------------
    def record(
        self, op: str, target: str, num_tokens: int | None = None, base_ptr: int | None = None
    ) -> None:
        self.events.append(EpEvent(op, target, self.is_capturing(), num_tokens, base_ptr))

    def require(self, condition: bool, message: str) -> None:
        if not condition:
            self.violations.append(message)
            raise FakeNcclAbort(f"nccl.ep double: the real library aborts here: {message}")

    def ops(self, *names: str) -> list[EpEvent]:
        return [e for e in self.events if not names or e.op in names]

    def live_groups(self) -> list[Any]:
        return [g for g in self.groups if g.live]

    def live_handles(self) -> list[Any]:
        return [h for h in self.handles if h.live]

    # -- modules ------------------------------------------------------------------------------
    def _ep_module(self) -> ModuleType:
        mod = ModuleType("nccl.ep", "nccl.ep test double (tests.doubles.nccl_ep)")
        handle_cls = type("Handle", (_Handle,), {"_world": self})
        group_cls = type("Group", (_Group,), {"_world": self, "_handle_cls": handle_cls})
        for name, obj in {
            "Algorithm": Algorithm,
            "AllocConfig": AllocConfig,
            "AllocFn": AllocFn,
            "CombineConfig": CombineConfig,
            "CombineInputs": CombineInputs,
            "CombineOutputs": CombineOutputs,
            "CombineQuantizationRecipe": CombineQuantizationRecipe,
            "DispatchConfig": DispatchConfig,
            "DispatchInputs": DispatchInputs,
            "DispatchOutputs": DispatchOutputs,
            "DispatchQuantizationRecipe": DispatchQuantizationRecipe,
            "ExpertIdKind": ExpertIdKind,
            "FreeFn": FreeFn,
            "Group": group_cls,
            "GroupConfig": GroupConfig,
            "Handle": handle_cls,
            "HandleConfig": HandleConfig,
            "Layout": Layout,
            "LayoutInfo": LayoutInfo,
            "OverflowPolicy": OverflowPolicy,
            "PassDir": PassDir,
            "Tensor": Tensor,
            "ZeroCopyMode": ZeroCopyMode,
        }.items():
            setattr(mod, name, obj)
        mod.get_lib_version = lambda: Version("0.2.0")  # type: ignore[attr-defined]
        mod.get_lib_path = lambda: None  # type: ignore[attr-defined]
        return mod

    def _core_module(self) -> ModuleType:
        mod = ModuleType("nccl.core", "nccl.core test double (tests.doubles.nccl_ep)")
        mod.Communicator = type("Communicator", (_Communicator,), {"_world": self})  # type: ignore[attr-defined]
        mod.NcclDataType = NcclDataType  # type: ignore[attr-defined]
        mod.UniqueId = UniqueId  # type: ignore[attr-defined]
        mod.get_unique_id = _get_unique_id  # type: ignore[attr-defined]
        version = self.nccl_version

        def get_version() -> VersionInfo:
            lib = LibraryInfo(version, Version("13.0"), None)
            return VersionInfo(Version("0.6.0"), Version("2.30.4"), lib)

        mod.get_version = get_version  # type: ignore[attr-defined]
        return mod

    def _interop_module(self) -> ModuleType:
        mod = ModuleType(
            "nccl.ep.interop.torch", "nccl.ep.interop.torch test double (tests.doubles.nccl_ep)"
        )
        core = self.core

        def get_nccl_comm_from_group(group: Any = None) -> Any:
            """A fresh communicator over ``group``'s ranks (None: the default group), as the
            real one builds by broadcasting a unique id; the double knows world size 1 only."""
            if group is None:
                if not dist.is_initialized():
                    raise RuntimeError(
                        "PyTorch distributed is not initialized. "
                        "Call torch.distributed.init_process_group(...) first."
                    )
                size, rank = dist.get_world_size(), dist.get_rank()
            else:
                size, rank = group.size(), group.rank()
            self.record("comm_from_group", f"process group of {size}")
            uid = core.UniqueId.from_bytes(core.get_unique_id(empty=rank != 0).as_bytes)
            return core.Communicator.init(size, rank, uid)

        mod.get_nccl_comm_from_group = get_nccl_comm_from_group  # type: ignore[attr-defined]
        return mod
