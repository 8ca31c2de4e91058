"""sdpa_example against execrt's attention conformance suite."""

from __future__ import annotations

from execrt.testing import AttentionBackendSuite


class TestSdpaExample(AttentionBackendSuite):
    backend = "sdpa_example"  # looked up through execrt's plugin host, i.e. our entry point
