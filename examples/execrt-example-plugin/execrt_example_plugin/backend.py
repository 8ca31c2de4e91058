"""sdpa_example: attention through torch's scaled_dot_product_attention over gathered K/V."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from execrt.core.batch import ForwardBatch, PaddedContext
from execrt.core.interfaces import KV, AttentionBackend, AttentionLayer, AttentionStep


class SdpaAttentionBackend(AttentionBackend):
    """Gathers each request's K/V through ``req_to_token`` and calls SDPA with a mask.

    Simple rather than fast: every step copies the whole context of every request.
    """

    def plan(self, fb: ForwardBatch) -> PaddedContext:
        # Each request's context slots, padded to the longest; padding reads slot 0.
        return PaddedContext.of(fb, self.req_to_token_pool.req_to_token)

    def attend(
        self, q: Tensor, layer: AttentionLayer, step: AttentionStep, kv: KV = None
    ) -> Tensor:
        # This step's K/V are already in the cache (the model stored them): read, never write.
        meta: PaddedContext = step.meta
        k_buf = self.kv_cache.k_buffers[layer.layer_id]  # [S+1, Hkv, D]
        v_buf = self.kv_cache.v_buffers[layer.layer_id]  # [S+1, Hkv, Dv]
        if step.mode.is_decode():
            mask = meta.valid[:, None, None, :]  # [B, 1, 1, L]
            out = self._sdpa(q[:, :, None], k_buf[meta.slots], v_buf[meta.slots], mask, layer)
            return out[:, :, 0]  # [B, Hq, Dv]
        out = q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))
        # New token i sits at position prefix + i and sees positions 0 .. prefix + i.
        for rows, slots, causal in meta.extend_segments():  # slots [L], causal [n, L]
            qb = q[rows].transpose(0, 1)[None]  # [1, Hq, n, D]
            ob = self._sdpa(qb, k_buf[slots][None], v_buf[slots][None], causal, layer)
            out[rows] = ob[0].transpose(0, 1)
        return out

    @staticmethod
    def _sdpa(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        layer: AttentionLayer,
    ) -> torch.Tensor:
        """``q [B, Hq, n, D]``, ``k/v [B, L, Hkv, D]`` (cache layout) -> ``[B, Hq, n, Dv]``."""
        return F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=layer.num_q_heads != layer.num_kv_heads,
        )
