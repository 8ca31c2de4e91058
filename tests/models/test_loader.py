"""Checkpoint loading: formats, sharding, refusals and precise errors."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from execrt.core.errors import ModelLoadError
from execrt.models import ModelConfig, load_model
from execrt.models.loader import checkpoint_files, iter_weights


def _load(path: str):
    cfg = ModelConfig.from_pretrained(path)
    return load_model(
        path,
        cfg,
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_positions=64,
        dispatcher=None,
    )


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_sharded_checkpoint_is_read_through_its_index(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-untied-hd128-sharded"), tmp_path / "m")
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as fh:
        listed = sorted(set(json.load(fh)["weight_map"].values()))
    # A stray file beside the shards (an old export, a partial download) must not be read:
    # its tensor would shadow the real one and its garbage shape would fail the load.
    stray = os.path.join(path, "zz-stray.safetensors")
    save_file({"model.norm.weight": torch.zeros(7)}, stray)
    files = checkpoint_files(path)
    assert len(listed) > 1 and [os.path.basename(f) for f in files] == listed
    model = _load(path)
    reference = _load(checkpoint("dense-untied-hd128-sharded"))
    assert torch.equal(model.model.norm.weight, reference.model.norm.weight)


def _drop(path: str, names: list[str]) -> None:
    """Delete tensors ``names`` from the checkpoint's one safetensors file."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in names:
        del tensors[name]
    save_file(tensors, file)


def test_missing_tensor_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    _drop(path, ["model.layers.1.self_attn.k_norm.weight"])
    with pytest.raises(
        ModelLoadError, match="lacks tensor.*model.layers.1.self_attn.k_norm.weight"
    ):
        _load(path)


def test_a_tied_config_with_a_stored_head_loads_as_transformers_loads_it(
    checkpoint, tmp_path, caplog
) -> None:
    """tie_word_embeddings true, yet lm_head.weight stored: a head that differs from the
    embedding is used untied (as transformers 5 does; it was dropped, every logit wrong), one
    stored alone fills the embedding too (that load was refused), an equal one keeps the tie."""
    from transformers import AutoModelForCausalLM

    embed_name = "model.embed_tokens.weight"
    cases = {"distinct": lambda t: t[embed_name] * 0.5 + 0.01, "equal": lambda t: t[embed_name]}
    for case in (*cases, "alone"):
        path = _copy(checkpoint("dense-tied-hd64"), tmp_path / case)
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        if case == "alone":
            tensors["lm_head.weight"] = tensors.pop(embed_name)
        else:
            tensors["lm_head.weight"] = cases[case](tensors).clone()
        save_file(tensors, file)
        with caplog.at_level("WARNING"):
            ours = _load(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert torch.equal(ours.lm_head.weight, hf.lm_head.weight), case
        assert torch.equal(ours.model.embed_tokens.weight, hf.model.embed_tokens.weight), case
        tied = ours.lm_head.weight is ours.model.embed_tokens.weight
        assert tied == (case != "distinct"), case
        assert ("the stored head is used, untied" in caplog.text) == (case == "distinct"), case
        caplog.clear()


def _moe_load(path: str, experts: int = 8, top_k: int = 2):  # type: ignore[no-untyped-def]
    from execrt.backends.moe_dispatch.allreduce import AllReduceDispatcher
    from execrt.core.context import RuntimeContext
    from execrt.core.interfaces import MoEDispatcherInit
    from execrt.core.parallel import ParallelState
    from execrt.plugins.builtin import ALLREDUCE_DISPATCH

    cfg = ModelConfig.from_pretrained(path)
    init = MoEDispatcherInit(
        ALLREDUCE_DISPATCH,
        experts,
        top_k,
        cfg.hidden_size,
        torch.float32,
        torch.device("cpu"),
        16,
        ParallelState(),
        RuntimeContext(),
    )
    kwargs = dict(device=torch.device("cpu"), dtype=torch.float32, max_positions=64)
    return load_model(path, cfg, dispatcher=AllReduceDispatcher(init), **kwargs)


def _fused_expert_copy(src: str, dst) -> str:  # type: ignore[no-untyped-def]
    """A copy of the 2-layer, 8-expert checkpoint ``src`` in transformers 5's fused expert
    layout: ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]."""
    path = _copy(src, dst)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = [
            torch.cat(
                [tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")]
            )
            for e in range(8)
        ]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)]
        tensors[p + "gate_up_proj"] = torch.stack(gate_up)
        tensors[p + "down_proj"] = torch.stack(down)
    save_file(tensors, file)
    return path


def _lacks(names: list[str]) -> str:
    return "lacks tensor\\(s\\) " + re.escape(", ".join(names)) + "$"


@pytest.mark.parametrize(
    "deleted",
    [
        ["model.layers.1.self_attn.k_proj.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"],
        ["model.layers.0.mlp.up_proj.weight"],
    ],
)
def test_a_missing_part_of_a_fused_projection_is_named_as_the_checkpoint_names_it(
    checkpoint, tmp_path, deleted
) -> None:
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    _drop(path, deleted)
    with pytest.raises(ModelLoadError, match=_lacks(deleted)):
        _load(path)


def test_a_missing_expert_tensor_is_named_in_the_checkpoints_layout(checkpoint, tmp_path) -> None:
    per_expert = _copy(checkpoint("moe-8x2"), tmp_path / "hub")
    _drop(per_expert, ["model.layers.1.mlp.experts.5.up_proj.weight"])
    with pytest.raises(
        ModelLoadError, match=_lacks(["model.layers.1.mlp.experts.5.up_proj.weight"])
    ):
        _moe_load(per_expert)

    fused = _fused_expert_copy(checkpoint("moe-8x2"), tmp_path / "fused")
    _drop(fused, ["model.layers.1.mlp.experts.down_proj"])
    with pytest.raises(ModelLoadError, match=_lacks(["model.layers.1.mlp.experts.down_proj"])):
        _moe_load(fused)


def test_misshaped_tensor_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \(3, 3\)"
    ):
        _load(path)


def _add(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``tensors`` to the checkpoint's one safetensors file."""
    file = os.path.join(path, "model.safetensors")
    save_file(load_file(file) | tensors, file)


@pytest.mark.parametrize(
    "k_name, v_name",
    [
        ("self_attn.k_scale", "self_attn.v_scale"),  # llm-compressor
        ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),  # ModelOpt
        ("self_attn.kv_scale", None),  # the older single scale, for K and V
    ],
    ids=["self_attn", "k_proj-v_proj", "kv_scale"],
)
def test_kv_cache_scales_are_read_under_each_checkpoint_name(
    checkpoint, tmp_path, caplog, k_name: str, v_name: str | None
) -> None:
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    scales = {f"model.layers.1.{k_name}": torch.tensor(0.5)}  # layer 0 has none: 1.0
    if v_name is not None:
        scales[f"model.layers.1.{v_name}"] = torch.tensor([3.0])  # [1] as well as []
    _add(path, scales)
    with caplog.at_level("WARNING"):
        model = _load(path)
    assert not [r for r in caplog.records if "unexpected" in r.getMessage()]
    got = model.kv_scales()
    assert got is not None
    assert got.k == (1.0, 0.5) and got.v == (1.0, 3.0 if v_name else 0.5)
    reference = _load(checkpoint("dense-tied-hd64"))  # the weights are untouched by them
    assert reference.kv_scales() is None
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_a_kv_cache_scale_must_be_one_value(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    _add(path, {"model.layers.0.self_attn.k_scale": torch.ones(2)})  # per head: unsupported
    with pytest.raises(ModelLoadError, match=r"k_scale' has shape \(2,\); KV cache scales"):
        _load(path)


def test_pickle_checkpoints_are_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ModelLoadError, match="refuses to load"):
        checkpoint_files(tmp_path)


def test_missing_shard_and_unknown_architecture(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-untied-hd128-sharded"), tmp_path / "m")
    shard = checkpoint_files(path)[0]
    os.remove(shard)
    with pytest.raises(ModelLoadError, match="shard.*missing"):
        checkpoint_files(path)
    other = _copy(checkpoint("dense-tied-hd64"), tmp_path / "gemma")
    cfg = json.loads(open(os.path.join(other, "config.json")).read())
    cfg["architectures"] = ["GemmaForCausalLM"]
    with open(os.path.join(other, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    with pytest.raises(ModelLoadError, match="architecture 'GemmaForCausalLM' unsupported"):
        _load(other)


#: the smallest config.json ModelConfig accepts (a base for refusal tests)
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 8,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def test_unsupported_config_features_are_refused() -> None:
    base = TINY_QWEN3
    refused = {
        "rope_type 'longrope' unsupported": {"rope_scaling": {"rope_type": "longrope"}},
        "cfg.json rope_scaling: required field 'factor' missing": {
            "rope_scaling": {"rope_type": "yarn"}
        },
        "field 'factor' must be >= 1 for yarn, got 0.5": {
            "rope_scaling": {"rope_type": "yarn", "factor": 0.5}
        },
        "field 'attention_factor' must be > 0, got -1.0": {
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "attention_factor": -1.0}
        },
        "field 'beta_fast' must be a number, got 'x'": {
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": "x"}
        },
        "rope_type 'dynamic' unsupported": {"rope_parameters": {"rope_type": "dynamic"}},
        # beside default rope_parameters, a legacy rope_scaling is what transformers reads
        "rope_type 'dynamic'": {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
        },
        "sliding_window 4096, from layer 0 (max_window_layers)": {
            "use_sliding_window": True,
            "sliding_window": 4096,
            "max_window_layers": 0,
        },
        "sliding_window 64)": {  # Qwen3-MoE slides it in every layer, whatever layer_types says
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 8,
            "use_sliding_window": True,
            "sliding_window": 64,
            "layer_types": ["full_attention"],
        },
        "field 'original_max_position_embeddings' must be >= 1, got 0": {
            "original_max_position_embeddings": 0,
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0},
        },
        "no 'architectures' field, and model_type 'gpt2' is not one execrt knows": {
            "architectures": None,
            "model_type": "gpt2",
        },
        "layer type 'sliding_attention'": {"layer_types": ["sliding_attention"]},
        "hidden_act 'gelu' unsupported": {"hidden_act": "gelu"},
        "partial_rotary_factor 0.5 unsupported": {"partial_rotary_factor": 0.5},
        "architecture 'GPT2LMHeadModel' unsupported": {"architectures": ["GPT2LMHeadModel"]},
        "mlp_bias true unsupported": {"architectures": ["Qwen2ForCausalLM"], "mlp_bias": True},
        "'vocab_size' missing": {"vocab_size": None},
        "field 'num_hidden_layers' must be an integer, got 'four'": {"num_hidden_layers": "four"},
        "field 'rms_norm_eps' must be a number, got '1e-6'": {"rms_norm_eps": "1e-6"},
        "field 'tie_word_embeddings' must be true or false, got 1": {"tie_word_embeddings": 1},
        "field 'eos_token_id' must be an integer or a list": {"eos_token_id": ["2"]},
        "rope_scaling: required field 'factor' missing": {"rope_scaling": {"type": "linear"}},
    }
    for message, change in refused.items():
        with pytest.raises(ModelLoadError, match=re.escape(message)):
            raw = {k: v for k, v in (base | change).items() if v is not None or k == "vocab_size"}
            ModelConfig.from_dict(raw, source="cfg.json")
    # Qwen2 configs carry a sliding_window that is off: that is fine.
    qwen2 = base | {
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": False,
        "sliding_window": 4096,
    }
    assert ModelConfig.from_dict(qwen2).attention_bias is True


def test_configs_transformers_loads_the_same_way() -> None:
    """Fields whose absence or place transformers reads its own way (each was a refusal or a
    wrong shape here): no ``architectures`` (the model_type's), Qwen3 without ``head_dim``
    (Qwen3Config's 128, where Llama's is hidden / heads), and Qwen2/Qwen3's
    ``use_sliding_window`` where ``max_window_layers`` leaves the window no layer."""
    bare = {k: v for k, v in TINY_QWEN3.items() if k != "architectures"}
    for model_type, arch in (("qwen3", "Qwen3ForCausalLM"), ("llama", "LlamaForCausalLM")):
        config = ModelConfig.from_dict(bare | {"model_type": model_type})
        assert config.architecture == arch
    assert ModelConfig.from_dict(TINY_QWEN3).head_dim == 128
    llama = TINY_QWEN3 | {"architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_dict(llama).head_dim == 4
    window = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 28}
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        cfg = TINY_QWEN3 | window | {"architectures": [arch]}
        assert ModelConfig.from_dict(cfg).num_layers == 1  # the window is in no layer
        listed = cfg | {"max_window_layers": 0, "layer_types": ["full_attention"]}
        assert ModelConfig.from_dict(listed).num_layers == 1  # layer_types decides


def _llama_1024(scaling: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """A Llama config.json of 8 heads of 128 with ``scaling`` as its rope_scaling."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 1024,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "rope_theta": 500000.0,
        "max_position_embeddings": max_positions,
        "rope_scaling": dict(scaling),
    }


def test_rope_original_context_is_read_where_transformers_reads_it() -> None:
    """A top-level ``original_max_position_embeddings`` (Phi-3's and DeepSeek's layout) wins
    over the rope settings' copy, as transformers reads it."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from execrt.models.layers import rope_inv_freq

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cases = [
        (llama3, {"original_max_position_embeddings": 8192}, 8192),
        (
            llama3 | {"original_max_position_embeddings": 2048},
            {"original_max_position_embeddings": 8192},
            8192,
        ),
        ({"rope_type": "yarn", "factor": 4.0}, {"original_max_position_embeddings": 4096}, 4096),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, {}, 1024),
    ]
    for scaling, top, original in cases:
        raw = _llama_1024(scaling, 32768) | top
        ours = ModelConfig.from_dict(raw)
        assert ours.rope_scaling is not None
        assert ours.rope_scaling.original_max_position_embeddings == original, (scaling, top)
        hf_cfg = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        kind = hf_cfg.rope_parameters["rope_type"]
        ref, attention = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
        got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
        assert torch.allclose(got, ref.float(), rtol=1e-6, atol=0), (scaling, top)
        assert ours.rope_scaling.attention_factor == pytest.approx(attention, rel=1e-12)


def test_a_mistral_context_is_limited_to_its_sliding_window(caplog) -> None:
    """Mistral's sliding_window bounds every layer; within the window sliding-window attention
    is full attention, so the context is cut to it (with a warning) rather than refused."""
    base = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 32768,
        "attention_bias": True,  # no such bias in Mistral's layers: ignored, as transformers does
    }
    with caplog.at_level("WARNING"):
        windowed = ModelConfig.from_dict(base | {"sliding_window": 4096}, source="m.json")
    assert windowed.max_position_embeddings == 4096
    assert "m.json: sliding_window 4096: context limited to 4096 tokens" in caplog.text
    assert not windowed.attention_bias and not windowed.o_proj_bias
    for unlimited in ({"sliding_window": None}, {"sliding_window": 32768}):
        assert ModelConfig.from_dict(base | unlimited).max_position_embeddings == 32768
    # Left out, it is MistralConfig's default window, as transformers reads it.
    assert ModelConfig.from_dict(base).max_position_embeddings == 4096
    with pytest.raises(ModelLoadError, match="sliding_window must be >= 1 or null, got 0"):
        ModelConfig.from_dict(base | {"sliding_window": 0})


def test_a_prompt_past_mistrals_window_is_refused_by_length(checkpoint, plugin_host) -> None:
    from execrt.core.schedule import SamplingParams
    from execrt.engine import Engine

    with Engine(checkpoint("mistral-swa32"), device="cpu", plugin_host=plugin_host) as engine:
        long, short = engine.generate(
            [list(range(2, 42)), [5, 6, 7]], SamplingParams(max_new_tokens=40, temperature=0)
        )
    assert long.finish_reason == "error" and "context of 32" in (long.error or "")
    assert short.error is None and len(short.token_ids) == 32 - 3  # cut at the window


def test_rope_scaling_frequencies_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from execrt.models.layers import rope_inv_freq

    cases = [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"type": "linear", "factor": 4.0},
        # YaRN as Qwen3 documents it; DeepSeek's mscale pair; explicit attention factor, betas
        # and no rounding of the band
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "attention_factor": 1.25,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
    ]
    for scaling in cases:
        raw = _llama_1024(scaling, 131072)
        ours = ModelConfig.from_dict(raw)
        assert ours.rope_scaling is not None and ours.head_dim == 128
        hf_cfg = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        kind = hf_cfg.rope_parameters["rope_type"]
        ref, attention = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
        got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
        assert torch.allclose(got, ref.float(), rtol=1e-6, atol=0), scaling
        assert ours.rope_scaling.attention_factor == pytest.approx(attention, rel=1e-12), scaling
        if kind == "yarn":  # the context: the original one times the factor
            want = int(scaling["original_max_position_embeddings"] * scaling["factor"])
            assert ours.max_position_embeddings == max(131072, want), scaling
            assert not torch.equal(got, rope_inv_freq(128, 500000.0, None))  # it scales
        plain = rope_inv_freq(128, 500000.0, None)
        assert not torch.allclose(got, plain)  # the scaling did something


def test_broken_files_are_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    data = open(weights, "rb").read()
    for content in (data[: len(data) // 2], b"", data[:5]):
        with open(weights, "wb") as fh:
            fh.write(content)
        with pytest.raises(ModelLoadError, match=r"model\.safetensors is not a readable"):
            _load(path)
    with open(weights, "wb") as fh:
        fh.write(data)
    _load(path)  # intact again

    config = os.path.join(path, "config.json")
    good = open(config).read()
    for content, message in [
        ("{not json", "config.json is not valid JSON"),
        ("[1, 2]", "config.json: must be a JSON object, got list"),
        (
            good.replace('"num_hidden_layers": 2', '"num_hidden_layers": "four"'),
            "config.json: field 'num_hidden_layers' must be an integer, got 'four'",
        ),
    ]:
        with open(config, "w") as fh:
            fh.write(content)
        with pytest.raises(ModelLoadError, match=re.escape(message)):
            ModelConfig.from_pretrained(path)
    with open(config, "w") as fh:
        fh.write(good)

    sharded = _copy(checkpoint("dense-untied-hd128-sharded"), tmp_path / "s")
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as fh:
        fh.write("{oops")
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json is not valid JSON"):
        checkpoint_files(sharded)

    from execrt.models.tokenizer import load_tokenizer

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelLoadError, match="tokenizer.json is not a valid tokenizer.json"):
        load_tokenizer(str(tmp_path / "t"))


def test_generation_config_eos_ids_are_merged(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": [7, 1, 9]}, fh)
    assert ModelConfig.from_pretrained(path).eos_token_ids == (1, 7, 9)
    assert ModelConfig.from_pretrained(path).sampling_defaults == ()


def test_generation_config_sampling_settings_become_the_model_s_defaults(
    checkpoint, tmp_path, caplog
) -> None:
    """Qwen3's recommendation as its generation_config.json states it; a value SamplingParams
    refuses is dropped with a warning naming it (every request would fail with it)."""
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    gen = {"do_sample": True, "temperature": 0.6, "top_k": 20.0, "top_p": 0.95, "min_p": 1.5}
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump(gen | {"repetition_penalty": 1.05, "max_new_tokens": 99}, fh)
    with caplog.at_level("WARNING"):
        config = ModelConfig.from_pretrained(path)
    assert config.sampling_defaults == (
        ("temperature", 0.6), ("top_p", 0.95), ("top_k", 20), ("repetition_penalty", 1.05),
    )  # fmt: skip
    assert isinstance(dict(config.sampling_defaults)["top_k"], int)
    assert "min_p 1.5 ignored" in caplog.text


def test_a_damaged_builtin_checkpoint_is_regenerated() -> None:
    from execrt.models.builtin import builtin_model_path

    path = builtin_model_path()
    weights = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as fh:
        fh.truncate(size // 3)
    assert builtin_model_path() == path and os.path.getsize(weights) == size
    assert len(list(iter_weights(checkpoint_files(path)))) > 10


def test_fused_expert_layout_loads_like_the_hub_layout(checkpoint, tmp_path) -> None:
    hub = checkpoint("moe-8x2")
    fused = _fused_expert_copy(hub, tmp_path / "fused")
    a = _moe_load(hub).state_dict()
    b = _moe_load(fused).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
