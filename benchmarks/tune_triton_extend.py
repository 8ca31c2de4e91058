"""Sweep the Triton extend kernels' tiles, TMA, head packing and schedule on the GPU, and write
the tuned table the kernels read (tuning aid).

The kernels run on the issue's shapes (benchmark problems: random slots, the new tokens' K/V
handed as a model hands them): ``fresh`` (prefix gathered from the cache, new tokens from
their own rows, TMA on sm90), ``gather`` (everything through the cache: the fallback for
fp8 caches and callers without the step's K/V) and ``ws`` (what ``gather`` reads, by the
warp-specialised Gluon kernel: sm90, head dims 64 and 128; left out where it cannot run).
Phase 1 times each kernel's tiles (block_m, block_n, warps, stages; fresh also without TMA);
phase 2 takes each kernel's best tile and varies heads_per_tile (1 = no GQA packing) and
pairs_per_chunk (1 = request by request, "all" = one global longest-first order), and for ws
one persistent program per SM. Each configuration compiles once (~5-10 s); a time guard keeps
the run under 4 minutes on an H200. Prints TFLOP/s per configuration and shape, the best per
shape, and writes every row as JSON to ``out``.

The best configuration of each kernel (geometric mean over the shapes of its share of the
shape's best) goes into the tuned table, with ``use`` naming the kernel whose best is faster
by that measure: ``execrt/kernels/attention/extend_configs/<GPU>.json`` (``--table``; an
entry for another dtype or head dim already there is kept), which ``extend_attention`` reads
from then on in this checkout (commit it to keep it).

    python benchmarks/tune_triton_extend.py [out.json] [--head-dim 64|128|256]
        [--dtype float16] [--kernels fresh,gather,ws] [--table PATH | --no-table]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import triton

from execrt.bench.common import median_us
from execrt.bench.extend import DEFAULT_SHAPES, ExtendProblem
from execrt.kernels import attention as K
from execrt.kernels.attention import extend as ext
from execrt.kernels.attention.extend import FRESH, GATHER, WS, ExtendChoice, ExtendTiles
from execrt.kernels.attention.extend_ws import ws_unsupported
from execrt.kernels.kv_indices import fill_kv_index

T = ExtendTiles
# Per (kernel, head-dim class): the tiles of phase 1 (the table's current entry runs first).
# Hopper flash attention wants 128-row q tiles over two warpgroups and 64-128 K/V rows per
# step; 64-row tiles with 4 warps fit two programs per SM. Tiles that compiled with spills
# for sm90 (triton 3.6 AOT) are left out.
TILES = {
    (FRESH, 64): [T(128, 64, 8, 3), T(128, 128, 8, 3), T(128, 128, 8, 2), T(128, 64, 8, 4)],
    (FRESH, 128): [
        T(128, 64, 8, 3),
        T(128, 64, 8, 4),
        T(128, 64, 8, 2),
        T(128, 128, 8, 2),
        T(128, 32, 8, 4),
        T(64, 64, 4, 3),
    ],
    (FRESH, 256): [T(128, 32, 8, 3), T(128, 32, 8, 2), T(64, 32, 4, 3), T(64, 64, 8, 2)],
    (GATHER, 64): [T(128, 64, 8, 3), T(128, 64, 8, 4)],
    (GATHER, 128): [T(128, 64, 8, 3), T(128, 64, 8, 4)],
    (GATHER, 256): [T(128, 32, 8, 3)],
    # ws: 8 consumer warps (two warp groups of 64 rows); the ring's stages of 64- or 128-token
    # blocks within 227 KB with the query tile.
    (WS, 64): [T(128, 128, 8, 3), T(128, 128, 8, 4), T(128, 64, 8, 4)],
    (WS, 128): [T(128, 128, 8, 2), T(128, 128, 8, 3), T(128, 64, 8, 4), T(128, 64, 8, 3)],
}
BUDGET_S = 200  # default --budget: no new configuration starts past it (the run stays < 4 min)


@dataclass
class Config:
    kernel: str
    choice: ExtendChoice
    pairs_all: bool = False  # pairs_per_chunk "all": one global longest-first order

    def label(self) -> str:
        c, t = self.choice, self.choice.tiles
        heads = "G" if c.heads_per_tile is None else str(c.heads_per_tile)
        chunk = (
            "all"
            if self.pairs_all
            else "L2"
            if c.pairs_per_chunk is None
            else str(c.pairs_per_chunk)
        )
        tma = (" tma" if c.tma else " ptr") if self.kernel == FRESH else ""
        tma += " pers" if self.kernel == WS and c.persistent else ""
        return (
            f"{self.kernel:<6} m{t.block_m} n{t.block_n} w{t.num_warps} s{t.num_stages} "
            f"h{heads} c{chunk}{tma}"
        )


class Case:
    """A benchmark problem plus the kernel-level index tensors of its one extend step."""

    def __init__(
        self, bs: int, new: int, prefix: int, d: int, dtype: torch.dtype, device: str = "cuda"
    ) -> None:
        self.p = p = ExtendProblem(bs, new, prefix, 32, 8, d, dtype, device=device)
        dev = torch.device(device)
        seq = torch.full((bs,), p.ctx, dtype=torch.int64, device=dev)
        self.kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.empty(bs * p.ctx, dtype=torch.int32, device=dev)
        rows = torch.arange(1, bs + 1, device=dev)
        fill_kv_index(p.pool.req_to_token, rows, seq, self.kv_indptr, self.kv_indices)
        self.qo_indptr = torch.arange(0, bs * new + 1, new, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.full((bs,), prefix, dtype=torch.int32, device=dev)
        self.outs = [torch.empty_like(p.q) for _ in p.layers]
        self.refs = {b: p.reference(b) for b in sorted({0, bs - 1})}  # layer 0, fp32

    def rel_err(self) -> float:
        """Worst norm-relative error of layer 0's first and last request against fp32."""
        new = self.p.new
        return max(
            float((self.outs[0][b * new : (b + 1) * new].float() - ref).norm() / ref.norm())
            for b, ref in self.refs.items()
        )

    def run(self, cfg: Config) -> None:
        p, c, t = self.p, cfg.choice, cfg.choice.tiles
        for layer, o in zip(p.layers, self.outs, strict=True):
            k_new, v_new = p.kv[layer.layer_id] if cfg.kernel == FRESH else (None, None)
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
                k_new=k_new,
                v_new=v_new,
                kernel=cfg.kernel,
                tma=c.tma if cfg.kernel == FRESH else None,
                persistent=c.persistent if cfg.kernel == WS else None,
                block_m=t.block_m,
                block_n=t.block_n,
                num_warps=t.num_warps,
                num_stages=t.num_stages,
                heads_per_tile=c.heads_per_tile,
                pairs_per_chunk=1 << 30 if cfg.pairs_all else c.pairs_per_chunk,
            )

    def tflops(self, cfg: Config, reps: int = 3, iters: int = 3) -> float:
        self.run(cfg)  # compile / warm up
        err = self.rel_err()
        if not err < 2e-2:  # a wrong configuration must not win
            raise RuntimeError(f"relative error {err:.3g} against fp32")
        if self.p.device.type == "cuda":
            us = median_us(lambda: self.run(cfg), iters, reps)
        else:  # the interpreter's dry run: wall clock, one call
            begin = time.perf_counter()
            self.run(cfg)
            us = (time.perf_counter() - begin) * 1e6
        us_per_layer = us / len(self.p.layers)
        return self.p.flops / (us_per_layer * 1e-6) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", nargs="?", help="JSON file for every row")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument(
        "--kernels", default="fresh,gather,ws", help="kernels to sweep (default %(default)s)"
    )
    ap.add_argument("--table", help="tuned table to write (default: the one the kernels read)")
    ap.add_argument("--no-table", action="store_true", help="write no tuned table")
    ap.add_argument("--shapes", help="requests x new + prefix, e.g. 1x8192+0,64x128+1024")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under the interpreter")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds (default %(default)s)")
    args = ap.parse_args()
    start = time.time()
    dtype = getattr(torch, args.dtype)
    kernels = [k for k in args.kernels.split(",") if k]
    if not kernels or any(k not in ext.KERNELS for k in kernels):
        raise SystemExit(f"--kernels {args.kernels!r}: choose from {', '.join(ext.KERNELS)}")
    dev = torch.device(args.device)
    if WS in kernels:
        probe = torch.zeros(1, 1, args.head_dim, dtype=dtype, device=dev)
        why = ws_unsupported(probe, probe, probe, None, args.head_dim, args.head_dim)
        if why is not None:
            print(f"# ws left out: {why}")
            kernels.remove(WS)
    if not kernels:
        raise SystemExit("no kernel left to sweep")
    shapes = DEFAULT_SHAPES if args.shapes is None else parse_shapes(args.shapes)
    cases = [Case(*shape, args.head_dim, dtype, args.device) for shape in shapes]
    names = [f"{c.p.bs}x{c.p.new}+{c.p.prefix}" for c in cases]
    rows: list[dict[str, object]] = []
    results: dict[str, list[float]] = {}
    configs: dict[str, Config] = {}

    def sweep(cfg: Config) -> None:
        label = cfg.label()
        if label in results:
            return
        if time.time() - start > args.budget:
            print(f"{label:<36} skipped: time budget spent", flush=True)
            return
        cells = []
        try:
            for name, case in zip(names, cases, strict=True):
                tf = case.tflops(cfg)
                cells.append(tf)
                rows.append(
                    {"shape": name, "config": label, "tflops": tf, "kernel": cfg.kernel,
                     "pairs_all": cfg.pairs_all, **cfg.choice.to_json()}
                )  # fmt: skip
        except Exception as exc:  # e.g. out of shared memory: report it, go on
            print(f"{label:<36} failed: {type(exc).__name__}: {exc}"[:200], flush=True)
            return
        results[label], configs[label] = cells, cfg
        print(f"{label:<36} " + " ".join(f"{x:7.1f}" for x in cells), flush=True)

    size = 64 if args.head_dim <= 64 else 128 if args.head_dim <= 128 else 256
    current = {k: ext.extend_choice(dtype, args.head_dim, dev, k) for k in kernels}
    print(f"# head dim {args.head_dim}, {args.dtype}, triton {triton.__version__}; current: "
          + "; ".join(Config(k, c).label() for k, c in current.items()))  # fmt: skip
    print(f"{'TFLOP/s':<36} " + " ".join(f"{n:>7}"[-7:] for n in names))
    for kernel in kernels:  # phase 1: tiles
        tma_default = current[kernel].tma
        sweep(Config(kernel, current[kernel]))
        for tiles in TILES[(kernel, size)]:
            sweep(Config(kernel, ExtendChoice(tiles, tma=tma_default)))
        if kernel == FRESH:  # what TMA is worth, on the kernel's current tiles
            sweep(Config(kernel, ExtendChoice(current[kernel].tiles, tma=not tma_default)))

    def best_per_shape() -> list[float]:
        return [max(cells[i] for cells in results.values()) for i in range(len(cases))]

    def score(label: str) -> float:  # geometric mean of the share of each shape's best
        best = best_per_shape()
        return math.exp(
            sum(math.log(c / b) for c, b in zip(results[label], best, strict=True)) / len(best)
        )

    def best_of(kernel: str) -> str | None:
        labels = [lb for lb, c in configs.items() if c.kernel == kernel]
        return max(labels, key=score) if labels else None

    for kernel in kernels:  # phase 2: packing and schedule on the kernel's best tile
        top = best_of(kernel)
        if top is None:
            continue
        base = configs[top].choice
        sweep(Config(kernel, ExtendChoice(base.tiles, 1, base.pairs_per_chunk, base.tma)))
        sweep(Config(kernel, ExtendChoice(base.tiles, base.heads_per_tile, 1, base.tma)))
        sweep(Config(kernel, base, pairs_all=True))
        if kernel == WS:  # one program per SM walking the tiles
            sweep(Config(kernel, ExtendChoice(base.tiles, base.heads_per_tile,
                                              base.pairs_per_chunk, base.tma, True)))  # fmt: skip

    if not results:
        raise SystemExit("no configuration ran")
    best = best_per_shape()
    print(f"\n# elapsed {time.time() - start:.0f} s")
    print(f"{'shape':<16} {'best TFLOP/s':>12}  best config")
    for i, name in enumerate(names):
        label = max(results, key=lambda k: results[k][i])
        print(f"{name:<16} {best[i]:>12.1f}  {label}")
    entry: dict[str, object] = {}
    chosen: dict[str, str] = {}
    for kernel in kernels:
        # "all" (one global order) is not a table value: the best configuration without it.
        top = max(
            (lb for lb, c in configs.items() if c.kernel == kernel and not c.pairs_all),
            key=score,
            default=None,
        )
        if top is not None:
            chosen[kernel] = top
            entry[kernel] = configs[top].choice.to_json() | {"tflops": results[top]}
            print(f"# best {kernel}: {top}  ({score(top):.3f} of the per-shape best)")
    if not chosen:
        raise SystemExit("no table configuration ran")
    use = max(chosen, key=lambda k: score(chosen[k]))
    entry["use"] = use
    entry["shapes"] = names
    print(f"# table entry {ext.table_key(dtype, args.head_dim)}: use {use}")

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out
    if out is None:
        os.makedirs("benchmarks/results", exist_ok=True)
        out = f"benchmarks/results/triton-extend-tune-{stamp}.json"
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    meta = {
        "gpu": gpu,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "triton": triton.__version__,
        "date": stamp,
    }
    with open(out, "w") as fh:
        json.dump(meta | {"entry": entry, "rows": rows}, fh, indent=1, default=str)
    print(f"# saved {out}")
    if not args.no_table:
        name = ext.table_file_name(gpu)
        path = args.table or os.path.join(ext.CONFIG_DIR, name)
        write_table(path, ext.table_key(dtype, args.head_dim), entry, meta)
        print(f"# tuned table {path} (entry {ext.table_key(dtype, args.head_dim)})")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"1x8192+0,64x128+1024"`` -> ``[(1, 8192, 0), (64, 128, 1024)]``."""
    shapes = []
    for item in text.split(","):
        bs, rest = item.split("x")
        new, prefix = rest.split("+")
        shapes.append((int(bs), int(new), int(prefix)))
    return shapes


def write_table(path: str, key: str, entry: dict[str, object], meta: dict[str, object]) -> None:
    """Merge ``entry`` under ``key`` into the table at ``path`` (other keys kept)."""
    table: dict[str, object] = {"entries": {}}
    if os.path.exists(path):
        with open(path) as fh:
            table = json.load(fh)
    entries = table.setdefault("entries", {})
    assert isinstance(entries, dict)
    entries[key] = entry | {"tuned": meta}
    table["gpu"] = meta["gpu"]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(table, fh, indent=1, sort_keys=True)
        fh.write("\n")


if __name__ == "__main__":
    main()
