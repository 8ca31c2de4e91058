"""Sampling at decode batch sizes: today's torch Sampler vs the fused Triton draw (GPU only).

For each batch size, parameter mix (greedy, temperature 0.6, top-k 50, top-p 0.9, both at 50 / 0.9
and at 20 / 0.95, and a batch mixing all of them) and logit shape (``llm``: a broad bulk and a
dozen strong candidates per row; ``flat``: nearly uniform, the worst case of the top-k/top-p
search), it reports µs per call of the core Sampler's torch draw and of the fused kernels (eager,
and replayed in a CUDA graph where launch overhead is the GPU's), and the memory-bound floor: the
logit bytes one pass reads over the device-to-device copy rate measured in the same run. Each timed
call reads its own copy of the logits (round robin) so small batches stream from HBM, not from L2.
The tokens of both draws are compared (``mismatches``: rows that differ; expected 0).

    python benchmarks/bench_sampling.py --out sampling.json [--batches 1,32,256] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from bench_layer_kernels import time_graph  # this folder: run as a script

from execrt.bench.common import L2_BYTES, copy_bandwidth_gbps, median_us, utc_now
from execrt.core.sampler import Sampler, SamplingBatchInfo
from execrt.kernels import triton_sampling
from execrt.kernels.sampling import fused_sample

#: The sampler's launch constants a run can sweep: (flag, ``triton_sampling``'s name, the
#: argparse field and ``Row`` field, the table's column, what it is).
KNOBS = (
    ("--programs-per-sm", "PROGRAMS_PER_SM", "programs_per_sm", "pps", "race programs per SM"),
    ("--race-blocks", "RACE_BLOCK", "race_block", "block", "tokens per loop step"),
    ("--race-warps", "RACE_WARPS", "race_warps", "warps", "warps per race program"),
    ("--count-blocks", "COUNT_BLOCKS", "count_blocks", "cnt", "blocks a finish count loads"),
    ("--skip-blocks", "SKIP_BLOCKS", "skip_blocks", "skp", "1: skip blocks by their max"),
    ("--race-sums", "RACE_SUMS", "race_sums", "sum", "1: the race sums Z, pass 1 skips"),
    ("--race-ahead", "RACE_AHEAD", "race_ahead", "ahd", "1: the race loads a block ahead"),
    ("--race-regs", "RACE_REGS", "race_regs", "regs", "the race's maxnreg, 0: none"),
    (
        "--race-regs-above",
        "RACE_REGS_ABOVE",
        "race_regs_above",
        "rabv",
        "race programs per SM above which the cap applies, 0: every launch",
    ),
)
#: (temperature, top_k, top_p) of each mix; "mixed" cycles through the others row by row.
MIXES: dict[str, tuple[float, int, float]] = {
    "greedy": (0.0, -1, 1.0),
    "temp 0.6": (0.6, -1, 1.0),
    "top-k 50": (0.6, 50, 1.0),
    "top-p 0.9": (0.6, -1, 0.9),
    "top-k 50 + top-p 0.9": (0.6, 50, 0.9),
    "top-k 20 + top-p 0.95": (0.6, 20, 0.95),  # Qwen3's recommended sampling
}
MAX_SETS = 64


@dataclass
class Row:
    batch: int
    vocab: int
    dtype: str
    mix: str
    logits: str
    today_us: float
    fused_us: float
    fused_graph_us: float
    floor_us: float
    pct_floor: float  # floor / fused_graph_us
    speedup: float  # today_us / fused_graph_us
    mismatches: int
    programs_per_sm: int = 0
    race_block: int = 0
    race_warps: int = 0
    count_blocks: int = 0
    skip_blocks: int = 0
    race_sums: int = 0
    race_ahead: int = 0
    race_regs: int = 0
    race_regs_above: int = 0


def make_logits(
    shape: str, b: int, vocab: int, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    if shape == "flat":
        return (torch.randn(b, vocab, generator=gen, device="cuda") * 0.05).to(dtype)
    logits = torch.randn(b, vocab, generator=gen, device="cuda") * 2.5
    top = torch.randint(0, vocab, (b, 12), generator=gen, device="cuda")
    boost = torch.rand(b, 12, generator=gen, device="cuda") * 10 + 4
    return logits.scatter_add_(1, top, boost).to(dtype)


def make_info(mix: str, b: int) -> SamplingBatchInfo:
    mixes = list(MIXES.values())
    rows = [MIXES[mix]] * b if mix != "mixed" else [mixes[i % len(mixes)] for i in range(b)]

    def column(i: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r[i] for r in rows], dtype=dtype, device="cuda")

    return SamplingBatchInfo(
        temperatures=column(0, torch.float32),
        top_ks=column(1, torch.int64),
        top_ps=column(2, torch.float32),
        seeds=torch.arange(b, dtype=torch.int64, device="cuda") * 7919,
        steps=torch.full((b,), 17, dtype=torch.int64, device="cuda"),
        all_greedy=mix == "greedy",
    )


def round_robin(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()

    return call


def measure(
    b: int,
    vocab: int,
    dtype: torch.dtype,
    mix: str,
    shape: str,
    copy_gbps: float,
    time_today: bool = True,
) -> Row:
    gen = torch.Generator(device="cuda").manual_seed(b * 1000 + len(mix) + len(shape))
    nbytes = b * vocab * torch.empty((), dtype=dtype).element_size()
    sets = max(1, min(MAX_SETS, math.ceil(2 * L2_BYTES / nbytes)))
    logits = [make_logits(shape, b, vocab, dtype, gen) for _ in range(sets)]
    info = make_info(mix, b)
    today = Sampler()
    today_calls: list[Callable[[], object]] = [functools.partial(today, x, info) for x in logits]
    fused_calls: list[Callable[[], object]] = [
        functools.partial(fused_sample, x, info) for x in logits
    ]
    mismatches = int((today(logits[0], info) != fused_sample(logits[0], info)).sum())
    today_us = median_us(round_robin(today_calls), sets, 5) if time_today else math.nan
    fused_us = median_us(round_robin(fused_calls), sets, 5)
    replays = max(1, 200 // sets)
    fused_graph = time_graph(fused_calls, replays, 5)
    floor = nbytes / (copy_gbps * 1e9) * 1e6
    return Row(
        b,
        vocab,
        str(dtype).removeprefix("torch."),
        mix,
        shape,
        today_us,
        fused_us,
        fused_graph,
        floor,
        100 * floor / fused_graph,
        today_us / fused_graph,
        mismatches,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write the rows here as JSON")
    parser.add_argument("--batches", default="1,32,256", help="comma-separated batch sizes")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the logits' dtype: a bf16 model's LM head hands the sampler bf16 (the default)",
    )
    parser.add_argument("--mixes", default=",".join([*MIXES, "mixed"]))
    parser.add_argument("--logits", default="llm,flat", help="logit shapes: llm, flat")
    for flag, name, field, _column, what in KNOBS:
        parser.add_argument(
            flag,
            dest=field,
            default=str(int(getattr(triton_sampling, name) or 0)),
            help=f"comma-separated values of the sampler's {name} ({what}) to compare",
        )
    parser.add_argument(
        "--no-today",
        action="store_true",
        help="time only the fused draw (today's tokens are still compared)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampling: needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    copy_gbps = copy_bandwidth_gbps()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: device-to-device copy {copy_gbps:.0f} GB/s (read + write)")
    header = (
        "".join(f"{column:>5} " for *_, column, _what in KNOBS)
        + f"{'batch':>5} {'mix':<21} {'logits':<6} "
        f"{'today us':>10} {'fused us':>9} "
        f"{'graph us':>9} {'floor us':>9} {'% floor':>8} {'speedup':>8} {'diff':>5}"
    )
    print(header)
    meta = {"gpu": gpu, "copy_gbps": copy_gbps, "date": utc_now(), "vocab": args.vocab}
    rows: list[Row] = []
    sweep = [[int(x) for x in getattr(args, knob[2]).split(",")] for knob in KNOBS]
    for *knobs, b in itertools.product(*sweep, [int(x) for x in args.batches.split(",")]):
        for (_, name, _, _, _), value in zip(KNOBS, knobs, strict=True):
            setattr(triton_sampling, name, value)
        for mix in args.mixes.split(","):
            for shape in args.logits.split(","):
                r = measure(b, args.vocab, dtype, mix, shape, copy_gbps, not args.no_today)
                for (_, _, field, _, _), value in zip(KNOBS, knobs, strict=True):
                    setattr(r, field, value)
                rows.append(r)
                print(
                    "".join(f"{value:>5} " for value in knobs)
                    + f"{r.batch:>5} {r.mix:<21} {r.logits:<6} "
                    f"{r.today_us:>10.1f} "
                    f"{r.fused_us:>9.1f} {r.fused_graph_us:>9.1f} {r.floor_us:>9.1f} "
                    f"{r.pct_floor:>7.0f}% {r.speedup:>7.0f}x {r.mismatches:>5}",
                    flush=True,
                )
                _write(args.out, meta, rows)  # after every row: a run cut short keeps its rows
    print(f"wrote {args.out}")


def _write(path: str, meta: dict[str, object], rows: list[Row]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
