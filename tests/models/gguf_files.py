"""Small random GGUF files written with ``gguf.GGUFWriter`` from transformers models, the way
llama.cpp's converter lays them out (names, q/k row order, quantized blocks)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

# Test-side name table (HF -> GGUF), written independently of execrt's.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"


def _gguf_tensors(model: Any) -> list[tuple[str, str, torch.Tensor]]:
    """(HF name, GGUF name, tensor); fused experts become llama.cpp's stacked halves."""
    out = []
    for hf, tensor in model.state_dict().items():
        if hf.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> gate, up [E, I, H]
            layer = hf.split(".")[2]
            gate, up = tensor.chunk(2, dim=1)
            out += [(hf, f"blk.{layer}.ffn_gate_exps.weight", gate)]
            out += [(hf, f"blk.{layer}.ffn_up_exps.weight", up)]
        elif hf.endswith("mlp.experts.down_proj"):  # [E, H, I]
            out.append((hf, f"blk.{hf.split('.')[2]}.ffn_down_exps.weight", tensor))
        elif hf.endswith("mlp.gate.weight"):  # router [E, H]
            out.append((hf, f"blk.{hf.split('.')[2]}.ffn_gate_inp.weight", tensor))
        else:
            out.append((hf, gguf_name(hf), tensor))
    return out


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for Llama q/k: per head, rows of the two rotary halves
    interleaved (row i of the first half, then row i of the second half, ...)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(size: int) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary of ``size`` tokens: the 256 byte characters, merges of
    letter pairs, then the special tokens (type 3 = control)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = list(alphabet)
    merges = []
    letters = "etaoinshrdlu"
    pairs = [a + b for a in ["Ġ", *letters] for b in letters]
    for pair in pairs:
        if len(tokens) >= size - len(SPECIALS):
            break
        merges.append(f"{pair[0]} {pair[1:]}" if pair[0] != "Ġ" else f"Ġ {pair[1:]}")
        tokens.append(pair)
    tokens += SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    assert len(tokens) == size, (len(tokens), size)
    return tokens, merges, types


def random_kquant(rows: int, cols: int, qtype: Any, seed: int) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize to these) with small, finite scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale_bytes = {"Q4_K": (0, 8e-5), "Q6_K": (size - 2, 2e-5)}[qtype.name]
    at, d = scale_bytes
    data[:, :, at : at + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    if qtype.name == "Q4_K":  # dmin
        data[:, :, 2:4] = np.frombuffer(np.float16(4e-5).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write_gguf(
    model: Any,
    path: str,
    *,
    arch: str,
    quant: dict[str, str] | None = None,
    skip: tuple[str, ...] = (),
    tokenizer_pre: str = "default",
    tokenizer_model: str = "gpt2",
    seed: int = 0,
    extra_meta: dict[str, float] | None = None,
) -> str:
    """Write ``model`` (a transformers Llama / Qwen2 / Qwen3) as a GGUF file.

    ``quant`` maps a substring of the GGUF name to a type name (first match wins; 1-D tensors
    stay F32). ``skip`` leaves tensors out. ``tokenizer_model`` only labels the (byte-level)
    vocabulary: ``"llama"`` makes it look like a SentencePiece one. ``extra_meta``: float
    keys (without the arch prefix) written beside a YaRN model's rope scaling.
    """
    import gguf

    c = model.config
    q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes it
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, value in (extra_meta or {}).items():
            w.add_float32(f"{arch}.{key}", value)
    if arch != "llama":
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    if getattr(c, "num_experts", 0):
        w.add_uint32(f"{arch}.expert_count", c.num_experts)
        w.add_uint32(f"{arch}.expert_used_count", c.num_experts_per_tok)
        w.add_uint32(f"{arch}.expert_feed_forward_length", c.moe_intermediate_size)
    tokens, merges, types = byte_level_vocab(c.vocab_size)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHAT_TEMPLATE)
    for hf, name, tensor in _gguf_tensors(model):
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name in skip:
            continue
        array = tensor.detach().float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        kind = next((t for k, t in (quant or {}).items() if k in name), "F32")
        if kind == "F64":  # a type gguf cannot dequantize
            w.add_tensor(name, array.astype(np.float64))
        elif array.ndim == 1 or kind == "F32":
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        elif kind == "F16":
            w.add_tensor(name, array.astype(np.float16))
        elif kind in ("Q4_K", "Q6_K"):
            data = random_kquant(*array.shape, q[kind], seed + len(name))
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q[kind])
        else:
            data = gguf.quants.quantize(array, q[kind])
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def prefill_logits(path: str, prompts: list[list[int]], plugin_host: Any) -> list[torch.Tensor]:
    """execrt's fp32 logits ``[n, V]`` for each prompt, all prefilled in one batch."""
    from execrt.core.context import RuntimeContext
    from tests.drivers import make_worker, prefill_then_decode

    ctx = RuntimeContext()
    worker = make_worker(path, ctx, plugin_host)
    try:
        full = prefill_then_decode(worker, prompts, 0, full_logits=True).prefill_full_logits
        assert full is not None
        return list(full.split([len(p) for p in prompts]))
    finally:
        worker.close()
        ctx.close()


def hf_gguf_model(path: str) -> Any:
    """transformers' own load of the GGUF file (fp32), or pytest.skip with the reason."""
    import pytest

    try:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        ).eval()
    except (ImportError, ValueError, OSError) as exc:
        pytest.skip(f"transformers cannot load GGUF here: {exc}")
