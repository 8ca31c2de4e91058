"""A dispatcher's graph-lifetime resources as a graph backend holds them: create, warm up, close."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from execrt.core.context import RuntimeContext
from execrt.core.interfaces import GraphBackendInit, GraphResourceProvider


class GraphResourceOwner:
    """One generation of a provider's graph-lifetime resources, owned by one graph backend.

    ``ensure(n)`` creates the resources (empty) on the first capture of a generation, with
    capacity ``n``: graph runners capture the largest key first, so the first key sizes them
    for all. They are registered in the RuntimeContext under ``provider.resource_name``, the
    very object the provider returned. ``warm_up(n)`` runs outside capture, once per key;
    ``before_replay(n)`` warms key n up again before a re-executed (not relaunched) replay.
    ``close()`` must come after the backend has reset its graphs; it unregisters and closes
    the resources once (the context refuses while a dispatcher borrows them) and is idempotent.

    Should the context close the resources first (its ``close()`` before the backend's
    ``cleanup()``), ``on_context_close`` (the backend's cleanup) runs first, so graphs that
    still reference the resources are reset before the provider closes them.
    """

    def __init__(
        self,
        provider: GraphResourceProvider,
        context: RuntimeContext,
        owner: str,
        on_context_close: Callable[[], None],
    ) -> None:
        self.provider = provider
        self.context = context
        self.owner = owner
        self.on_context_close = on_context_close
        self.resources: Any = None  # None: no generation open
        self.capacity = 0

    @property
    def name(self) -> str:
        return self.provider.resource_name

    def ensure(self, num_tokens: int) -> Any:
        """The resources, created and registered by the first call of a generation."""
        if num_tokens < 1:
            raise ValueError(f"{self.owner}: graph resources for {num_tokens} tokens (need >= 1)")
        if self.resources is None:
            resources = self.provider.create_graph_resources(num_tokens, self.context)
            try:
                self.context.register(
                    self.name, resources, owner=self.owner, close=self._closed_by_context
                )
            except Exception:
                self.provider.close_graph_resources(resources)  # never registered: ours to close
                raise
            self.resources, self.capacity = resources, num_tokens
        elif num_tokens > self.capacity:
            raise ValueError(
                f"{self.owner}: shape key with {num_tokens} tokens exceeds the graph resources' "
                f"capacity {self.capacity}, set by the first key of this generation; capture "
                "the largest key first (cleanup() and recapture to resize)"
            )
        return self.resources

    def warm_up(self, num_tokens: int) -> None:
        """Prepare the resources for ``num_tokens`` tokens; never call it inside a capture."""
        assert self.resources is not None, "ensure() comes first"
        self.provider.warm_up_graph_resources(self.resources, num_tokens)

    def before_replay(self, num_tokens: int) -> None:
        """Make ``num_tokens``'s bucket current again before a replay that re-runs the forward
        (reexec): a real graph's recorded kernels carry their own bucket's routing, a re-run
        forward finds it only if the provider is back on that bucket. The provider's warm-up
        of a bucket it already ran only rebinds; real graph backends never call this."""
        assert self.resources is not None, "a replay comes after a capture"
        self.provider.warm_up_graph_resources(self.resources, num_tokens)

    def close(self) -> None:
        """Unregister and close the resources of this generation. Idempotent."""
        resources = self.resources
        if resources is None:
            return
        registered = self.context.has(self.name) and self.context.get(self.name) is resources
        self.resources = None  # from here on our own unregister must not re-enter cleanup
        if registered:
            try:
                self.context.unregister(self.name, owner=self.owner)
            except Exception:
                self.resources = resources  # still borrowed: a later close() retries
                raise
        self.provider.close_graph_resources(resources)
        self.capacity = 0

    def _closed_by_context(self, resources: Any) -> None:
        if resources is self.resources:  # the context closes first: graphs go before resources
            self.on_context_close()


def resource_owner(
    init: GraphBackendInit, owner: str, on_context_close: Callable[[], None]
) -> GraphResourceOwner | None:
    """The owner of ``init``'s provider resources, or None when no dispatcher needs any."""
    if init.resource_provider is None:
        return None
    return GraphResourceOwner(init.resource_provider, init.context, owner, on_context_close)
