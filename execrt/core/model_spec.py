"""What the core knows of a model: the shapes it sizes pools and backends by, and a loader.

The model classes live in ``execrt.models``; the edge (Engine, tests) hands ModelRunner a
``ModelLoader``, so the core never imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from execrt.core.batch import ForwardBatch, LogitsOutput
    from execrt.core.interfaces import MoEDispatcher
    from execrt.core.parallel import ParallelState


@dataclass(frozen=True)
class ModelSpec:
    """The shapes ModelRunner needs before any weight is loaded (global, unsharded counts)."""

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
    """A loaded model: ``model(input_ids [T], positions [T], fb) -> LogitsOutput``."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> LogitsOutput: ...


class ModelLoader(Protocol):
    """Reads a checkpoint's shapes cheaply (``spec``) and builds the model on request."""

    @property
    def spec(self) -> ModelSpec: ...

    def load(self, request: ModelLoadRequest) -> Model: ...
