"""cuBLAS against inductor's autotuned Triton GEMM templates on the decode projections.

For each (M, N, K): ``F.linear`` (cuBLAS, what the decode step runs above the skinny sizes)
and ``torch.compile(mode="max-autotune-no-cudagraphs")`` restricted to Triton templates (the
best config inductor's autotuner finds). Each call reads one of enough weight copies that
the set is 4x the L2, so every call streams its weight from DRAM as in a decode step. Times
are replays of one CUDA graph calling every copy twice (median of 5); GB/s counts the weight
and activations once. A shape where the Triton template beats cuBLAS by a wide margin is
worth a kernel. ``--cublaslt`` also times each call through cuBLASLt
(``torch.backends.cuda.preferred_blas_library("cublaslt")``).

    python benchmarks/gemm_peers.py --shapes 128x4096x4096,128x24576x4096 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F


def timed(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """µs per call of ``fn(weight)``: one CUDA graph calling it on each weight copy twice in
    turn, replayed, median of 5."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in weights[:3]:
            fn(w)
    torch.cuda.synchronize()
    calls = weights * 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in calls:
            fn(w)
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(runs)


def measure(m: int, n: int, k: int, l2: int, lt: bool, autotune: bool) -> dict[str, object]:
    copies = max(2, -(-4 * l2 // (n * k * 2)))
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
    ]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    moved = n * k * 2 + m * k * 2 + m * n * 2
    t_cublas = timed(lambda w: torch.mm(x, w.t(), out=out), weights)
    rec: dict[str, object] = {
        "m": m, "n": n, "k": k, "cublas_us": t_cublas, "cublas_gbps": moved / t_cublas / 1e3,
        "gpu": torch.cuda.get_device_name(),
    }  # fmt: skip
    if lt:  # the same call through cuBLASLt's heuristics (torch's other BLAS library)
        default = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            t_lt = timed(lambda w: torch.mm(x, w.t(), out=out), weights)
        finally:
            torch.backends.cuda.preferred_blas_library(default)
        rec |= {"cublaslt_us": t_lt, "cublaslt_gbps": moved / t_lt / 1e3}
    if autotune:
        compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        ref = F.linear(x, weights[1]).float()
        err = (compiled(x, weights[1]).float() - ref).abs().max().item()
        t_triton = timed(lambda w: compiled(x, w), weights)
        rec |= {"triton_us": t_triton, "triton_gbps": moved / t_triton / 1e3}
        rec["triton_max_abs_err"] = err
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128x4096x4096,32x4096x4096,128x24576x4096")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-autotune", action="store_true", help="cuBLAS (and --cublaslt) only")
    ap.add_argument("--cublaslt", action="store_true", help="also time torch's cuBLASLt path")
    args = ap.parse_args()
    import torch._inductor.config as ic

    ic.max_autotune_gemm_backends = "TRITON"
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    records = []
    for shape in args.shapes.split(","):
        m, n, k = map(int, shape.split("x"))
        records.append(measure(m, n, k, l2, args.cublaslt, not args.no_autotune))
        print(json.dumps(records[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
