"""``execrt serve``: an OpenAI-compatible HTTP server over an EngineClient (never torch)."""

from __future__ import annotations

#: ``--generation-config``: ``auto`` applies the model's generation_config.json sampling
#: settings to the fields a request leaves out (as vLLM and SGLang do); ``none``: OpenAI's
#: defaults. Here, not in ``serve.app``, so that the CLI lists it without importing FastAPI.
GENERATION_CONFIGS = ("auto", "none")
