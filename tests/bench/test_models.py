"""execrt.bench.models: the benchmark model shapes."""

from __future__ import annotations

import pytest

from execrt.bench.models import MODELS, model_config


def test_a_named_shape_is_a_copy_cut_to_the_layers_asked() -> None:
    cfg = model_config("qwen3-0.6b", 2)
    assert cfg == MODELS["qwen3-0.6b"] | {"num_hidden_layers": 2}
    cfg["vocab_size"] = 1
    assert model_config("qwen3-0.6b") == MODELS["qwen3-0.6b"]  # the table is untouched


def test_a_custom_shape_wins_over_the_name_and_is_cut_too() -> None:
    custom = {"num_hidden_layers": 4, "vocab_size": 64}
    assert model_config("tiny", None, custom) == custom
    assert model_config("tiny", None, custom) is not custom
    assert model_config("tiny", 1, custom) == {"num_hidden_layers": 1, "vocab_size": 64}
    assert custom["num_hidden_layers"] == 4  # the caller's dict is untouched


def test_unknown_names_and_bad_layer_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="model 'tiny' unknown .*qwen3-0.6b"):
        model_config("tiny")
    with pytest.raises(ValueError, match="layers 0 must be >= 1"):
        model_config("qwen3-0.6b", 0)


def test_projection_shapes_are_the_weights_a_decode_step_streams() -> None:
    from execrt.bench.models import projection_shapes

    dense = projection_shapes("qwen3-0.6b")  # 16 / 8 heads of 128, hidden 1024, I 3072
    assert dense == {
        "qkv": (4096, 1024),
        "o": (1024, 2048),
        "lm_head": (151936, 1024),
        "down": (1024, 3072),
        "gate_up": (6144, 1024),
    }
    moe = projection_shapes("qwen3-30b-a3b")  # the experts are no skinny GEMM: the router is
    assert set(moe) == {"qkv", "o", "lm_head", "router"} and moe["router"] == (128, 2048)
