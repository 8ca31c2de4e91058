"""ModelRunner: one rank's execution environment (model, KV pools, backends) and its forward."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from execrt.core.batch import ForwardBatch, LogitsOutput
from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.errors import BackendUnavailableError, ConfigError
from execrt.core.interfaces import (
    AttentionBackend,
    AttentionBackendInit,
    AttentionCapabilities,
    AttentionRequirements,
    GraphBackendInit,
    GraphCapabilities,
    GraphRequirements,
    MoEDispatcher,
    MoEDispatcherCapabilities,
    MoEDispatcherInit,
    MoERequirements,
)
from execrt.core.memory import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from execrt.core.model_spec import ModelLoader, ModelLoadRequest
from execrt.core.parallel import ParallelState
from execrt.core.plugins import NO_GRAPH, BackendRegistry, BackendSpec
from execrt.core.preflight import available_memory, check_before_load, cpu_kv_budget
from execrt.core.runners import (
    DecodeCudaGraphRunner,
    EagerRunner,
    InputBuffers,
    capture_batch_sizes,
)
from execrt.core.sampler import Sampler
from execrt.core.selection import Resolution, ResolutionReport, build_backend

logger = logging.getLogger(__name__)
OWNER = "model_runner"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_KV_BUDGET_BYTES = 256 << 20
MAX_GRAPH_BS = 512  # largest decode bucket captured unless cuda_graph_max_bs says otherwise


@dataclass
class ModelRunnerOutput:
    logits_output: LogitsOutput
    can_run_graph: bool


class ModelRunner:
    """Loads the model once, owns the KV pools and backends, and runs forward passes.

    Lifecycle: MoE dispatcher -> model weights -> KV pools -> attention backend -> runners.
    ``registry`` comes from the edge (the plugin host); ``close()`` releases everything this
    runner registered in the context.
    """

    def __init__(
        self,
        loader: ModelLoader,
        config: RuntimeConfig,
        context: RuntimeContext,
        registry: BackendRegistry,
    ) -> None:
        self.config = config
        self.context = context
        self.registry = registry
        #: What this runner registered in the context, oldest first: close() releases exactly
        #: these (another runner's resources of the same names are not this one's to close).
        self._owned: list[tuple[str, Any]] = []
        try:
            self._setup(loader)
        except BaseException:
            # A runner that fails to build leaves nothing registered behind; the build error
            # is what the caller sees, a failure while undoing it only a warning.
            try:
                self.close()
            except Exception as exc:
                logger.warning("model runner: releasing after a failed build failed: %r", exc)
            raise

    def _setup(self, loader: ModelLoader) -> None:
        config, context = self.config, self.context
        self.model_spec = spec = loader.spec
        # The context holds the world; the config says how TP and EP split it.
        world = context.parallel or ParallelState.single()
        self.parallel = world.with_layout(config.tp_size, config.ep_size, is_moe=spec.is_moe)
        #: This rank's share of the model (its attention heads): sizes the KV cache and the
        #: attention backend.
        self.local_spec = local = spec.local(self.parallel)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, spec.dtype, self.device)
        self.context_len = min(
            config.context_len or spec.max_position_embeddings, spec.max_position_embeddings
        )
        check_before_load(config, local, self.device, self.dtype, self.context_len)
        self.max_running_requests = config.max_running_requests
        self.max_num_tokens = max(config.max_prefill_tokens, config.max_running_requests)
        self.resolution = ResolutionReport()

        self.moe_dispatcher = self._build_moe_dispatcher() if spec.is_moe else None
        if not spec.is_moe:
            if config.moe_dispatcher != "auto":  # unused here, but a misspelt name still fails
                self.registry.get("moe_dispatch", config.moe_dispatcher)
            self.resolution.resolutions.append(
                Resolution("moe_dispatch", config.moe_dispatcher, None, note="dense model")
            )
        self.model = loader.load(
            ModelLoadRequest(
                device=self.device,
                dtype=self.dtype,
                max_positions=self.context_len,
                dispatcher=self.moe_dispatcher,
                parallel=self.parallel,
                fused_kernels=config.fused_kernels,
            )
        )
        kv_tokens = config.kv_cache_tokens or self.auto_kv_tokens()
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, self.context_len, self.device
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(kv_tokens, self.device)
        self.kv_cache = self._own(
            "kv_cache",
            KVCache(
                kv_tokens,
                local.num_layers,
                local.num_kv_heads,
                local.head_dim,
                self.dtype,
                self.device,
            ),
        )
        self.attn_backend = self._build_attention()
        self.sampler = Sampler()
        self.input_buffers = InputBuffers(
            self.max_running_requests, self.max_num_tokens, self.device
        )
        self.eager_runner = EagerRunner(self.model, self.attn_backend, self.input_buffers)
        self.decode_graph_runner = self._build_graph_runner()
        logger.info("backends:\n%s", self.resolution.describe())

    # -- building -----------------------------------------------------------------------------
    def _own(self, name: str, obj: Any, close: Callable[[Any], None] | None = None) -> Any:
        """Register ``obj`` under ``name`` as this runner's; closed here if that fails."""
        try:
            self.context.register(name, obj, owner=OWNER, close=close)
        except BaseException:
            if close is not None:
                close(obj)  # built but never registered: nobody else would release it
            raise
        self._owned.append((name, obj))
        return obj

    def _build(self, kind: str, requested: str, requirements: Any, make_init: Any) -> Any:
        backend, resolution = build_backend(
            self.registry, kind, requested, requirements, make_init, strict=self.config.strict
        )
        self.resolution.resolutions.append(resolution)
        return backend

    def _build_moe_dispatcher(self) -> MoEDispatcher:
        spec = self.model_spec
        requirements = MoERequirements(
            device=self.device.type,
            dtype=self.dtype,
            world_size=self.parallel.ep_size,
            process_group_backend=self.parallel.backend if self.parallel.ep_size > 1 else "none",
            num_experts=spec.num_experts,
            top_k=spec.top_k,
            hidden_size=spec.hidden_size,
        )

        def make_init(backend: BackendSpec) -> MoEDispatcherInit:
            return MoEDispatcherInit(
                capabilities=cast(MoEDispatcherCapabilities, backend.capabilities),
                num_experts=spec.num_experts,
                top_k=spec.top_k,
                hidden_size=spec.hidden_size,
                dtype=self.dtype,
                device=self.device,
                max_tokens_per_rank=self.max_num_tokens,
                parallel=self.parallel,
                context=self.context,
            )

        dispatcher = self._build(
            "moe_dispatch", self.config.moe_dispatcher, requirements, make_init
        )
        return self._own("moe_dispatcher", dispatcher, close=lambda d: d.close())

    def _build_attention(self) -> AttentionBackend:
        spec = self.local_spec  # this rank's heads
        requirements = AttentionRequirements(
            device=self.device.type,
            dtype=self.dtype,
            head_dim=spec.head_dim,
            num_q_heads=spec.num_q_heads,
            num_kv_heads=spec.num_kv_heads,
        )

        def make_init(backend: BackendSpec) -> AttentionBackendInit:
            return AttentionBackendInit(
                capabilities=cast(AttentionCapabilities, backend.capabilities),
                num_q_heads=spec.num_q_heads,
                num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                v_head_dim=spec.head_dim,
                num_layers=spec.num_layers,
                dtype=self.dtype,
                device=self.device,
                req_to_token_pool=self.req_to_token_pool,
                kv_cache=self.kv_cache,
                max_batch_size=self.max_running_requests,
                max_context_len=self.context_len,
                context=self.context,
            )

        backend = self._build("attention", self.config.attention_backend, requirements, make_init)
        return self._own("attn_backend", backend, close=lambda b: b.close())

    def _build_graph_runner(self) -> DecodeCudaGraphRunner | None:
        """Resolve the graph backend and capture every decode bucket; None runs eagerly.

        ``auto`` takes a graph backend only when the attention backend and the MoE dispatcher
        can be captured; an explicitly named one fails with the reason when they cannot.
        """
        requested = self.config.graph_backend
        if requested not in ("auto", NO_GRAPH):
            self.registry.get("graph", requested)  # an unknown name fails as "not registered"
        blockers = [
            f"{kind} backend {name!r} is not graph-capable"
            for kind, name, capable in (
                ("attention", self._chosen("attention"), self.attn_backend.capabilities.graph),
                (
                    "moe_dispatch",
                    self._chosen("moe_dispatch"),
                    self.moe_dispatcher is None or self.moe_dispatcher.capabilities.graph,
                ),
            )
            if not capable
        ]
        if blockers and requested != NO_GRAPH:
            if requested != "auto" or self.config.strict and self.device.type == "cuda":
                raise BackendUnavailableError("graph", requested, blockers)
            note = "; ".join(blockers) + ": decode runs eagerly"
            self.resolution.resolutions.append(Resolution("graph", requested, None, note=note))
            return None
        provider = self.moe_dispatcher.graph_resource_provider() if self.moe_dispatcher else None

        def make_init(backend: BackendSpec) -> GraphBackendInit:
            return GraphBackendInit(
                capabilities=cast(GraphCapabilities, backend.capabilities),
                device=self.device,
                context=self.context,
                resource_provider=provider,
            )

        graph_backend = self._build(
            "graph", requested, GraphRequirements(self.device.type), make_init
        )
        if graph_backend is None:
            return None
        self._own("graph_backend", graph_backend, close=lambda g: g.cleanup())
        max_bs = min(self.config.cuda_graph_max_bs or MAX_GRAPH_BS, self.max_running_requests)
        runner = DecodeCudaGraphRunner(
            self.model,
            self.attn_backend,
            self.input_buffers,
            graph_backend,
            capture_batch_sizes(max_bs, self.config.graph_batch_sizes()),
        )
        runner.capture()
        return runner

    def _chosen(self, kind: str) -> str:
        return next((r.chosen or "none" for r in self.resolution.resolutions if r.kind == kind), "")

    def auto_kv_tokens(self) -> int:
        """KV slots when ``kv_cache_tokens`` is 0: every request at full context, capped by a
        share of free GPU memory (a fixed budget on CPU)."""
        spec = self.local_spec
        per_token = KVCache.bytes_per_token_for(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, self.dtype
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.kv_cache_memory_fraction)
        else:
            budget = cpu_kv_budget(
                CPU_KV_BUDGET_BYTES, per_token, self.context_len, available_memory(self.device)
            )
        wanted = self.max_running_requests * self.context_len
        tokens = max(1, min(wanted, budget // per_token))
        # Every rank runs the same schedule, so every rank must have the same number of slots:
        # the smallest (free memory differs from GPU to GPU).
        return min(self.parallel.all_gather_counts(tokens, self.device, self.parallel.world))

    # -- running ------------------------------------------------------------------------------
    def forward(self, fb: ForwardBatch) -> ModelRunnerOutput:
        """Run one forward pass, through a captured graph when one fits, else eagerly."""
        graphs = self.decode_graph_runner
        if graphs is not None and graphs.can_run(fb):
            return ModelRunnerOutput(graphs.execute(fb), can_run_graph=True)
        return ModelRunnerOutput(self.eager_runner.execute(fb), can_run_graph=False)

    def sample(self, logits_output: LogitsOutput, fb: ForwardBatch) -> torch.Tensor:
        """Next token id per request ``[B]`` int64."""
        assert fb.sampling_info is not None
        ids = self.sampler(logits_output.next_token_logits, fb.sampling_info)
        # Every rank holds the full logits and samples alike; rank 0's tokens are taken anyway,
        # so that a last-bit difference between ranks can never split their schedules.
        return self.parallel.broadcast(ids, self.parallel.world)

    def close(self) -> None:
        """Release the backends and KV storage this runner registered. Idempotent."""
        # Newest first: graphs hold pointers into the KV cache and the dispatcher's buffers.
        while self._owned:
            name, obj = self._owned.pop()
            if self.context.has(name) and self.context.get(name) is obj:
                self.context.unregister(name, owner=OWNER)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"config: device {name!r} requested but no CUDA device is visible")
    return device


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on CUDA, float32 on CPU (where half math is slow)."""
    if name != "auto":
        return DTYPES[name]
    return checkpoint_dtype if device.type == "cuda" else torch.float32
