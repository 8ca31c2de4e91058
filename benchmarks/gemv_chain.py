"""The skinny GEMM's tiles in a dependent chain at one row: what a decode step's projection costs
past the kernel ahead, which the tuner (one projection timed alone, its calls independent)
does not see.

For each projection shape of a model (0.6B: q/k/v 4096 x 1024, o 1024 x 2048, gate/up
6144 x 1024, down 1024 x 3072), a CUDA graph of ``--calls`` launches of that shape, each reading
the output of the one before (its first ``N`` inputs; every call its own weight, so the weights
stream from DRAM as a step's do), under PDL. Per tile (``block_n, block_k, warps, stages``, the
preload on or off) it reports µs per call and the share of the copy bandwidth measured in the
same run. Each runs the variant the step runs at one row (``STEP_VARIANTS``: the norm in front
of q/k/v and gate/up, SwiGLU on down's input; ``--plain`` for none). The tuned table's tile
for M = 1 comes first. Each chain's last output is checked
against the table tile's (the same arithmetic per row, so equal up to the K order of the
tile: relative 1e-2 in bf16).

Usage (GPU): ``python benchmarks/gemv_chain.py [--model qwen3-0.6b] [--calls 112] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace

import torch

from execrt.bench.common import copy_bandwidth_gbps, graph_us
from execrt.bench.environment import write_run
from execrt.bench.models import MODELS, projection_shapes
from execrt.kernels import triton_linear as tl_mod
from execrt.kernels.norm import fused_add_rmsnorm
from execrt.kernels.triton_linear import (
    NORM,
    PLAIN,
    SWIGLU_IN,
    SWIGLU_OUT,
    NormIn,
    SkinnyTile,
    launch,
)

#: The dense benchmark models (an MoE model's experts are no skinny GEMM).
DENSE = sorted(name for name, c in MODELS.items() if not c.get("num_experts"))


#: The variant each projection runs in a decode step (the H100 table's choices): at one row
#: q/k/v and gate/up take the residual add + RMSNorm in front and down the SwiGLU of gate/up's
#: output on its input; at more rows gate/up writes the SwiGLU itself (its norm apart).
STEP_VARIANTS = {
    1: {"qkv": NORM, "o": PLAIN, "gate_up": NORM, "down": SWIGLU_IN, "lm_head": PLAIN},
    2: {"qkv": NORM, "o": PLAIN, "gate_up": SWIGLU_OUT, "down": PLAIN, "lm_head": PLAIN},
}
#: Weight copies of a shape at most (the LM head's are 0.3-1.2 GB each; two already miss L2).
MAX_COPY_BYTES = 4 << 30


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def candidates(
    n: int, k: int, variant: str, m: int, norm: bool = False
) -> list[tuple[SkinnyTile, bool]]:
    """Tiles to time, preload off and on. One row: CUDA-core tiles, thin and fat rows, whole-K
    and split K steps (a norm in front: inside the main loop, ``late_norm``). More rows: the
    tensor-core tiles (split-K too where the output is narrow) and a few CUDA-core ones; a
    norm in front (``norm``) also inside the main loop (``late_norm``, whole rows only)."""
    out = []
    if m == 1:
        for block_n in (4, 8, 16):
            for block_k in sorted({min(_pow2(k), 4096), 1024, 512}):
                if block_n * block_k > 16384:  # > 128 bf16 values a thread at 4 warps
                    continue
                for warps in (4, 8):
                    for preload in (False, True):
                        tile = SkinnyTile(block_n, block_k, num_warps=warps, num_stages=2,
                                          late_norm=variant == NORM)  # fmt: skip
                        out.append((tile, preload))
        return out
    width = n // 2 if variant == SWIGLU_OUT else n
    for block_n in (16, 32, 64):
        for block_k in (128, 256):
            for stages in (3, 4):
                for split in (1, 2, 4) if width <= 2048 else (1,):
                    for preload in (False, True):
                        tile = SkinnyTile(block_n, block_k, use_dot=True, num_warps=4,
                                          num_stages=stages, split_k=split)  # fmt: skip
                        out.append((tile, preload))
                        if norm and split == 1:
                            out.append((replace(tile, late_norm=True), preload))
    if m <= 16:
        for block_n in (4, 8):
            for block_k in (256, 512):
                for preload in (False, True):
                    out.append((SkinnyTile(block_n, block_k, num_stages=2), preload))
                    if norm:
                        tile = SkinnyTile(block_n, block_k, num_stages=2, late_norm=True)
                        out.append((tile, preload))
    return out


def _chain(bufs, weights, n, tile, preload, variant, norm, apart=False) -> None:
    for i, w in enumerate(weights):
        k = w.shape[1] * (2 if variant == SWIGLU_IN else 1)
        x = bufs[i][:, :k]
        if apart:  # the norm kernel of its own, then the product without it (the step's "apart")
            x, _ = fused_add_rmsnorm(x, norm.residual, norm.weight, norm.eps, use_triton=True)
        launch(x, w, None, tile, out=bufs[i + 1][:, :n], preload=preload,
               swiglu=variant == SWIGLU_IN, swiglu_out=variant == SWIGLU_OUT,
               norm=None if apart else norm)  # fmt: skip


def run(
    model: str,
    calls: int,
    only: list[str] | None,
    step_variants: bool,
    m: int = 1,
    gate_up_norm: bool = False,
) -> list[dict]:
    dev = torch.device("cuda")
    copy_gbps = copy_bandwidth_gbps()
    records = []
    for name, (w_rows, k) in projection_shapes(model).items():
        if only and name not in only:
            continue
        variant = STEP_VARIANTS[min(m, 2)][name] if step_variants else PLAIN
        n = w_rows // 2 if variant == SWIGLU_OUT else w_rows  # the output's width
        gen = torch.Generator(device=dev).manual_seed(0)
        copies = min(calls, max(2, MAX_COPY_BYTES // (w_rows * k * 2)))
        weights = [
            (torch.randn(w_rows, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
            for _ in range(copies)
        ]
        width = max(n, 2 * k)  # each call reads columns :k (:2k) of its buffer, writes :n
        bufs = [torch.randn(m, width, device=dev, generator=gen).to(torch.bfloat16)
                for _ in range(copies + 1)]  # fmt: skip
        first = bufs[0].clone()
        norm = None
        with_norm = variant == NORM or (gate_up_norm and name == "gate_up" and m > 1)
        if with_norm:  # the residual stream and the norm weight; x + r lands in scratch
            # the residual has x's strides (a view of a buffer as wide as the chain's)
            residual = torch.randn(m, width, device=dev, generator=gen).to(torch.bfloat16)[:, :k]
            norm_w = (torch.rand(k, device=dev, generator=gen) + 0.5).to(torch.bfloat16)
            norm = NormIn(
                norm_w, 1e-6, residual, torch.empty(m, k, dtype=torch.bfloat16, device=dev)
            )
        tuned = tl_mod.pick_tile(m, w_rows, k, torch.bfloat16, dev, variant)
        # The table's tile; one that leaves a norm in front to the norm kernel runs behind it.
        apart = norm is not None and tuned is not None and not tuned.fuse_norm
        arms = [(tuned, None, "apart" if apart else "table")] if tuned is not None else []
        arms += [(t, p, "candidate") for t, p in candidates(w_rows, k, variant, m, with_norm)]
        ref = None
        floor_us = w_rows * k * 2 / copy_gbps / 1e3
        for tile, preload, kind in arms:
            bufs[0].copy_(first)
            fn = functools.partial(
                _chain, bufs, weights, n, tile, preload, variant, norm, kind == "apart"
            )
            try:
                us = graph_us(fn, 10, 5) / copies
            except Exception as exc:  # a tile this triton cannot compile: skip it, say why
                records.append({"shape": name, "tile": str(tile), "error": str(exc)[:200]})
                continue
            got = bufs[copies][:, :n].float()
            ref = got if ref is None else ref
            err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            records.append({
                "model": model, "shape": name, "rows": m, "n": w_rows, "k": k, "kind": kind,
                "variant": variant + ("+norm" if norm is not None and variant != NORM else ""),
                "split_k": tile.split_k,
                "block_n": tile.block_n, "block_k": tile.block_k, "warps": tile.num_warps,
                "stages": tile.num_stages, "late_norm": tile.late_norm, "use_dot": tile.use_dot,
                "preload": preload, "us_per_call": round(us, 3),
                "floor_us": round(floor_us, 3), "pct_copy": round(100 * floor_us / us, 1),
                "max_rel_err_vs_first": err, "copy_gbps": round(copy_gbps, 1),
            })  # fmt: skip
        del weights, bufs
        torch.cuda.empty_cache()
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", choices=DENSE)
    ap.add_argument("--calls", type=int, default=112)
    ap.add_argument("--shapes", help="comma-separated subset of the model's shapes")
    ap.add_argument("--rows", type=int, default=1, help="M: the decode batch (default: 1)")
    ap.add_argument("--plain", action="store_true", help="every shape plain (no norm, no SwiGLU)")
    ap.add_argument(
        "--gate-up-norm",
        action="store_true",
        help="more rows: gate/up (SwiGLU out) takes the norm in front, each tile against the "
        "norm kernel + the table's tile ('apart')",
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    only = args.shapes.split(",") if args.shapes else None
    records = run(args.model, args.calls, only, not args.plain, args.rows, args.gate_up_norm)
    print(f"GPU {torch.cuda.get_device_name(0)}")
    for shape in dict.fromkeys(r["shape"] for r in records):
        rows = [r for r in records if r["shape"] == shape and "us_per_call" in r]
        rows.sort(key=lambda r: r["us_per_call"])
        table = [r for r in rows if r["kind"] == "table"]
        print(f"## {shape}: table {table[0]['us_per_call'] if table else '-'} us; best 6:")
        for r in rows[:6]:
            keys = ("block_n", "block_k", "warps", "stages", "split_k", "use_dot", "preload",
                    "us_per_call", "pct_copy")  # fmt: skip
            print(json.dumps({key: r[key] for key in keys}))
    if args.json:
        write_run(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
