"""Models execrt runs: Llama, Qwen2, Qwen3 and Qwen3-MoE from Hugging Face or GGUF checkpoints."""

from __future__ import annotations

from execrt.models.config import ModelConfig
from execrt.models.loader import ARCHITECTURES, CheckpointLoader, load_model

__all__ = ["ARCHITECTURES", "CheckpointLoader", "ModelConfig", "load_model"]
