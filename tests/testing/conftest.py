"""Fixtures of the suite-about-suites tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _inner_runs_without_the_unraisable_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated suites these tests run in-process (``run_suite_source``, ``run_conformance``)
    load without pytest's unraisable-exception plugin: its clean-up at the end of every run
    collects garbage five times over this worker's whole heap (~0.7 s a run, more than most of
    these suites take). The outer run read its options already; only the inner runs see this."""
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:unraisableexception")
