"""Benchmark model shapes, seeded random weights on the device, and the same weights in HF.

The random weights are defined in the Hugging Face checkpoint layout (fused expert tensors),
one seeded stream per tensor name, so the execrt model (through its own ``load_weights``) and
a transformers model built from the same config get bit-identical parameters without a
checkpoint on disk and without both models in memory at once.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from execrt.core.errors import ModelLoadError
from execrt.core.model_spec import ModelLoadRequest, ModelSpec
from execrt.kernels import use_triton
from execrt.models.config import ModelConfig
from execrt.models.decoder import DecoderForCausalLM
from execrt.models.loader import ARCHITECTURES, build_empty

INIT_STD = 0.02

_QWEN3_COMMON: dict[str, Any] = {
    "vocab_size": 151936,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "hidden_act": "silu",
    "eos_token_id": 151645,
}

#: ``--model`` name -> Hugging Face style config.json contents
MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _QWEN3_COMMON
    | {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "intermediate_size": 3072,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": _QWEN3_COMMON
    | {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": _QWEN3_COMMON
    | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
}


#: The shape of the ``--device cpu`` smoke runs (``bench prefix``, ``bench serve``): the whole
#: method in seconds, a check that it runs rather than a measurement. Labelled SMOKE_MODEL.
SMOKE_MODEL = "tiny"
SMOKE_SHAPE: dict[str, Any] = MODELS["qwen3-0.6b"] | {
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def model_config(
    name: str, layers: int | None = None, config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The config dict of benchmark model ``name``, or a copy of the custom shape ``config``
    (which ``name`` then only labels), cut to ``layers`` decoder layers."""
    if config:
        cfg = dict(config)
    elif name in MODELS:
        cfg = dict(MODELS[name])
    else:
        raise ValueError(f"bench models: model {name!r} unknown (known: {', '.join(MODELS)})")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"bench models: layers {layers} must be >= 1")
        cfg["num_hidden_layers"] = layers
    return cfg


# -- the weights, in checkpoint layout ----------------------------------------------------------
def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3 / Qwen3-MoE checkpoint of ``config``, experts fused."""
    c = config
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_q_heads * d, c.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        }
        if c.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if c.is_moe_layer(i):
            e, inter = c.num_experts, c.moe_intermediate_size
            shapes |= {
                p + "mlp.gate.weight": (e, h),
                p + "mlp.experts.gate_up_proj": (e, 2 * inter, h),
                p + "mlp.experts.down_proj": (e, h, inter),
            }
        else:
            inter = c.intermediate_size
            shapes |= {
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
    return shapes


def random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    """The value of checkpoint tensor ``name``: ones for norms, zeros for biases, else
    normal(0, 0.02) drawn on ``device`` from a generator seeded by (``seed``, ``name``)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # 32 bits of seed: CPU generators ignore the rest.
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=g)


def random_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint as a stream of (name, tensor), one tensor alive at a time."""
    for name, shape in checkpoint_shapes(config).items():
        yield name, random_tensor(name, shape, dtype, device, seed)


class RandomWeightsLoader:
    """A ``ModelLoader`` that builds the model on the device and fills it with seeded random
    weights (no checkpoint on disk)."""

    def __init__(self, config: dict[str, Any], seed: int = 0) -> None:
        self.config = ModelConfig.from_dict(config)
        self.raw = dict(config)
        self.seed = seed

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec()

    def load(self, request: ModelLoadRequest) -> DecoderForCausalLM:
        cls = ARCHITECTURES.get(self.config.architecture)
        if cls is None:
            raise ModelLoadError(
                f"random weights: architecture {self.config.architecture!r} unsupported "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        model = build_empty(
            cls,
            self.config,
            device=request.device,
            dtype=request.dtype,
            max_positions=request.max_positions,
            dispatcher=request.dispatcher,
            parallel=request.parallel,
        )
        with torch.no_grad():
            loaded = model.load_weights(
                random_weights(self.config, request.dtype, request.device, self.seed)
            )
        missing = sorted(model.expected_weights() - loaded)
        if missing:  # the shape table and the model disagree: a bug here, not a user error
            raise ModelLoadError(f"random weights: parameters left unfilled: {missing[:5]}")
        model.set_fused_kernels(use_triton(request.device, request.fused_kernels))
        return model.eval()


# -- the same weights in Hugging Face transformers ----------------------------------------------
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def build_hf_model(
    config: dict[str, Any], seed: int, device: torch.device | str, dtype: torch.dtype
) -> nn.Module:
    """The transformers model of ``config`` on ``device`` holding ``RandomWeightsLoader``'s
    weights. Fused (transformers 5) and per-expert (4.x) expert layouts are both filled."""
    import transformers

    mc = ModelConfig.from_dict(config)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    cls = getattr(transformers, mc.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(previous)
    fill_hf_model(model, mc, seed)
    return model.eval()


def fill_hf_model(model: nn.Module, config: ModelConfig, seed: int) -> None:
    """Overwrite every parameter of ``model`` with the random checkpoint's tensor."""
    shapes = checkpoint_shapes(config)
    fused: dict[str, torch.Tensor] = {}  # one layer's fused experts, for per-expert layouts
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in shapes:
                value = random_tensor(name, shapes[name], param.dtype, param.device, seed)
            elif match := _PER_EXPERT.fullmatch(name):
                block, expert, proj = match.group(1), int(match.group(2)), match.group(3)
                key = f"{block}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
                if key not in fused:
                    if not any(k.startswith(block + ".") for k in fused):
                        fused = {}  # a new layer: drop the previous one's tensors
                    fused[key] = random_tensor(key, shapes[key], param.dtype, param.device, seed)
                inter = config.moe_intermediate_size
                rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}
                value = fused[key][expert][rows.get(proj, slice(None))]
            else:
                raise ModelLoadError(f"random weights: HF parameter {name!r} has no value")
            if value.shape != param.shape:
                raise ModelLoadError(
                    f"random weights: HF parameter {name!r} has shape {tuple(param.shape)}, "
                    f"the checkpoint {tuple(value.shape)}"
                )
            param.copy_(value)


# -- the bytes one decode step must read -----------------------------------------------------------
def projection_shapes(model: str) -> dict[str, tuple[int, int]]:
    """The decode-size projections of a benchmark model (``MODELS``), name -> (N, K) of its
    weight: ``qkv``, ``o``, ``lm_head``, then ``router`` (a MoE model, whose experts are no
    such projection) or ``down`` and ``gate_up`` (N = 2I)."""
    c = MODELS[model]
    h, d = c["hidden_size"], c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
    shapes = {"qkv": ((hq + 2 * hkv) * d, h), "o": (h, hq * d), "lm_head": (c["vocab_size"], h)}
    if c.get("num_experts"):
        return shapes | {"router": (c["num_experts"], h)}
    inter = c["intermediate_size"]
    return shapes | {"down": (h, inter), "gate_up": (2 * inter, h)}


def expected_experts_touched(num_experts: int, top_k: int, batch_size: int) -> float:
    """Distinct experts a layer reads for ``batch_size`` tokens under uniform routing:
    E·(1 − (1 − K/E)^bs)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch_size)


def weight_bytes_per_step(config: ModelConfig, batch_size: int, dtype_bytes: int = 2) -> float:
    """Weight bytes one decode step reads: every linear layer and the LM head once; for MoE
    layers only the experts touched (expected, uniform routing). Norm vectors, biases and the
    embedding rows gathered are negligible and not counted."""
    total = 0.0
    for name, shape in checkpoint_shapes(config).items():
        # A tied embedding is the LM head's matrix, read in full every step; an untied one is
        # only gathered (bs rows).
        embedding = name == "model.embed_tokens.weight"
        if len(shape) < 2 or (embedding and not config.tie_word_embeddings):
            continue
        n = float(math.prod(shape))
        if ".mlp.experts." in name:
            n *= expected_experts_touched(config.num_experts, config.top_k, batch_size)
            n /= config.num_experts
        total += n * dtype_bytes
    return total


def kv_bytes_per_step(
    config: ModelConfig, batch_size: int, ctx: float, dtype_bytes: int = 2
) -> float:
    """K and V bytes the attention of one decode step reads: bs × ctx × layers × 2 × Hkv × D
    (``ctx``: the tokens each request's step reads, a mean over steps possibly)."""
    c = config
    return batch_size * ctx * c.num_layers * 2 * c.num_kv_heads * c.head_dim * dtype_bytes


# -- the FLOPs one prefill must do ---------------------------------------------------------------
def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """FLOPs of prefilling one prompt of ``tokens`` from scratch: 2 per weight of every layer's
    linear maps per token (MoE: the router and ``top_k`` experts), the causal attention (two
    GEMMs over the visible (query, key) pairs), and the LM head for the last token only."""
    from execrt.bench.extend import causal_flops

    per_token = 0.0
    for name, shape in checkpoint_shapes(config).items():
        if not name.startswith("model.layers.") or len(shape) < 2:
            continue
        n = float(math.prod(shape))
        if ".mlp.experts." in name:
            n *= config.top_k / config.num_experts
        per_token += 2 * n
    attention = config.num_layers * causal_flops(1, tokens, 0, config.num_q_heads, config.head_dim)
    return per_token * tokens + attention + 2.0 * config.vocab_size * config.hidden_size
