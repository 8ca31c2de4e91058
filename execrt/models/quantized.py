"""FP8 checkpoints (``quantization_config``), dequantized as they load.

Layouts in use: fine-grained blocks (DeepSeek-V3's and Qwen3's ``-FP8`` releases:
``weight_block_size [bn, bk]``, each ``<proj>.weight`` in e4m3 beside a ``<proj>.weight_scale_inv``
of ``[ceil(N / bn), ceil(K / bk)]`` fp32 factors), per tensor (one ``<proj>.weight_scale``), and
compressed-tensors' ``float-quantized`` format (llm-compressor's FP8 and FP8-dynamic schemes:
``weight_scale`` per tensor, per output channel ``[N, 1]`` or per block).
Either way the real weight is ``stored * factor`` over its block, which is what the model
receives, in fp32, before its own dtype's rounding: the runtime computes in that dtype, so an FP8
checkpoint serves at the cost (and accuracy) of its dequantized weights. Activation scales
(``input_scale``, static activation schemes) are dropped: activations stay in the model dtype.

Fused expert tensors (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj``,
transformers 5's layout) carry no ``.weight`` suffix: their factors are ``<name>_scale_inv``.

Every other ``quant_method`` or scheme (AWQ, GPTQ, compressed-tensors' integer or packed
formats, bitsandbytes, MXFP4, ...) is refused by name, as is an fp8 tensor without its factor:
a cast of the stored bytes alone would run and be silently wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from execrt.core.errors import ModelLoadError
from execrt.core.kv_quant import FP8_DTYPES

logger = logging.getLogger(__name__)

_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
#: a factor of a tensor named without ``.weight`` (fused experts): ``<name>_scale_inv``
_BARE_SCALE_SUFFIX = "_scale_inv"


def _weight_key(name: str) -> str:
    """What pairs an fp8 tensor with its factors: its module for ``<module>.weight``, else
    its own name (a fused expert tensor)."""
    return name.removesuffix(".weight")


def _factor_key(name: str) -> str | None:
    """The key of the fp8 tensor that the factor ``name`` scales, or None if it is no factor."""
    suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
    if suffix is not None:
        return name.removesuffix(suffix)
    if name.endswith(_BARE_SCALE_SUFFIX):
        return name.removesuffix(_BARE_SCALE_SUFFIX)
    return None


_DROPPED_SUFFIXES = (".input_scale",)
#: compressed-tensors' weight strategies: one factor per tensor, output channel or block
_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class WeightQuant:
    """How a checkpoint's linear weights are stored (config.json's ``quantization_config``)."""

    method: str  # "fp8" or "compressed-tensors"
    #: (rows, columns) per factor; None: one factor per tensor (or per row, by its shape)
    block: tuple[int, int] | None


def parse_quantization(cfg: dict[str, Any], source: str) -> WeightQuant | None:
    """``cfg``'s ``quantization_config`` as a WeightQuant (None when absent); a ModelLoadError
    names any method or field this loader cannot honour."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelLoadError(f"{source}: field 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ModelLoadError(
                f"{source}: quantization_config fmt {fmt!r} unsupported (supported: 'e4m3')"
            )
        block = q.get("weight_block_size")
        return WeightQuant(
            "fp8", None if block is None else _block(block, source, "weight_block_size")
        )
    if method == "compressed-tensors":
        return _compressed_tensors(q, source)
    raise ModelLoadError(
        f"{source}: quantization_config quant_method {method!r} unsupported (supported: 'fp8' "
        "and compressed-tensors' fp8 weights, dequantized at load; or an unquantized "
        "checkpoint, or a GGUF file)"
    )


def _block(block: Any, source: str, name: str) -> tuple[int, int]:
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
    ):
        raise ModelLoadError(
            f"{source}: quantization_config {name} must be two integers >= 1 "
            f"(rows, columns), got {block!r}"
        )
    return block[0], block[1]


def _compressed_tensors(q: dict[str, Any], source: str) -> WeightQuant:
    """compressed-tensors' ``float-quantized`` checkpoints (llm-compressor's FP8 and
    FP8-dynamic schemes): every group's weights 8-bit symmetric floats, per tensor, per
    output channel or in blocks (their scale's shape says which when loading)."""
    fmt = q.get("format")
    groups = q.get("config_groups")
    if fmt not in ("float-quantized", "naive-quantized") or not isinstance(groups, dict):
        raise ModelLoadError(
            f"{source}: compressed-tensors format {fmt!r} unsupported (supported: "
            "'float-quantized' or 'naive-quantized', fp8 weights)"
        )
    blocks = set()
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        if not (
            isinstance(w, dict)
            and (w.get("type"), w.get("num_bits"), w.get("symmetric", True)) == ("float", 8, True)
            and w.get("strategy") in _STRATEGIES
        ):
            raise ModelLoadError(
                f"{source}: compressed-tensors group {name!r} weights {w!r} unsupported "
                "(supported: type float, num_bits 8, symmetric, strategy "
                f"{' / '.join(_STRATEGIES)})"
            )
        if w["strategy"] == "block":
            blocks.add(_block(w.get("block_structure"), source, f"{name} block_structure"))
    if len(blocks) > 1:
        raise ModelLoadError(
            f"{source}: compressed-tensors groups of different blocks {sorted(blocks)}"
        )
    return WeightQuant("compressed-tensors", blocks.pop() if blocks else None)


def dequantized(
    weights: Iterator[tuple[str, torch.Tensor]],
    quant: WeightQuant | None,
    device: torch.device | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each fp8 weight multiplied by its factors (fp32; on ``device`` where
    given, a GPU doing the arithmetic) and the factors and activation scales consumed. A
    weight waits for its factors (and factors for their weight) whichever comes first, across
    files; one left without the other at the end raises ModelLoadError naming it."""
    waiting: dict[str, tuple[str, torch.Tensor]] = {}  # fp8 tensors (name, value) by key
    factors: dict[str, torch.Tensor] = {}
    dropped = 0
    for name, tensor in weights:
        if tensor.dtype in FP8_DTYPES:  # a weight, whatever its name: never cast unscaled
            if quant is None:
                raise ModelLoadError(
                    f"model: tensor {name!r} is {tensor.dtype} but config.json has no "
                    "quantization_config to say how to scale it"
                )
            key = _weight_key(name)
            if key in factors:
                yield name, _scaled(name, tensor, factors.pop(key), quant, device)
            else:
                waiting[key] = (name, tensor)
            continue
        scaled = _factor_key(name) if quant is not None else None
        if quant is not None and scaled is not None:
            if scaled in waiting:
                weight, value = waiting.pop(scaled)
                yield weight, _scaled(weight, value, tensor, quant, device)
            else:
                factors[scaled] = tensor
            continue
        if quant is not None and name.endswith(_DROPPED_SUFFIXES):
            dropped += 1
            continue
        yield name, tensor
    if waiting or factors:
        lonely = [f"{weight} (no {_expected_factors(weight)})" for weight, _ in waiting.values()]
        lonely += [f"{k} scale (no fp8 weight)" for k in factors]
        raise ModelLoadError(f"model: unpaired fp8 tensor(s): {', '.join(sorted(lonely)[:5])}")
    if dropped:
        logger.info("model: %d activation scale(s) unused: activations stay unquantized", dropped)


def _expected_factors(weight: str) -> str:
    """The names a factor of the fp8 tensor ``weight`` may have, for an error message."""
    if weight.endswith(".weight"):
        return "weight_scale_inv / weight_scale"
    return weight.rsplit(".", 1)[-1] + _BARE_SCALE_SUFFIX


def _scaled(
    name: str,
    weight: torch.Tensor,
    factor: torch.Tensor,
    quant: WeightQuant,
    device: torch.device | None,
) -> torch.Tensor:
    """``weight`` (fp8, 2-D or stacked experts ``[E, N, K]``) times its factors, in fp32."""
    w = weight.to(device) if device is not None else weight
    f = factor.to(w.device, torch.float32)
    rows, cols = w.shape[-2:]
    grid = None
    if quant.block is not None:
        bn, bk = quant.block
        grid = (*w.shape[:-2], -(-rows // bn), -(-cols // bk))
    if f.numel() == 1:  # one factor per tensor
        return w.float() * f.reshape(())
    if grid is not None and tuple(f.shape) == grid:
        full = f.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)
        return w.float() * full[..., :cols]
    lead, rows_of = tuple(w.shape[:-2]), tuple(w.shape[:-1])
    if tuple(f.shape) in (lead, (*lead, 1, 1)):  # one per expert of a stacked [E, N, K]
        return w.float() * f.reshape(*lead, 1, 1)
    if tuple(f.shape) in (rows_of, (*rows_of, 1)):  # one per output row (compressed-tensors)
        return w.float() * f.reshape(*rows_of, 1)
    blocks = "" if grid is None else f", blocks of {bn} x {bk}: {grid}"
    raise ModelLoadError(
        f"model: tensor {name!r}: scales of shape {tuple(f.shape)} for a weight of shape "
        f"{tuple(w.shape)} (expected one per tensor, per expert or per row{blocks})"
    )
