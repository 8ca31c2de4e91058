"""A tiny model and loader that satisfy the core's protocols without execrt.models, and a
counter of host reads (what would make the host wait for a GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


class HostReads:
    """Counts what would make the host wait for a GPU: reading a tensor's values back (``item``,
    ``int()``, ``tolist``, ``numpy``, ``cpu``, ``nonzero``). On CPU nothing waits, so this
    is how a CPU test asserts that a path is sync-free. Use as a context manager; ``seen``
    lists each read (what, and the innermost execrt frame that made it)."""

    READ_FUNCS = frozenset({"tolist", "item", "numpy", "cpu", "__int__", "__bool__", "__index__"})
    READ_OPS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default"})

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._modes: list[Any] = []

    def __enter__(self) -> HostReads:
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                name = getattr(func, "__name__", "")
                if name in HostReads.READ_FUNCS:
                    reads.seen.append(f"{name} at {_caller()}")
                return func(*args, **(kwargs or {}))

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if str(func) in HostReads.READ_OPS:
                    reads.seen.append(f"{func} at {_caller()}")
                return func(*args, **(kwargs or {}))

        self._modes = [Functions(), Ops()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _caller() -> str:
    import traceback

    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/execrt/" in frame.filename and "/tests/" not in frame.filename:
            return f"{frame.filename.rsplit('/execrt/', 1)[1]}:{frame.lineno} {frame.name}"
    return "?"
