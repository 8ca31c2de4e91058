"""ModelConfig: range checks of the size fields, before any tensor is read."""

from __future__ import annotations

import json
import logging
import re
import warnings

import pytest

from execrt.core.errors import ModelLoadError
from execrt.models import ModelConfig

DENSE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MOE = DENSE | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}
_AT_LEAST_1 = "must be an integer >= 1, got"


@pytest.mark.parametrize(
    "base, change, message",
    [
        (DENSE, {"vocab_size": -5}, f"field 'vocab_size' {_AT_LEAST_1} -5"),
        (DENSE, {"num_hidden_layers": -1}, f"field 'num_hidden_layers' {_AT_LEAST_1} -1"),
        (DENSE, {"num_hidden_layers": 0}, f"field 'num_hidden_layers' {_AT_LEAST_1} 0"),
        (DENSE, {"hidden_size": 0}, f"field 'hidden_size' {_AT_LEAST_1} 0"),
        (DENSE, {"num_attention_heads": 0}, f"field 'num_attention_heads' {_AT_LEAST_1} 0"),
        (DENSE, {"num_key_value_heads": -2}, f"field 'num_key_value_heads' {_AT_LEAST_1} -2"),
        (DENSE, {"head_dim": 0}, f"field 'head_dim' {_AT_LEAST_1} 0"),
        (
            DENSE | {"hidden_size": 2},
            {},
            f"field 'head_dim' {_AT_LEAST_1} 0 (hidden_size // num_attention_heads)",
        ),
        (DENSE, {"intermediate_size": 0}, f"field 'intermediate_size' {_AT_LEAST_1} 0"),
        (DENSE, {"intermediate_size": None}, "required field 'intermediate_size' missing"),
        (DENSE, {"max_position_embeddings": 0}, f"'max_position_embeddings' {_AT_LEAST_1} 0"),
        (
            DENSE,
            {"num_attention_heads": 3, "num_key_value_heads": 5},
            "'num_attention_heads' 3 must be a multiple of 'num_key_value_heads' 5",
        ),
        (MOE, {"num_experts_per_tok": 0}, "'num_experts_per_tok' must be an integer in [1, "),
        (MOE, {"num_experts_per_tok": 5}, "in [1, num_experts 4], got 5"),
        (MOE, {"moe_intermediate_size": 0}, f"'moe_intermediate_size' {_AT_LEAST_1} 0"),
        (MOE, {"num_experts": -1}, "'num_experts' must be an integer >= 0 (0: dense), got -1"),
        (MOE, {"decoder_sparse_step": -2}, f"'decoder_sparse_step' {_AT_LEAST_1} -2"),
        (MOE, {"decoder_sparse_step": 2, "intermediate_size": 0}, "'intermediate_size' must"),
    ],
)
def test_a_size_out_of_range_names_file_field_value_and_range(base, change, message) -> None:
    cfg = {k: v for k, v in (base | change).items() if v is not None}
    with pytest.raises(ModelLoadError, match=re.escape(message)) as info:
        ModelConfig.from_dict(cfg, source="cfg.json")
    assert str(info.value).startswith("cfg.json: ")


def test_moe_without_dense_layers_needs_no_intermediate_size() -> None:
    cfg = {k: v for k, v in MOE.items() if k != "intermediate_size"}
    c = ModelConfig.from_dict(cfg)
    assert (c.num_experts, c.top_k, c.intermediate_size) == (4, 2, 0)
    assert ModelConfig.from_dict(MOE | {"num_experts_per_tok": 4}).top_k == 4  # top_k = E is fine


def test_a_bad_size_fails_from_the_directory_without_a_warning(tmp_path, caplog) -> None:
    # No weights at all: the refusal must come from config.json, before any tensor is read.
    (tmp_path / "config.json").write_text(json.dumps(DENSE | {"vocab_size": -5}))
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModelLoadError) as info:
            ModelConfig.from_pretrained(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / 'config.json'}: field 'vocab_size' must be an integer >= 1, got -5"
    )
    assert caplog.records == []


def test_moe_routing_fields_left_out_default_as_in_transformers() -> None:
    # Qwen3MoeConfig's defaults: a config.json without norm_topk_prob routes with the raw
    # softmax weights (not renormalised over the top k), every layer sparse.
    c = ModelConfig.from_dict(MOE)
    assert (c.norm_topk_prob, c.decoder_sparse_step, c.mlp_only_layers) == (False, 1, ())
    assert ModelConfig.from_dict(MOE | {"norm_topk_prob": True}).norm_topk_prob is True
