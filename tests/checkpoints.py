"""Tiny random Qwen3 / Qwen3-MoE checkpoints built with transformers for the parity tests."""

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
}


def build_hf_model(name: str) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    kind, kwargs, _ = CHECKPOINTS[name]
    torch.manual_seed(sum(map(ord, name)))
    common = dict(
        vocab_size=384,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=1,
        bos_token_id=0,
    )
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(**common, **kwargs))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **kwargs))
    # Larger-than-default weights make logits far from ties, so greedy paths are stable.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model.float().eval()


def build_checkpoint(name: str, path: str) -> str:
    model = build_hf_model(name)
    model.save_pretrained(path, **CHECKPOINTS[name][2])
    return path
