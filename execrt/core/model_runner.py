"""ModelRunner: one rank's execution environment (model, KV pools, backends) and its forward."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from execrt.core import assembly
from execrt.core.assembly import ResolvedRuntime, resolve_runtime
from execrt.core.batch import ForwardBatch, LogitsOutput
from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.errors import ConfigError
from execrt.core.interfaces import AttentionBackend, MoEDispatcher
from execrt.core.memory import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from execrt.core.model_spec import Model, ModelLoader, ModelLoadRequest
from execrt.core.plugins import BackendRegistry
from execrt.core.runners import (
    DecodeCudaGraphRunner,
    EagerRunner,
    InputBuffers,
    capture_batch_sizes,
)
from execrt.core.sampler import Sampler
from execrt.core.selection import ResolutionReport

logger = logging.getLogger(__name__)
OWNER = "model_runner"


@dataclass
class ModelRunnerOutput:
    logits_output: LogitsOutput
    can_run_graph: bool


class ModelRunner:
    """One rank's parts, built from a resolved run: dispatcher -> weights -> KV pools ->
    attention -> runners. ``forward`` runs one step, ``sample`` picks tokens, ``close``
    releases everything this runner registered in the context."""

    def __init__(
        self,
        loader: ModelLoader,
        config: RuntimeConfig,
        context: RuntimeContext,
        registry: BackendRegistry,
    ) -> None:
        self.context = context
        #: What this runner registered in the context, oldest first: close() releases exactly
        #: these (another runner's resources of the same names are not this one's to close).
        self._owned: list[tuple[str, Any]] = []
        self.resolved = resolve_runtime(config, loader.spec, registry, context.parallel)
        try:
            self._build(loader, self.resolved, registry)
        except BaseException:
            # A runner that fails to build leaves nothing registered behind; the build error
            # is what the caller sees, a failure while undoing it only a warning.
            try:
                self.close()
            except Exception as exc:
                logger.warning("model runner: releasing after a failed build failed: %r", exc)
            raise

    def _build(self, loader: ModelLoader, r: ResolvedRuntime, registry: BackendRegistry) -> None:
        self.config, self.model_spec, self.local_spec = r.config, r.spec, r.local_spec
        self.parallel, self.device, self.dtype = r.parallel, r.device, r.dtype
        self.context_len, self.max_running_requests = r.context_len, r.config.max_running_requests
        built = []
        self.moe_dispatcher: MoEDispatcher | None = None
        if r.moe_dispatch.chosen is not None:
            dispatcher, res = assembly.build_moe_dispatcher(r, registry, self.context)
            self.moe_dispatcher = self._own("moe_dispatcher", dispatcher, lambda d: d.close())
            built.append(res)
        self.model: Model = loader.load(
            ModelLoadRequest(
                device=r.device,
                dtype=r.dtype,
                max_positions=r.context_len,
                dispatcher=self.moe_dispatcher,
                parallel=r.parallel,
                fused_kernels=r.config.fused_kernels,
            )
        )
        if r.kv_rotation:
            r = self.resolved = self._rotate_keys(r)
        kv_tokens = assembly.kv_cache_tokens(r)
        # Automatic running requests fit the pool, now that its size is known.
        r = self.resolved = assembly.fit_running_requests(r, kv_tokens)
        self.config, self.max_running_requests = r.config, r.config.max_running_requests
        s = r.local_spec
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, r.context_len, r.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(kv_tokens, r.device)
        self.kv_cache: KVCache = self._own(
            "kv_cache",
            KVCache(kv_tokens, s.num_layers, s.num_kv_heads, s.head_dim, r.kv_dtype, r.device),
        )
        if self.kv_cache.is_fp8:
            self._use_checkpoint_kv_scales()
        attn, res = assembly.build_attention(
            r, registry, self.kv_cache, self.req_to_token_pool, self.context
        )
        self.attn_backend: AttentionBackend = self._own("attn_backend", attn, lambda b: b.close())
        built.append(res)
        # The one K/V writer, fixed here: the backend if it stores K/V itself, else the model.
        stores = self.attn_backend.capabilities.stores_kv
        self.model.attach_kv_cache(None if stores else self.kv_cache)
        # A model that runs fused kernels brings the fused sampling draw (kernels live above
        # the core, so the core takes it from the model rather than importing it).
        self.sampler = Sampler(sample_fn=getattr(self.model, "sample_fn", None))
        self.input_buffers = InputBuffers(self.max_running_requests, r.max_num_tokens, r.device)
        self.eager_runner = EagerRunner(self.model, self.attn_backend, self.input_buffers)
        self.decode_graph_runner: DecodeCudaGraphRunner | None = None
        if r.graph.chosen is not None:
            graphs, res = assembly.build_graph_backend(
                r, registry, self.context, self.moe_dispatcher
            )
            self._own("graph_backend", graphs, lambda g: g.cleanup())
            built.append(res)
            max_bs, requested = assembly.graph_max_bs(r), r.config.graph_batch_sizes()
            if dropped := sorted(b for b in set(requested) if b > max_bs):
                logger.warning(
                    "cuda_graph_bs: %s not captured: no decode batch exceeds %d "
                    "(max_running_requests %d, cuda_graph_max_bs %s)",
                    ", ".join(map(str, dropped)), max_bs, r.config.max_running_requests,
                    r.config.cuda_graph_max_bs or "auto",
                )  # fmt: skip
            self.decode_graph_runner = DecodeCudaGraphRunner(
                self.model,
                self.attn_backend,
                self.input_buffers,
                graphs,
                capture_batch_sizes(max_bs, requested),
                sampler=self.sampler if self._samples_in_graph() else None,
            )
            self.decode_graph_runner.capture()
        # What was built, where a constructor that failed under "auto" changed the choice.
        by_kind = {res.kind: res for res in built}
        self.resolution = ResolutionReport(
            [by_kind.get(res.kind, res) for res in r.report.resolutions]
        )
        logger.info("backends:\n%s", self.resolution.describe())

    def _samples_in_graph(self) -> bool:
        """Whether decode graphs run the sampler too: only a fused draw is known to capture
        (the torch draw sorts the vocabulary; it keeps running after the replay)."""
        return self.config.cuda_graph_sampling and self.sampler.sample_fn is not None

    def _use_checkpoint_kv_scales(self) -> None:
        """An fp8 cache stores real / scale with the checkpoint's per-layer scales; without
        any it uses 1.0, which clips K/V beyond the format's range: say so, once."""
        scales = self.model.kv_scales()
        if scales is not None:
            self.kv_cache.set_scales(scales)
            return
        logger.warning(
            "model runner: the KV cache is %s but the checkpoint has no k_scale/v_scale: "
            "using 1.0 for every layer (K/V beyond +-%g are clipped)",
            str(self.kv_cache.dtype).removeprefix("torch."),
            torch.finfo(self.kv_cache.dtype).max,
        )

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

    # -- running ------------------------------------------------------------------------------
    def _rotate_keys(self, r: ResolvedRuntime) -> ResolvedRuntime:
        """Have the model rotate q and k (``kv_cache_rotation``) through its optional
        ``set_kv_rotation``; a model without one runs unrotated when ``auto`` chose it."""
        rotate = getattr(self.model, "set_kv_rotation", None)
        if rotate is not None:
            rotate(True)
            return r
        if r.config.kv_cache_rotation == "hadamard":
            raise ConfigError(
                f"config: kv_cache_rotation 'hadamard' needs a model that rotates q and k "
                f"(set_kv_rotation); {type(self.model).__name__} has none (use 'none')",
                keys=["kv_cache_rotation"],
            )
        return dataclasses.replace(r, kv_rotation=False)

    def forward(self, fb: ForwardBatch) -> ModelRunnerOutput:
        """Run one forward pass, through a captured graph when one fits, else eagerly."""
        graphs = self.decode_graph_runner
        if graphs is not None and graphs.can_run(fb):
            return ModelRunnerOutput(graphs.execute(fb), can_run_graph=True)
        return ModelRunnerOutput(self.eager_runner.execute(fb), can_run_graph=False)

    def sample(self, logits_output: LogitsOutput, fb: ForwardBatch) -> torch.Tensor:
        """Next token id per request ``[B]`` int64: those a decode graph sampled with the
        forward (for ``fb``'s own sampling info), else the sampler's on the logits. A batch
        with penalties, biases or ``min_p`` is drawn here, after the replay: the graph's
        draw has none."""
        ids = logits_output.next_token_ids
        info = fb.sampling_info
        if ids is None or (info is not None and info.adjusted):
            assert info is not None
            ids = self.sampler(logits_output.next_token_logits, info)
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
        self._release_storage()

    def _release_storage(self) -> None:
        """Free the weights and the KV pool in place. A caller may keep a closed engine (a
        ``with`` block's name outlives the block), and the next runner in this process sizes
        its KV pool from the device memory that is free: a closed runner must hold none."""
        model = getattr(self, "model", None)
        if isinstance(model, torch.nn.Module):
            model.to_empty(device="meta")
        kv = getattr(self, "kv_cache", None)
        if kv is not None:
            kv.release()
