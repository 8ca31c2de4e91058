"""The flashinfer backend's start on CPU, against a stand-in flashinfer module: the prefill
variant it builds, the warm-up that makes FlashInfer compile or load its kernels, cleanup."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest
import torch

from execrt.backends.attention import flashinfer as backend_module
from execrt.backends.attention.flashinfer_prefill import prefill_variant
from execrt.core.context import RuntimeContext
from execrt.core.errors import BackendUnavailableError
from execrt.core.interfaces import AttentionBackendInit
from execrt.core.memory import KVCache, ReqToTokenPool
from execrt.plugins.builtin import FLASHINFER_ATTENTION

CPU = torch.device("cpu")


class FakeFlashInfer:
    """Records what the backend asks of FlashInfer's wrappers."""

    def __init__(self, fail_plan: bool = False) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.fail_plan = fail_plan
        self.module = types.ModuleType("flashinfer")
        self.module.BatchDecodeWithPagedKVCacheWrapper = self.wrapper("decode")  # type: ignore[attr-defined]
        self.module.BatchPrefillWithPagedKVCacheWrapper = self.wrapper("prefill")  # type: ignore[attr-defined]

    def wrapper(self, kind: str) -> type:
        fake = self

        class Wrapper:
            def __init__(self, workspace: torch.Tensor, layout: str, **kw: Any) -> None:
                fake.calls.append((kind, "init", kw))

            def plan(self, *args: Any, **kw: Any) -> None:
                if fake.fail_plan:
                    raise RuntimeError("ninja: build stopped")
                fake.calls.append((kind, "plan", (args, kw)))

            def run(self, q: torch.Tensor, cache: Any, **kw: Any) -> torch.Tensor:
                fake.calls.append((kind, "run", q.shape))
                return torch.zeros_like(q)

        return Wrapper


def build(monkeypatch, fake: FakeFlashInfer, capability=(9, 0), context=None, **options):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    monkeypatch.setattr(
        backend_module,
        "device_prefill_variant",
        lambda requested, device, q, kv: prefill_variant(requested, capability, "13.0", q, kv),
    )
    pool = ReqToTokenPool(2, 16, CPU)
    cache = KVCache(8, 1, 2, 64, torch.bfloat16, CPU)
    context = context or RuntimeContext()
    init = AttentionBackendInit.over_cache(
        FLASHINFER_ATTENTION, cache, pool, num_q_heads=8, max_batch_size=2, context=context,
        options=options,
    )  # fmt: skip
    return backend_module.FlashInferAttnBackend(init), context


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_fa3_on_sm90_by_default_and_kernels_warmed_up_at_start(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake = FakeFlashInfer()
    progress, seen = logging.getLogger("execrt.progress"), Lines()
    # The CLI may have made it stop propagating (another test ran main()): listen on it.
    level = progress.level
    progress.setLevel(logging.INFO)
    progress.addHandler(seen)
    try:
        attn, context = build(monkeypatch, fake)
    finally:
        progress.removeHandler(seen)
        progress.setLevel(level)
    assert attn.prefill_variant == "fa3" and attn.warm_up_s >= 0
    assert ("prefill", "init", {"backend": "fa3"}) in fake.calls
    # One prefill (causal, one token over the padding slot) and one decode, planned and run.
    steps = [(kind, what) for kind, what, _ in fake.calls if what != "init"]
    assert steps == [("prefill", "plan"), ("prefill", "run"), ("decode", "plan"), ("decode", "run")]
    (args, kw) = next(c for k, w, c in fake.calls if (k, w) == ("prefill", "plan"))
    assert kw["causal"] and args[2].tolist() == [0]  # the padding slot
    (line,) = seen.lines
    assert line.startswith("flashinfer: preparing the fa3 prefill and decode kernels (JIT cache")
    attn.close()
    assert not context.has(backend_module.WORKSPACE)
    context.close()


def test_fa2_elsewhere_or_when_asked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for capability, options in [((8, 0), {}), ((9, 0), {"prefill_backend": "fa2"})]:
        fake = FakeFlashInfer()
        attn, context = build(monkeypatch, fake, capability, **options)
        assert attn.prefill_variant == "fa2"
        assert ("prefill", "init", {"backend": "fa2"}) in fake.calls
        attn.close()
        context.close()


def test_fa3_where_it_cannot_run_is_refused_before_anything_is_allocated(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake = FakeFlashInfer()
    with pytest.raises(BackendUnavailableError, match="sm90 GPU"):
        build(monkeypatch, fake, (8, 6), prefill_backend="fa3")
    assert fake.calls == []


def test_a_warm_up_that_fails_releases_the_workspace(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake = FakeFlashInfer(fail_plan=True)
    context = RuntimeContext()
    with pytest.raises(RuntimeError, match="ninja: build stopped"):
        build(monkeypatch, fake, context=context)
    assert not context.has(backend_module.WORKSPACE)  # the next backend starts clean
    context.close()
