"""Sweep the Triton extend kernel's tiles, head packing and schedule on the GPU (tuning aid).

Phase 1 times every tile (block_m, block_n, warps, stages) with the default head packing and
schedule on the issue's shapes; phase 2 takes the two best tiles and varies heads_per_tile
(1 = no GQA packing) and pairs_per_chunk (1 = request by request, "all" = one global
longest-first order). Each configuration compiles once (~5-10 s); a time guard keeps the
whole run under 4 minutes on an H200. Prints TFLOP/s per configuration and shape, then the
best per shape, and writes every row as JSON to the output path (default benchmarks/results/).
Tiles that do not fit the head dim (shared memory, registers) are reported and skipped.

    python benchmarks/tune_triton_extend.py [out.json] [--head-dim 64|128|256] [--dtype float16]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from execrt.bench.common import median_us
from execrt.bench.extend import DEFAULT_SHAPES, ExtendProblem
from execrt.kernels import attention as K
from execrt.kernels.attention.extend import ExtendTiles, default_extend_tiles
from execrt.kernels.kv_indices import fill_kv_index

TILES = [
    ExtendTiles(128, 64, 8, 3),
    ExtendTiles(128, 64, 8, 4),
    ExtendTiles(128, 64, 8, 2),
    ExtendTiles(128, 32, 8, 3),
    ExtendTiles(128, 32, 8, 4),
    ExtendTiles(64, 64, 4, 3),
    ExtendTiles(64, 64, 4, 4),
    ExtendTiles(64, 32, 4, 3),
    ExtendTiles(64, 128, 4, 3),
    ExtendTiles(64, 64, 8, 3),
]
# Head dim 64 leaves room for wider K/V tiles; at 256 the q tile and the K/V stages of the
# D <= 128 tiles no longer fit in shared memory (227 KB on sm90), so it gets its own list.
TILES_D64 = [ExtendTiles(128, 128, 8, 3), ExtendTiles(128, 128, 8, 2), ExtendTiles(64, 128, 4, 2)]
TILES_D256 = [
    ExtendTiles(64, 32, 8, 3),
    ExtendTiles(64, 32, 8, 2),
    ExtendTiles(64, 32, 4, 3),
    ExtendTiles(64, 64, 8, 2),
    ExtendTiles(64, 64, 4, 2),
    ExtendTiles(128, 32, 8, 2),
    ExtendTiles(128, 32, 8, 3),
    ExtendTiles(32, 32, 4, 3),
    ExtendTiles(32, 64, 4, 2),
]
BUDGET_S = 200  # stop starting new configurations past this (the run must stay < 4 min)


@dataclass
class Config:
    tiles: ExtendTiles
    heads_per_tile: int | None = None  # None: the whole GQA group
    pairs_per_chunk: int | str | None = None  # None: sized to L2; "all": one chunk

    def label(self) -> str:
        t = self.tiles
        heads = "G" if self.heads_per_tile is None else str(self.heads_per_tile)
        chunk = "L2" if self.pairs_per_chunk is None else str(self.pairs_per_chunk)
        return f"m{t.block_m} n{t.block_n} w{t.num_warps} s{t.num_stages} h{heads} c{chunk}"


class Case:
    """A benchmark problem plus the kernel-level index tensors of its one extend step."""

    def __init__(self, bs: int, new: int, prefix: int, d: int, dtype: torch.dtype) -> None:
        self.p = p = ExtendProblem(bs, new, prefix, 32, 8, d, dtype)
        dev = torch.device("cuda")
        seq = torch.full((bs,), p.ctx, dtype=torch.int64, device=dev)
        self.kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.empty(bs * p.ctx, dtype=torch.int32, device=dev)
        rows = torch.arange(1, bs + 1, device=dev)
        fill_kv_index(p.pool.req_to_token, rows, seq, self.kv_indptr, self.kv_indices)
        self.qo_indptr = torch.arange(0, bs * new + 1, new, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.full((bs,), prefix, dtype=torch.int32, device=dev)
        self.outs = [torch.empty_like(p.q) for _ in p.layers]

    def run(self, cfg: Config) -> None:
        p, t = self.p, cfg.tiles
        chunk = cfg.pairs_per_chunk
        for layer, o in zip(p.layers, self.outs, strict=True):
            K.extend_attention(
                p.q,
                p.kv_cache.k_buffers[layer.layer_id],
                p.kv_cache.v_buffers[layer.layer_id],
                o,
                self.qo_indptr,
                self.kv_indptr,
                self.kv_indices,
                self.prefix_lens,
                p.new,
                layer.scaling,
                max_kv_len=p.ctx,
                block_m=t.block_m,
                block_n=t.block_n,
                num_warps=t.num_warps,
                num_stages=t.num_stages,
                heads_per_tile=cfg.heads_per_tile,
                pairs_per_chunk=1 << 30 if chunk == "all" else chunk,  # type: ignore[arg-type]
            )

    def tflops(self, cfg: Config, reps: int = 3, iters: int = 3) -> float:
        self.run(cfg)  # compile / warm up
        us_per_layer = median_us(lambda: self.run(cfg), iters, reps) / len(self.p.layers)
        return self.p.flops / (us_per_layer * 1e-6) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", nargs="?", help="JSON file for every row")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()
    start = time.time()
    dtype = getattr(torch, args.dtype)
    cases = [Case(*shape, args.head_dim, dtype) for shape in DEFAULT_SHAPES]
    names = [f"{c.p.bs}x{c.p.new}+{c.p.prefix}" for c in cases]
    rows: list[dict[str, object]] = []
    results: dict[str, list[float]] = {}

    def sweep(cfg: Config) -> None:
        if time.time() - start > BUDGET_S:
            print(f"{cfg.label():<28} skipped: time budget spent", flush=True)
            return
        cells = []
        try:
            for name, case in zip(names, cases, strict=True):
                tf = case.tflops(cfg)
                cells.append(tf)
                rows.append({"shape": name, "config": cfg.label(), "tflops": tf, **asdict(cfg)})
        except Exception as exc:  # e.g. out of shared memory: report it, go on
            print(f"{cfg.label():<28} failed: {type(exc).__name__}: {exc}"[:200], flush=True)
            return
        results[cfg.label()] = cells
        print(f"{cfg.label():<28} " + " ".join(f"{x:7.1f}" for x in cells), flush=True)

    # The table's entry for this head dim and dtype first: the rows compare against it.
    default_tiles = default_extend_tiles(dtype, args.head_dim, torch.device("cuda"))
    pool = TILES_D256 if args.head_dim > 128 else TILES + (TILES_D64 if args.head_dim <= 64 else [])
    tiles_list = [default_tiles] + [t for t in pool if t != default_tiles]
    print(f"# head dim {args.head_dim}, {args.dtype}; default {Config(default_tiles).label()}")
    print(f"{'TFLOP/s':<28} " + " ".join(f"{n:>7}"[-7:] for n in names))
    for tiles in tiles_list:
        sweep(Config(tiles))
    best_per_shape = [max(cells[i] for cells in results.values()) for i in range(len(cases))]

    def score(cells: list[float]) -> float:  # geometric mean of the share of each shape's best
        return math.exp(sum(math.log(c / b) for c, b in zip(cells, best_per_shape, strict=True)))

    ranked = sorted(results, key=lambda k: score(results[k]), reverse=True)
    by_label = {Config(t).label(): t for t in tiles_list}
    for label in ranked[:2]:
        tiles = by_label[label]
        for extra in (Config(tiles, heads_per_tile=1), Config(tiles, pairs_per_chunk=1),
                      Config(tiles, pairs_per_chunk="all")):  # fmt: skip
            sweep(extra)

    best_per_shape = [max(cells[i] for cells in results.values()) for i in range(len(cases))]
    ranked = sorted(results, key=lambda k: score(results[k]), reverse=True)
    print(f"\n# best overall (geometric mean of share of best): {ranked[0]}")
    print(f"# elapsed {time.time() - start:.0f} s")
    print(f"{'shape':<16} {'best TFLOP/s':>12}  best config / default config TFLOP/s")
    default = Config(default_tiles).label()
    for i, name in enumerate(names):
        label = max(results, key=lambda k: results[k][i])
        dflt = results.get(default, [float("nan")] * len(names))[i]
        print(f"{name:<16} {best_per_shape[i]:>12.1f}  {label} / {dflt:.1f}")
    out = args.out
    if out is None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        os.makedirs("benchmarks/results", exist_ok=True)
        out = f"benchmarks/results/triton-extend-tune-{stamp}.json"
    with open(out, "w") as fh:
        meta = {"gpu": torch.cuda.get_device_name(), "head_dim": args.head_dim, "dtype": args.dtype}
        json.dump(meta | {"rows": rows}, fh, indent=1, default=str)
    print(f"# saved {out}")


if __name__ == "__main__":
    main()
