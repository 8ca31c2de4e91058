"""Where a profiled run's GPU time went, from its Chrome trace, with each kernel's critical path.

    python benchmarks/trace_critical.py TRACE.json [--steps N] [--top 30] [--layers 28]

``bench decode --profile --out DIR`` writes such traces (``bench throughput --profile`` prints
the same columns itself: ``crit ms``). Per
kernel name: calls, total duration, and its critical time (``execrt.bench.timing.critical_path_us``:
the busy time it adds past the end of every span that started before it). Under PDL a kernel
starts early and waits for the one ahead, so its duration overstates what it costs the step;
the critical time does not. ``--steps`` divides by the steps the trace holds (µs per step);
``--layers`` also divides by the layers (µs per layer and step).
"""

from __future__ import annotations

import argparse
import collections
import json

from execrt.bench.timing import critical_path_us, short_kernel_name, union_length

#: Trace categories that run on the GPU.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_spans(path: str) -> list[tuple[float, float, str]]:
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), short_kernel_name(e["name"]))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds (default 1)")
    ap.add_argument("--layers", type=int, default=0, help="also per layer (default off)")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    spans = gpu_spans(args.trace)
    if not spans:
        raise SystemExit(f"{args.trace}: no GPU spans (categories {GPU_CATEGORIES})")
    total: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for start, stop, name in spans:
        total[name] += stop - start
        calls[name] += 1
    critical = critical_path_us(spans)
    busy = union_length([s[:2] for s in spans])
    wall = max(s[1] for s in spans) - min(s[0] for s in spans)
    per = args.steps * (args.layers or 1)
    unit = "µs per step" + (" and layer" if args.layers else "")
    print(f"GPU busy {busy / args.steps:.1f} of {wall / args.steps:.1f} µs per step; {unit}:")
    print(f"  {'calls':>7} {'duration':>9} {'critical':>9}  kernel")
    for name, _ in sorted(critical.items(), key=lambda kv: -kv[1])[: args.top]:
        n, dur, crit = calls[name] / per, total[name] / per, critical[name] / per
        print(f"  {n:7.2f} {dur:9.2f} {crit:9.2f}  {name}")


if __name__ == "__main__":
    main()
