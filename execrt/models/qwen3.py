"""Former home of the decoder; its names stay importable from here."""

from __future__ import annotations

from execrt.models.decoder import DecoderLayer, Qwen3ForCausalLM, Qwen3Model

__all__ = ["DecoderLayer", "Qwen3ForCausalLM", "Qwen3Model"]
