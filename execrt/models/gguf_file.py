"""GGUF checkpoints: metadata -> config, tensors -> Hugging Face names, the tokenizer and chat
template, all converted once into a checkpoint directory in the cache (keyed by the file's path,
size and mtime) that the safetensors loader then reads like any other."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from execrt.core.errors import ModelLoadError
from execrt.models.cache import cached_dir
from execrt.models.tokenizer import NO_TOKENIZER_NOTE, gguf_adds_bos, tokenizer_from_gguf

INSTALL_HINT = "pip install execrt[gguf]"
#: Bump when the conversion changes, so old cache entries are not reused.
FORMAT_VERSION = 2
#: Name prefix of converted GGUF directories in the cache
CACHE_PREFIX = "gguf-"
#: GGUF ``general.architecture`` -> Hugging Face ``architectures`` value
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
#: llama.cpp stores Llama's q/k rows interleaved per head; the others are stored as trained.
_PERMUTED_ARCHS = frozenset({"llama"})
_SHARD_BYTES = 1 << 30
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_EXPERT_NAMES = {  # stacked [E, ...] tensors, stored without a ``.weight`` suffix
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}


def find_gguf(path: str | os.PathLike[str]) -> str | None:
    """The GGUF file ``path`` names: the path itself, or the one ``.gguf`` in a directory
    without a config.json. None for a Hugging Face checkpoint directory."""
    p = os.fspath(path)
    if os.path.isfile(p):
        return p if p.endswith(".gguf") else None
    if not os.path.isdir(p) or os.path.isfile(os.path.join(p, "config.json")):
        return None
    files = sorted(n for n in os.listdir(p) if n.endswith(".gguf"))
    if len(files) > 1:
        raise ModelLoadError(
            f"model: {p!r} holds {len(files)} .gguf files ({', '.join(files)}); pass one file"
        )
    return os.path.join(p, files[0]) if files else None


def gguf_checkpoint_dir(file: str) -> str:
    """The converted checkpoint directory of ``file``, converting it on first use."""
    st = os.stat(file)
    key = f"{os.path.realpath(file)}|{st.st_size}|{st.st_mtime_ns}|v{FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.basename(file).removesuffix(".gguf")[:48]
    # source=file: the conversion of an earlier version of this file (touched, replaced) goes.
    return cached_dir(f"{CACHE_PREFIX}{stem}-{digest}", lambda out: convert(file, out), file)


def convert(file: str, out: str) -> None:
    """Write config.json, generation_config.json, tokenizer files and safetensors into ``out``."""
    from execrt.models.config import ModelConfig

    gguf = _import_gguf()
    reader = _open(gguf, file)
    meta = _metadata(reader, file)
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_config(meta, tensors, file)
    ModelConfig.from_dict(config, source=file)  # refuse early, naming the GGUF file
    _write_json(os.path.join(out, "config.json"), config)
    if "tokenizer.ggml.eos_token_id" in meta:
        eos = {"eos_token_id": [meta["tokenizer.ggml.eos_token_id"]]}
        _write_json(os.path.join(out, "generation_config.json"), eos)
    _write_tokenizer(meta, file, out)
    _write_weights(gguf, config, meta["general.architecture"], tensors, file, out)


def gguf_config(meta: dict[str, Any], tensors: dict[str, Any], file: str) -> dict[str, Any]:
    """A Hugging Face config.json dict from the ``<arch>.*`` metadata keys."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"model: {file}: GGUF architecture {arch!r} unsupported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"model: {file}: GGUF metadata key '{arch}.{name}' missing")
        return value

    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; only uniform ones are supported
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(
                f"model: {file}: per-layer '{arch}.attention.head_count_kv' {kv_heads} unsupported"
            )
        kv_heads = kv_heads[0]
    hidden = key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads if heads else 0)  # 0: refused later
    if key("attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"model: {file}: value head size != key head size unsupported")
    rotary = key("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ModelLoadError(
            f"model: {file}: '{arch}.rope.dimension_count' {rotary} != head size {head_dim} "
            "(partial rotary) unsupported"
        )
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(
            f"model: {file}: per-dimension RoPE frequency factors (tensor 'rope_freqs.weight', "
            "Llama 3.1-style scaling) unsupported in GGUF files"
        )
    if f"{arch}.attention.sliding_window" in meta:
        raise ModelLoadError(f"model: {file}: sliding-window attention unsupported")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope |= {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling == "yarn":
        rope |= _gguf_yarn(file, meta, arch, key)
    elif scaling != "none":
        rope["rope_type"] = scaling  # refused by ModelConfig with the value named
    # The embedding's row count is the vocabulary the weights have; the token list may differ.
    embd = tensors.get("token_embd.weight")
    vocab = (
        int(embd.shape[-1])
        if embd is not None
        else meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    )
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "hidden_act": "silu",
        "dtype": _natural_dtype(tensors),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if f"{arch}.feed_forward_length" in meta:
        config["intermediate_size"] = meta[f"{arch}.feed_forward_length"]
    if f"{arch}.expert_count" in meta:
        config |= {
            "num_experts": key("expert_count"),
            "num_experts_per_tok": key("expert_used_count"),
            "moe_intermediate_size": key("expert_feed_forward_length"),
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
        }
    return config


def _natural_dtype(tensors: dict[str, Any]) -> str:
    """The dtype to run in on a GPU: the file's if all its matrices agree, else bfloat16."""
    kinds = {t.tensor_type.name for t in tensors.values() if len(t.shape) >= 2}
    if kinds == {"F32"}:
        return "float32"
    return "float16" if kinds == {"F16"} else "bfloat16"


def iter_gguf_weights(
    gguf: Any, config: dict[str, Any], arch: str, tensors: dict[str, Any], file: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, tensor)`` for every GGUF tensor, dequantized to fp32 (F16/BF16
    kept as they are), in torch layout ``[out, in]``, Llama's q/k rows un-permuted."""
    for name, t in tensors.items():
        hf = hf_name(name)
        if hf is None:
            raise ModelLoadError(f"model: {file}: GGUF tensor {name!r} unknown to execrt")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            array = gguf.dequantize(t.data, t.tensor_type).reshape(shape)
        except NotImplementedError:
            raise ModelLoadError(
                f"model: {file}: tensor {name!r} has quantization {t.tensor_type.name}, "
                "which gguf cannot dequantize"
            ) from None
        except ValueError as exc:
            raise ModelLoadError(f"model: {file}: tensor {name!r} is unreadable ({exc})") from None
        value = torch.from_numpy(array.copy())
        if t.tensor_type.name in ("F16", "BF16"):
            value = value.to(torch.float16 if t.tensor_type.name == "F16" else torch.bfloat16)
        if arch in _PERMUTED_ARCHS and (".attn_q." in name or ".attn_k." in name):
            heads = config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
            value = unpermute_rows(value, heads)
        yield hf, value


def hf_name(name: str) -> str | None:
    """Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None when unknown."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, rest = parts[1], parts[2]
    if rest in _EXPERT_NAMES:
        return f"model.layers.{layer}.{_EXPERT_NAMES[rest]}"
    base, _, suffix = rest.rpartition(".")
    if base not in _BLOCK_NAMES or suffix not in ("weight", "bias"):
        return None
    return f"model.layers.{layer}.{_BLOCK_NAMES[base]}.{suffix}"


def gguf_name(hf: str) -> str:
    """The GGUF name of a Hugging Face checkpoint name (inverse of ``hf_name``; one expert's
    tensor maps to the stacked tensor holding it); ``hf`` itself when it has none."""
    inverse = {v: k for k, v in _GLOBAL_NAMES.items()}
    if hf in inverse:
        return inverse[hf]
    parts = hf.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        return hf
    layer, rest = parts[2], parts[3]
    for gg, ours in _EXPERT_NAMES.items():
        stacked, _, proj = ours.rpartition(".")
        if rest == ours or (
            rest.startswith(f"{stacked}.") and rest.endswith(f".{proj}.weight")
        ):  # mlp.experts.gate_proj or mlp.experts.N.gate_proj.weight
            return f"blk.{layer}.{gg}"
    base, _, suffix = rest.rpartition(".")
    for gg, ours in _BLOCK_NAMES.items():
        if ours == base:
            return f"blk.{layer}.{gg}.{suffix}"
    return hf


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: within each head, its converter moved the rows of
    the two rotate-half halves into interleaved (even, odd) pairs; put them back."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


# -- tokenizer ----------------------------------------------------------------------------------
def _write_tokenizer(meta: dict[str, Any], file: str, out: str) -> None:
    """tokenizer.json and tokenizer_config.json, or, where the vocabulary cannot be rebuilt,
    a note saying why (``load_tokenizer`` logs it at every load, not only this first one)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    try:
        if not tokens:
            raise ModelLoadError(f"model: {file}: GGUF file has no vocabulary")
        tokenizer_from_gguf(meta, file).save(os.path.join(out, "tokenizer.json"))
    except ModelLoadError as exc:
        with open(os.path.join(out, NO_TOKENIZER_NOTE), "w", encoding="utf-8") as fh:
            fh.write(f"{exc}\n")
        return

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    tok_config: dict[str, Any] = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "eot_token": token("eot_token_id"),
        "add_bos_token": gguf_adds_bos(meta),
    }
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    _write_json(os.path.join(out, "tokenizer_config.json"), tok_config)


# -- weights ------------------------------------------------------------------------------------
def _write_weights(
    gguf: Any, config: dict[str, Any], arch: str, tensors: dict[str, Any], file: str, out: str
) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, value in iter_gguf_weights(gguf, config, arch, tensors, file):
        nbytes = value.numel() * value.element_size()
        if size and size + nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = value.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"))
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        shard_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, shard_name))
        weight_map |= dict.fromkeys(shard, shard_name)
    _write_json(
        os.path.join(out, "model.safetensors.index.json"),
        {"metadata": {}, "weight_map": weight_map},
    )


# -- reading ------------------------------------------------------------------------------------
def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(
            f"model: GGUF checkpoints need the 'gguf' package ({INSTALL_HINT})"
        ) from None
    return gguf


def _open(gguf: Any, file: str) -> Any:
    try:
        return gguf.GGUFReader(file)
    except (ValueError, KeyError, IndexError, OSError, TypeError) as exc:
        raise ModelLoadError(
            f"model: {file} is not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from None


def _metadata(reader: Any, file: str) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        try:
            meta[name] = fld.contents()
        except (ValueError, UnicodeDecodeError, IndexError) as exc:
            raise ModelLoadError(
                f"model: {file}: GGUF metadata {name!r} unreadable ({exc})"
            ) from None
    return meta


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, ensure_ascii=False)


def _gguf_yarn(file: str, meta: dict[str, Any], arch: str, key: Any) -> dict[str, Any]:
    """A GGUF file's YaRN keys as config.json's rope_scaling fields. llama.cpp's attention
    factors, log multiplier and extrapolation mix change the cos/sin scale or the blend in
    ways transformers' fields do not name: a file that sets one to other than its neutral
    value is refused by key rather than run with another scale."""
    neutral = {
        "attn_factor": (1.0,), "yarn_attn_factor": (1.0,), "yarn_log_multiplier": (0.0,),
        "yarn_ext_factor": (-1.0, 1.0),  # (-1: llama.cpp's "yarn's own", which is 1)
    }  # fmt: skip
    for name, values in neutral.items():
        value = meta.get(f"{arch}.rope.scaling.{name}")
        if value is not None and float(value) not in values:
            raise ModelLoadError(
                f"model: {file}: GGUF key '{arch}.rope.scaling.{name}' {value} unsupported "
                f"(supported: {' or '.join(map(str, values))})"
            )
    fields = {
        "rope_type": "yarn",
        "factor": key("rope.scaling.factor"),
        "original_max_position_embeddings": key("rope.scaling.original_context_length"),
    }
    for gguf_name, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = meta.get(f"{arch}.rope.scaling.{gguf_name}")
        if value is not None:
            fields[field] = float(value)
    return fields
