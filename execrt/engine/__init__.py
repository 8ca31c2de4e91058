"""The serving side: a continuous-batching scheduler, the Engine API and the EngineClient seam.

Names resolve on first use, so a front end importing ``execrt.engine.client`` (plain Python)
does not load torch through this package.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from execrt.engine.engine import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'execrt.engine' has no attribute {name!r}")
    value = getattr(import_module("execrt.engine.engine"), name)
    globals()[name] = value  # later lookups skip this function
    return value
