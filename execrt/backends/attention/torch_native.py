"""torch_native attention: plain PyTorch over K/V gathered per request; the reference backend."""

from __future__ import annotations

import torch
from torch import Tensor

from execrt.core.batch import ForwardBatch, PaddedContext
from execrt.core.interfaces import KV, AttentionBackend, AttentionLayer, AttentionStep
from execrt.core.kv_quant import K_SCALE, V_SCALE, dequantize


class TorchNativeAttnBackend(AttentionBackend):
    """Gathers each request's K/V through ``req_to_token`` and attends in fp32.

    Runs on any device and dtype torch supports. Decode is batched over padded contexts;
    extend loops over requests. Not graph-capturable (shapes follow the longest context).
    An fp8 cache is dequantized as it is gathered (``stored * scale``): the reference the
    other backends' fp8 paths are held to.
    """

    def plan(self, fb: ForwardBatch) -> PaddedContext:
        return PaddedContext.of(fb, self.req_to_token_pool.req_to_token)

    def attend(
        self, q: Tensor, layer: AttentionLayer, step: AttentionStep, kv: KV = None
    ) -> Tensor:
        meta: PaddedContext = step.meta
        if step.mode.is_decode():
            k, v = self._gather(layer.layer_id, meta.slots)  # [B, L, Hkv, D], [B, L, Hkv, Dv]
            mask = meta.valid[:, None, None, :]  # [B, 1, 1, L]: every head sees one context
            return attend(q[:, None], k, v, layer.scaling, mask)[:, 0]  # [B, Hq, Dv]
        out = q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))
        for rows, ctx, causal in meta.extend_segments():  # ctx [L], causal [n, L]
            k, v = self._gather(layer.layer_id, ctx)  # [L, Hkv, D], [L, Hkv, Dv]
            out[rows] = attend(
                q[None, rows], k[None], v[None], layer.scaling, causal[None, :, None, :]
            )[0]
        return out

    def _gather(self, layer_id: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The K and V rows at ``slots``, dequantized when the cache is fp8."""
        cache = self.kv_cache
        k, v = cache.k_buffers[layer_id][slots], cache.v_buffers[layer_id][slots]
        if not cache.is_fp8:
            return k, v
        scales = cache.layer_scales[layer_id]
        return dequantize(k, scales[K_SCALE]), dequantize(v, scales[V_SCALE])


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
