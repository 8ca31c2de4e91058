"""Build FlashInfer's JIT kernels for a set of attention shapes, several at once.

FlashInfer compiles each kernel module (one per q dtype, KV dtype, head dim and prefill family)
on first use, for minutes, and keeps it in its JIT cache. The GPU suite meets dozens of such
modules; its workers each wait on the same module's lock and a call's time limit can end them
all mid-compile. This builds every distinct module once, in separate processes (nvcc is mostly
single-threaded per module), so the suite afterwards only loads them.

Each job builds the ``flashinfer`` attention backend over a tiny cache; the backend's start-up
warm-up plans and runs one prefill and one decode, which is what compiles (or loads) them.
Jobs that would run the same kernels are built once: an fp8 cache runs FA2 even under "auto"
(FA3 cannot read one), and GQA groups only matter as below or at least
``tensor_core_min_group`` (tensor-core decode).

    python benchmarks/fi_precompile.py --head-dims 64,128,256 \\
        --kv-dtypes auto,float8_e4m3fn,float8_e5m2 --groups 1,4 --variants auto,fa2 --jobs 8
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import multiprocessing
import sys
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Job:
    dtype: str  # the model's (q and the output)
    kv_dtype: str  # "auto": the model's
    head_dim: int
    group: int  # q heads per KV head
    variant: str  # FlashInfer prefill family: auto, fa2 or fa3

    def describe(self) -> str:
        return (
            f"{self.dtype} q, {self.kv_dtype} KV, head dim {self.head_dim}, GQA {self.group}, "
            f"prefill {self.variant}"
        )


def jobs(
    dtypes: list[str],
    kv_dtypes: list[str],
    head_dims: list[int],
    groups: list[int],
    variants: list[str],
    tensor_core_min_group: int,
) -> list[Job]:
    """Every combination, less those that would build the same modules as one kept."""
    out: dict[tuple[object, ...], Job] = {}
    for dtype, kv, d, g, v in itertools.product(dtypes, kv_dtypes, head_dims, groups, variants):
        fp8 = kv.startswith("float8")
        if fp8 and v == "fa3":
            continue  # refused: FA3 cannot read an fp8 cache
        family = "fa2" if fp8 else v  # an fp8 cache runs FA2 under "auto" too
        out.setdefault((dtype, kv, d, g >= tensor_core_min_group, family), Job(dtype, kv, d, g, v))
    return list(out.values())


def build(job: Job) -> float:
    """Build the backend for ``job`` on the GPU (its warm-up compiles); seconds."""
    from execrt.plugins.host import PluginHost
    from execrt.testing.attention_harness import AttentionHarness, Geometry

    start = time.perf_counter()
    spec = PluginHost().registry.get("attention", "flashinfer")
    dtype = getattr(torch, job.dtype)
    kv_dtype = None if job.kv_dtype == "auto" else getattr(torch, job.kv_dtype)
    harness = AttentionHarness(
        spec,
        "cuda",
        dtype,
        Geometry(num_kv_heads=2, gqa_ratio=job.group, head_dim=job.head_dim),
        max_reqs=4,
        max_context_len=64,
        cache_slots=64,
        seed=0,
        options={"prefill_backend": job.variant},
        kv_dtype=kv_dtype,
    )
    harness.close()
    return time.perf_counter() - start


def _csv(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--kv-dtypes", default="auto,float8_e4m3fn,float8_e5m2")
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--groups", default="1,4")
    p.add_argument("--variants", default="auto,fa2")
    p.add_argument("--jobs", type=int, default=8, help="processes building at once")
    p.add_argument("--list", action="store_true", help="print the jobs and stop")
    args = p.parse_args(argv)
    from execrt.backends.attention.flashinfer import FlashInferAttnBackend

    todo = jobs(
        _csv(args.dtypes),
        _csv(args.kv_dtypes),
        [int(d) for d in _csv(args.head_dims)],
        [int(g) for g in _csv(args.groups)],
        _csv(args.variants),
        FlashInferAttnBackend.tensor_core_min_group,
    )
    for job in todo:
        print(f"job: {job.describe()}", flush=True)
    if args.list:
        return 0
    if not torch.cuda.is_available():
        print("fi_precompile: needs a CUDA device (none is visible)", file=sys.stderr)
        return 2
    failed = 0
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # CUDA in each child
    with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx) as pool:
        futures = {pool.submit(build, job): job for job in todo}
        for fut in cf.as_completed(futures):
            job = futures[fut]
            try:
                print(f"built in {fut.result():6.1f} s: {job.describe()}", flush=True)
            except Exception as exc:  # one refusal or failed compile: say so, build the rest
                failed += 1
                print(f"FAILED: {job.describe()}: {type(exc).__name__}: {exc}", flush=True)
    print(
        f"fi_precompile: {len(todo) - failed} of {len(todo)} built in "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
