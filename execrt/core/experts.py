"""Expert compute per dispatch format: what models and the MoE conformance suites share.

Reads only the dispatch *format* (``DispatchFormat``), never the dispatcher that produced it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from execrt.core.interfaces import (
    DispatchOutput,
    ExpertMajorDispatchOutput,
    StandardDispatchOutput,
)


def run_experts(d: DispatchOutput, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Apply the local experts to dispatched tokens, following ``d.format`` (see DispatchFormat)."""
    if isinstance(d, StandardDispatchOutput):
        return _experts_standard(d, w13, w2)
    if isinstance(d, ExpertMajorDispatchOutput):
        return _experts_expert_major(d, w13, w2)
    raise TypeError(f"moe: unknown dispatch output {type(d).__name__}")


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def _experts_standard(
    d: StandardDispatchOutput, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    x = d.hidden_states  # [T, H]
    out = torch.zeros_like(x)
    flat = d.topk_ids.flatten()  # [T*K]
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    counts = torch.bincount(sorted_ids[sorted_ids >= 0], minlength=w13.shape[0]).tolist()
    start = int((sorted_ids < 0).sum())
    k = d.topk_ids.shape[1]
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        picks = order[start : start + n]  # flat (token, slot) positions routed to this expert
        tokens = picks // k
        y = _swiglu(x[tokens], w13[expert], w2[expert])  # [n, H]
        w = d.topk_weights.flatten()[picks].to(y.dtype)[:, None]
        out.index_add_(0, tokens, y * w)
        start += n
    return out


def _experts_expert_major(
    d: ExpertMajorDispatchOutput, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    # Every row is computed, valid or not: static shapes keep this graph-capturable, and
    # combine reads only the first expert_counts[e] rows of each expert.
    x = d.hidden_states  # [E_local, P*C, H]
    gate, up = torch.bmm(x, w13.transpose(1, 2)).chunk(2, dim=-1)  # [E_local, P*C, I] each
    return torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # [E_local, P*C, H]
