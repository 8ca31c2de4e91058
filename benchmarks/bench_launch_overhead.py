"""Host cost of one launch of the decode-step ops (eager mode is bound by it): µs per call.

python benchmarks/bench_launch_overhead.py          # on a GPU; EXECRT_DISABLE_PDL=1 compares
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from execrt.kernels.linear import linear, norm_linear
from execrt.kernels.norm import fused_add_rmsnorm


def host_us(fn, n: int = 2000) -> float:  # type: ignore[no-untyped-def]
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - start) / n * 1e6


def main() -> None:
    dev = torch.device("cuda")
    x = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    nw = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    rows = {
        "F.linear": lambda: F.linear(x, w),
        "linear (skinny)": lambda: linear(x, w, use_triton=True),
        "norm_linear": lambda: norm_linear(x, w, None, nw, 1e-6, residual=r, use_triton=True),
        "fused_add_rmsnorm": lambda: fused_add_rmsnorm(x, r, nw, 1e-6, use_triton=True),
    }
    pdl = "off" if os.environ.get("EXECRT_DISABLE_PDL") == "1" else "on"
    for name, fn in rows.items():
        print(f"{name:<20} pdl {pdl}: {host_us(fn):7.1f} us/call")


if __name__ == "__main__":
    main()
