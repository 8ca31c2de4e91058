"""torch_native attention: plain PyTorch over K/V gathered per request; the reference backend."""

from __future__ import annotations

import torch

from execrt.core.batch import ForwardBatch, PaddedContext
from execrt.core.interfaces import AttentionBackend, AttentionLayer


class TorchNativeAttnBackend(AttentionBackend):
    """Gathers each request's K/V through ``req_to_token`` and attends in fp32.

    Runs on any device and dtype torch supports. Decode is batched over padded contexts;
    extend loops over requests. Not graph-capturable (shapes follow the longest context).
    """

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        fb.attn_metadata = PaddedContext.of(fb, self.req_to_token_pool.req_to_token)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        meta: PaddedContext = fb.attn_metadata
        k_ctx = self.kv_cache.k_buffers[layer.layer_id][meta.slots]  # [B, L, Hkv, D]
        v_ctx = self.kv_cache.v_buffers[layer.layer_id][meta.slots]  # [B, L, Hkv, Dv]
        mask = meta.valid[:, None, :]  # [B, 1, L]: every query head sees the same context
        out = attend(q[:, None], k_ctx, v_ctx, layer.scaling, mask[:, None])  # [B, 1, Hq, Dv]
        return out[:, 0]

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        meta: PaddedContext = fb.attn_metadata
        k_buf = self.kv_cache.k_buffers[layer.layer_id]
        v_buf = self.kv_cache.v_buffers[layer.layer_id]
        out = q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))
        for rows, ctx, causal in meta.extend_segments(fb):  # ctx [L], causal [n, L]
            out[rows] = attend(
                q[None, rows], k_buf[ctx][None], v_buf[ctx][None], layer.scaling,
                causal[None, :, None, :],
            )[0]  # fmt: skip
        return out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor
) -> torch.Tensor:
    """Masked softmax attention in fp32 with GQA grouping.

    ``q [B, n, Hq, D]``, ``k [B, L, Hkv, D]``, ``v [B, L, Hkv, Dv]``, ``mask`` broadcastable to
    ``[B, n, Hq, L]`` (True = attend) -> ``[B, n, Hq, Dv]`` in q's dtype.
    """
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(b, n, hkv, hq // hkv, d)  # [B, n, Hkv, G, D]
    scores = torch.einsum("bnhgd,blhd->bnhgl", qg, k.float()) * scale  # [B, n, Hkv, G, L]
    scores = scores.reshape(b, n, hq, -1).masked_fill(~mask, float("-inf"))  # [B, n, Hq, L]
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # an empty context yields zeros
    probs = probs.view(b, n, hkv, hq // hkv, -1)
    out = torch.einsum("bnhgl,blhd->bnhgd", probs, v.float())  # [B, n, Hkv, G, Dv]
    return out.reshape(b, n, hq, -1).to(q.dtype)
