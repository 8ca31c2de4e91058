"""RuntimeContext: registration, borrowing, ownership and close order."""

from __future__ import annotations

import pytest

from execrt.core.context import RuntimeContext
from execrt.core.errors import ResourceError


def test_register_returns_the_same_object_and_rejects_duplicates() -> None:
    ctx = RuntimeContext()
    obj = object()
    assert ctx.register("ws", obj, owner="a") is obj
    assert ctx.get("ws") is obj and ctx.owner_of("ws") == "a"
    with pytest.raises(ResourceError, match="already registered by a"):
        ctx.register("ws", object(), owner="b")
    with pytest.raises(ResourceError, match="no resource 'nope'"):
        ctx.get("nope")


def test_get_or_create_builds_once() -> None:
    ctx = RuntimeContext()
    calls = []
    first = ctx.get_or_create("x", lambda: calls.append(1) or [1], owner="a")
    assert ctx.get_or_create("x", lambda: calls.append(1) or [2], owner="a") is first
    assert calls == [1]


def test_one_borrower_at_a_time() -> None:
    ctx = RuntimeContext()
    ctx.register("handle", object(), owner="graph")
    ctx.borrow("handle", "layer0")
    with pytest.raises(ResourceError, match="borrowed by layer0"):
        ctx.borrow("handle", "layer1")
    with pytest.raises(ResourceError, match="held by layer0"):
        ctx.release("handle", "layer1")
    ctx.release("handle", "layer0")
    with ctx.borrowed("handle", "layer1"):
        assert ctx.borrower_of("handle") == "layer1"
    assert ctx.borrower_of("handle") is None


def test_close_runs_in_reverse_creation_order_and_is_idempotent() -> None:
    ctx = RuntimeContext()
    closed: list[str] = []
    for name in ("group", "handle", "buffers"):
        ctx.register(name, name, owner="o", close=closed.append)
    assert ctx.close() == []
    assert closed == ["buffers", "handle", "group"]
    assert ctx.close() == [] and closed == ["buffers", "handle", "group"]
    with pytest.raises(ResourceError, match="after close"):
        ctx.register("late", 1, owner="o")


def test_close_reports_borrowed_and_failing_resources() -> None:
    ctx = RuntimeContext()
    ctx.register("held", 1, owner="o")
    ctx.register(
        "broken", 2, owner="o", close=lambda _: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    ctx.register("fine", 3, owner="o")
    ctx.borrow("held", "dispatcher")
    report = ctx.close()
    assert "left open: held (owner o, borrowed by dispatcher)" in report
    assert any("closing broken failed" in line and "boom" in line for line in report)
    assert ctx.open_resources() == ["held (owner o, borrowed by dispatcher)"]


def test_unregister_checks_owner_and_borrower() -> None:
    ctx = RuntimeContext()
    closed: list[int] = []
    ctx.register("r", 1, owner="a", close=closed.append)
    with pytest.raises(ResourceError, match="b cannot close 'r', owned by a"):
        ctx.unregister("r", owner="b")
    ctx.borrow("r", "x")
    with pytest.raises(ResourceError, match="while borrowed by x"):
        ctx.unregister("r", owner="a")
    ctx.release("r", "x")
    ctx.unregister("r", owner="a")
    assert closed == [1] and not ctx.has("r")
