"""sdpa_example: attention through torch's scaled_dot_product_attention over gathered K/V."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from execrt.core.batch import ForwardBatch, PaddedContext
from execrt.core.interfaces import AttentionBackend, AttentionLayer


class SdpaAttentionBackend(AttentionBackend):
    """Gathers each request's K/V through ``req_to_token`` and calls SDPA with a mask.

    Simple rather than fast: every step copies the whole context of every request.
    """

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        # Each request's context slots, padded to the longest; padding reads slot 0.
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
        keys = self.kv_cache.k_buffers[layer.layer_id][meta.slots]  # [B, L, Hkv, D]
        values = self.kv_cache.v_buffers[layer.layer_id][meta.slots]  # [B, L, Hkv, Dv]
        mask = meta.valid[:, None, None, :]  # [B, 1, 1, L]
        out = self._sdpa(q[:, :, None], keys, values, mask, layer)  # [B, Hq, 1, Dv]
        return out[:, :, 0]

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
        # New token i sits at position prefix + i and sees positions 0 .. prefix + i.
        for rows, slots, causal in meta.extend_segments(fb):  # slots [L], causal [n, L]
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
