"""One K/V writer per step: each new token's K and V row is stored exactly once per layer,
by the model or by a backend that declares ``stores_kv``, never by both."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from execrt.core.context import RuntimeContext
from execrt.core.memory import KVCache
from tests.drivers import fake_attention_host, make_worker, prefill, release

STORING = "storing_native"


class SlotWrites(TorchDispatchMode):
    """Counts, per cache buffer, the slots every indexed store writes."""

    def __init__(self, cache: KVCache) -> None:
        super().__init__()
        self.names = {}
        for layer, (k, v) in enumerate(zip(cache.k_buffers, cache.v_buffers, strict=True)):
            self.names[k.data_ptr()] = f"K{layer}"
            self.names[v.data_ptr()] = f"V{layer}"
        self.writes: dict[str, Counter[int]] = {name: Counter() for name in self.names.values()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
            name = self.names.get(args[0].data_ptr())
            if name is not None:
                (index,) = args[1]
                self.writes[name].update(index.flatten().tolist())
        elif func is torch.ops.aten.copy_.default and args[0].data_ptr() in self.names:
            raise AssertionError("a whole cache buffer was overwritten")
        return func(*args, **kwargs)


@pytest.mark.parametrize("storing", [False, True], ids=["model-stores", "backend-stores"])
def test_every_new_token_is_stored_exactly_once_per_layer(checkpoint, storing: bool) -> None:  # type: ignore[no-untyped-def]
    ctx = RuntimeContext()
    attention: dict[str, Any] = {"attention_backend": STORING} if storing else {}
    host = fake_attention_host(STORING, "StoringAttention", "STORES_CAPS") if storing else None
    worker = make_worker(checkpoint("dense-tied-hd64"), ctx, host, **attention)
    mr = worker.model_runner
    assert mr.attn_backend.capabilities.stores_kv is storing
    reqs, decode = prefill(worker, [[5, 6, 7, 8], [9, 10]])
    spy = SlotWrites(mr.kv_cache)
    with spy:
        worker.forward_batch_generation(decode)
    want = Counter(decode.inputs.out_cache_loc.tolist())
    assert len(want) == 2
    for name, got in spy.writes.items():
        assert got == want, f"{name}: slots written {dict(got)}, expected each of {want} once"
    release(worker, reqs)
    worker.close()
    ctx.close()
