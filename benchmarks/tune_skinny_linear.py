"""Tune the skinny-GEMM tiles on this GPU by what a decode layer pays; write the package's table.

For every projection of the benchmark models (``execrt.bench.models.MODELS``: q/k/v, o,
gate/up, down, router, LM head) and each row count, each way the layer can run the call is
timed with all of its kernels, graph-replayed over rotated weight copies (so no call finds its
weight in L2; launch gaps count), after every candidate tile was checked against an fp32
oracle:

- ``plain`` (every projection): the best tile, or cuBLAS unless a tile beats it by ``--margin``;
- ``norm`` (q/k/v, gate/up, LM head: a residual add + RMSNorm in front): the norm inside the
  best tile, or ``apart`` (the norm kernel, then the plain choice) if that is faster by
  ``--margin`` (one kernel fewer wins ties);
- ``swiglu_in`` (down): SwiGLU computed while loading down's input, or ``apart``
  (``silu_and_mul``, then the plain choice; cuBLAS's split-K brings its reduce kernel);
- ``swiglu_out`` (gate/up): SwiGLU in gate/up's epilogue, the norm inside or apart, then down
  plain, against gate/up's ``norm`` choice then down's ``swiglu_in`` choice: both MLP chains
  are timed end to end in one graph and the faster (by ``--margin``, fewer kernels on ties) wins.

The table (format 2) has one entry per call variant (``"N,K,variant"``; format 1 tables still
load), and each record says which variant won and by how much. Kernels are compiled up front by
a pool of worker processes into Triton's on-disk cache.

    python benchmarks/tune_skinny_linear.py --out "$OUT"          # table + records into $OUT
    python benchmarks/tune_skinny_linear.py --models qwen3-0.6b --rows 1,8
    python benchmarks/tune_skinny_linear.py --models qwen3-0.6b --rows 64,128,256 \
        --projections qkv,o,down,gate_up                          # wide decode batches
    python benchmarks/tune_skinny_linear.py --dry-run              # CPU, interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

if "--dry-run" in sys.argv:  # triton.jit reads the switch when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from execrt.bench.common import copy_bandwidth_gbps, median_us, utc_now
from execrt.bench.models import MODELS, projection_shapes
from execrt.kernels._triton import tuned_table_name
from execrt.kernels.activation import silu_and_mul, silu_and_mul_torch
from execrt.kernels.norm import fused_add_rmsnorm, fused_add_rmsnorm_torch
from execrt.kernels.triton_linear import (
    CONFIG_DIR,
    CUDA_CORE_ROWS,
    NORM,
    PLAIN,
    SWIGLU_IN,
    SWIGLU_OUT,
    NormIn,
    SkinnyTile,
    block_m_for,
    launch,
    tile_to_json,
)

ROWS = (1, 2, 4, 8, 16)
# bf16 on the GPU; the interpreter computes bf16 dots wrongly, so a dry run uses fp16.
DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float16}
SPLITS = (2, 4, 8)  # split-K slice counts tried ...
SPLIT_FROM_BEST = 3  # ... on this many of the fastest unsplit tensor-core tiles
ROTATE_BYTES = 320 << 20  # weight copies per timing: several times the 60 MB L2
TOLERANCE = 2e-2


@dataclass(frozen=True)
class Shape:
    name: str  # "qwen3-0.6b.down"
    n: int  # weight rows (gate/up: 2I)
    k: int
    variants: tuple[str, ...] = (PLAIN,)
    down: tuple[int, int] | None = None  # gate/up: down's (N, K), for the MLP chain


#: The call variants each projection is tuned for (``projection_shapes``' names).
PROJECTION_VARIANTS = {
    "qkv": (PLAIN, NORM),
    "o": (PLAIN,),
    "lm_head": (PLAIN, NORM),
    "router": (PLAIN,),
    "down": (PLAIN, SWIGLU_IN),
    "gate_up": (PLAIN, NORM, SWIGLU_OUT),
}


def model_shapes(names: list[str]) -> list[Shape]:
    seen: dict[tuple[int, int], Shape] = {}
    for model in names:
        projections = projection_shapes(model)  # down before gate/up: its chain needs down's
        shapes = [
            Shape(
                f"{model}.{name}",
                n,
                k,
                PROJECTION_VARIANTS[name],
                down=projections["down"] if name == "gate_up" else None,
            )  # fmt: skip
            for name, (n, k) in projections.items()
        ]
        for s in shapes:
            old = seen.get((s.n, s.k))
            variants = tuple(dict.fromkeys((old.variants if old else ()) + s.variants))
            seen[(s.n, s.k)] = replace(
                old or s, variants=variants, down=s.down or (old and old.down)
            )
    return list(seen.values())


def candidates(m: int, variant: str = PLAIN, k: int = 0) -> list[SkinnyTile]:
    """CUDA-core tiles up to 8 rows (their fp32 accumulators, two sets with SwiGLU on the
    output, within 128 per lane), tensor-core tiles from 2 rows; past ``CUDA_CORE_ROWS`` (a
    large decode batch, every row in one program) ``wide_candidates``. At one row also the
    tile of the whole K (``k`` up to 4096 columns, padded to a power of two): the o and down
    projections' winners in a dependent chain (``gemv_chain.py``, docs/kernels.md)."""
    out: list[SkinnyTile] = []
    sets = 2 if variant == SWIGLU_OUT else 1
    if m > CUDA_CORE_ROWS:
        return wide_candidates(m, sets)
    if m <= 8:
        bm = 1 << (m - 1).bit_length()
        stages = (2, 3, 4) if m == 1 else (3,)
        whole = 1 << max(0, k - 1).bit_length()
        widths = (256, 512, 1024) + ((whole,) if m == 1 and 1024 < whole <= 4096 else ())
        for bn, bk, st in itertools.product((4, 8, 16), widths, stages):
            for warps in (4, 8):
                if sets * bm * bn * bk // (32 * warps) <= 128:
                    out.append(SkinnyTile(bn, bk, False, warps, st))
    if m >= 2:
        for bn, bk, st in itertools.product((16, 32, 64, 128), (128, 256), (3, 4)):
            if sets * bn * bk <= 128 * 256:  # shared memory for the weight tiles' stages
                out.append(SkinnyTile(bn, bk, True, 4, st))
    return out


#: Shared memory a wide tile's stages may take (the H200 has 227 KB per block).
WIDE_SMEM = 200 << 10


def wide_candidates(m: int, sets: int) -> list[SkinnyTile]:
    """Tensor-core tiles for ``m`` rows in one program: 4 warps up to 64 rows, 8 beyond; the
    x and weight tiles of every stage within ``WIDE_SMEM`` (bf16) and the fp32 accumulators
    (``sets`` of them) within 128 per lane."""
    bm = block_m_for(m, True)
    warps = 4 if bm <= 64 else 8
    out = []
    for bn, bk, st in itertools.product((32, 64, 128), (64, 128), (3, 4)):
        smem = (bm + sets * bn) * bk * 2 * st
        if smem <= WIDE_SMEM and sets * bm * bn <= 128 * 32 * warps:
            out.append(SkinnyTile(bn, bk, True, warps, st))
    return out


def variant_tiles(m: int, variant: str, k: int = 0) -> list[SkinnyTile]:
    """Every tile ``best_tile`` times for ``variant`` (before split-K): the candidates, with a
    norm in front also as ``late_norm`` (the norm's 1 / rms on the product, no prologue
    pass), and SwiGLU on the output also with the norm apart."""
    base = candidates(m, variant, k)
    tiles = list(base)
    if variant in (NORM, SWIGLU_OUT):
        tiles += [replace(t, late_norm=True) for t in base]
    if variant == SWIGLU_OUT:
        tiles += [replace(t, fuse_norm=False) for t in base]
    return tiles


def max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (fp32)."""
    ref = ref.float()
    return float((got.float() - ref).abs().max() / ref.abs().max())


# -- one problem: weights, activations and the kernels of every variant -------------------------


class Problem:
    """Rotated weight copies of one (N, K) at M rows, the activations a layer hands it, and
    each variant's kernels as ``fn(i)`` on weight copy ``i``."""

    def __init__(self, n: int, k: int, m: int, device: str, copies: int | None = None) -> None:
        self.n, self.k, self.m, self.device = n, k, m, device
        props = torch.cuda.get_device_properties(device) if device == "cuda" else None
        self.sms = props.multi_processor_count if props else 4
        self.copies = copies or (
            max(2, min(64, ROTATE_BYTES // (n * k * 2))) if device == "cuda" else 1
        )
        gen = torch.Generator(device=device).manual_seed(n * 31 + k + m)
        dtype = DTYPES[device]

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

        self.ws = [randn(n, k, scale=k**-0.5) for _ in range(self.copies)]
        self.x = randn(m, k)  # the delta in front of a norm, or the plain input
        self.gate_up = randn(m, 2 * k)  # down's SwiGLU input
        self.residual = randn(m, k)
        self.norm_w = (torch.rand(k, generator=gen, device=device) + 0.5).to(dtype)
        self.new_res = torch.empty_like(self.x)

    def norm_in(self) -> NormIn:
        return NormIn(self.norm_w, 1e-6, self.residual, self.new_res)

    def normed(self) -> torch.Tensor:
        return fused_add_rmsnorm(self.x, self.residual, self.norm_w, 1e-6, use_triton=True)[0]

    # fp32 oracles, from the reference ops
    def ref(self, variant: str) -> torch.Tensor:
        w = self.ws[0].float()
        if variant == PLAIN:
            return F.linear(self.x.float(), w)
        if variant == SWIGLU_IN:
            return F.linear(silu_and_mul_torch(self.gate_up).float(), w)
        normed = fused_add_rmsnorm_torch(self.x, self.residual, self.norm_w, 1e-6)[0]
        out = F.linear(normed.float(), w)
        return out if variant == NORM else silu_and_mul_torch(out.to(self.x.dtype)).float()

    def tile_fn(self, variant: str, tile: SkinnyTile) -> Callable[[int], torch.Tensor]:
        """The one kernel of ``variant`` on ``tile`` (SwiGLU out: the norm as ``fuse_norm``)."""
        if variant == PLAIN:
            return lambda i: launch(self.x, self.ws[i], None, tile)
        if variant == SWIGLU_IN:
            return lambda i: launch(self.gate_up, self.ws[i], None, tile, swiglu=True)
        if variant == NORM or tile.fuse_norm:
            out = variant == SWIGLU_OUT
            return lambda i: launch(
                self.x, self.ws[i], None, tile, swiglu_out=out, norm=self.norm_in()
            )
        return lambda i: launch(self.normed(), self.ws[i], None, tile, swiglu_out=True)

    def plain_fn(
        self, choice: SkinnyTile | None, x: Callable[[], torch.Tensor]
    ) -> Callable[[int], torch.Tensor]:
        """The plain product as chosen (tile or cuBLAS) on the input ``x()`` computes."""
        if choice is None:
            return lambda i: F.linear(x(), self.ws[i])
        return lambda i: launch(x(), self.ws[i], None, choice)

    def apart_fn(self, variant: str, plain: SkinnyTile | None) -> Callable[[int], torch.Tensor]:
        """``variant``'s part as a kernel of its own, then the plain choice."""
        if variant == NORM:
            return self.plain_fn(plain, self.normed)
        return self.plain_fn(plain, lambda: silu_and_mul(self.gate_up, use_triton=True))


def time_us(fn: Callable[[int], Any], copies: int) -> float:
    """µs per call of ``fn(i)`` over ``copies`` weight copies, captured in one CUDA graph."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    return median_us(graph.replay, 5, 3) / copies


def best_tile(
    p: Problem, variant: str, label: str
) -> tuple[float, SkinnyTile | None, list[dict[str, Any]]]:
    """The fastest checked candidate of ``variant`` (SwiGLU out: with the norm inside and
    apart): (µs, tile, every timing)."""
    ref = p.ref(variant)
    tiles = variant_tiles(p.m, variant, p.k)
    timed: list[tuple[float, SkinnyTile]] = []

    def check_and_time(tile: SkinnyTile) -> None:
        fn = p.tile_fn(variant, tile)
        try:
            out = fn(0)
        except Exception as exc:  # a tile the compiler refuses (shared memory, registers)
            print(
                f"#   {label} {variant or 'plain'} m={p.m} {tile}: {type(exc).__name__}",
                file=sys.stderr,
            )
            return
        err = max_rel(out, ref)
        if err > TOLERANCE:
            raise AssertionError(f"{label} {variant or 'plain'} m={p.m} {tile}: error {err:.3g}")
        timed.append((time_us(fn, p.copies) if p.device == "cuda" else 0.0, tile))

    for tile in tiles:
        check_and_time(tile)
    # Split-K on the fastest tensor-core tiles, where a tile alone leaves SMs idle.
    width = p.n // 2 if variant == SWIGLU_OUT else p.n
    dots = [t for _, t in sorted(timed, key=lambda r: r[0]) if t.use_dot][:SPLIT_FROM_BEST]
    for tile in [s for t in dots for s in split_tiles(t, width, p.k, p.sms)]:
        check_and_time(tile)
    us, tile = min(timed, key=lambda r: r[0]) if timed else (float("inf"), None)
    return us, tile, [{"us": u, "tile": asdict(t)} for u, t in sorted(timed, key=lambda r: r[0])]


def split_tiles(tile: SkinnyTile, n: int, k: int, sms: int) -> list[SkinnyTile]:
    """``tile`` with its K cut in 2, 4 and 8 slices, where its tiles alone are fewer than two
    per SM and each slice keeps at least two K steps (not a ``late_norm`` tile)."""
    if -(-n // tile.block_n) >= 2 * sms or tile.late_norm:  # late_norm needs whole rows
        return []
    return [replace(tile, split_k=s) for s in SPLITS if k >= 2 * s * tile.block_k]


def decide(fused_us: float, apart_us: float, margin: float) -> bool:
    """Whether the fused variant (a kernel fewer) is kept: unless apart is faster by ``margin``."""
    return fused_us <= apart_us * (1 + margin)


def tune_one(
    shape: Shape, m: int, device: str, margin: float, chosen: dict[tuple[int, int, str], Any]
) -> list[dict[str, Any]]:
    """Records for every variant of ``shape`` at ``m`` rows; ``chosen[(N, K, variant)]`` gets
    each verdict (gate/up's chain reads down's)."""
    p = Problem(shape.n, shape.k, m, device)
    cuda = device == "cuda"
    records = []

    def record(variant: str, choice: SkinnyTile | None, us: float, apart_us: float,
               apart: str, timings: list[dict[str, Any]], **extra: Any) -> None:  # fmt: skip
        chosen[(shape.n, shape.k, variant)] = choice
        won = "fused" if choice is not None else apart
        gain = apart_us / us if choice is not None and us else us / apart_us if apart_us else None
        records.append(
            {
                "shape": shape.name, "n": shape.n, "k": shape.k, "m": m,
                "variant": variant or "plain", "choice": tile_to_json(choice, variant),
                "won": won, "fused_us": us, "apart_us": apart_us, "gain": gain,
                "gbps": shape.n * shape.k * 2 / min(us, apart_us) / 1e3 if cuda else None,
                "all": timings, **extra,
            }
        )  # fmt: skip

    # plain: the best tile against cuBLAS (kept unless beaten by the margin)
    us, tile, timings = best_tile(p, PLAIN, shape.name)
    cublas_us = time_us(p.plain_fn(None, lambda: p.x), p.copies) if cuda else float("nan")
    keep = tile is not None and (not cuda or us * (1 + margin) < cublas_us)
    plain = tile if keep else None
    record(PLAIN, plain, us, cublas_us, "cublas", timings)
    for variant in shape.variants:
        if variant in (NORM, SWIGLU_IN):
            us, tile, timings = best_tile(p, variant, shape.name)
            apart_us = time_us(p.apart_fn(variant, plain), p.copies) if cuda else float("nan")
            keep = tile is not None and (not cuda or decide(us, apart_us, margin))
            record(variant, tile if keep else None, us, apart_us, "apart", timings)
        elif variant == SWIGLU_OUT:
            records.append(tune_chain(shape, p, margin, chosen))
    return records


def tune_chain(
    shape: Shape, p: Problem, margin: float, chosen: dict[tuple[int, int, str], Any]
) -> dict[str, Any]:
    """gate/up + down at ``p.m`` rows, both MLP chains in one graph each: SwiGLU in gate/up's
    epilogue then down plain, against gate/up's norm choice then down's SwiGLU-in choice."""
    assert shape.down is not None
    dn, dk = shape.down
    cuda = p.device == "cuda"
    us, tile, timings = best_tile(p, SWIGLU_OUT, shape.name)
    d = Problem(dn, dk, p.m, p.device, copies=p.copies)
    pick = lambda v: chosen.get((dn, dk, v))  # noqa: E731
    gu_plain, gu_norm = chosen.get((shape.n, shape.k, PLAIN)), chosen.get((shape.n, shape.k, NORM))
    down_plain, down_in = pick(PLAIN), pick(SWIGLU_IN)

    def chain_epi(i: int) -> torch.Tensor:
        assert tile is not None
        act = p.tile_fn(SWIGLU_OUT, tile)(i)
        return d.plain_fn(down_plain, lambda: act)(i)

    def chain_apart(i: int) -> torch.Tensor:
        if gu_norm is not None:
            gate_up = p.tile_fn(NORM, gu_norm)(i)
        else:
            gate_up = p.apart_fn(NORM, gu_plain)(i)
        if down_in is not None:
            return launch(gate_up, d.ws[i], None, down_in, swiglu=True)
        return d.plain_fn(down_plain, lambda: silu_and_mul(gate_up, use_triton=True))(i)

    apart_us = time_us(chain_apart, p.copies) if cuda else float("nan")
    epi_us = time_us(chain_epi, p.copies) if cuda and tile is not None else float("inf")
    if not cuda and tile is not None:
        torch.testing.assert_close(
            chain_epi(0).float(), chain_apart(0).float(), atol=5e-2, rtol=5e-2
        )
        epi_us = 0.0
    keep = tile is not None and (not cuda or decide(epi_us, apart_us, margin))
    choice = tile if keep else None
    chosen[(shape.n, shape.k, SWIGLU_OUT)] = choice
    return {
        "shape": shape.name, "n": shape.n, "k": shape.k, "m": p.m, "variant": SWIGLU_OUT,
        "choice": tile_to_json(choice, SWIGLU_OUT), "won": "fused" if keep else "apart",
        "fused_us": epi_us, "apart_us": apart_us,
        "gain": (apart_us / epi_us if keep else epi_us / apart_us) if cuda else None,
        "gate_up_us": us, "chain": "norm + gate/up + SwiGLU, down (one graph)", "all": timings,
    }  # fmt: skip


# -- compiling in parallel ---------------------------------------------------------------------


def _compile(jobs: list[tuple[int, int, int, str, SkinnyTile]], device: str) -> int:
    done = 0
    for m, n, k, variant, tile in jobs:
        # A narrower weight compiles the same kernel (N keeps its divisibility by 16).
        n_small = min(n, 4096) if n % 32 == 0 else n
        p = Problem(n_small, k, m, device, copies=1)
        try:
            p.tile_fn(variant, tile)(0)
            done += 1
        except Exception:
            pass
    if device == "cuda":
        torch.cuda.synchronize()
    return done


def precompile(jobs: list[tuple[int, int, int, str, SkinnyTile]], workers: int) -> None:
    start = time.perf_counter()
    chunks = [jobs[w::workers] for w in range(workers)]
    try:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = sum(pool.map(_compile, chunks, ["cuda"] * workers))
        print(f"# compiled {done}/{len(jobs)} kernels in {time.perf_counter() - start:.0f} s")
    except Exception as exc:
        print(f"# parallel compilation failed ({exc}); compiling while timing")


def compile_jobs(
    shapes: list[Shape], rows: list[int]
) -> list[tuple[int, int, int, str, SkinnyTile]]:
    jobs = []
    for s, m in itertools.product(shapes, rows):
        for v in s.variants:
            tiles = variant_tiles(m, v, s.k)
            # split-K compiles once per tile (the slice count is a launch argument)
            tiles += [replace(t, split_k=2) for t in tiles if t.use_dot and not t.late_norm]
            jobs += [(m, s.n, s.k, v, t) for t in tiles]
    return jobs


def merged(table: dict[str, dict[str, Any]], old_path: str) -> dict[str, dict[str, Any]]:
    """``table`` plus the entries of the table at ``old_path`` (format 1 or 2) for the (N, K, M)
    this run did not tune: a tuned (N, K) keeps none of its old variant entries at a tuned M,
    and all of them at the row counts this run left alone (``--rows 8`` re-tunes M = 8 only)."""
    if not os.path.exists(old_path):
        return table
    with open(old_path) as fh:
        old = json.load(fh)["shapes"]
    tuned: dict[tuple[str, ...], set[str]] = {}
    for key, by_m in table.items():
        tuned.setdefault(tuple(key.split(",")[:2]), set()).update(by_m)
    out: dict[str, dict[str, Any]] = {}
    for key, by_m in old.items():
        done = tuned.get(tuple(key.split(",")[:2]), set())
        kept = {m: t for m, t in by_m.items() if m not in done}
        if kept:
            out[key] = kept
    for key, by_m in table.items():
        out[key] = out.get(key, {}) | by_m
    return {key: dict(sorted(by_m.items(), key=lambda e: int(e[0]))) for key, by_m in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="benchmark model shapes to tune")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="token counts (M)")
    ap.add_argument(
        "--projections",
        default="",
        help="only these projections, e.g. qkv,o,down,gate_up (default: all; gate/up's SwiGLU "
        "chain reads down's choice, so tune down with it)",
    )
    ap.add_argument("--out", default=CONFIG_DIR, help="directory for the table and the records")
    ap.add_argument("--margin", type=float, default=0.03,
                    help="keep cuBLAS unless a tile beats it by this; keep a fused variant "
                    "unless apart beats it by this")  # fmt: skip
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop tuning after this long")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument(
        "--no-merge",
        action="store_true",
        help="drop the package table's shapes this run did not tune (kept by default)",
    )
    ap.add_argument(
        "--install",
        action="store_true",
        help="also write the table into the package (later runs in this tree use it)",
    )
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    if args.dry_run:
        device = "cpu"
        shapes = [
            Shape("tiny.qkv", 24, 40, (PLAIN, NORM)),
            Shape("tiny.down", 16, 24, (PLAIN, SWIGLU_IN)),
            Shape("tiny.gate_up", 48, 16, (PLAIN, NORM, SWIGLU_OUT), down=(16, 24)),
        ]
    else:
        device, shapes = "cuda", model_shapes(args.models.split(","))
    if args.projections:
        wanted = set(args.projections.split(","))
        shapes = [s for s in shapes if s.name.rsplit(".", 1)[1] in wanted]
    start = time.perf_counter()
    if device == "cuda":
        precompile(compile_jobs(shapes, rows), args.workers)
        copy = copy_bandwidth_gbps()
        print(f"# copy bandwidth {copy:.0f} GB/s")
    records: list[dict[str, Any]] = []
    chosen: dict[tuple[int, int, str], Any] = {}
    out_of_time = False
    for shape in shapes:
        for m in rows:
            if time.perf_counter() - start > args.budget_s:
                print(f"# budget spent: {shape.name} m={m} and later not tuned")
                out_of_time = True
                break
            for r in tune_one(shape, m, device, args.margin, chosen):
                records.append(r)
                print(
                    f"{r['shape']:<22} {r['variant']:<10} m={m:<3} fused {r['fused_us']:8.2f} us"
                    f"  apart {r['apart_us']:8.2f} us  {r['won']:<6} -> {r['choice']}",
                    flush=True,
                )
        if out_of_time:
            break
    os.makedirs(args.out, exist_ok=True)
    table: dict[str, dict[str, Any]] = {}
    for r in records:
        key = f"{r['n']},{r['k']}" + ("" if r["variant"] == "plain" else f",{r['variant']}")
        table.setdefault(key, {})[str(r["m"])] = r["choice"]
    name = torch.cuda.get_device_name() if device == "cuda" else "interpreter"
    file_name = tuned_table_name(name, torch.bfloat16)
    if not args.no_merge:
        table = merged(table, os.path.join(CONFIG_DIR, file_name))
    meta = {"format": 2, "device_name": name, "date": utc_now(), "torch": torch.__version__}
    paths = [os.path.join(args.out, file_name)]
    if args.install:
        paths.append(os.path.join(CONFIG_DIR, file_name))
    for path in paths:
        with open(path, "w") as fh:
            json.dump(meta | {"shapes": table}, fh, indent=1)
    rec_path = os.path.join(args.out, f"tune-skinny-linear-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(rec_path, "w") as fh:
        json.dump(meta | {"records": records}, fh, indent=1)
    print(f"# wrote {', '.join(paths)} and {rec_path} in {time.perf_counter() - start:.0f} s")
    fused = [r["gain"] for r in records if r["won"] == "fused" and r["gain"]]
    if fused and device == "cuda":
        gain = statistics.geometric_mean(fused)
        print(f"# geometric-mean gain where a fused variant won: {gain:.2f}")


if __name__ == "__main__":
    main()
