"""Expert compute per dispatch format: what models and the MoE conformance suites share.

Reads only the dispatch *format* (``DispatchFormat``), never the dispatcher that produced it.
Every path here is free of host synchronisation and data-dependent shapes, so it can be
captured in a CUDA graph; it is the CPU default and the reference the fused kernels are
tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from execrt.core.interfaces import (
    DispatchOutput,
    ExpertMajorDispatchOutput,
    StandardDispatchOutput,
)

StandardMethod = Literal["auto", "grouped_mm", "dense"]
_GroupedMM = Callable[..., torch.Tensor]
_GROUPED_MM: _GroupedMM | None = getattr(F, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)


def run_experts(d: DispatchOutput, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Apply the local experts to dispatched tokens, following ``d.format`` (see DispatchFormat)."""
    if isinstance(d, StandardDispatchOutput):
        return standard_experts(d.hidden_states, d.topk_ids, d.topk_weights, w13, w2)
    if isinstance(d, ExpertMajorDispatchOutput):
        return _experts_expert_major(d, w13, w2)
    raise TypeError(f"moe: unknown dispatch output {type(d).__name__}")


def grouped_mm_usable(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs these operands natively, without a host sync.

    CPU: fp32/bf16/fp16. CUDA: bf16 on sm90/sm100 only (other devices and dtypes fall back
    to a per-group loop that copies the offsets to the host). Everywhere, rows of 16 bytes'
    multiples (the hidden size and the expert width: torch refuses other strides, e.g. an fp32
    expert width of 30).
    """
    if _GROUPED_MM is None or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    per_16_bytes = 16 // x.element_size()
    if x.shape[-1] % per_16_bytes or w2.shape[-1] % per_16_bytes:
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (9, 10)


def standard_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    method: StandardMethod = "auto",
) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * SwiGLU_{ids[t,k]}(x[t])`` over local ids; -1 routes nowhere.

    ``hidden [T, H]``, ``topk_ids [T, K]`` local ids (-1 or out of range: not here),
    ``topk_weights [T, K]``; returns ``[T, H]`` in ``hidden``'s dtype. ``method``:
    ``grouped_mm`` (sort pairs by expert, one grouped GEMM each way), ``dense`` (every expert
    over every token, masked: E/K times the work, for devices without a native grouped GEMM),
    ``auto`` picks ``grouped_mm`` where ``grouped_mm_usable``.
    """
    if hidden.shape[0] == 0:
        return torch.zeros_like(hidden)
    grouped = method == "grouped_mm" or (method == "auto" and grouped_mm_usable(hidden, w13, w2))
    if grouped:
        return _standard_grouped(hidden, topk_ids, topk_weights, w13, w2)
    return _standard_dense(hidden, topk_ids, topk_weights, w13, w2)


def _standard_grouped(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    assert _GROUPED_MM is not None
    (t, k), num_experts = ids.shape, w13.shape[0]
    flat = ids.flatten()  # [S = T*K]
    local = (flat >= 0) & (flat < num_experts)
    keys = torch.where(local, flat, num_experts)  # non-local pairs sort last
    order = torch.argsort(keys, stable=True)  # [S] pair indices grouped by expert
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys, dtype=torch.int32))
    offs = counts[:num_experts].cumsum(0, dtype=torch.int32)  # [E] group ends
    # One spare row keeps offs[-1] strictly below the operand length, as grouped_mm asks.
    rows = torch.cat([order // k, order.new_zeros(1)])  # [S+1] token of each sorted pair
    gate, up = _GROUPED_MM(x[rows], w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = _GROUPED_MM(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)[:-1]  # [S, H]
    # Rows of non-local pairs were never computed (uninitialised): select, do not multiply.
    scale = w.flatten()[order].to(y.dtype)[:, None]  # [S, 1]
    y = torch.where(local[order][:, None], y * scale, 0)
    per_pair = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
    return per_pair.view(t, k, -1).sum(dim=1)  # [T, H]


def _standard_dense(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    # A static loop over the local experts, each over every token: no sort, no sync.
    out = torch.zeros_like(x)  # [T, H]
    for expert in range(w13.shape[0]):
        hit = ids == expert  # [T, K]
        coef = (w * hit).sum(dim=1, keepdim=True).to(x.dtype)  # [T, 1]
        y = _swiglu(x, w13[expert], w2[expert])  # [T, H]
        out += torch.where(hit.any(dim=1, keepdim=True), y * coef, 0)
    return out


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def _experts_expert_major(
    d: ExpertMajorDispatchOutput, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    # Every row is computed, valid or not: static shapes keep this graph-capturable, and
    # combine reads only the first expert_counts[e] rows of each expert.
    x = d.hidden_states  # [E_local, P*C, H]
    gate, up = torch.bmm(x, w13.transpose(1, 2)).chunk(2, dim=-1)  # [E_local, P*C, I] each
    return torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # [E_local, P*C, H]
