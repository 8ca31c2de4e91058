"""GGUF checkpoints: random Llama / Qwen2 files in several quantizations load into logits that
match the original weights (F32) and transformers' own GGUF load (every type); the tokenizer,
the cache and clear errors for bad files."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from execrt.core.errors import ModelLoadError
from execrt.models import ModelConfig, load_model
from tests.drivers import rel_err
from tests.models.gguf_files import CHAT_TEMPLATE, hf_gguf_model, prefill_logits, write_gguf

gguf = pytest.importorskip("gguf", reason="GGUF tests need the 'gguf' package")
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77, 300, 301]]


def small_model(arch: str, seed: int) -> object:
    """Llama (tied, GQA 4:2, head 16) or Qwen2 (untied, biases, rows of 256 for K-quants)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=384, max_position_embeddings=128, rms_norm_eps=1e-6, num_hidden_layers=2
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(
            **common,
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=1e6,
        )
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith(".bias"):
                p.normal_(0.0, 0.08)
    return model.float().eval()


def reference_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    return small_model("llama", 11)


@pytest.fixture(scope="module")
def qwen2():  # type: ignore[no-untyped-def]
    return small_model("qwen2", 12)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_file_matches_the_original_weights(arch, llama, qwen2, tmp_path, plugin_host) -> None:
    model = llama if arch == "llama" else qwen2
    path = write_gguf(model, str(tmp_path / f"{arch}.gguf"), arch=arch)
    ours = prefill_logits(path, PROMPTS, plugin_host)
    ref = reference_logits(model, PROMPTS)
    assert max(rel_err(a, b) for a, b in zip(ours, ref, strict=True)) <= 1e-5
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.tie_word_embeddings is (arch == "llama")
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm) == (arch == "qwen2", False, False)


@pytest.mark.parametrize("name", ["dense-tied-hd64", "moe-8x2", "qwen3-yarn"])
def test_qwen3_and_qwen3_moe_files_match_the_original_weights(name, tmp_path, plugin_host) -> None:
    from tests.checkpoints import build_hf_model

    model = build_hf_model(name)
    arch = "qwen3moe" if "moe" in name else "qwen3"
    path = write_gguf(model, str(tmp_path / f"{name}.gguf"), arch=arch)
    ours = prefill_logits(path, PROMPTS, plugin_host)
    ref = reference_logits(model, PROMPTS)
    assert max(rel_err(a, b) for a, b in zip(ours, ref, strict=True)) <= 1e-5
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.qk_norm and cfg.num_experts == (8 if arch == "qwen3moe" else 0)
    if name == "qwen3-yarn":  # read from the file's rope.scaling keys, not defaulted
        assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
        assert (cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position_embeddings) == (
            4.0, 64,
        )  # fmt: skip


def test_a_yarn_gguf_with_llama_cpp_only_factors_is_refused_by_key(tmp_path) -> None:
    from tests.checkpoints import build_hf_model

    model = build_hf_model("qwen3-yarn")
    for key, value in (
        ("rope.scaling.attn_factor", 0.5),
        ("rope.scaling.yarn_log_multiplier", 0.25),
    ):
        path = write_gguf(model, str(tmp_path / "y.gguf"), arch="qwen3", extra_meta={key: value})
        with pytest.raises(ModelLoadError, match=f"'qwen3.{key}' {value} unsupported"):
            ModelConfig.from_pretrained(path)


QUANTS = {
    "llama-f16-bf16-q8_0": (
        "llama",
        {"token_embd": "Q8_0", "attn_output": "BF16", "attn": "F16", "ffn": "Q8_0"},
    ),
    "llama-q4_0-q5_1": ("llama", {"token_embd": "Q8_0", "attn": "Q4_0", "ffn": "Q5_1"}),
    "qwen2-kquants": (
        "qwen2",
        {"token_embd": "Q4_1", "output": "Q5_0", "attn": "Q4_K", "ffn_down": "Q8_0", "ffn": "Q6_K"},
    ),
}


@pytest.mark.parametrize("name", sorted(QUANTS))
def test_quantized_file_matches_transformers_on_the_same_file(
    name, llama, qwen2, tmp_path, plugin_host
) -> None:
    arch, quant = QUANTS[name]
    path = write_gguf(
        llama if arch == "llama" else qwen2, str(tmp_path / f"{name}.gguf"), arch=arch, quant=quant
    )
    reader = gguf.GGUFReader(path)
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert set(quant.values()) <= kinds  # the file really holds those types
    ours = prefill_logits(path, PROMPTS, plugin_host)
    ref = reference_logits(hf_gguf_model(path), PROMPTS)
    # Both dequantize the same blocks to fp32, then run the same fp32 math.
    assert max(rel_err(a, b) for a, b in zip(ours, ref, strict=True)) <= 1e-5


def test_tokenizer_and_chat_template_match_transformers(llama, tmp_path) -> None:
    from execrt.models.config import checkpoint_dir
    from execrt.models.tokenizer import load_chat_template, load_tokenizer

    path = write_gguf(llama, str(tmp_path / "tok.gguf"), arch="llama")
    try:
        ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    except (ImportError, ValueError, OSError) as exc:
        pytest.skip(f"transformers cannot load a GGUF tokenizer here: {exc}")
    ours = load_tokenizer(checkpoint_dir(path))
    texts = [
        "the hat is on the tree",
        "  two  spaces\tand\nnew lines  ",
        "héllo wörld ✓ 日本",
        "<|im_start|>user\nhi<|im_end|>",
        "",
    ]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text, add_special_tokens=False), text
        decoded = ours.decode(ids, skip_special_tokens=False)
        assert decoded == text  # byte-level BPE round-trips exactly
        # Some transformers versions drop the leading space of a llama-architecture GGUF
        # tokenizer's decode; compare where theirs round-trips too.
        if ref.decode(ids) == text:
            assert decoded == ref.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
                ids, skip_special_tokens=True
            )
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hey"},
        {"role": "user", "content": "ünïcode?"},
    ]
    template = load_chat_template(checkpoint_dir(path))
    assert template is not None and template.source == CHAT_TEMPLATE
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template.render(messages) == expected
    assert template.stop_token_ids(ours) == (ours.token_to_id("<|im_end|>"),)


def test_conversion_is_cached_and_a_damaged_cache_is_rebuilt(llama, tmp_path, monkeypatch) -> None:
    from execrt.models import gguf_file
    from execrt.models.config import checkpoint_dir

    path = write_gguf(llama, str(tmp_path / "c.gguf"), arch="llama")
    first = checkpoint_dir(path)
    calls = []
    real = gguf_file.convert
    monkeypatch.setattr(gguf_file, "convert", lambda f, out: (calls.append(f), real(f, out)))
    assert checkpoint_dir(path) == first and calls == []  # cache hit
    weights = os.path.join(first, "model.safetensors")
    with open(weights, "r+b") as fh:
        fh.truncate(os.path.getsize(weights) // 2)
    assert checkpoint_dir(path) == first and calls == [path]  # rebuilt in place
    cfg = ModelConfig.from_pretrained(path)
    load_model(
        path,
        cfg,
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_positions=32,
        dispatcher=None,
    )


def test_touching_a_gguf_file_leaves_one_converted_copy(llama, tmp_path, monkeypatch) -> None:
    """Each touch used to leave another full copy (517 MB for SmolLM2) in the cache."""
    from execrt.models.config import checkpoint_dir

    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(llama, str(tmp_path / "t.gguf"), arch="llama")
    seen = [checkpoint_dir(path)]
    for mtime in (10**18, 2 * 10**18):
        os.utime(path, ns=(mtime, mtime))
        seen.append(checkpoint_dir(path))
    assert len(set(seen)) == 3  # each version is converted anew...
    assert sorted(os.listdir(tmp_path / "cache")) == [os.path.basename(seen[-1])]  # ...once


def _load(path: str) -> None:
    cfg = ModelConfig.from_pretrained(path)
    load_model(
        path,
        cfg,
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_positions=32,
        dispatcher=None,
    )


def test_bad_gguf_files_are_named(llama, tmp_path) -> None:
    good = write_gguf(llama, str(tmp_path / "good.gguf"), arch="llama")
    data = open(good, "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        _load(str(truncated))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty.gguf"):
        _load(str(empty))

    missing = write_gguf(
        llama, str(tmp_path / "missing.gguf"), arch="llama", skip=("blk.1.ffn_down.weight",)
    )
    with pytest.raises(ModelLoadError, match=r"missing.gguf.*blk\.1\.ffn_down\.weight"):
        _load(missing)

    # Parts of execrt's fused q/k/v and gate/up parameters are named as the file names them.
    skip = ("blk.0.attn_k.weight", "blk.1.ffn_up.weight")
    fused = write_gguf(llama, str(tmp_path / "fused.gguf"), arch="llama", skip=skip)
    with pytest.raises(ModelLoadError, match=r"fused.gguf' lacks tensor\(s\) " + ", ".join(skip)):
        _load(fused)

    unknown = write_gguf(llama, str(tmp_path / "gpt2.gguf"), arch="gpt2")
    with pytest.raises(ModelLoadError, match="gpt2.gguf.*architecture 'gpt2' unsupported"):
        _load(unknown)

    f64 = write_gguf(llama, str(tmp_path / "f64.gguf"), arch="llama", quant={"output_norm": "F64"})
    with pytest.raises(ModelLoadError, match=r"f64.gguf.*'output_norm.weight'.*F64"):
        _load(f64)


def test_a_sentencepiece_vocabulary_is_named_at_every_load(llama, tmp_path, caplog) -> None:
    from execrt.models.config import checkpoint_dir
    from execrt.models.tokenizer import load_tokenizer

    path = write_gguf(llama, str(tmp_path / "spm.gguf"), arch="llama", tokenizer_model="llama")
    expected = (
        f"model: {path}: GGUF tokenizer model 'llama' (SentencePiece, as in Llama 2, Mistral and "
        "TinyLlama) unsupported (supported: 'gpt2', byte-level BPE as in Llama 3, Qwen2 and "
        "SmolLM2); text prompts will be refused (pass token ids)"
    )
    for _ in range(2):  # the conversion, then a cache hit: both say why
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert load_tokenizer(checkpoint_dir(path)) is None
        assert caplog.messages == [expected]


def test_chat_on_a_sentencepiece_gguf_names_the_tokenizer_not_the_template(
    llama, tmp_path, capsys
) -> None:
    """The file has a chat template; what is missing is a tokenizer execrt can rebuild."""
    from execrt.cli import main
    from execrt.core.errors import RequestError
    from execrt.engine import Engine

    path = write_gguf(llama, str(tmp_path / "spm.gguf"), arch="llama", tokenizer_model="llama")
    reason = (
        f"model: {path}: GGUF tokenizer model 'llama' (SentencePiece, as in Llama 2, Mistral and "
        "TinyLlama) unsupported (supported: 'gpt2', byte-level BPE as in Llama 3, Qwen2 and "
        "SmolLM2)"
    )
    with Engine(path, device="cpu") as engine:
        with pytest.raises(RequestError) as info:
            engine.chat([{"role": "user", "content": "hi"}])
    assert str(info.value) == f"engine: chat needs a tokenizer: {reason}"
    assert main(["generate", "--model", path, "--chat", "hi", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"execrt: error: engine: chat needs a tokenizer: {reason}"
    )


def test_a_missing_stacked_expert_tensor_is_named(tmp_path) -> None:
    from tests.checkpoints import build_hf_model
    from tests.models.test_loader import _moe_load

    skip = ("blk.1.ffn_up_exps.weight",)
    path = write_gguf(
        build_hf_model("moe-8x2"), str(tmp_path / "moe.gguf"), arch="qwen3moe", skip=skip
    )
    with pytest.raises(
        ModelLoadError, match=r"moe.gguf' lacks tensor\(s\) blk\.1\.ffn_up_exps\.weight$"
    ):
        _moe_load(path)


def test_a_gguf_directory_and_the_missing_package_hint(llama, tmp_path, monkeypatch) -> None:
    d = tmp_path / "dir"
    d.mkdir()
    write_gguf(llama, str(d / "m.gguf"), arch="llama")
    assert ModelConfig.from_pretrained(str(d)).architecture == "LlamaForCausalLM"
    write_gguf(llama, str(d / "other.gguf"), arch="llama")
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files"):
        ModelConfig.from_pretrained(str(d))

    fresh = write_gguf(llama, str(tmp_path / "fresh.gguf"), arch="llama")
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(ModelLoadError, match=r"pip install execrt\[gguf\]"):
        ModelConfig.from_pretrained(fresh)
