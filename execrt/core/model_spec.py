"""What the core knows of a model: the shapes it sizes pools and backends by, and a loader.

The model classes live in ``execrt.models``; the edge (Engine, tests) hands ModelRunner a
``ModelLoader``, so the core never imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from execrt.core.errors import ConfigError
from execrt.core.parallel import ParallelState, shard_heads

if TYPE_CHECKING:
    from execrt.core.batch import ForwardBatch, LogitsOutput
    from execrt.core.interfaces import AttentionStep, MoEDispatcher
    from execrt.core.kv_quant import KVScales
    from execrt.core.memory import KVCache


@dataclass(frozen=True)
class ModelSpec:
    """The shapes ModelRunner needs before any weight is loaded (global, unsharded counts;
    ``local`` gives one rank's)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: torch.dtype  # the checkpoint's
    num_experts: int = 0
    top_k: int = 0
    eos_token_ids: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def local(self, parallel: ParallelState) -> ModelSpec:
        """The shapes one rank holds: its share of the attention heads under tensor
        parallelism (``core.parallel.shard_heads``); everything else is global. Raises
        ConfigError, one line, when the heads or the experts do not split over the groups."""
        if self.is_moe and self.num_experts % parallel.ep_size:
            raise ConfigError(
                f"expert parallel: num_experts {self.num_experts} not divisible by ep_size "
                f"{parallel.ep_size} (supported: an ep_size dividing the experts)",
                keys=["ep_size"],
            )
        heads = shard_heads(self.num_q_heads, self.num_kv_heads, parallel.tp_size, parallel.tp_rank)
        return replace(self, num_q_heads=heads.num_q, num_kv_heads=heads.num_kv)


@dataclass(frozen=True)
class ModelLoadRequest:
    """How ModelRunner wants the model built: where, in what dtype, with which dispatcher."""

    device: torch.device
    dtype: torch.dtype
    max_positions: int
    dispatcher: MoEDispatcher | None
    parallel: ParallelState
    fused_kernels: str = "off"  # "auto" | "on" | "off": Triton kernels in the model's layers


class Model(Protocol):
    """A loaded model: ``model(fb, attn) -> LogitsOutput``.

    ``attn`` carries the attention backend and its plan for this step; every attention layer
    calls ``attn.backend.attend``. ``attach_kv_cache`` fixes the K/V writer once, before the
    first forward: with a cache the model stores each step's K/V in it (the one store helper,
    ``KVCache.set_kv`` or a fused kernel doing the same); with None the backend stores them
    (it declares ``stores_kv``). Either way ``attend`` receives ``kv``, this step's K/V.
    ``kv_scales`` gives the checkpoint's per-layer K/V scales of an fp8 cache (None: it has
    none, 1.0 is used).

    An extend may name rows whose logits are wanted beside each request's last
    (``ForwardBatch.logit_rows``, for prompt log-probabilities): the model returns them as
    ``LogitsOutput.row_logits``, and says so with ``computes_logit_rows = True``; the engine
    refuses prompt log-probabilities for a model without it.
    Optional: ``set_kv_rotation(True)`` (before the first forward) asks the model to rotate q
    and k by a Hadamard matrix after RoPE (``kv_cache_rotation``); a model without it runs
    unrotated under ``auto`` and is refused under ``hadamard``.
    """

    def __call__(self, fb: ForwardBatch, attn: AttentionStep) -> LogitsOutput: ...

    def attach_kv_cache(self, kv_cache: KVCache | None) -> None: ...

    def kv_scales(self) -> KVScales | None: ...


class ModelLoader(Protocol):
    """Reads a checkpoint's shapes cheaply (``spec``) and builds the model on request."""

    @property
    def spec(self) -> ModelSpec: ...

    def load(self, request: ModelLoadRequest) -> Model: ...
