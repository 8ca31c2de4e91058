"""ModelConfig: the fields of a Hugging Face config.json (or GGUF metadata) that execrt reads."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from execrt.core.errors import ModelLoadError
from execrt.core.model_spec import ModelSpec
from execrt.models.quantized import WeightQuant, parse_quantization

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MISSING = object()


@dataclass(frozen=True)
class Family:
    """What one architecture changes in the shared decoder."""

    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    qkv_bias: bool | None = None  # None: from the config's ``attention_bias``
    o_bias: bool | None = None  # None: from the config's ``attention_bias``
    mlp_bias: bool = False  # whether the config's ``mlp_bias`` is honoured (else it must be false)
    moe: bool = False
    #: the config's ``sliding_window`` (when not null) bounds every layer's attention span
    #: (Mistral); execrt attends in full, so the context is limited to the window instead
    sliding_window: bool = False
    #: ``head_dim`` when config.json leaves it out (Qwen3Config's 128); None: hidden / heads
    head_dim: int | None = None
    #: ``use_sliding_window`` applies to layers from ``max_window_layers`` on (Qwen2, Qwen3),
    #: unless ``layer_types`` lists them; False: to every layer
    window_layers: bool = False
    #: the config's ``use_sliding_window`` turns sliding-window attention on (Qwen2, Qwen3,
    #: Qwen3-MoE); the other families' config classes ignore the field
    use_sliding_window: bool = False
    #: ``max_position_embeddings`` when config.json leaves it out (the config class's default,
    #: which is also the original context of a ``llama3`` or ``yarn`` rope that names none)
    max_positions: int = 2048


#: Hugging Face ``architectures`` value -> how the decoder is configured for it
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(mlp_bias=True),
    "Qwen2ForCausalLM": Family(
        qkv_bias=True,
        o_bias=False,
        window_layers=True,
        use_sliding_window=True,
        max_positions=32768,
    ),
    "MistralForCausalLM": Family(
        qkv_bias=False, o_bias=False, sliding_window=True, max_positions=131072
    ),
    "Qwen3ForCausalLM": Family(
        qk_norm=True, head_dim=128, window_layers=True, use_sliding_window=True, max_positions=32768
    ),
    "Qwen3MoeForCausalLM": Family(
        qk_norm=True, moe=True, use_sliding_window=True, max_positions=32768
    ),
}
#: config.json ``model_type`` -> architecture, for a config without ``architectures`` (which
#: transformers then loads by its model_type)
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``linear`` divides every frequency by ``factor``; ``llama3``
    divides the low frequencies, keeps the high ones and interpolates in between; ``yarn``
    (the YaRN paper's "NTK-by-parts") keeps the dimensions that turn more than ``beta_fast``
    times over the original context, divides those that turn fewer than ``beta_slow`` times
    by ``factor``, blends linearly in between, and scales cos and sin by
    ``attention_factor``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: the blend's bounds rounded out to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters. MoE fields are zero for dense models."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = True
    rope_scaling: RopeScaling | None = None
    dtype: torch.dtype = torch.bfloat16
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    #: generation_config.json's sampling settings as SamplingParams keywords (the model
    #: creator's recommendation, e.g. Qwen3's temperature 0.6, top_p 0.95, top_k 20): what
    #: ``execrt serve`` applies to the fields a request leaves out (``--generation-config``)
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    #: how the checkpoint stores its linear weights (None: as they are; see models/quantized)
    quantization: WeightQuant | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def spec(self) -> ModelSpec:
        """The shapes the core sizes its pools and backends by."""
        return ModelSpec(
            architecture=self.architecture,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            dtype=self.dtype,
            num_experts=self.num_experts,
            top_k=self.top_k,
            eos_token_ids=self.eos_token_ids,
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.is_moe
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, cfg: Any, source: str = "model config") -> ModelConfig:
        """Validate a config.json dict. Errors name ``source`` and the offending field."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source}: must be a JSON object, got {type(cfg).__name__}")
        r = _Reader(cfg, source)
        arch = _architecture(r)
        family = FAMILIES[arch]
        _refuse_unsupported_math(r, family)
        heads = r.get_int("num_attention_heads")
        hidden = r.get_int("hidden_size")
        attention_bias = r.get_bool("attention_bias", False)
        num_experts = r.get_int("num_experts", 0) or r.get_int("num_local_experts", 0)
        if num_experts and not family.moe:
            raise ModelLoadError(f"{source}: {arch} with num_experts {num_experts} unsupported")
        config = cls(
            architecture=arch,
            vocab_size=r.get_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.get_int("intermediate_size", 0),
            num_layers=r.get_int("num_hidden_layers"),
            num_q_heads=heads,
            num_kv_heads=r.get_int("num_key_value_heads", heads),
            head_dim=r.get_int("head_dim", family.head_dim or (hidden // heads if heads else 0)),
            rms_norm_eps=r.get_float("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(r),
            max_position_embeddings=r.get_int("max_position_embeddings", family.max_positions),
            tie_word_embeddings=r.get_bool("tie_word_embeddings", False),
            attention_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_proj_bias=attention_bias if family.o_bias is None else family.o_bias,
            mlp_bias=family.mlp_bias and r.get_bool("mlp_bias", False),
            qk_norm=family.qk_norm,
            rope_scaling=_rope_scaling(r, family),
            dtype=_DTYPES.get(
                str(cfg.get("dtype") or cfg.get("torch_dtype") or "").replace("torch.", ""),
                torch.bfloat16,
            ),
            eos_token_ids=r.int_list("eos_token_id"),
            num_experts=num_experts,
            top_k=r.get_int("num_experts_per_tok", 0),
            moe_intermediate_size=r.get_int("moe_intermediate_size", 0),
            norm_topk_prob=r.get_bool("norm_topk_prob", False),  # Qwen3MoeConfig's default
            decoder_sparse_step=r.get_int("decoder_sparse_step", 1) or 1,
            mlp_only_layers=r.int_list("mlp_only_layers"),
            quantization=parse_quantization(cfg, source),
            raw=cfg,
        )
        _check_sizes(config, cfg, source)
        return _within_window(_yarn_context(config, source), r, family)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """From a checkpoint directory, a ``.gguf`` file or a directory holding one.

        Eos ids from ``generation_config.json`` are merged with config.json's: a request
        stops at either (vLLM stops at the tokenizer's and the generation config's;
        transformers' ``generate`` at the generation config's alone). Its sampling settings
        become ``sampling_defaults``.
        """
        root = checkpoint_dir(path)
        file = os.path.join(root, "config.json")
        if not os.path.isfile(file):
            raise ModelLoadError(f"model: no config.json in {root!r}")
        config = cls.from_dict(read_json(file), source=file)
        gen_file = os.path.join(root, "generation_config.json")
        if os.path.isfile(gen_file):
            gen = read_json(gen_file)
            extra = _Reader(gen, gen_file).int_list("eos_token_id") if isinstance(gen, dict) else ()
            merged = tuple(dict.fromkeys(config.eos_token_ids + extra))
            defaults = _sampling_defaults(gen, gen_file) if isinstance(gen, dict) else ()
            config = replace(config, eos_token_ids=merged, sampling_defaults=defaults)
        return config


#: generation_config.json's sampling keys (the keys vLLM reads too), SamplingParams' names
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling_defaults(gen: dict[str, Any], source: str) -> tuple[tuple[str, float | int], ...]:
    """The sampling settings of a generation config that SamplingParams accepts; one it
    refuses is left out with a warning naming it (every request would fail with it)."""
    from execrt.core.sampling_params import SamplingParams

    out: list[tuple[str, float | int]] = []
    for key in SAMPLING_KEYS:
        value = gen.get(key)
        if value is None:
            continue
        if key == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        setting: dict[str, Any] = {key: value}
        problems = SamplingParams(**setting).problems()
        if problems:
            logger.warning("%s: %s %r ignored (%s)", source, key, value, "; ".join(problems))
            continue
        out.append((key, value))
    return tuple(out)


def checkpoint_dir(path: str | os.PathLike[str]) -> str:
    """The Hugging Face-layout directory for ``path``: itself, or a GGUF file's converted copy
    in the cache (converted once, on first use)."""
    from execrt.models.gguf_file import find_gguf, gguf_checkpoint_dir

    gguf = find_gguf(path)
    return gguf_checkpoint_dir(gguf) if gguf is not None else os.fspath(path)


def read_json(file: str) -> Any:
    """Parsed JSON of ``file``; a ModelLoadError naming the file if it is not valid JSON."""
    try:
        with open(file, encoding="utf-8") as fh:
            return json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"model: {file} is not valid JSON ({exc})") from None


class _Reader:
    """Typed access to a config dict: each error names the source and the field."""

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg, self.source = cfg, source

    def get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        value = self.cfg.get(key)
        if value is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.source}: required field {key!r} missing")
            return default
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ModelLoadError(
                f"{self.source}: field {key!r} must be {_KIND_NAMES[kind]}, got {value!r}"
            )
        return value

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        return int(self.get(key, int, default))

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        value = self.cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return float(self.get(key, float, default))

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        return bool(self.get(key, bool, default))

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.cfg.get(key)
        if value is None:
            return ()
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            raise ModelLoadError(
                f"{self.source}: field {key!r} must be an integer or a list of them, got {value!r}"
            )
        return tuple(items)


def _architecture(r: _Reader) -> str:
    """The config's first ``architectures`` entry, or, without that field, the architecture
    of its ``model_type`` (as transformers' AutoModelForCausalLM picks it)."""
    archs = r.get("architectures", list, [])
    if archs:
        arch = str(archs[0])
        if arch not in FAMILIES:
            raise ModelLoadError(
                f"{r.source}: architecture {arch!r} unsupported "
                f"(supported: {', '.join(sorted(FAMILIES))})"
            )
        return arch
    model_type = r.cfg.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[str(model_type)]
    raise ModelLoadError(
        f"{r.source}: no 'architectures' field, and model_type {model_type!r} is not one "
        f"execrt knows (supported: {', '.join(MODEL_TYPES)}; architectures: "
        f"{', '.join(sorted(FAMILIES))})"
    )


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", list: "a list"}


def _rope_dict(r: _Reader) -> dict[str, Any]:
    # A legacy rope_scaling wins over rope_parameters, as transformers reads them (its
    # convert_rope_params_to_dict; before rope_parameters existed it was the only one).
    rope = r.cfg.get("rope_scaling") or r.cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{r.source}: field 'rope_scaling' must be an object, got {rope!r}")
    return rope


def _rope_theta(r: _Reader) -> float:
    rope = _Reader(_rope_dict(r), r.source)
    return rope.get_float("rope_theta", r.get_float("rope_theta", 10000.0))


def _rope_scaling(r: _Reader, family: Family) -> RopeScaling | None:
    rope = _rope_dict(r)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    p = _Reader(rope, f"{r.source} rope_scaling")
    if kind == "linear":
        return RopeScaling("linear", p.get_float("factor"))
    # The context the model was trained on. Phi-3's and DeepSeek's configs keep it at the
    # top level, and transformers then takes that copy over the one in the rope settings.
    key = "original_max_position_embeddings"
    context = r.get_int("max_position_embeddings", family.max_positions)
    original = r.get_int(key) if key in r.cfg else p.get_int(key, context)
    if original < 1:
        where = r.source if key in r.cfg else p.source
        raise ModelLoadError(f"{where}: field {key!r} must be >= 1, got {original}")
    if kind == "yarn":
        return _yarn(p, original)
    return RopeScaling(
        "llama3",
        p.get_float("factor"),
        p.get_float("low_freq_factor"),
        p.get_float("high_freq_factor"),
        original,
    )


def _yarn(p: _Reader, original: int) -> RopeScaling:
    """YaRN's parameters as transformers reads them: ``factor`` required (its validation
    refuses a config without), ``attention_factor`` defaulting to ``mscale(factor)`` or, with
    ``mscale`` and ``mscale_all_dim`` given (DeepSeek's configs), their ratio, where
    ``mscale(s, m) = 1 + 0.1 m ln s`` for s > 1, else 1."""
    factor = p.get_float("factor")
    if factor < 1.0:
        raise ModelLoadError(f"{p.source}: field 'factor' must be >= 1 for yarn, got {factor}")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 + 0.1 * m * math.log(scale) if scale > 1 else 1.0

    attention = p.cfg.get("attention_factor")
    m, m_all = p.cfg.get("mscale"), p.cfg.get("mscale_all_dim")
    if attention is not None:
        attention = p.get_float("attention_factor")
        if attention <= 0:
            raise ModelLoadError(
                f"{p.source}: field 'attention_factor' must be > 0, got {attention}"
            )
    elif m and m_all:
        attention = mscale(factor, p.get_float("mscale"))
        attention /= mscale(factor, p.get_float("mscale_all_dim"))
    else:
        attention = mscale(factor)
    return RopeScaling(
        "yarn", factor, original_max_position_embeddings=original,
        beta_fast=p.get_float("beta_fast", 32.0), beta_slow=p.get_float("beta_slow", 1.0),
        truncate=p.get_bool("truncate", True), attention_factor=attention,
    )  # fmt: skip


def _check_sizes(c: ModelConfig, cfg: dict[str, Any], source: str) -> None:
    """Every size a positive integer and the heads and experts consistent, so a bad config
    fails here, naming the field, rather than as a tensor error (or a 0-layer model) later."""

    def at_least_1(key: str, value: int, note: str = "") -> None:
        if value < 1:
            raise ModelLoadError(
                f"{source}: field {key!r} must be an integer >= 1, got {value}{note}"
            )

    at_least_1("vocab_size", c.vocab_size)
    at_least_1("hidden_size", c.hidden_size)
    at_least_1("num_hidden_layers", c.num_layers)
    at_least_1("num_attention_heads", c.num_q_heads)
    at_least_1("num_key_value_heads", c.num_kv_heads)
    derived = "" if "head_dim" in cfg else " (hidden_size // num_attention_heads)"
    at_least_1("head_dim", c.head_dim, derived)
    at_least_1("max_position_embeddings", c.max_position_embeddings)
    if c.num_q_heads % c.num_kv_heads:
        raise ModelLoadError(
            f"{source}: field 'num_attention_heads' {c.num_q_heads} must be a multiple of "
            f"'num_key_value_heads' {c.num_kv_heads}"
        )
    if c.num_experts < 0:
        raise ModelLoadError(
            f"{source}: field 'num_experts' must be an integer >= 0 (0: dense), got {c.num_experts}"
        )
    at_least_1("decoder_sparse_step", c.decoder_sparse_step)
    if c.is_moe:
        if not 1 <= c.top_k <= c.num_experts:
            raise ModelLoadError(
                f"{source}: field 'num_experts_per_tok' must be an integer in "
                f"[1, num_experts {c.num_experts}], got {c.top_k}"
            )
        at_least_1("moe_intermediate_size", c.moe_intermediate_size)
    if any(not c.is_moe_layer(i) for i in range(c.num_layers)):  # a dense MLP is built
        if "intermediate_size" not in cfg:
            raise ModelLoadError(f"{source}: required field 'intermediate_size' missing")
        at_least_1("intermediate_size", c.intermediate_size)


def _yarn_context(config: ModelConfig, source: str) -> ModelConfig:
    """A YaRN model's context is its original one times ``factor`` (as vLLM and SGLang take
    it), where that is longer than max_position_embeddings: Qwen3's instructions add the
    rope_scaling and leave max_position_embeddings at 40,960 for 4 x 32,768 tokens."""
    s = config.rope_scaling
    if s is None or s.rope_type != "yarn":
        return config
    extended = int(s.original_max_position_embeddings * s.factor)
    if extended <= config.max_position_embeddings:
        return config
    logger.info(
        "%s: yarn rope_scaling (factor %g over %d tokens): context %d tokens "
        "(max_position_embeddings %d)",
        source, s.factor, s.original_max_position_embeddings, extended,
        config.max_position_embeddings,
    )  # fmt: skip
    return replace(config, max_position_embeddings=extended)


def _within_window(config: ModelConfig, r: _Reader, family: Family) -> ModelConfig:
    """``config`` with its context limited to the sliding window of a family whose
    ``sliding_window`` bounds every layer (Mistral), where the window is the shorter: within
    it, sliding-window attention is full attention, which is what execrt computes."""
    if not family.sliding_window or ("sliding_window" in r.cfg and r.cfg["sliding_window"] is None):
        return config
    window = r.get_int("sliding_window", 4096)  # left out: MistralConfig's default; null: none
    if window < 1:
        raise ModelLoadError(f"{r.source}: sliding_window must be >= 1 or null, got {window}")
    if window >= config.max_position_embeddings:
        return config
    logger.warning(
        "%s: sliding_window %d: context limited to %d tokens (max_position_embeddings %d); "
        "execrt attends in full, which equals sliding-window attention only within the window",
        r.source, window, window, config.max_position_embeddings,
    )  # fmt: skip
    return replace(config, max_position_embeddings=window)


def _refuse_unsupported_math(r: _Reader, family: Family) -> None:
    """Fields that would change the math in ways the decoder does not implement."""
    src, cfg = r.source, r.cfg
    rope = _rope_dict(r)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ModelLoadError(
            f"{src}: rope_type {kind!r} unsupported (supported: {', '.join(_ROPE_TYPES)})"
        )
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' two names for x * sigmoid(x)
        raise ModelLoadError(f"{src}: hidden_act {act!r} unsupported (supported: silu, swish)")
    for where in (cfg, rope):
        partial = where.get("partial_rotary_factor")  # null: not set, as transformers reads it
        if partial is not None and partial != 1.0:
            raise ModelLoadError(
                f"{src}: partial_rotary_factor {partial!r} unsupported (supported: 1.0)"
            )
    layer_types = cfg.get("layer_types") or []
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        odd = next(t for t in layer_types if t != "full_attention")
        raise ModelLoadError(
            f"{src}: layer type {odd!r} unsupported (sliding-window attention; "
            "supported: full_attention)"
        )
    window = cfg.get("sliding_window")
    if family.use_sliding_window and cfg.get("use_sliding_window") and window is not None:
        # Qwen2 and Qwen3 slide the window in the layers layer_types names (checked above:
        # none) or, without it, from max_window_layers on: none where that is past the last.
        # Qwen3-MoE slides it in every layer whatever layer_types says.
        first = r.get_int("max_window_layers", 28) if family.window_layers else 0
        listed = bool(layer_types) and family.window_layers
        if not listed and first < r.get_int("num_hidden_layers", 0):
            layers = f", from layer {first} (max_window_layers)" if family.window_layers else ""
            raise ModelLoadError(
                f"{src}: sliding-window attention unsupported (use_sliding_window true, "
                f"sliding_window {window!r}{layers})"
            )
    if cfg.get("mlp_bias") and not family.mlp_bias:
        raise ModelLoadError(f"{src}: mlp_bias true unsupported for this architecture")
