"""FP8 checkpoints (``quantization_config.quant_method = "fp8"``) load dequantized.

The oracle: transformers running the same checkpoint's weights dequantized by this test (a loop
over blocks, stored value times its block's factor), in fp32. Our engine reads the fp8 files.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from execrt.core.errors import ModelLoadError
from execrt.models import ModelConfig
from execrt.models.quantized import WeightQuant, dequantized
from tests.checkpoints import build_checkpoint, build_hf_model
from tests.drivers import make_worker, prefill_then_decode, rel_err
from tests.models.test_loader import TINY_QWEN3

pytest.importorskip("transformers")

FP8 = torch.float8_e4m3fn
PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77]]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


ROWS = (1, 1 << 30)  # a block of one whole row: compressed-tensors' "channel" strategy


def quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, factors): per block of ``block`` (ragged at the edges; ROWS: one per row,
    stored ``[N, 1]``), or one per tensor."""
    if block is None:
        factor = w.abs().max().clamp(min=1e-12) / 448
        return (w / factor).to(FP8), factor.reshape(())
    bn, bk = block
    rows, cols = w.shape
    factors = torch.empty(-(-rows // bn), -(-cols // bk))
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(factors.shape[0]):
        for j in range(factors.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            factors[i, j] = tile.abs().max().clamp(min=1e-12) / 448
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / factors[i, j]).to(FP8)
    return q, factors


def real(q: torch.Tensor, factors: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """What the stored values mean: each times its block's factor (the oracle's own loop)."""
    if block is None:
        return q.float() * factors
    out = q.float()
    bn, bk = block
    for i in range(factors.shape[0]):
        for j in range(factors.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= factors[i, j]
    return out


def fp8_checkpoint(name: str, path: str, block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """Save ``name`` with its linear weights in fp8, with activation scales beside them: as
    Qwen3's -FP8 releases store them (blocks, ``weight_scale_inv``), one scale per tensor, or
    (ROWS) as llm-compressor's FP8-dynamic scheme does (compressed-tensors, per channel).
    Returns the dequantized weights the oracle runs."""
    build_checkpoint(name, path)
    file = next(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    tensors = load_file(file)
    out, oracle = {}, {}
    for key, w in tensors.items():
        if key.endswith(".weight") and key.split(".")[-2] in LINEAR:
            q, factors = quantize(w.float(), block)
            module = key.removesuffix(".weight")
            out[key] = q
            scale = ".weight_scale_inv" if block and block != ROWS else ".weight_scale"
            out[module + scale] = factors
            out[module + ".input_scale"] = torch.tensor(1.0)
            oracle[key] = real(q, factors, block)
        else:
            out[key] = w
    save_file(out, file, metadata={"format": "pt"})
    config = os.path.join(path, "config.json")
    cfg = json.load(open(config))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"} | (
        {"fmt": "e4m3", "weight_block_size": list(block)} if block else {}
    )
    if block == ROWS:
        weights = {"type": "float", "num_bits": 8, "symmetric": True, "strategy": "channel"}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"],
        }
    json.dump(cfg, open(config, "w"))
    return oracle


def assert_runs_like_transformers(
    name: str, oracle: dict[str, torch.Tensor], path: str, runtime_context, plugin_host
) -> None:
    """Our engine on the fp8 checkpoint at ``path`` gives the prompts' logits of transformers
    running ``name`` with the ``oracle``'s dequantized tensors."""
    hf = build_hf_model(name)
    state = hf.state_dict()
    for key, w in oracle.items():
        assert not torch.equal(state[key], w)  # the rounding is real, so the test can fail
        state[key] = w
    hf.load_state_dict(state)
    worker = make_worker(path, runtime_context, plugin_host)
    trace = prefill_then_decode(worker, PROMPTS, steps=1, full_logits=True)
    worker.close()
    assert trace.prefill_full_logits is not None
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert rel_err(trace.prefill_full_logits, ref) <= 1e-5


@pytest.mark.parametrize(
    "name,block",
    [
        ("llama-untied-bias-llama3", (64, 64)),  # ragged blocks: 96 and 200 are no multiples
        ("qwen2-untied", (32, 48)),  # q/k/v biases stay as they are; blocks of two shapes
        ("dense-tied-hd64", None),  # one factor per tensor
        ("qwen3-yarn", ROWS),  # compressed-tensors, one factor per output channel
    ],
)
def test_an_fp8_checkpoint_runs_its_dequantized_weights(
    name, block, tmp_path, plugin_host, runtime_context
) -> None:
    oracle = fp8_checkpoint(name, str(tmp_path), block)
    want = WeightQuant("compressed-tensors", None) if block == ROWS else WeightQuant("fp8", block)
    assert ModelConfig.from_pretrained(str(tmp_path)).quantization == want
    assert_runs_like_transformers(name, oracle, str(tmp_path), runtime_context, plugin_host)


def test_factors_before_weights_stacked_experts_and_other_tensors_pass() -> None:
    """Order does not matter (a factor may come first, from another file); stacked expert
    weights ``[E, N, K]`` take per-expert blocks; other tensors pass untouched."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 24, generator=gen)
    qs, fs = zip(*(quantize(w[e], (16, 16)) for e in range(3)), strict=True)
    q, f = torch.stack(qs), torch.stack(fs)  # [3, 40, 24], [3, 3, 2]
    norm = torch.randn(24, generator=gen)
    stream = [
        ("e.weight_scale_inv", f),
        ("n.weight", norm),
        ("e.weight", q),
        ("e.input_scale", f[0, 0, 0]),
    ]
    out = dict(dequantized(iter(stream), WeightQuant("fp8", (16, 16))))
    assert list(out) == ["n.weight", "e.weight"] and out["n.weight"] is norm
    want = torch.stack([real(qs[e], fs[e], (16, 16)) for e in range(3)])
    assert torch.equal(out["e.weight"], want)
    assert (out["e.weight"] - w).abs().max() <= w.abs().max() / 8  # e4m3's rounding, no more


@pytest.mark.parametrize(
    "stream,quant,message",
    [
        (
            [("a.weight", torch.zeros(4, 4, dtype=FP8))],
            None,
            "is torch.float8_e4m3fn but config.json has no quantization_config",
        ),
        (
            [("a.weight", torch.zeros(4, 4, dtype=FP8))],
            WeightQuant("fp8", (2, 2)),
            "unpaired fp8 tensor(s): a.weight (no weight_scale_inv",
        ),
        (
            [("a.weight_scale_inv", torch.ones(2, 2))],
            WeightQuant("fp8", (2, 2)),
            "unpaired fp8 tensor(s): a scale (no fp8 weight)",
        ),
        (
            [("a.weight", torch.zeros(4, 6, dtype=FP8)), ("a.weight_scale_inv", torch.ones(2, 2))],
            WeightQuant("fp8", (2, 2)),
            "scales of shape (2, 2) for a weight of shape (4, 6) (expected one per tensor, per "
            "expert or per row, blocks of 2 x 2: (2, 3))",
        ),
        (
            [("a.weight", torch.zeros(4, 6, dtype=FP8)), ("a.weight_scale", torch.ones(3))],
            WeightQuant("fp8", None),
            "scales of shape (3,) for a weight of shape (4, 6) (expected one per tensor, per "
            "expert or per row)",
        ),
        (  # a fused expert tensor has no ".weight": it is an fp8 weight all the same
            [("m.mlp.experts.gate_up_proj", torch.zeros(2, 4, 4, dtype=FP8))],
            None,
            "tensor 'm.mlp.experts.gate_up_proj' is torch.float8_e4m3fn but config.json has no",
        ),
        (
            [("m.mlp.experts.down_proj", torch.zeros(2, 4, 4, dtype=FP8))],
            WeightQuant("fp8", (2, 2)),
            "unpaired fp8 tensor(s): m.mlp.experts.down_proj (no down_proj_scale_inv)",
        ),
    ],
    ids=[
        "no-config",
        "no-factor",
        "no-weight",
        "block-shape",
        "tensor-shape",
        "fused-no-config",
        "fused-no-factor",
    ],
)
def test_what_cannot_be_dequantized_is_named(stream, quant, message) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        list(dequantized(iter(stream), quant))


@pytest.mark.parametrize(
    "quant,message",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' unsupported (supported: 'fp8'"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized"},
            "compressed-tensors format 'pack-quantized' unsupported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}},
            },
            "compressed-tensors group 'g' weights {'type': 'int', 'num_bits': 8} unsupported",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' unsupported (supported: 'e4m3')"),
        (
            {"quant_method": "fp8", "weight_block_size": [128]},
            "weight_block_size must be two integers >= 1 (rows, columns), got [128]",
        ),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "got [0, 128]"),
        ("fp8", "field 'quantization_config' must be an object, got 'fp8'"),
    ],
)
def test_unsupported_quantization_configs_are_refused_by_name(quant, message) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        ModelConfig.from_dict(TINY_QWEN3 | {"quantization_config": quant}, source="cfg.json")
    plain = ModelConfig.from_dict(TINY_QWEN3, source="cfg.json")
    assert plain.quantization is None


def fused_fp8_moe_checkpoint(path: str, scales: bool) -> dict[str, torch.Tensor]:
    """The MoE checkpoint with its experts in transformers 5's fused layout
    (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``), in fp8
    blocks of 32 x 32 with ``<name>_scale_inv`` factors (left out unless ``scales``). Returns
    the dequantized fused tensors the oracle runs."""
    build_checkpoint("moe-8x2", path)
    file = next(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    hf_state = build_hf_model("moe-8x2").state_dict()
    out = {k: v for k, v in load_file(file).items() if ".mlp.experts." not in k}
    oracle = {}
    for key, w in hf_state.items():
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            qf = [quantize(w[e].float(), (32, 32)) for e in range(w.shape[0])]
            q, f = torch.stack([a for a, _ in qf]), torch.stack([b for _, b in qf])
            out[key] = q
            if scales:
                out[key + "_scale_inv"] = f
            oracle[key] = torch.stack([real(a, b, (32, 32)) for a, b in qf])
    out["model.layers.0.mlp.experts.e_score_correction_bias"] = torch.zeros(8)  # not ours
    save_file(out, file, metadata={"format": "pt"})
    config = os.path.join(path, "config.json")
    cfg = json.load(open(config))
    block = {"fmt": "e4m3", "weight_block_size": [32, 32]}
    cfg["quantization_config"] = {"quant_method": "fp8"} | block
    json.dump(cfg, open(config, "w"))
    return oracle


def test_fused_fp8_experts_load_with_their_factors(
    tmp_path, plugin_host, runtime_context, caplog
) -> None:
    """Found by an audit: fused fp8 experts were cast without their factors (relative logit
    error 1.5), and their ``_scale_inv`` factors (or any other name under ``mlp.experts.``)
    crashed the loader with an unpacking error."""
    oracle = fused_fp8_moe_checkpoint(str(tmp_path), scales=True)
    assert_runs_like_transformers("moe-8x2", oracle, str(tmp_path), runtime_context, plugin_host)
    assert "e_score_correction_bias" in caplog.text  # ignored with the other unexpected names


def test_fused_fp8_experts_without_factors_are_refused(
    tmp_path, plugin_host, runtime_context
) -> None:
    fused_fp8_moe_checkpoint(str(tmp_path), scales=False)
    named = r"experts\.(gate_up|down)_proj \(no (gate_up|down)_proj_scale_inv\)"
    with pytest.raises(ModelLoadError, match=named):
        make_worker(str(tmp_path), runtime_context, plugin_host)
