"""Measuring helpers the benchmarks share: copy bandwidth, CUDA-event timing, result files."""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

L2_BYTES = 60 << 20  # at least the L2 of the GPUs we measure (H100/H200: 50 MB)


def copy_bandwidth_gbps(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = median_us(lambda: dst.copy_(src), 1, iters) / 1e6
    return 2 * nbytes / seconds / 1e9


def median_us(launch: Callable[[], object], iters: int, reps: int) -> float:
    """Median over ``reps`` samples of the µs one ``launch()`` takes, each sample timing
    ``iters`` back-to-back launches between CUDA events."""
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            launch()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def save_records(records: Sequence[Any], out_dir: str, stem: str) -> str:
    """Write dataclass records as a JSON list to ``out_dir/<stem>-<UTC stamp>.json``."""
    os.makedirs(out_dir, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = os.path.join(out_dir, f"{stem}-{stamp}.json")
    with open(path, "w") as fh:
        json.dump([asdict(r) for r in records], fh, indent=2)
    return path
