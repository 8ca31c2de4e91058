"""``triton_decode_prologue``: a decode step's q/k norm, RoPE (and Hadamard rotation) and K/V
store run inside the triton backend's split launch instead of the rotary kernel.

The oracle is the same model with the option off: the separate rotary kernel (``fused_kernels``
on, so both rotations are the same Triton code) and the same decode launch. Under the
interpreter the logits must be the same bits; compiled on a GPU, within rounding. Prefill is
untouched by the option, so it is also a check that the K/V the prologue stored at decode are
what later steps read.
"""

from __future__ import annotations

import pytest
import torch

from execrt.core.context import RuntimeContext
from execrt.core.errors import ConfigError
from execrt.models import layers
from tests.drivers import make_worker, prefill_then_decode, rel_err

pytest.importorskip("triton")

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77], [9] * 13 + [100, 101], [7]]
CUDA = torch.cuda.is_available()


def _interpreted() -> None:
    from execrt.kernels._triton import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("the Triton kernels run on CPU under the Triton interpreter only")


def _run(path: str, plugin_host, monkeypatch, prologue: str, **config):  # type: ignore[no-untyped-def]
    """(trace, how many times the model's rotary kernel ran at decode)."""
    calls = {"decode": 0}
    rotate = layers.qk_norm_rope

    def counted(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["decode"] += q.shape[0] == len(PROMPTS)  # every decode row; the prefill has more
        return rotate(q, *args, **kwargs)

    monkeypatch.setattr(layers, "qk_norm_rope", counted)
    ctx = RuntimeContext()
    settings = (
        dict(attention_backend="triton", fused_kernels="on", triton_decode_prologue=prologue)
        | config
    )
    worker = make_worker(path, ctx, plugin_host, **settings)
    try:
        trace = prefill_then_decode(worker, PROMPTS, steps=5)
    finally:
        worker.close()
        ctx.close()
    monkeypatch.setattr(layers, "qk_norm_rope", rotate)
    return trace, calls["decode"]


CASES = {
    "qwen3": ("dense-tied-hd64", {}),  # q/k norms
    "llama-no-norm": ("llama-llama3-gqa3-hd64", {}),  # no q/k norm, GQA 3, Llama-3 RoPE
    "fp8-hadamard": ("dense-tied-hd64", {"kv_cache_dtype": "fp8_e4m3"}),  # rotated by default
}
# e5m2 and the unrotated fp8 store are the kernel's cases (tests/kernels/attention/
# test_decode_prologue.py); a model run of them here cost the suite 24 s of interpreter.


@pytest.mark.parametrize("case", list(CASES))
def test_the_prologue_gives_the_separate_rotations_logits_bit_for_bit(
    checkpoint, plugin_host, monkeypatch, case: str
) -> None:
    _interpreted()
    name, config = CASES[case]
    path = checkpoint(name)
    ref, ref_calls = _run(path, plugin_host, monkeypatch, "off", **config)
    got, got_calls = _run(path, plugin_host, monkeypatch, "on", **config)
    assert ref_calls > 0 and got_calls == 0, "with the option on, decode skips the rotary kernel"
    assert got.tokens == ref.tokens
    for step, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ by {rel_err(a, b):.2e}"


def test_an_unknown_prologue_setting_is_refused_by_name() -> None:
    from execrt.core.config import RuntimeConfig

    with pytest.raises(ConfigError, match=r"triton_decode_prologue 'yes' unsupported.*off, on"):
        RuntimeConfig(triton_decode_prologue="yes")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("graph", ["none", "full_cuda_graph"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_gpu_the_prologue_keeps_the_logits(checkpoint, plugin_host, monkeypatch, graph, kv) -> None:  # type: ignore[no-untyped-def]
    """Compiled, eager and graph-replayed (padded buckets included): fp32 logits within 1e-4
    of the separate rotation's and the same tokens (the rotation's multiply-adds may be
    contracted differently in the two kernels)."""
    path = checkpoint("dense-untied-hd128-sharded")
    config = dict(device="cuda", dtype="float32", graph_backend=graph, kv_cache_dtype=kv)
    ref, _ = _run(path, plugin_host, monkeypatch, "off", **config)
    got, calls = _run(path, plugin_host, monkeypatch, "on", **config)
    assert calls == 0
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits, strict=True):
        assert rel_err(a, b) <= 1e-4
