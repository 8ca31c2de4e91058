"""Fixtures of the HTTP side's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serve.fakes import ScriptClient


@pytest.fixture
def script() -> Iterator[ScriptClient]:
    """A fake engine whose every request answers ``script.script`` (set by the test)."""
    client = ScriptClient()
    yield client
    client.close()
