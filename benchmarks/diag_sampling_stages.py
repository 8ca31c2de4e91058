"""Where the fused draw's time goes, launch by launch (GPU only): the parts' race alone and
both launches, each replayed in a CUDA graph (the finish: the difference), with PDL on or off,
for each setting of the knobs (``SKIP_BLOCKS`` / ``COUNT_BLOCKS`` / ``RACE_SUMS`` /
``RACE_AHEAD``), ``PROGRAMS_PER_SM`` and ``RACE_REGS``. A setting that slows rows it does not
apply to (greedy, temperature only) shows here in the launch that carries the cost, with its
registers.

    python benchmarks/diag_sampling_stages.py --out stages.json [--batch 256] [--mixes ...]

The logits are bf16 by default: what a bf16 model's LM head hands the sampler at decode.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import torch
from bench_sampling import MIXES, make_info, make_logits  # this folder: run as a script

from execrt.bench.common import graph_us, utc_now
from execrt.kernels import triton_sampling as ts
from execrt.kernels.sampling import fused_sample

REAL_KERNEL = ts._sample_kernel
REAL_PDL = ts.pdl_kwargs


#: finish? -> (registers per thread, spilled bytes, programs) of the last such launch
KERNELS: dict[bool, tuple[int, int, int]] = {}


class _OnlyStage:
    """Stands in for ``_sample_kernel``: launches only the stage(s) named by ``finish``, and
    notes each compiled launch's registers and grid (they set how many programs fit an SM)."""

    def __init__(self, finish: set[bool]) -> None:
        self.finish = finish

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            if kwargs["FINISH"] in self.finish:
                k = REAL_KERNEL[grid](*args, **kwargs)
                KERNELS[kwargs["FINISH"]] = (k.n_regs, k.n_spills, math.prod(grid))

        return launch


def _time(logits: torch.Tensor, info: Any, stages: set[bool]) -> float:
    ts._sample_kernel = _OnlyStage(stages)  # type: ignore[assignment]
    try:
        return graph_us(lambda: fused_sample(logits, info), 100, 5)
    finally:
        ts._sample_kernel = REAL_KERNEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--mixes", default="greedy,temp 0.6,top-k 20 + top-p 0.95")
    parser.add_argument(
        "--settings",
        default="0,1,0,0;0,1,0,1;1,1,0,0;0,1,1,0;1,2,1,0;1,2,1,1",
        help="';'-separated SKIP_BLOCKS,COUNT_BLOCKS,RACE_SUMS,RACE_AHEAD",
    )
    parser.add_argument("--programs-per-sm", default="4", help="PROGRAMS_PER_SM values")
    parser.add_argument("--pdl", default="1", help="PDL launches: 1, 0 or 1,0")
    parser.add_argument(
        "--race-regs",
        default="0,80",
        help="RACE_REGS values (0: none), applied to the race at any grid size",
    )
    args = parser.parse_args()
    settings = [tuple(int(x) for x in s.split(",")) for s in args.settings.split(";")]
    pps_values = [int(x) for x in args.programs_per_sm.split(",")]
    regs_values = [int(x) for x in args.race_regs.split(",")]
    pdl_values = [x == "1" for x in args.pdl.split(",")]
    mixes = args.mixes.split(",")
    if unknown := [m for m in mixes if m not in [*MIXES, "mixed"]]:
        parser.error(f"--mixes {unknown} unknown (known: {', '.join(MIXES)}, mixed)")
    if not torch.cuda.is_available():
        raise SystemExit("diag_sampling_stages: needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = make_logits("llm", args.batch, args.vocab, getattr(torch, args.dtype), gen)
    rows = []
    head = ["mix".ljust(22)] + [
        f"{c:>3}" for c in ("pps", "reg", "skp", "cnt", "sum", "ahd", "pdl")
    ]
    head += ["race us", "finish us", "both us", " (regs, spills, grid) race, finish"]
    print(" ".join(head))
    for mix, pps, regs, (skip, count, sums, ahead), pdl in itertools.product(
        mixes, pps_values, regs_values, settings, pdl_values
    ):
        info = make_info(mix, args.batch)
        ts.SKIP_BLOCKS, ts.COUNT_BLOCKS, ts.RACE_SUMS = bool(skip), count, bool(sums)
        ts.RACE_AHEAD = bool(ahead)
        ts.PROGRAMS_PER_SM = pps
        ts.RACE_REGS = regs or None
        ts.RACE_REGS_ABOVE = 0  # --race-regs caps the race at every batch size, as asked
        ts.pdl_kwargs = REAL_PDL if pdl else (lambda device: {"PDL": False})  # type: ignore
        try:
            race = _time(logits, info, {False})
            both = _time(logits, info, {False, True})
        finally:
            ts.pdl_kwargs = REAL_PDL
        race_k, finish_k = KERNELS[False], KERNELS[True]
        row = dict(mix=mix, programs_per_sm=pps, race_regs=regs, skip=skip, count=count)
        row.update(sums=sums, ahead=ahead)
        row.update(pdl=pdl, race_us=race, finish_us=both - race, both_us=both)
        row.update(race_kernel=race_k, finish_kernel=finish_k)
        rows.append(row)
        cells = " ".join(f"{v:>3}" for v in (pps, regs, skip, count, sums, ahead, int(pdl)))
        print(f"{mix:<22} {cells} {race:>7.1f} {both - race:>9.1f} {both:>7.1f}  {race_k} "
              f"{finish_k}", flush=True)  # fmt: skip
    meta = {"gpu": torch.cuda.get_device_name(0), "date": utc_now(), "batch": args.batch}
    meta["dtype"] = args.dtype
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
