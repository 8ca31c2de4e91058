"""Tiny random Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints built with transformers for the
parity tests."""

from __future__ import annotations

from typing import Any

import torch

# name -> (kind, config kwargs, save kwargs)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "dense-tied-hd64": (
        "dense",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            tie_word_embeddings=True,
        ),
        {},
    ),
    "dense-untied-hd128-sharded": (
        "dense",
        dict(
            hidden_size=256,
            intermediate_size=384,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            tie_word_embeddings=False,
            rope_theta=1e6,
        ),
        {"max_shard_size": "1MB"},
    ),
    "moe-8x2": (
        "moe",
        dict(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        {},
    ),
    "moe-mixed-layers": (
        "moe",
        dict(
            hidden_size=128,
            intermediate_size=192,
            moe_intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            tie_word_embeddings=True,
        ),
        {},
    ),
    # Odd shapes, biases everywhere and a llama3 RoPE whose original context is short enough
    # that all three frequency bands (kept, blended, stretched) occur.
    "llama-untied-bias-llama3": (
        "llama",
        dict(
            hidden_size=96,
            intermediate_size=200,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        {},
    ),
    # Qwen3 with YaRN over an original context of 64 (max_position_embeddings 256: factor 4):
    # the blend band covers pairs 0-9 of 32, and cos/sin carry the attention factor 1.139.
    "qwen3-yarn": (
        "dense",
        dict(
            hidden_size=128,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        {},
    ),
    # One kv head for four query heads (two tensor-parallel ranks each hold a copy of it), and
    # biases on q/k/v, o_proj and the MLP (row-parallel biases must be added once).
    "llama-bias-kv1": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
        ),
        {},
    ),
    "llama-tied-linear": (
        "llama",
        dict(
            hidden_size=80,
            intermediate_size=144,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=5,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.5},
        ),
        {},
    ),
    # Small enough for workloads of hundreds of requests on a CPU, long enough (1024 positions)
    # for prompts that grow a few hundred tokens at a time (the prefix-cache tests).
    "dense-tiny-ctx1k": (
        "dense",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            max_position_embeddings=1024,
        ),
        {},
    ),
    "qwen2-untied": (
        "qwen2",
        dict(
            hidden_size=96,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
        {},
    ),
    # Mistral: Llama's layers without biases, and a sliding window (32) shorter than the
    # context (256), to which execrt limits the context; the tests' contexts fit in it.
    "mistral-swa32": (
        "mistral",
        dict(
            hidden_size=64,
            intermediate_size=112,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=32,
        ),
        {},
    ),
    "qwen2-tied": (
        "qwen2",
        dict(
            hidden_size=128,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_theta=1e6,
        ),
        {},
    ),
}

# Built on demand only (not in the parametrization over CHECKPOINTS that the parity tests run).
EXTRA_CHECKPOINTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # dense-tiny-ctx1k with a head dim the Triton and FlashInfer kernels serve (GPU tests).
    "dense-tiny-ctx1k-hd64": ("dense", CHECKPOINTS["dense-tiny-ctx1k"][1] | {"head_dim": 64}, {}),
    # Llama-3 RoPE, no q/k norm, three query heads per kv head, in a head dim Triton serves.
    "llama-llama3-gqa3-hd64": (
        "llama",
        CHECKPOINTS["llama-untied-bias-llama3"][1]
        | {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64},
        {},
    ),
}


def spec(name: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    return CHECKPOINTS[name] if name in CHECKPOINTS else EXTRA_CHECKPOINTS[name]


def build_hf_model(name: str) -> Any:
    import transformers

    kind, kwargs, _ = spec(name)
    torch.manual_seed(sum(map(ord, name)))
    common = dict(
        vocab_size=384,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=1,
        bos_token_id=0,
    )
    family = {
        "dense": "Qwen3", "moe": "Qwen3Moe", "llama": "Llama", "qwen2": "Qwen2",
        "mistral": "Mistral",
    }[kind]  # fmt: skip
    config = getattr(transformers, f"{family}Config")(**(common | kwargs))
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    # Larger-than-default weights make logits far from ties, so greedy paths are stable; biases
    # are drawn too (they start at zero, which would test nothing).
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2 or pname.endswith(".bias"):
                p.normal_(0.0, 0.08)
    return model.float().eval()


def build_checkpoint(name: str, path: str) -> str:
    model = build_hf_model(name)
    model.save_pretrained(path, **spec(name)[2])
    return path
