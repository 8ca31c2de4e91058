"""HTTP helpers the server tests share."""

from __future__ import annotations

from typing import Any

import httpx


def abandon_stream(url: str, body: dict[str, Any], chunks: int) -> None:
    """Start a streamed completion, read ``chunks`` events, then close the connection."""
    with httpx.Client(base_url=url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen == chunks:
                    return
