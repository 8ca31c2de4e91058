"""Model building blocks: RMSNorm, RoPE, attention through the backend, SwiGLU MLP, sparse MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from execrt.core.batch import ForwardBatch
from execrt.core.experts import run_experts
from execrt.core.interfaces import AttentionLayer, MoEDispatcher


class RMSNorm(nn.Module):
    """RMS normalisation computed in fp32, scaled in the input dtype (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed fp32 cos/sin table indexed by position."""

    cos: torch.Tensor  # [P, D] fp32
    sin: torch.Tensor  # [P, D] fp32

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the tables on the buffers' device, e.g. after ``to_empty``."""
        if self.cos.is_meta:
            return
        d, device = self.head_dim, self.cos.device
        exponent = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
        inv_freq = 1.0 / (self.theta**exponent)  # [D/2]
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        emb = torch.outer(pos, inv_freq).repeat(1, 2)  # [P, D]
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hq, D]``, ``k [T, Hkv, D]`` rotated by ``positions [T]``."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm (Qwen3); the kernel is the backend's."""

    def __init__(
        self,
        layer_id: int,
        hidden_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        rotary: RotaryEmbedding,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden_size, num_q_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_q_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        self.rotary = rotary
        self.spec = AttentionLayer(
            layer_id=layer_id,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            scaling=head_dim**-0.5,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        s = self.spec
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, s.num_q_heads, s.head_dim))  # [T, Hq, D]
        k = self.k_norm(self.k_proj(x).view(t, s.num_kv_heads, s.head_dim))  # [T, Hkv, D]
        v = self.v_proj(x).view(t, s.num_kv_heads, s.head_dim)  # [T, Hkv, D]
        q, k = self.rotary(positions, q, k)
        assert fb.attn_backend is not None
        o = fb.attn_backend.forward(q, k, v, s, fb)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matrix ``[2I, H]``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Softmax top-k router, this rank's experts, and the dispatcher between them.

    Expert weights are stacked: ``w13 [E_local, 2I, H]`` (gate rows, then up rows) and
    ``w2 [E_local, H, I]``. Expert compute reads the dispatch *format*, never the dispatcher.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        dispatcher: MoEDispatcher,
    ) -> None:
        super().__init__()
        local = dispatcher.init.num_local_experts
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, intermediate_size))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.dispatcher = dispatcher

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(topk_ids [T, K] int64, topk_weights [T, K] fp32)``."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # Hugging Face rounds the weights to the model dtype before applying them.
        return ids, weights.to(x.dtype).float()

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        ids, weights = self.route(x)
        real = fb.num_token_non_padded_device  # [1]; set whenever rows may be graph padding
        if real is not None:  # padded rows route nowhere: a device-side mask, capture-safe
            padded = torch.arange(x.shape[0], device=x.device)[:, None] >= real  # [T, 1]
            ids = ids.masked_fill(padded, -1)
        dispatched = self.dispatcher.dispatch(x, ids, weights)
        out = run_experts(dispatched, self.w13, self.w2)
        return self.dispatcher.combine(out, dispatched)
