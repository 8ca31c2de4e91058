"""Tune the skinny-GEMM tiles on this GPU against cuBLAS; write the package's table.

For every projection of the benchmark models (``execrt.bench.models.MODELS``: q/k/v, o,
gate/up, down with SwiGLU fused, router, LM head) and each row count, every candidate tile is
checked against ``F.linear`` and graph-timed over rotated weight copies (so no call finds its
weight in L2), beside cuBLAS (for down: the Triton ``silu_and_mul`` + ``F.linear``, the unfused
path). The table keeps the fastest tile, or "cublas" where no tile beats it by ``--margin``.
Kernels are compiled up front by a pool of worker processes into Triton's on-disk cache.

    python benchmarks/tune_skinny_linear.py --out "$OUT"          # table + records into $OUT
    python benchmarks/tune_skinny_linear.py --models qwen3-0.6b --rows 1
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
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

if "--dry-run" in sys.argv:  # triton.jit reads the switch when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from execrt.bench.common import copy_bandwidth_gbps, median_us, utc_now
from execrt.bench.models import MODELS
from execrt.kernels._triton import tuned_table_name
from execrt.kernels.activation import silu_and_mul
from execrt.kernels.norm import fused_add_rmsnorm
from execrt.kernels.triton_linear import CONFIG_DIR, NormIn, SkinnyTile, launch, tile_to_json

ROWS = (1, 2, 4, 8, 16)
# bf16 on the GPU; the interpreter computes bf16 dots wrongly, so a dry run uses fp16.
DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float16}
ROTATE_BYTES = 320 << 20  # weight copies per timing: several times the 60 MB L2
TOLERANCE = 2e-2


@dataclass(frozen=True)
class Shape:
    name: str  # "qwen3-0.6b.down"
    n: int
    k: int
    swiglu: bool = False
    norm: bool = False  # the model runs an RMSNorm (with its residual add) in front of it


def model_shapes(names: list[str]) -> list[Shape]:
    seen: dict[tuple[int, int, bool], Shape] = {}
    for model in names:
        c = MODELS[model]
        h, d = c["hidden_size"], c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
        shapes = [
            Shape(f"{model}.qkv", (hq + 2 * hkv) * d, h, norm=True),
            Shape(f"{model}.o", h, hq * d),
            Shape(f"{model}.lm_head", c["vocab_size"], h, norm=True),
        ]
        if c.get("num_experts"):
            shapes.append(Shape(f"{model}.router", c["num_experts"], h))
        else:
            i = c["intermediate_size"]
            shapes += [
                Shape(f"{model}.gate_up", 2 * i, h, norm=True),
                Shape(f"{model}.down", h, i, swiglu=True),
            ]
        for s in shapes:
            seen.setdefault((s.n, s.k, s.swiglu), s)
    return list(seen.values())


def candidates(m: int) -> list[SkinnyTile]:
    out: list[SkinnyTile] = []
    if m <= 4:
        bm = 1 if m == 1 else (2 if m == 2 else 4)
        stages = (2, 3, 4) if m == 1 else (3,)
        for bn, bk, st in itertools.product((4, 8, 16), (256, 512, 1024), stages):
            for warps in (4, 8):
                if bm * bn * bk // (32 * warps) <= 128:  # fp32 accumulators per lane
                    out.append(SkinnyTile(bn, bk, False, warps, st))
    if m >= 2:
        for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 4)):
            out.append(SkinnyTile(bn, bk, True, 4, st))
    return out


def max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (fp32)."""
    ref = ref.float()
    return float((got.float() - ref).abs().max() / ref.abs().max())


# -- compiling in parallel ---------------------------------------------------------------------


def _compile(jobs: list[tuple[int, int, int, bool, SkinnyTile]], device: str) -> int:
    done = 0
    for m, n, k, swiglu, tile in jobs:
        # A narrower weight compiles the same kernel (N keeps its divisibility by 16).
        n_small = min(n, 4096) if n % 16 == 0 else n
        w = torch.zeros(n_small, k, dtype=torch.bfloat16, device=device)
        x = torch.zeros(m, 2 * k if swiglu else k, dtype=torch.bfloat16, device=device)
        try:
            launch(x, w, None, tile, swiglu=swiglu)
            done += 1
        except Exception:
            pass
    if device == "cuda":
        torch.cuda.synchronize()
    return done


def precompile(jobs: list[tuple[int, int, int, bool, SkinnyTile]], workers: int) -> None:
    start = time.perf_counter()
    chunks = [jobs[w::workers] for w in range(workers)]
    try:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = sum(pool.map(_compile, chunks, ["cuda"] * workers))
        print(f"# compiled {done}/{len(jobs)} kernels in {time.perf_counter() - start:.0f} s")
    except Exception as exc:
        print(f"# parallel compilation failed ({exc}); compiling while timing")


# -- timing ------------------------------------------------------------------------------------


def time_us(fn: Any, copies: int) -> float:
    """µs per call of ``fn(i)`` over ``copies`` weight copies, captured in one CUDA graph."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    return median_us(graph.replay, 5, 3) / copies


def time_norm(
    x: torch.Tensor, ws: list[torch.Tensor], tile: SkinnyTile, copies: int, device: str
) -> tuple[float, float]:
    """µs of residual add + RMSNorm + this tile: fused into the kernel, and as the norm kernel
    followed by the kernel (checked to agree)."""
    gen = torch.Generator(device=device).manual_seed(x.shape[1])
    residual = torch.randn(x.shape, generator=gen, device=device).to(x.dtype)
    norm_w = (torch.rand(x.shape[1], generator=gen, device=device) + 0.5).to(x.dtype)
    new_res = torch.empty_like(x)

    def fused(i: int) -> torch.Tensor:
        return launch(x, ws[i], None, tile, norm=NormIn(norm_w, 1e-6, residual, new_res))

    def separate(i: int) -> torch.Tensor:
        normed, _ = fused_add_rmsnorm(x, residual, norm_w, 1e-6, use_triton=True)
        return launch(normed, ws[i], None, tile)

    err = max_rel(fused(0), separate(0))
    if err > TOLERANCE:
        raise AssertionError(f"fused norm disagrees with the separate kernels: {err:.3g}")
    if device != "cuda":
        return 0.0, 1.0
    return time_us(fused, copies), time_us(separate, copies)


def tune_one(shape: Shape, m: int, device: str, margin: float) -> dict[str, Any]:
    n, k = shape.n, shape.k
    copies = max(2, min(64, ROTATE_BYTES // (n * k * 2)))
    gen = torch.Generator(device=device).manual_seed(n * 31 + k + m)
    ws = [
        (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(DTYPES[device])
        for _ in range(copies if device == "cuda" else 1)
    ]
    x = torch.randn(m, 2 * k if shape.swiglu else k, generator=gen, device=device)
    x = x.to(DTYPES[device])
    act = silu_and_mul(x, use_triton=True) if shape.swiglu else x
    ref = F.linear(act.float(), ws[0].float())

    def cublas(i: int) -> torch.Tensor:
        a = silu_and_mul(x, use_triton=True) if shape.swiglu else x
        return F.linear(a, ws[i])

    results: list[tuple[float, SkinnyTile | None]] = []
    if device == "cuda":
        results.append((time_us(cublas, copies), None))
    for tile in candidates(m):
        try:
            out = launch(x, ws[0], None, tile, swiglu=shape.swiglu)
        except Exception as exc:  # a tile the compiler refuses (shared memory, registers)
            print(f"#   {shape.name} m={m} {tile}: {type(exc).__name__}", file=sys.stderr)
            continue
        err = max_rel(out, ref)
        if err > TOLERANCE:
            raise AssertionError(f"{shape.name} m={m} {tile}: relative error {err:.3g}")
        if device != "cuda":
            results.append((0.0, tile))
            continue
        results.append(
            (
                time_us(lambda i, t=tile: launch(x, ws[i], None, t, swiglu=shape.swiglu), copies),
                tile,
            )
        )
    cublas_us = results[0][0] if device == "cuda" else float("nan")
    best_us, best = min(((us, t) for us, t in results if t is not None), key=lambda r: r[0])
    verdict = best if device != "cuda" or best_us * (1 + margin) < cublas_us else None
    fused_us = separate_us = None
    if shape.norm and verdict is not None:
        fused_us, separate_us = time_norm(x, ws, verdict, copies, device)
        if fused_us > separate_us:
            verdict = replace(verdict, fuse_norm=False)
    nbytes = n * k * 2
    return {
        "shape": shape.name,
        "n": n,
        "k": k,
        "swiglu": shape.swiglu,
        "m": m,
        "cublas_us": cublas_us,
        "best_us": best_us,
        "best_tile": asdict(best),
        "choice": tile_to_json(verdict),
        "speedup": cublas_us / best_us if best_us else float("nan"),
        "norm_fused_us": fused_us,
        "norm_separate_us": separate_us,
        "cublas_gbps": nbytes / cublas_us / 1e3 if device == "cuda" else None,
        "best_gbps": nbytes / best_us / 1e3 if device == "cuda" else None,
        "all": [
            {"us": us, "tile": tile_to_json(t)} for us, t in sorted(results, key=lambda r: r[0])
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="benchmark model shapes to tune")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="token counts (M)")
    ap.add_argument("--out", default=CONFIG_DIR, help="directory for the table and the records")
    ap.add_argument("--margin", type=float, default=0.03, help="keep cuBLAS unless beaten by this")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop tuning after this long")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    if args.dry_run:
        device = "cpu"
        shapes = [Shape("tiny.o", 24, 40, norm=True), Shape("tiny.down", 16, 48, swiglu=True)]
    else:
        device, shapes = "cuda", model_shapes(args.models.split(","))
    start = time.perf_counter()
    if device == "cuda":
        jobs = [(m, s.n, s.k, s.swiglu, t) for s in shapes for m in rows for t in candidates(m)]
        precompile(jobs, args.workers)
        copy = copy_bandwidth_gbps()
        print(f"# copy bandwidth {copy:.0f} GB/s")
    records = []
    for shape in shapes:
        for m in rows:
            if time.perf_counter() - start > args.budget_s:
                print(f"# budget spent: {shape.name} m={m} and later not tuned")
                break
            r = tune_one(shape, m, device, args.margin)
            records.append(r)
            norm = ""
            if r["norm_fused_us"] is not None:
                norm = f"  norm fused {r['norm_fused_us']:.2f} / apart {r['norm_separate_us']:.2f}"
            print(
                f"{r['shape']:<24} m={m:<3} cublas {r['cublas_us']:8.2f} us"
                f"  best {r['best_us']:8.2f} us  x{r['speedup']:.2f}{norm}  -> {r['choice']}",
                flush=True,
            )
    os.makedirs(args.out, exist_ok=True)
    table: dict[str, dict[str, Any]] = {}
    for r in records:
        table.setdefault(f"{r['n']},{r['k']}", {})[str(r["m"])] = r["choice"]
    name = torch.cuda.get_device_name() if device == "cuda" else "interpreter"
    meta = {"device_name": name, "date": utc_now(), "torch": torch.__version__}
    path = os.path.join(args.out, tuned_table_name(name, torch.bfloat16))
    with open(path, "w") as fh:
        json.dump(meta | {"shapes": table}, fh, indent=1)
    rec_path = os.path.join(args.out, f"tune-skinny-linear-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(rec_path, "w") as fh:
        json.dump(meta | {"records": records}, fh, indent=1)
    speedups = [r["speedup"] for r in records if r["choice"] != "cublas"]
    print(f"# wrote {path} and {rec_path} in {time.perf_counter() - start:.0f} s")
    if speedups:
        mean = statistics.geometric_mean(speedups)
        print(f"# geometric-mean speedup where the kernel is chosen: {mean:.2f}")


if __name__ == "__main__":
    main()
