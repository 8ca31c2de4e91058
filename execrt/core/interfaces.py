"""The three backend interfaces (attention, MoE dispatch, graph) and their capability records."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor

from execrt.core.kv_quant import FP8_DTYPES as FP8_DTYPES  # the fp8 cache dtypes, re-exported
from execrt.core.step import ForwardMode

if TYPE_CHECKING:
    from execrt.core.batch import ForwardBatch
    from execrt.core.context import RuntimeContext
    from execrt.core.memory import KVCache, ReqToTokenPool
    from execrt.core.parallel import ParallelState

ANY = None  # a capability field set to None means "no restriction"


def _fmt(values: frozenset[Any]) -> str:
    return ", ".join(sorted((str(v).replace("torch.", "") for v in values), key=_natural))


class Capabilities:
    """Base of the frozen capability records: a backend's claims, readable before it is built."""

    kind: ClassVar[str]

    def refusals(self, req: Any) -> list[str]:
        """Reasons this backend cannot serve ``req``, its kind's requirements (empty: it can)."""
        raise NotImplementedError(f"{type(self).__name__} declares no refusals")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, frozenset):
                value = (
                    sorted(value)
                    if all(isinstance(v, int) for v in value)
                    else sorted((str(v).replace("torch.", "") for v in value), key=_natural)
                )
            elif isinstance(value, Enum):
                value = value.value
            out[f.name] = value
        return out

    @staticmethod
    def _check(label: str, value: Any, allowed: frozenset[Any] | None, out: list[str]) -> None:
        if allowed is not None and value not in allowed:
            shown = str(value).replace("torch.", "")
            out.append(f"{label} {shown} unsupported (supported: {_fmt(allowed)})")


def _natural(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() else (1 << 30, text)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionRequirements:
    """What a model asks of its attention backend (local head counts after sharding)."""

    device: str  # "cpu" or "cuda"
    dtype: torch.dtype
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    graph: bool = False
    kv_dtype: torch.dtype | None = None  # the KV cache's storage dtype; None: ``dtype``
    # The steps it will run: an engine runs both (prefills and decodes); a conformance case
    # names its own.
    decode: bool = True
    extend: bool = True

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype


#: The KV cache dtypes a backend reads unless it declares others: the model dtypes.
MODEL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class AttentionCapabilities(Capabilities):
    """An attention backend's claims. ``None`` in a field means any value is supported."""

    kind: ClassVar[str] = "attention"
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
    head_dims: frozenset[int] | None = ANY
    gqa_ratios: frozenset[int] | None = ANY  # num_q_heads // num_kv_heads
    decode: bool = True
    extend: bool = True
    graph: bool = False  # init_graph_state + plan_graph are capture-safe
    # True: attend receives this step's K/V and stores them itself (e.g. fused into its kernel).
    # False: the model stores them before attend (the runner decides this once, at build time).
    stores_kv: bool = False
    # KV cache storage dtypes it reads (an fp8 cache needs a backend that lists it).
    kv_dtypes: frozenset[torch.dtype] = MODEL_DTYPES

    def refusals(self, req: AttentionRequirements) -> list[str]:
        """Reasons this backend cannot serve ``req`` (empty list: it can)."""
        out: list[str] = []
        self._check("device", req.device, self.devices, out)
        self._check("dtype", req.dtype, self.dtypes, out)
        if req.cache_dtype != req.dtype:  # a cache in the model dtype is the dtype check's
            self._check("KV cache dtype", req.cache_dtype, self.kv_dtypes, out)
        self._check("head_dim", req.head_dim, self.head_dims, out)
        if req.num_kv_heads < 1 or req.num_q_heads % req.num_kv_heads:
            out.append(
                f"num_q_heads {req.num_q_heads} not a multiple of num_kv_heads {req.num_kv_heads}"
            )
        else:
            self._check("GQA ratio", req.num_q_heads // req.num_kv_heads, self.gqa_ratios, out)
        if req.graph and not self.graph:
            out.append("graph capture unsupported")
        for mode in ("decode", "extend"):
            if getattr(req, mode) and not getattr(self, mode):
                out.append(f"{mode} steps unsupported (capability {mode} is False)")
        return out


@dataclass(frozen=True)
class AttentionLayer:
    """Static attributes of one attention layer, as the backend sees them (local heads)."""

    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float


@dataclass(frozen=True)
class AttentionBackendInit:
    """Everything an attention backend is built from."""

    capabilities: AttentionCapabilities
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    num_layers: int
    dtype: torch.dtype  # the model's (q and the output); the cache's is kv_cache.dtype
    device: torch.device
    req_to_token_pool: ReqToTokenPool
    kv_cache: KVCache
    max_batch_size: int
    max_context_len: int
    context: RuntimeContext
    # This backend's own settings: config keys "<name>_<option>" as {option: value}.
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def over_cache(
        cls,
        capabilities: AttentionCapabilities,
        kv_cache: KVCache,
        req_to_token_pool: ReqToTokenPool,
        *,
        num_q_heads: int,
        max_batch_size: int,
        context: RuntimeContext,
        dtype: torch.dtype | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> AttentionBackendInit:
        """The init record of a backend over ``kv_cache`` and ``req_to_token_pool``: head
        counts, dims, layers and device come from the cache, the context length from the pool.
        ``dtype`` is the model's (q and the output); None: the cache's, which an fp8 cache
        cannot be."""
        if dtype is None and kv_cache.is_fp8:
            raise ValueError(f"attention init: an {kv_cache.dtype} cache needs the model dtype")
        return cls(
            capabilities=capabilities,
            num_q_heads=num_q_heads,
            num_kv_heads=kv_cache.num_kv_heads,
            head_dim=kv_cache.head_dim,
            v_head_dim=kv_cache.v_head_dim,
            num_layers=kv_cache.num_layers,
            dtype=kv_cache.dtype if dtype is None else dtype,
            device=kv_cache.device,
            req_to_token_pool=req_to_token_pool,
            kv_cache=kv_cache,
            max_batch_size=max_batch_size,
            max_context_len=req_to_token_pool.max_context_len,
            context=context,
            options=dict(options or {}),
        )


#: This step's ``(k [T, Hkv, D], v [T, Hkv, Dv])`` in the model dtype, rows as ``q``'s. A backend
#: that stores K/V itself (``stores_kv``) always receives them. Any other backend finds them
#: stored already; a model hands them too where it has them (the built-in models do), so the
#: backend may read the new tokens' K/V from them instead of the cache; None otherwise.
KV = tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class QKPrologue:
    """What a decode step does to its q and k between the q/k/v projection and attention,
    for a backend that does it inside its own kernel (``AttentionBackend.fuses_qk_prologue``):
    per-head RMSNorm (``eps``; a weight of None: no norm), rotate-half RoPE from the fp32
    tables at ``positions``, optionally the Hadamard rotation after it, then the store of this
    step's K/V at ``step.out_cache_loc`` (quantized with the layer's scales for an fp8 cache).
    The rotation rounds as ``execrt.kernels.rotary.qk_norm_rope``'s Triton kernel does."""

    positions: Tensor  # [T] rows of cos/sin
    cos: Tensor  # [P, D] fp32
    sin: Tensor  # [P, D] fp32
    q_norm_weight: Tensor | None  # [D]
    k_norm_weight: Tensor | None  # [D]
    eps: float
    hadamard: bool = False


@dataclass(frozen=True)
class AttentionStep:
    """What every attention layer of one forward pass receives: the backend, the plan it made
    for this step (``plan`` or ``plan_graph``), where this step's K/V go and the step's mode."""

    backend: AttentionBackend
    meta: Any  # the backend's own plan object; opaque to everyone else
    out_cache_loc: torch.Tensor  # [T] int64
    mode: ForwardMode


class AttentionBackend(ABC):
    """Paged attention over the slot-granular KV cache: plan once per step, attend per layer.

    ``plan(fb)`` runs once per step (host side, may allocate) and *returns* the backend's own
    plan object; the runner wraps it in an ``AttentionStep`` and hands that to the model, whose
    every layer calls ``attend(q, layer, step)``. Nothing is written into the batch.

    This step's K/V are stored exactly once, by one writer fixed when the runner is built:
    the model (its fused rotary kernel or ``KVCache.set_kv``) stores them before ``attend``,
    unless the backend declares ``capabilities.stores_kv``; then only the backend receives them
    (``attend(..., kv=(k, v))``) and must store them at ``step.out_cache_loc`` itself. A step
    the backend ``fuses_qk_prologue`` for is the one exception: the model then hands q and k
    as projected to ``attend_with_prologue``, and the backend rotates and stores in its kernel.

    Graph support (``capabilities.graph``): ``init_graph_state`` allocates every plan buffer
    once; ``plan_graph`` then writes a decode batch's plan into those buffers only (fixed
    addresses, no host sync, no device memory kept past a bucket's first plan), before
    capture and before each replay.
    """

    #: ``seq_lens`` value for padded graph rows; they read request row 0 / slot 0.
    graph_seq_len_fill_value: int = 1

    def __init__(self, init: AttentionBackendInit) -> None:
        self.init = init
        self.capabilities = init.capabilities
        self.kv_cache = init.kv_cache
        self.req_to_token_pool = init.req_to_token_pool
        self.device, self.dtype = init.device, init.dtype
        self.num_q_heads, self.num_kv_heads = init.num_q_heads, init.num_kv_heads
        self.head_dim, self.v_head_dim = init.head_dim, init.v_head_dim

    @abstractmethod
    def plan(self, fb: ForwardBatch) -> Any:
        """This step's plan for every layer (e.g. CSR indices over ``req_to_token``).

        Called once per step with the batch's device tensors and host mirrors
        (``fb.seq_lens_cpu`` etc., so planning need not wait for the device). Must not modify
        the batch, the pools or the cache."""

    @abstractmethod
    def attend(
        self, q: Tensor, layer: AttentionLayer, step: AttentionStep, kv: KV = None
    ) -> Tensor:
        """Attention of this step's queries over their requests' cached context.

        ``q [T, Hq, D]`` in the model dtype (``init.dtype``) -> ``[T, Hq, Dv]`` in q's dtype.
        The cache may be stored in another dtype (fp8, with the layer's scales in
        ``kv_cache.layer_scales``: a value reads as ``stored * scale``). Decode
        (``step.mode``): one token per request. Extend: the new tokens of every request,
        request after request; token i of request b sits at position ``prefix_len[b] + i`` and
        attends causally over the cached prefix and the new tokens. This step's K/V are in the
        cache at ``step.out_cache_loc`` already, except for a backend that declares
        ``stores_kv``: it receives ``kv = (k [T, Hkv, D], v [T, Hkv, Dv])`` and stores them
        there first. Other backends may receive ``kv`` too (see ``KV``): the same values the
        cache holds (before an fp8 cache's quantization: with one, read this step's K/V from
        the cache, as later steps will), in consecutive rows; None is valid."""

    def fuses_qk_prologue(self, step: AttentionStep) -> bool:
        """Whether this step's ``attend_with_prologue`` normalises and rotates q and k and
        stores K/V inside the backend's own launch (for the built-in triton backend: decode
        steps with its ``decode_prologue`` option on). Must answer the same for a graph's
        capture and its replays (decide from the step's mode and the backend's settings).
        Default: never; the model rotates, the fixed writer stores, ``attend`` attends."""
        return False

    def attend_with_prologue(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: AttentionLayer,
        step: AttentionStep,
        prologue: QKPrologue,
    ) -> Tensor:
        """``attend`` for a step ``fuses_qk_prologue`` took: ``q [T, Hq, D]``, ``k [T, Hkv,
        D]`` and ``v [T, Hkv, Dv]`` as projected (before the norm and RoPE; possibly strided
        views of one projection, never to be written). The backend does ``prologue`` and
        stores this step's K/V at ``step.out_cache_loc`` (it is this step's only writer,
        whoever the writer is otherwise), then attends as ``attend`` does."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the q/k prologue")

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static plan buffers graph capture and replay write into."""
        raise NotImplementedError(self._no_graph("init_graph_state"))

    def plan_graph(self, fb: ForwardBatch) -> Any:
        """A decode batch's plan written into the static buffers: no host sync, and no new
        device memory kept once a batch size has been planned (a first plan of a size may
        allocate that bucket's own state). The object returned for one bucket must view the
        same buffers at every call."""
        raise NotImplementedError(self._no_graph("plan_graph"))

    def _no_graph(self, method: str) -> str:
        name = type(self).__name__
        if not self.capabilities.graph:
            return f"{name}: graph capture unsupported"
        return (
            f"{name}: graph capture unsupported: it declares capabilities.graph = True but does "
            f"not implement {method} (implement init_graph_state and plan_graph, or declare "
            "graph = False)"
        )

    @staticmethod
    def check_graph_batch(component: str, max_bs: int | None, fb: ForwardBatch) -> None:
        """Refuse what a graph plan cannot serve: ``init_graph_state`` not called yet
        (``max_bs`` None), a batch that is not decode, or one larger than ``max_bs``."""
        if max_bs is None:
            raise RuntimeError(f"{component}: init_graph_state() was not called")
        if not fb.mode.is_decode():
            raise ValueError(f"{component}: graphs capture decode only, got {fb.mode.name}")
        if fb.batch_size > max_bs:
            raise ValueError(f"{component}: batch {fb.batch_size} exceeds graph max_bs {max_bs}")

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the backend allocated. Idempotent."""


# ---------------------------------------------------------------------------------------------
# MoE dispatch
# ---------------------------------------------------------------------------------------------
class DispatchFormat(str, Enum):
    """How dispatched tokens are laid out; expert compute reads this, never the dispatcher type.

    STANDARD: all T tokens stay in place; ``topk_ids`` hold *local* expert ids, -1 where the
    expert lives on another rank. Expert compute returns ``[T, H]`` with the routing weights
    applied, summed over local experts.
    EXPERT_MAJOR: ``[E_local, R, H]`` rows per local expert, the first ``expert_counts[e]``
    valid (from every source rank), ``R`` at least the largest count: ``P * C`` always is
    (``P`` the EP size, ``C`` = ``max_tokens_per_rank``). Expert compute returns the same shape,
    unweighted; combine applies the weights.
    """

    STANDARD = "standard"
    EXPERT_MAJOR = "expert_major"


@dataclass
class StandardDispatchOutput:
    hidden_states: torch.Tensor  # [T, H]
    topk_ids: torch.Tensor  # [T, K] int64 local expert ids, -1 = not on this rank
    topk_weights: torch.Tensor  # [T, K] fp32
    format: ClassVar[DispatchFormat] = DispatchFormat.STANDARD


@dataclass
class ExpertMajorDispatchOutput:
    hidden_states: torch.Tensor  # [E_local, R, H], R >= max(expert_counts), e.g. P * C
    expert_counts: torch.Tensor  # [E_local] int32
    num_tokens: int  # T on this rank, before dispatch
    state: Any = None  # dispatcher-private routing state combine needs
    format: ClassVar[DispatchFormat] = DispatchFormat.EXPERT_MAJOR


DispatchOutput = StandardDispatchOutput | ExpertMajorDispatchOutput


@dataclass(frozen=True)
class MoERequirements:
    device: str
    dtype: torch.dtype
    world_size: int
    process_group_backend: str  # "gloo", "nccl", or "none" at world size 1
    num_experts: int
    top_k: int
    hidden_size: int
    graph: bool = False


@dataclass(frozen=True)
class MoEDispatcherCapabilities(Capabilities):
    kind: ClassVar[str] = "moe_dispatch"
    output_format: DispatchFormat = DispatchFormat.STANDARD
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
    world_sizes: frozenset[int] | None = ANY
    process_group_backends: frozenset[str] = frozenset({"none", "gloo", "nccl"})
    hidden_sizes: frozenset[int] | None = ANY
    max_top_k: int | None = ANY
    graph: bool = False
    # True: every EP rank must hold the same tokens (e.g. allreduce, after replicated
    # attention). False: each rank brings its own tokens and dispatch moves them.
    replicated_tokens: bool = True

    def refusals(self, req: MoERequirements) -> list[str]:
        out: list[str] = []
        self._check("device", req.device, self.devices, out)
        self._check("dtype", req.dtype, self.dtypes, out)
        self._check("world size", req.world_size, self.world_sizes, out)
        self._check(
            "process group backend", req.process_group_backend, self.process_group_backends, out
        )
        self._check("hidden size", req.hidden_size, self.hidden_sizes, out)
        if self.max_top_k is not None and req.top_k > self.max_top_k:
            out.append(f"top_k {req.top_k} unsupported (supported: <= {self.max_top_k})")
        if req.num_experts % max(req.world_size, 1):
            out.append(
                f"num_experts {req.num_experts} not divisible by world size {req.world_size}"
            )
        if req.graph and not self.graph:
            out.append("graph capture unsupported")
        return out


@dataclass(frozen=True)
class MoEDispatcherInit:
    """Everything a dispatcher is built from. Experts are sharded in contiguous blocks."""

    capabilities: MoEDispatcherCapabilities
    num_experts: int
    top_k: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    max_tokens_per_rank: int
    parallel: ParallelState
    context: RuntimeContext

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.parallel.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.parallel.ep_rank * self.num_local_experts


class MoEDispatcher(ABC):
    """Moves routed tokens to their experts and the expert outputs back.

    ``combine(experts(dispatch(x)))`` must equal ``sum_k w[t, k] * expert_{ids[t, k]}(x[t])``
    over the whole EP group, for every token of this rank.
    """

    def __init__(self, init: MoEDispatcherInit) -> None:
        self.init = init
        self.capabilities = init.capabilities

    @abstractmethod
    def dispatch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchOutput:
        """``hidden [T, H]``, ``topk_ids [T, K]`` int64 global ids (-1 = none), ``topk_weights
        [T, K]`` fp32 (not necessarily summing to 1: apply them as given) -> the declared
        format. Collective over the EP group (all ranks call it). The inputs are read-only:
        the model reads them again. ``T <= init.max_tokens_per_rank``."""

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        """Expert outputs in the dispatch format -> ``[T, H]`` in token order. Collective.

        The result is the caller's: a contiguous tensor in the tokens' dtype that no later call
        overwrites (copy out of a reused buffer). ``expert_output`` may be written in place.
        Nothing of a call (its inputs, its output) may be kept past the next call."""

    def graph_resource_provider(self) -> GraphResourceProvider | None:
        """The provider of graph-lifetime state, for dispatchers that need one under graphs."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release communication handles and buffers. Idempotent."""


# ---------------------------------------------------------------------------------------------
# Graph execution
# ---------------------------------------------------------------------------------------------
class GraphResourceProvider(Protocol):
    """Graph-lifetime state a dispatcher lends to a graph backend (e.g. NCCL EP buffers).

    The graph backend creates the resources empty, registers them in the RuntimeContext under
    ``resource_name``, warms them up outside capture for each bucket, and closes them after
    every graph was reset. ``backends/graph`` reaches dispatchers only through this protocol.

    Call order, per capture generation: ``create`` once when capture begins; per bucket,
    largest first, ``warm_up(T)`` outside capture and before that bucket's capture (before or
    after its eager warm-up runs, but with no other bucket's warm-up in between); after the
    last replay: synchronise, reset every graph, ``close``, unregister. A recapture creates a
    new generation.
    """

    resource_name: str

    def create_graph_resources(self, capacity: int, context: RuntimeContext) -> Any:
        """An empty resources object for buckets of up to ``capacity`` tokens per rank, kept
        in ``context`` (the dispatcher's). Allocates nothing native."""
        ...

    def warm_up_graph_resources(self, resources: Any, num_tokens: int) -> None:
        """Graph mode on for bucket ``num_tokens``: from here until the next warm-up or close,
        forwards of that many tokens use the graph-lifetime state. Builds it on first use and
        runs it once, so nothing is created or loaded during capture. Never inside capture."""
        ...

    def close_graph_resources(self, resources: Any) -> None:
        """Release native state once no graph can replay; refuses while borrowed; idempotent."""
        ...


@dataclass(frozen=True)
class ShapeKey:
    """Identifies one captured graph: the padded batch size and an optional variant label."""

    batch_size: int
    variant: str = ""


@dataclass(frozen=True)
class GraphRequirements:
    device: str


@dataclass(frozen=True)
class GraphCapabilities(Capabilities):
    kind: ClassVar[str] = "graph"
    devices: frozenset[str] = frozenset({"cuda"})
    # True: replay relaunches what capture recorded and calls no Python function. False:
    # replay runs the key's function again (a CPU backend, e.g. reexec, must declare False).
    real_capture: bool = True
    shared_memory_pool: bool = True  # every graph allocates from one pool
    graph_resources: bool = False  # can own a dispatcher's GraphResourceProvider state

    def refusals(self, req: GraphRequirements) -> list[str]:
        out: list[str] = []
        self._check("device", req.device, self.devices, out)
        return out


@dataclass(frozen=True)
class GraphBackendInit:
    capabilities: GraphCapabilities
    device: torch.device
    context: RuntimeContext
    resource_provider: GraphResourceProvider | None = None


class GraphBackend(ABC):
    """Captures a forward function per shape key and replays it.

    ``capture`` runs inside ``capture_session()``, warms ``fn`` up, records it and returns the
    static output objects; ``replay`` re-runs the recording and returns those same objects,
    overwritten. ``cleanup`` synchronises, drops every graph and closes owned resources;
    it is idempotent, and a later capture starts a new generation.
    """

    def __init__(self, init: GraphBackendInit) -> None:
        self.init = init
        self.capabilities = init.capabilities

    @contextmanager
    def capture_session(self) -> Iterator[None]:
        yield

    @abstractmethod
    def capture(self, key: ShapeKey, fn: Callable[[], Any]) -> Any:
        """Record ``fn`` (no arguments; it reads static tensors) for ``key`` and return its
        static output objects. Runs inside ``capture_session()``; warms ``fn`` up first, as a
        real capture needs. Raises ValueError for a ``key`` captured already (cleanup first).
        If ``fn`` raises, re-raises (chained) and leaves ``key`` uncaptured."""

    @abstractmethod
    def replay(self, key: ShapeKey) -> Any:
        """Re-run ``key``'s recording over the current contents of its static inputs and return
        the objects ``capture`` returned, every tensor overwritten in place (a replay of any
        key may overwrite other keys' outputs: callers copy what they keep). KeyError, naming
        the captured keys, for a key never captured."""

    @abstractmethod
    def has(self, key: ShapeKey) -> bool:
        """Whether ``key`` is captured (and not cleaned up)."""

    @abstractmethod
    def cleanup(self) -> None:
        """Synchronise, drop every recording and close owned resources. Idempotent; a later
        capture starts a new generation."""
