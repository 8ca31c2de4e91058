"""RuntimeContext: registration, borrowing, ownership and close order."""

from __future__ import annotations

import logging

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


def test_unknown_names_are_errors_listing_what_is_registered() -> None:
    ctx = RuntimeContext()
    with pytest.raises(ResourceError, match=r"no resource 'x' \(registered: none\)"):
        ctx.borrow("x", "layer0")
    ctx.register("b", 1, owner="o")
    ctx.register("a", 2, owner="o")
    for call in (
        lambda: ctx.owner_of("x"),
        lambda: ctx.borrower_of("x"),
        lambda: ctx.release("x", "layer0"),
        lambda: ctx.unregister("x", owner="o"),
    ):
        with pytest.raises(ResourceError) as info:
            call()
        assert str(info.value) == "runtime context: no resource 'x' (registered: a, b)"
    assert ctx.has("a") and not ctx.has("x")


def test_releasing_what_nobody_holds_is_an_error() -> None:
    ctx = RuntimeContext()
    ctx.register("buf", 1, owner="o")
    with pytest.raises(
        ResourceError, match="^runtime context: layer0 released 'buf', which is held by nobody$"
    ):
        ctx.release("buf", "layer0")


def test_borrowed_releases_even_when_the_block_raises() -> None:
    ctx = RuntimeContext()
    obj = ["handle"]
    ctx.register("h", obj, owner="o")
    with pytest.raises(KeyError), ctx.borrowed("h", "layer3") as got:
        assert got is obj and ctx.borrower_of("h") == "layer3"
        raise KeyError("inside")
    assert ctx.borrower_of("h") is None
    assert ctx.borrow("h", "layer4") is obj  # free for the next borrower


def test_get_or_create_with_a_failing_factory_registers_nothing() -> None:
    ctx = RuntimeContext()

    def broken() -> object:
        raise OSError("no memory")

    with pytest.raises(OSError):
        ctx.get_or_create("ws", broken, owner="o")
    assert not ctx.has("ws")
    closed: list[str] = []
    assert ctx.get_or_create("ws", lambda: "made", owner="o", close=closed.append) == "made"
    assert ctx.owner_of("ws") == "o"
    ctx.close()
    assert closed == ["made"]


def test_open_resources_are_listed_newest_first() -> None:
    ctx = RuntimeContext()
    assert ctx.open_resources() == []
    ctx.register("pool", 1, owner="runner")
    ctx.register("workspace", 2, owner="attn")
    ctx.borrow("pool", "graph")
    assert ctx.open_resources() == [
        "workspace (owner attn)",
        "pool (owner runner, borrowed by graph)",
    ]


def test_a_re_registered_name_closes_by_its_new_registration_order() -> None:
    ctx = RuntimeContext()
    closed: list[str] = []
    ctx.register("a", "a1", owner="o", close=closed.append)
    ctx.register("b", "b", owner="o", close=closed.append)
    ctx.unregister("a", owner="o")
    ctx.register("a", "a2", owner="o", close=closed.append)
    ctx.close()
    assert closed == ["a1", "a2", "b"]  # a1 at unregister; then newest first


def test_close_logs_the_leak_report_and_a_borrowed_resource_closes_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = RuntimeContext()
    closed: list[int] = []
    ctx.register("held", 1, owner="o", close=closed.append)
    ctx.borrow("held", "dispatcher")
    with caplog.at_level(logging.WARNING, logger="execrt.core.context"):
        report = ctx.close()
    assert report == ["left open: held (owner o, borrowed by dispatcher)"]
    assert [r.getMessage() for r in caplog.records] == [
        "runtime context: left open: held (owner o, borrowed by dispatcher)"
    ]
    assert ctx.closed and closed == []
    ctx.release("held", "dispatcher")
    assert ctx.close() == [] and closed == [1] and ctx.open_resources() == []


def test_a_failing_closer_does_not_stop_the_others() -> None:
    ctx = RuntimeContext()
    closed: list[str] = []

    def fail(_: object) -> None:
        raise RuntimeError("driver gone")

    ctx.register("first", "first", owner="o", close=closed.append)
    ctx.register("broken", "broken", owner="o", close=fail)
    ctx.register("last", "last", owner="o", close=closed.append)
    assert ctx.close() == ["closing broken failed: RuntimeError('driver gone')"]
    assert closed == ["last", "first"] and not ctx.has("broken")


def test_a_closer_that_unregisters_what_it_used_is_not_closed_twice() -> None:
    # The FlashInfer backend's closer unregisters its workspace; when a failed Engine start
    # closes the whole context, the workspace is then already gone (was a KeyError that hid
    # the error that failed the start).
    ctx = RuntimeContext()
    closed: list[str] = []
    ctx.register("workspace", "workspace", owner="attn", close=closed.append)

    def close_backend(_: object) -> None:
        closed.append("backend")
        ctx.unregister("workspace", owner="attn")

    ctx.register("backend", "backend", owner="attn", close=close_backend)
    assert ctx.close() == []
    assert closed == ["backend", "workspace"] and ctx.open_resources() == []


def test_the_context_manager_closes_on_exit_and_keeps_the_parallel_state() -> None:
    closed: list[int] = []
    marker = object()
    with RuntimeContext(parallel=marker) as ctx:  # type: ignore[arg-type]
        assert ctx.parallel is marker and not ctx.closed
        ctx.register("r", 5, owner="o", close=closed.append)
    assert ctx.closed and closed == [5]
    assert RuntimeContext().parallel is None
