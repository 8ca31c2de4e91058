"""GPU, bf16: the fast decode path against the reference path on the shapes of real checkpoints.

The rest of the GPU suite runs a few synthetic shapes (hidden 512, 8 query heads over 2 KV
heads, head dim 128). Users load Qwen2.5, SmolLM2, Llama-3.2 and larger Qwen3 checkpoints,
whose hidden sizes (896, 960, 1536, 2048, 5120), query groups (3, 5, 6, 7) and head dims (64,
128) pick other skinny-GEMM tiles, other padded attention groups and other rotary programs.
Each shape is built with random weights and its real layout (biases, tied embeddings, RoPE
scaling), one or two layers deep, then run both ways on the same token stream:

- fast: triton attention, CUDA graphs, the fused Triton layer kernels (what ``auto`` gives);
- reference: torch_native attention (fp32 softmax over the gathered K/V), no graphs, the
  torch layers.

Logits agree within bf16 tolerance at every step, the decode steps replay a captured graph,
and the greedy token agrees wherever the reference's top-2 margin is clear. With an fp8 e4m3
cache both paths store and read fp8 K/V (the reference dequantizes what it gathers), so the
same comparison holds them to each other, not to a bf16 cache.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from execrt.core.context import RuntimeContext
from tests.drivers import Trace, assert_traces_agree, make_worker, prefill_then_decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 2048


def _dims(hidden: int, inter: int, heads: int, kv: int, **more: Any) -> dict[str, Any]:
    """A config's layer dims: two layers and tied embeddings unless ``more`` says otherwise."""
    dims = dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads)
    dims |= dict(num_key_value_heads=kv, num_hidden_layers=2, tie_word_embeddings=True)
    return dims | more


LLAMA3_ROPE = dict(
    rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)  # fmt: skip
# name: (transformers family, its config), as published but for the layer count.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # 14 query heads over 2 KV heads (a group of 7), head dim 64, q/k/v biases.
    "qwen2.5-0.5b": ("Qwen2", _dims(896, 4864, 14, 2)),
    # 12 over 2 (a group of 6), head dim 128, hidden 1536.
    "qwen2.5-1.5b": ("Qwen2", _dims(1536, 8960, 12, 2)),
    # 15 over 5 (a group of 3), head dim 64, hidden 960.
    "smollm2-360m": ("Llama", _dims(960, 2560, 15, 5)),
    # 32 over 8, head dim 64, Llama-3 RoPE scaling.
    "llama-3.2-1b": (
        "Llama",
        _dims(
            2048,
            8192,
            32,
            8,
            head_dim=64,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling=LLAMA3_ROPE,
        ),
    ),  # fmt: skip
    # 40 over 8 (a group of 5), head dim 128, q/k norms, hidden 5120, one untied layer.
    "qwen3-14b": (
        "Qwen3",
        _dims(5120, 17408, 40, 8, head_dim=128, num_hidden_layers=1, tie_word_embeddings=False),
    ),
}


@pytest.fixture(scope="module")
def checkpoint_dirs() -> dict[str, str]:
    return {}


def _checkpoint(dirs: dict[str, str], tmp_path_factory: Any, name: str) -> str:
    if name not in dirs:
        import transformers

        family, kwargs = SHAPES[name]
        common = dict(vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-6)
        config = getattr(transformers, f"{family}Config")(**(common | kwargs))
        torch.manual_seed(sum(map(ord, name)))
        model = getattr(transformers, f"{family}ForCausalLM")(config)
        path = tmp_path_factory.mktemp(name.replace(".", "_"))
        model.to(torch.bfloat16).save_pretrained(path)
        dirs[name] = str(path)
    return dirs[name]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lens = [1, 7, 130, 301, 57]  # one token, a short one, several KV splits
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lens]


def _trace(path: str, kv: str, fast: bool, follow: list[list[int]] | None) -> Trace:
    ctx = RuntimeContext()
    worker = make_worker(
        path,
        ctx,
        device="cuda",
        attention_backend="triton" if fast else "torch_native",
        graph_backend="full_cuda_graph" if fast else "none",
        fused_kernels="on" if fast else "off",
        kv_cache_dtype=kv,
        max_running_requests=8,
        kv_cache_tokens=4096,
    )
    try:
        return prefill_then_decode(worker, _prompts(), steps=8, follow=follow)
    finally:
        worker.close()
        ctx.close()


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fast_path_matches_the_reference_path(checkpoint_dirs, tmp_path_factory, name, kv) -> None:  # type: ignore[no-untyped-def]
    path = _checkpoint(checkpoint_dirs, tmp_path_factory, name)
    ref = _trace(path, kv, fast=False, follow=None)
    got = _trace(path, kv, fast=True, follow=ref.tokens)
    assert all(got.graphed[1:]), f"decode steps that replayed no graph: {got.graphed}"
    assert_traces_agree(got, ref)
