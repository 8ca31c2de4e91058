"""Registers one attention backend through the ``execrt`` entry-point group (for tests)."""

from __future__ import annotations

from execrt.core.interfaces import AttentionCapabilities
from execrt.core.plugins import BackendRegistry, hookimpl


@hookimpl
def execrt_register_backends(registry: BackendRegistry) -> None:
    registry.register(
        "attention",
        "testplugin_native",
        "execrt.backends.attention.torch_native:TorchNativeAttnBackend",
        AttentionCapabilities(),
        description="the reference backend under another name, registered by entry point",
    )
