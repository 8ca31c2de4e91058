"""``execrt serve``: an OpenAI-compatible HTTP server over an EngineClient (never torch)."""

from __future__ import annotations
