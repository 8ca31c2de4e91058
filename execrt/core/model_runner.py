"""ModelRunner: one rank's execution environment (model, KV pools, backends) and its forward."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch

from execrt.core.batch import ForwardBatch, LogitsOutput
from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import (
    AttentionBackend,
    AttentionBackendInit,
    AttentionCapabilities,
    AttentionRequirements,
    GraphRequirements,
    MoEDispatcher,
    MoEDispatcherCapabilities,
    MoEDispatcherInit,
    MoERequirements,
)
from execrt.core.memory import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from execrt.core.parallel import ParallelState
from execrt.core.plugins import BackendRegistry, PluginHost, get_plugin_host
from execrt.core.runners import EagerRunner
from execrt.core.sampler import Sampler
from execrt.core.selection import Resolution, ResolutionReport, resolve_backend
from execrt.models import ModelConfig, load_model

logger = logging.getLogger(__name__)
OWNER = "model_runner"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelRunnerOutput:
    logits_output: LogitsOutput
    can_run_graph: bool


class ModelRunner:
    """Loads the model once, owns the KV pools and backends, and runs forward passes.

    Lifecycle: resolve backends -> MoE dispatcher -> model weights -> KV pools -> attention
    backend -> runners. ``close()`` releases everything it registered in the context.
    """

    def __init__(
        self,
        model_path: str,
        config: RuntimeConfig,
        context: RuntimeContext,
        plugin_host: PluginHost | None = None,
    ) -> None:
        self.config = config
        self.context = context
        self.parallel = context.parallel or ParallelState.single()
        self.device = resolve_device(config.device)
        self.model_config = mc = ModelConfig.from_pretrained(model_path)
        self.dtype = resolve_dtype(config.dtype, mc, self.device)
        self.context_len = min(
            config.context_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.max_running_requests = config.max_running_requests
        self.max_num_tokens = max(config.max_prefill_tokens, config.max_running_requests)
        registry = (plugin_host or get_plugin_host()).registry
        self.resolution = ResolutionReport()

        attn_name = self._resolve(
            registry,
            "attention",
            config.attention_backend,
            AttentionRequirements(
                self.device.type, self.dtype, mc.head_dim, mc.num_q_heads, mc.num_kv_heads
            ),
        )
        self.moe_dispatcher = self._build_moe_dispatcher(registry) if mc.is_moe else None
        if not mc.is_moe:
            self.resolution.resolutions.append(
                Resolution("moe_dispatch", config.moe_dispatcher, None, note="dense model")
            )
        self.graph_backend_name = self._resolve(
            registry, "graph", config.graph_backend, GraphRequirements(self.device.type)
        )

        self.model = load_model(
            model_path,
            mc,
            device=self.device,
            dtype=self.dtype,
            max_positions=self.context_len,
            dispatcher=self.moe_dispatcher,
        )
        kv_tokens = config.kv_cache_tokens or self._auto_kv_tokens()
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, self.context_len, self.device
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(kv_tokens, self.device)
        self.kv_cache = context.register(
            "kv_cache",
            KVCache(
                kv_tokens, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
            ),
            owner=OWNER,
        )
        self.attn_backend = self._build_attention(registry, attn_name)
        self.sampler = Sampler()
        self.forward_pass_id = 0
        self.eager_runner = EagerRunner(self, self.max_running_requests, self.max_num_tokens)
        self.decode_graph_runner = None  # the graph runner arrives with the CUDA-graph backends
        logger.info("backends:\n%s", self.resolution.describe())

    def _resolve(
        self, registry: BackendRegistry, kind: str, requested: str, requirements: object
    ) -> str | None:
        res = resolve_backend(registry, kind, requested, requirements, strict=self.config.strict)
        self.resolution.resolutions.append(res)
        return res.chosen

    def _build_moe_dispatcher(self, registry: BackendRegistry) -> MoEDispatcher:
        mc = self.model_config
        name = self._resolve(
            registry,
            "moe_dispatch",
            self.config.moe_dispatcher,
            MoERequirements(
                self.device.type,
                self.dtype,
                self.parallel.world_size,
                self.parallel.backend,
                mc.num_experts,
                mc.top_k,
                mc.hidden_size,
            ),
        )
        assert name is not None, "resolve_backend raises when no dispatcher is usable"
        spec = registry.get("moe_dispatch", name)
        init = MoEDispatcherInit(
            cast(MoEDispatcherCapabilities, spec.capabilities),
            mc.num_experts,
            mc.top_k,
            mc.hidden_size,
            self.dtype,
            self.device,
            self.max_num_tokens,
            self.parallel,
            self.context,
        )
        dispatcher: MoEDispatcher = spec.create(init)
        return self.context.register(
            "moe_dispatcher", dispatcher, owner=OWNER, close=lambda d: d.close()
        )

    def _build_attention(self, registry: BackendRegistry, name: str | None) -> AttentionBackend:
        mc = self.model_config
        assert name is not None, "resolve_backend raises when no attention backend is usable"
        spec = registry.get("attention", name)
        init = AttentionBackendInit(
            cast(AttentionCapabilities, spec.capabilities),
            mc.num_q_heads,
            mc.num_kv_heads,
            mc.head_dim,
            mc.head_dim,
            mc.num_layers,
            self.dtype,
            self.device,
            self.req_to_token_pool,
            self.kv_cache,
            self.max_running_requests,
            self.context_len,
            self.context,
        )
        backend: AttentionBackend = spec.create(init)
        return self.context.register(
            "attn_backend", backend, owner=OWNER, close=lambda b: b.close()
        )

    def _auto_kv_tokens(self) -> int:
        per_token = KVCache.bytes_per_token_for(
            self.model_config.num_layers,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
            self.dtype,
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.kv_cache_memory_fraction)
        else:
            budget = 256 << 20
        wanted = self.max_running_requests * self.context_len
        return max(1, min(wanted, budget // per_token))

    def forward(self, fb: ForwardBatch) -> ModelRunnerOutput:
        """Run one forward pass, through a captured graph when one fits, else eagerly."""
        self.forward_pass_id += 1
        return ModelRunnerOutput(self.eager_runner.execute(fb), can_run_graph=False)

    def sample(self, logits_output: LogitsOutput, fb: ForwardBatch) -> torch.Tensor:
        """Next token id per request ``[B]`` int64."""
        assert fb.sampling_info is not None
        return self.sampler(logits_output.next_token_logits, fb.sampling_info)

    def close(self) -> None:
        """Release the backends and KV storage this runner registered. Idempotent."""
        for name in ("attn_backend", "kv_cache", "moe_dispatcher"):
            if self.context.has(name) and self.context.owner_of(name) == OWNER:
                self.context.unregister(name, owner=OWNER)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        from execrt.core.errors import ConfigError

        raise ConfigError(f"config: device {name!r} requested but no CUDA device is visible")
    return device


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on CUDA, float32 on CPU (where half math is slow)."""
    if name != "auto":
        return _DTYPES[name]
    return model_config.dtype if device.type == "cuda" else torch.float32
