"""RuntimeContext: the explicit registry of long-lived resources, their owners and borrowers."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from execrt.core.errors import ResourceError

if TYPE_CHECKING:
    from execrt.core.parallel import ParallelState

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ResourceRecord:
    """One registered resource. ``close`` is called with the object when it is closed."""

    name: str
    obj: Any
    owner: str
    close: Callable[[Any], None] | None
    order: int
    borrower: str | None = None

    def describe(self) -> str:
        held = f", borrowed by {self.borrower}" if self.borrower else ""
        return f"{self.name} (owner {self.owner}{held})"


class RuntimeContext:
    """Resources shared across components, passed explicitly (never a hidden global).

    A resource has one owner, which registered it and alone may close it, and at most one
    borrower at a time. ``close()`` closes what is left in reverse order of registration and
    reports anything it could not close.
    """

    def __init__(self, parallel: ParallelState | None = None) -> None:
        self.parallel = parallel
        self._records: dict[str, ResourceRecord] = {}
        self._order = 0
        self.closed = False

    # -- registration -------------------------------------------------------------------------
    def register(
        self, name: str, obj: T, *, owner: str, close: Callable[[T], None] | None = None
    ) -> T:
        """Register ``obj`` under ``name``; the same object is returned, not a copy."""
        if self.closed:
            raise ResourceError(f"runtime context: cannot register {name!r} after close()")
        if name in self._records:
            raise ResourceError(
                f"runtime context: resource {name!r} already registered by "
                f"{self._records[name].owner}"
            )
        self._order += 1
        self._records[name] = ResourceRecord(name, obj, owner, close, self._order)
        return obj

    def get_or_create(
        self,
        name: str,
        factory: Callable[[], T],
        *,
        owner: str,
        close: Callable[[T], None] | None = None,
    ) -> T:
        """The resource under ``name``, creating and registering it on first use."""
        if name in self._records:
            return cast(T, self._records[name].obj)
        return self.register(name, factory(), owner=owner, close=close)

    def has(self, name: str) -> bool:
        return name in self._records

    def get(self, name: str) -> Any:
        return self._record(name).obj

    def owner_of(self, name: str) -> str:
        return self._record(name).owner

    def borrower_of(self, name: str) -> str | None:
        return self._record(name).borrower

    # -- borrowing ----------------------------------------------------------------------------
    def borrow(self, name: str, borrower: str) -> Any:
        """Mark ``name`` as held by ``borrower``; refuses while someone else holds it."""
        record = self._record(name)
        if record.borrower is not None:
            raise ResourceError(
                f"runtime context: {name!r} is borrowed by {record.borrower}; "
                f"{borrower} must wait for its release"
            )
        record.borrower = borrower
        return record.obj

    def release(self, name: str, borrower: str) -> None:
        record = self._record(name)
        if record.borrower != borrower:
            raise ResourceError(
                f"runtime context: {borrower} released {name!r}, which is held by "
                f"{record.borrower or 'nobody'}"
            )
        record.borrower = None

    @contextmanager
    def borrowed(self, name: str, borrower: str) -> Iterator[Any]:
        obj = self.borrow(name, borrower)
        try:
            yield obj
        finally:
            self.release(name, borrower)

    # -- closing ------------------------------------------------------------------------------
    def unregister(self, name: str, *, owner: str) -> None:
        """Close and forget ``name``. Only its owner may, and not while it is borrowed."""
        record = self._record(name)
        if record.owner != owner:
            raise ResourceError(
                f"runtime context: {owner} cannot close {name!r}, owned by {record.owner}"
            )
        if record.borrower is not None:
            raise ResourceError(
                f"runtime context: cannot close {name!r} while borrowed by {record.borrower}"
            )
        del self._records[name]
        if record.close is not None:
            record.close(record.obj)

    def open_resources(self) -> list[str]:
        """Resources still registered, newest first, each with owner and borrower."""
        records = sorted(self._records.values(), key=lambda r: r.order, reverse=True)
        return [r.describe() for r in records]

    def close(self) -> list[str]:
        """Close every resource in reverse order of registration. Idempotent.

        A borrowed resource is not closed: it is left registered and reported. Returns the
        report of what was left open (empty when everything closed). A closer that raises is
        reported too, after the others were closed.
        """
        problems: list[str] = []
        for record in sorted(self._records.values(), key=lambda r: r.order, reverse=True):
            if self._records.get(record.name) is not record:
                continue  # an earlier closer already closed it (unregister of what it used)
            if record.borrower is not None:
                problems.append(f"left open: {record.describe()}")
                continue
            del self._records[record.name]
            try:
                if record.close is not None:
                    record.close(record.obj)
            except Exception as exc:
                problems.append(f"closing {record.name} failed: {exc!r}")
        self.closed = True
        for line in problems:
            logger.warning("runtime context: %s", line)
        return problems

    def _record(self, name: str) -> ResourceRecord:
        try:
            return self._records[name]
        except KeyError:
            known = ", ".join(sorted(self._records)) or "none"
            raise ResourceError(
                f"runtime context: no resource {name!r} (registered: {known})"
            ) from None

    def __enter__(self) -> RuntimeContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
