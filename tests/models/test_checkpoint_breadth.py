"""Checkpoints beyond the parity set: config.json as transformers 4.x wrote it, fields left out
or null, and families that ignore a field another family reads, each loaded as transformers
loads it."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch

from execrt.core.errors import ModelLoadError
from execrt.models import ModelConfig
from execrt.models.layers import rope_inv_freq
from tests.drivers import hf_trace_errors, make_worker, prefill_then_decode

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [50, 3, 77], [9] * 11 + [60, 61]]
MAX_REL_ERR = 1e-4
#: the smallest config each family's config class accepts (a base for config-only tests)
SMALL = {
    "vocab_size": 16,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
FAMILIES = {
    "LlamaForCausalLM": ("llama", "LlamaConfig", {}),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2Config", {}),
    "MistralForCausalLM": ("mistral", "MistralConfig", {}),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3Config", {}),
    "Qwen3MoeForCausalLM": (
        "qwen3_moe",
        "Qwen3MoeConfig",
        {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8},
    ),
}


def _config_json(arch: str, **change: Any) -> dict[str, Any]:
    model_type, _, moe = FAMILIES[arch]
    cfg = {"architectures": [arch], "model_type": model_type} | SMALL | moe | change
    return {k: v for k, v in cfg.items() if v is not None}


def _hf_config(tmp_path, cfg: dict[str, Any]) -> Any:
    """transformers' reading of ``cfg`` as a checkpoint's config.json."""
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.from_pretrained(folder)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_a_config_without_max_position_embeddings_reads_the_config_class_default(
    arch: str, tmp_path
) -> None:
    """The context, and the original context of a llama3 rope that names none, are the config
    class's default (Llama 2048, Qwen 32768, Mistral 131072), not one execrt picks."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = _config_json(arch, rope_scaling=llama3)
    hf = _hf_config(tmp_path, cfg)
    ours = ModelConfig.from_dict(cfg)
    # Mistral's context is further cut to its sliding window (MistralConfig's 4096 when left out).
    window = getattr(hf, "sliding_window", None) if arch == "MistralForCausalLM" else None
    assert ours.max_position_embeddings == min(hf.max_position_embeddings, window or 1 << 30)
    assert ours.rope_scaling is not None
    assert ours.rope_scaling.original_max_position_embeddings == hf.max_position_embeddings
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    assert torch.allclose(got, ref.float(), rtol=1e-6, atol=0)


def test_fields_transformers_reads_as_not_set_or_as_silu_load() -> None:
    """A null ``partial_rotary_factor`` is no partial rotary (transformers skips a None), and
    ``swish`` is transformers' other name for SiLU; a real partial factor is still refused."""
    for change in ({"partial_rotary_factor": None}, {"hidden_act": "swish"}):
        cfg = _config_json("LlamaForCausalLM") | change
        assert ModelConfig.from_dict(cfg).head_dim == 32
    nested = _config_json("Qwen3ForCausalLM", rope_parameters={"partial_rotary_factor": None})
    assert ModelConfig.from_dict(nested).rope_scaling is None
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0\.5 unsupported"):
        ModelConfig.from_dict(_config_json("LlamaForCausalLM", partial_rotary_factor=0.5))
    with pytest.raises(ModelLoadError, match=r"hidden_act 'gelu' unsupported \(supported: silu"):
        ModelConfig.from_dict(_config_json("LlamaForCausalLM", hidden_act="gelu"))


def test_use_sliding_window_is_read_only_by_the_families_whose_config_has_it(caplog) -> None:
    """Llama's config class ignores ``use_sliding_window`` (full attention), Mistral's slides
    ``sliding_window`` whatever it says (the context is cut to the window); Qwen2, Qwen3 and
    Qwen3-MoE slide it where it is on, which is refused."""
    window = {"use_sliding_window": True, "sliding_window": 64, "max_position_embeddings": 512}
    llama = ModelConfig.from_dict(_config_json("LlamaForCausalLM", **window))
    assert llama.max_position_embeddings == 512
    with caplog.at_level("WARNING"):
        mistral = ModelConfig.from_dict(_config_json("MistralForCausalLM", **window))
    assert mistral.max_position_embeddings == 64
    assert "sliding_window 64: context limited to 64 tokens" in caplog.text
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        with pytest.raises(ModelLoadError, match="sliding-window attention unsupported"):
            ModelConfig.from_dict(_config_json(arch, max_window_layers=0, **window))


# -- end to end: saved by transformers, compared with transformers loading the same folder ------


def _legacy(path: str) -> None:
    """Rewrite config.json as transformers 4.x wrote it (most checkpoints on the Hub): a
    top-level rope_theta, ``rope_scaling`` with the old ``type`` key, ``torch_dtype``, and
    Qwen3-MoE's ``num_experts``."""
    file = os.path.join(path, "config.json")
    with open(file) as fh:
        cfg = json.load(fh)
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    kind = rope.pop("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind} | rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    if cfg["model_type"] == "qwen3_moe":
        cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg.pop("layer_types", None)
    with open(file, "w") as fh:
        json.dump(cfg, fh)


_DENSE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # 14 query heads over 2 kv heads (7 per group), head_dim 16 where hidden / heads is 8
    "llama-gqa7-legacy-llama3": (
        "Llama",
        _DENSE
        | dict(
            hidden_size=112,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        {"legacy": True},
    ),
    "llama-swish-tied-mqa": (
        "Llama",
        _DENSE | dict(num_key_value_heads=1, hidden_act="swish", tie_word_embeddings=True),
        {},
    ),
    "qwen2-yarn-legacy-bf16-sharded": (
        "Qwen2",
        _DENSE
        | dict(
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        {"legacy": True, "dtype": torch.bfloat16, "max_shard_size": "40KB"},
    ),
    # head_dim 32 where hidden / heads is 16, attention biases, no renormalised top-k, a dense
    # layer between sparse ones
    "qwen3moe-hd32-bias-legacy": (
        "Qwen3Moe",
        _DENSE
        | dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=32,
            attention_bias=True,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
        {"legacy": True},
    ),
}


def _build(name: str, folder: str) -> str:
    family, kwargs, how = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    common = dict(vocab_size=128, max_position_embeddings=256, eos_token_id=1, bos_token_id=0)
    config = getattr(transformers, f"{family}Config")(**(common | kwargs))
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():  # far from ties; norms and biases away from their 1 / 0 init
        for pname, p in model.named_parameters():
            if p.dim() >= 2 or pname.endswith(".bias"):
                p.normal_(0.0, 0.08)
            else:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.to(how.get("dtype", torch.float32)).save_pretrained(
        folder, **({"max_shard_size": how["max_shard_size"]} if "max_shard_size" in how else {})
    )
    if how.get("legacy"):
        _legacy(folder)
    return folder


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers_loading_the_same_folder(
    name: str, tmp_path, plugin_host, runtime_context
) -> None:
    path = _build(name, str(tmp_path / name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worker = make_worker(path, runtime_context, plugin_host, dtype="float32")
    trace = prefill_then_decode(worker, PROMPTS, steps=3, full_logits=True)
    worker.close()
    errors = hf_trace_errors(hf, PROMPTS, trace)
    assert len(errors) == len(PROMPTS) * 4
    assert max(errors) <= MAX_REL_ERR, f"max relative error {max(errors):.2e}"
