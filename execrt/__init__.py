"""execrt: a pluggable LLM execution runtime."""

from __future__ import annotations

__version__ = "0.1.0"
