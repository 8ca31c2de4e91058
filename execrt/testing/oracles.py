"""Reference computations the conformance suites compare backends against, in float64."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def attention_oracle(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    scaling: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """float64 attention over K/V gathered through ``req_to_token``; knows nothing of backends.

    ``q [T, Hq, D]`` holds the new tokens, request after request; request b has
    ``extend_lens[b]`` of them at positions ``prefix_lens[b] ..``, and its context is
    ``k_buffer[req_to_token[req_pool_indices[b], :prefix + extend]]`` (``[S, Hkv, D]`` buffers,
    already holding this step's K/V). Token i sees context positions ``<= prefix + i``
    (decode is the case ``extend = 1``). Returns ``[T, Hq, Dv]`` float64 on q's device.
    A cache that stores ``K / k_scale`` and ``V / v_scale`` (fp8) is read times the scales.
    """
    num_q_heads = q.shape[1]
    num_kv_heads, head_dim_v = v_buffer.shape[1], v_buffer.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape[0], num_q_heads, head_dim_v, dtype=torch.float64, device=q.device)
    start = 0
    for row, prefix, n in zip(req_pool_indices, prefix_lens, extend_lens, strict=True):
        length = prefix + n
        slots = req_to_token[int(row), :length].long().to(k_buffer.device)  # [L]
        k = k_buffer[slots].to(q.device, torch.float64).repeat_interleave(group, 1)  # [L, Hq, D]
        v = v_buffer[slots].to(q.device, torch.float64).repeat_interleave(group, 1)  # [L, Hq, Dv]
        k, v = k * k_scale, v * v_scale
        qb = q[start : start + n].double()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qb, k) * scaling  # [Hq, n, L]
        q_pos = torch.arange(prefix, length, device=q.device)[:, None]  # [n, 1]
        hidden = torch.arange(length, device=q.device)[None, :] > q_pos  # [n, L]
        probs = scores.masked_fill(hidden[None], float("-inf")).softmax(-1)
        out[start : start + n] = torch.einsum("hnl,lhd->nhd", probs, v)
        start += n
    return out


def qk_prologue_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    hadamard: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(q, k)`` after a decode step's q/k prologue (``QKPrologue``): per-head RMSNorm
    (a weight of None: none), rotate-half RoPE with the tables' rows at ``positions``, then,
    with ``hadamard``, times the orthonormal Sylvester-Hadamard matrix. No intermediate
    rounding: a backend's rounding shows as a difference within the dtype's tolerance."""
    c = cos.double()[positions.long()][:, None, :]  # [T, 1, D]
    s = sin.double()[positions.long()][:, None, :]
    d = q.shape[-1]
    rotation = None
    if hadamard:
        rotation = torch.ones(1, 1, dtype=torch.float64, device=q.device)
        while rotation.shape[0] < d:  # Sylvester: [[H, H], [H, -H]]
            rotation = torch.cat(
                [torch.cat([rotation, rotation], 1), torch.cat([rotation, -rotation], 1)], 0
            )
        rotation = rotation * d**-0.5

    def one(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        x = x.double()
        if weight is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
        half = d // 2
        x = x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s
        return x if rotation is None else x @ rotation

    return one(q, q_norm_weight), one(k, k_norm_weight)


def moe_oracle(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The naive single-process MoE: ``out[t] = sum_k w[t,k] * SwiGLU_{ids[t,k]}(x[t])``.

    ``hidden [T, H]``, ``topk_ids [T, K]`` global expert ids (-1 = none), ``topk_weights
    [T, K]``, global ``w13 [E, 2I, H]`` (gate rows first, then up) and ``w2 [E, H, I]``.
    Loops token by token in float64; returns ``[T, H]`` float64.
    """
    x = hidden_states.double()
    out = torch.zeros_like(x)
    experts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            if e not in experts:
                experts[e] = (w13[e].to(x.device, torch.float64), w2[e].to(x.device, torch.float64))
            up_proj, down_proj = experts[e]
            gate, up = (up_proj @ x[t]).chunk(2)  # [I] each
            out[t] += float(topk_weights[t, k]) * (down_proj @ (F.silu(gate) * up))
    return out


@dataclass(frozen=True)
class Comparison:
    """How far ``out`` is from the oracle: ``||out - ref|| / ||ref||`` and where it is worst.
    Against a zero reference the error is ``||out||``, absolute (``relative`` False)."""

    rel_error: float
    worst_index: tuple[int, ...]
    num_nonfinite: int
    relative: bool = True

    @property
    def kind(self) -> str:
        """The error's kind as a message names it."""
        return "relative" if self.relative else "absolute (the reference is zero)"

    def ok(self, tolerance: float) -> bool:
        return self.num_nonfinite == 0 and self.rel_error <= tolerance


def compare(out: torch.Tensor, ref: torch.Tensor) -> Comparison:
    """Norm-relative error of ``out`` against a float64 reference of the same shape."""
    if out.shape != ref.shape:
        raise ValueError(f"compare: shape {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    if out.numel() == 0:
        return Comparison(0.0, (), 0)
    diff = out.detach().to(ref.device, torch.float64) - ref
    nonfinite = int((~torch.isfinite(diff)).sum())
    if nonfinite:
        flat = int((~torch.isfinite(diff)).flatten().nonzero()[0])
        return Comparison(float("inf"), _unravel(flat, out.shape), nonfinite)
    ref_norm = float(ref.norm())
    err = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    worst = _unravel(int(diff.abs().flatten().argmax()), out.shape)
    return Comparison(err, worst, 0, relative=ref_norm > 0)


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))
