"""The serving side: a continuous-batching scheduler and the Engine.generate API."""

from __future__ import annotations

from execrt.engine.engine import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult"]
