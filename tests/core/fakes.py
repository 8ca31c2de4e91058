"""A tiny model and loader that satisfy the core's protocols without execrt.models."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from execrt.core.batch import ForwardBatch, LogitsOutput
from execrt.core.interfaces import AttentionLayer, AttentionStep
from execrt.core.memory import KVCache
from execrt.core.model_spec import ModelLoadRequest, ModelSpec

SPEC = ModelSpec(
    architecture="Toy",
    vocab_size=32,
    hidden_size=32,
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    dtype=torch.bfloat16,
)


class ToyModel(torch.nn.Module):
    """Embedding -> per-layer attention through the backend -> a linear head."""

    def __init__(self, spec: ModelSpec, request: ModelLoadRequest) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.spec = spec
        self.embed = torch.randn(spec.vocab_size, spec.hidden_size, generator=g).to(
            request.device, request.dtype
        )
        self.head = self.embed.t().contiguous()
        hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
        self.layers = [AttentionLayer(i, hq, hkv, d, d, d**-0.5) for i in range(spec.num_layers)]
        self.kv_cache: KVCache | None = None

    def attach_kv_cache(self, kv_cache: KVCache | None) -> None:
        self.kv_cache = kv_cache

    def kv_scales(self) -> None:
        return None  # no fp8 K/V scales in this checkpoint

    def forward(self, fb: ForwardBatch, attn: AttentionStep) -> LogitsOutput:
        s = self.spec
        h = self.embed[fb.input_ids]  # [T, H]
        t = h.shape[0]
        for layer in self.layers:
            q = h[:, : s.num_q_heads * s.head_dim].reshape(t, s.num_q_heads, s.head_dim)
            kv = h[:, : s.num_kv_heads * s.head_dim].reshape(t, s.num_kv_heads, s.head_dim)
            if self.kv_cache is not None:  # the model is the K/V writer
                self.kv_cache.set_kv(layer.layer_id, attn.out_cache_loc, kv, kv)
                o = attn.backend.attend(q, layer, attn)  # [T, Hq, D]
            else:
                o = attn.backend.attend(q, layer, attn, (kv, kv))
            h = h + o.reshape(t, -1)[:, : s.hidden_size]
        if fb.mode.is_extend():
            last = torch.tensor(fb.extend_lens_cpu).cumsum(0) - 1
            h = h[last.to(h.device)]
        return LogitsOutput(next_token_logits=(h @ self.head).float())


@dataclass
class ToyLoader:
    """A ModelLoader: ``spec`` at once, the model on ``load`` (requests are recorded)."""

    spec: ModelSpec = SPEC
    requests: list[ModelLoadRequest] = field(default_factory=list)

    def load(self, request: ModelLoadRequest) -> ToyModel:
        self.requests.append(request)
        return ToyModel(self.spec, request)
