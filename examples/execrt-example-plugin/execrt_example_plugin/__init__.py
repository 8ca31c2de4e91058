"""execrt-example-plugin: registers the ``sdpa_example`` attention backend (lazily)."""

from __future__ import annotations

import torch

from execrt.core.interfaces import AttentionCapabilities
from execrt.core.plugins import BackendRegistry, hookimpl

#: What sdpa_example claims; the conformance suite tests every value declared here.
CAPABILITIES = AttentionCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
    head_dims=None,  # any: scaled_dot_product_attention has no head-dim limit
    gqa_ratios=None,
    decode=True,
    extend=True,
    graph=False,
)


@hookimpl
def execrt_register_backends(registry: BackendRegistry) -> None:
    # A "module:attr" string: execrt imports the backend module only when it is built.
    registry.register(
        "attention",
        "sdpa_example",
        "execrt_example_plugin.backend:SdpaAttentionBackend",
        CAPABILITIES,
        description="example: torch scaled_dot_product_attention over gathered K/V",
    )
