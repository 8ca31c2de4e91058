"""The HTTP side never touches torch: every module of execrt.serve, and an app built over a
client and answering a request, load no torch and nothing of the runtime below the seam."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.structure.test_layering import modules_under, within

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_MODULES = modules_under("execrt.serve")
#: What the HTTP side may never load: torch, and the engine and runtime beneath the seam.
BELOW = ("torch", "execrt.engine.engine", "execrt.engine.scheduler", "execrt.models")
BELOW += ("execrt.backends", "execrt.kernels", "execrt.core.schedule", "execrt.core.worker")

PROBE = r"""
import asyncio, json, sys
import httpx
for name in json.loads(sys.argv[1]):
    __import__(name)
from execrt.serve.app import create_app
from tests.serve.fakes import FakeClient

async def ask():
    transport = httpx.ASGITransport(app=create_app(FakeClient()))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        return r.json()["choices"][0]["text"]

print(json.dumps({"text": asyncio.run(ask()), "loaded": sorted(sys.modules)}))
"""


def test_the_http_side_loads_no_torch() -> None:
    assert {"execrt.serve.app", "execrt.serve.server", "execrt.serve.cli"} <= set(SERVE_MODULES)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(SERVE_MODULES)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["text"] == "bc"  # the app answered a request
    below = [m for m in report["loaded"] if within(m, BELOW)]
    assert below == [], below
    assert "execrt.engine.client" in report["loaded"]
