"""The GPU-session test logging: which node ids a later call skips."""

from __future__ import annotations

import os
import types

from tests import gpu_session_log as log


def test_skip_done_reads_time_logs_and_id_lists_and_keeps_failures(tmp_path, monkeypatch) -> None:
    timelog = tmp_path / "tests-done.txt"
    timelog.write_text("1.20 passed t.py::a\n0.00 skipped t.py::b\n3.10 failed t.py::c\n")
    ids = tmp_path / "ids.txt"
    ids.write_text("t.py::d\n\n")
    assert log.done_node_ids(str(timelog)) == {"t.py::a", "t.py::b"}
    items = [types.SimpleNamespace(nodeid=f"t.py::{n}") for n in "abcde"]
    deselected: list = []
    hook = types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items))
    config = types.SimpleNamespace(hook=hook)
    monkeypatch.setenv("TESTS_SKIP_DONE", f"{timelog}{os.pathsep}{ids}")
    log.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == ["t.py::c", "t.py::e"]  # the failure runs again
    assert len(deselected) == 3
