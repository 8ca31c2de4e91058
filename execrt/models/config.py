"""ModelConfig: the fields of a Hugging Face config.json that execrt's models read."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from execrt.core.errors import ModelLoadError
from execrt.core.model_spec import ModelSpec

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
    attention_bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
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
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ModelLoadError(
                    f"model config: rope_type {rope_type!r} unsupported (supported: default)"
                )
            if cfg.get("use_sliding_window"):
                raise ModelLoadError("model config: sliding-window attention unsupported")
            theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            dtype_name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
            num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg.get("intermediate_size", 0)),
                num_layers=int(cfg["num_hidden_layers"]),
                num_q_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                dtype=_DTYPES.get(dtype_name.replace("torch.", ""), torch.bfloat16),
                eos_token_ids=eos_ids,
                num_experts=num_experts,
                top_k=int(cfg.get("num_experts_per_tok", 0) or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
                raw=cfg,
            )
        except KeyError as exc:
            raise ModelLoadError(f"model config: required field {exc.args[0]!r} missing") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise ModelLoadError(f"model: no config.json in {os.fspath(path)!r}")
        with open(file) as fh:
            return cls.from_dict(json.load(fh))
