"""Passes over a row that the fused sampler's finish makes for top-k / top-p rows (CPU).

The finish runs one program per filtered row, so its time is that row's passes over the
vocabulary (a counting pass or a race each), and a launch lasts as long as its slowest row.
This counts them under the Triton interpreter, per row, for several ``ROUND_SHARE`` values
(2.0: never a round, the threshold search alone; 0.5: the default), with the tokens checked
against the core Sampler. The
interpreter makes it slow (~1 s per pass over 152k tokens), not different: the kernels run
the same passes on a GPU, where ``bench_sampling.py`` times them.

    python benchmarks/sampling_passes.py [--vocab 151936] [--rows 16] [--shares 2.0,0.5]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from execrt.core.sampler import Sampler, SamplingBatchInfo
from execrt.kernels import triton_sampling
from execrt.kernels.sampling import fused_sample

#: (temperature, top_k, top_p) per mix.
MIXES: dict[str, tuple[float, int, float]] = {
    "top-p 0.9": (0.6, -1, 0.9),
    "top-p 0.95 T 1.0": (1.0, -1, 0.95),
    "top-p 0.5": (0.8, -1, 0.5),
    "top-k 50": (0.6, 50, 1.0),
    "top-k 20 + top-p 0.8": (0.7, 20, 0.8),
    "top-k 20 + top-p 0.95 T 0.6": (0.6, 20, 0.95),  # Qwen3's recommended sampling
    "top-k 50 + top-p 0.9 T 1.0": (1.0, 50, 0.9),
}


def logits_of(shape: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """``llm``: a broad bulk and a dozen strong candidates per row; ``zipf``: logits falling
    with the log of a random rank, as a language model's do; ``flat``: nearly uniform."""
    if shape == "flat":
        return torch.randn(rows, vocab, generator=gen) * 0.05
    if shape == "zipf":
        ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]) + 1
        noise = torch.randn(rows, vocab, generator=gen) * 0.3
        return 12.0 - 1.6 * torch.log(ranks.float()) + noise
    logits = torch.randn(rows, vocab, generator=gen) * 2.5
    for row in range(rows):
        top = torch.randperm(vocab, generator=gen)[:12]
        logits[row, top] += torch.rand(12, generator=gen) * 10 + 4
    return logits


class PassCounter:
    """Wraps the finish's pass functions in the module the kernel reads them from."""

    def __init__(self) -> None:
        self.current = 0
        self.per_row: list[int] = []
        self._saved: dict[str, Any] = {}

    def _counting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.current += 1
            return fn(*args, **kwargs)

        return wrapper

    def _row(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.current = 0
            out = fn(*args, **kwargs)
            self.per_row.append(self.current)
            return out

        return wrapper

    def __enter__(self) -> PassCounter:
        for name in ("_count", "_race", "_filtered_token"):
            self._saved[name] = getattr(triton_sampling, name)
        triton_sampling._count = self._counting(self._saved["_count"])
        triton_sampling._race = self._counting(self._saved["_race"])
        triton_sampling._filtered_token = self._row(self._saved["_filtered_token"])
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(triton_sampling, name, fn)


def run(
    vocab: int, rows: int, shares: list[float], shapes: list[str], mixes: list[str] | None = None
) -> list[dict[str, Any]]:
    records = []
    for shape in shapes:
        gen = torch.Generator().manual_seed(len(shape))
        logits = logits_of(shape, rows, vocab, gen)
        seeds = torch.randint(0, 2**62, (rows,), generator=gen)
        for mix, (temp, top_k, top_p) in MIXES.items():
            if mixes and not any(m in mix for m in mixes):
                continue
            info = SamplingBatchInfo(
                temperatures=torch.full((rows,), temp),
                top_ks=torch.full((rows,), top_k, dtype=torch.int64),
                top_ps=torch.full((rows,), top_p),
                seeds=seeds,
                steps=torch.arange(rows, dtype=torch.int64),
                all_greedy=False,
            )
            expected = Sampler.sample_torch(logits, info)
            for share in shares:
                triton_sampling.ROUND_SHARE = share
                with PassCounter() as counter:
                    tokens = fused_sample(logits, info)
                passes = counter.per_row
                record = {
                    "shape": shape,
                    "mix": mix,
                    "round_share": share,
                    "rows": rows,
                    "vocab": vocab,
                    "mean_passes": round(statistics.mean(passes), 2),
                    "max_passes": max(passes),
                    "mismatches": int((tokens != expected).sum()),
                }
                records.append(record)
                print(json.dumps(record), flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--shares", default="2.0,0.5", help="ROUND_SHARE values, comma-separated")
    parser.add_argument("--shapes", default="llm,zipf,flat")
    parser.add_argument("--out", help="write the records here as JSON")
    parser.add_argument("--mixes", help="only the mixes whose names contain one of these (',')")
    args = parser.parse_args()
    records = run(
        args.vocab,
        args.rows,
        [float(r) for r in args.shares.split(",")],
        args.shapes.split(","),
        args.mixes.split(",") if args.mixes else None,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
