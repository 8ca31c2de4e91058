"""Models execrt runs: Qwen3 dense and Qwen3-MoE, loaded from Hugging Face checkpoints."""

from __future__ import annotations

from execrt.models.config import ModelConfig
from execrt.models.loader import ARCHITECTURES, CheckpointLoader, load_model

__all__ = ["ARCHITECTURES", "CheckpointLoader", "ModelConfig", "load_model"]
