"""Where a profiled run's GPU time went, from its Chrome trace, with each kernel's critical path.

    python benchmarks/trace_critical.py TRACE.json [--steps N] [--top 30] [--layers 28]
    python benchmarks/trace_critical.py TRACE.json --timeline 300:24   # 24 kernels from the 300th

``bench decode --profile --out DIR`` writes such traces (``bench throughput --profile`` prints
the same columns itself: ``crit ms``). Per
kernel name: calls, total duration, and its critical time (``execrt.bench.timing.critical_path_us``:
the busy time it adds past the end of every span that started before it). Under PDL a kernel
starts early and waits for the one ahead, so its duration overstates what it costs the step;
the critical time does not. ``--steps`` divides by the steps the trace holds (µs per step);
``--layers`` also divides by the layers (µs per layer and step). ``--timeline FIRST:COUNT``
lists COUNT spans in start order from the FIRST: start and end (µs from the first), duration,
critical time, and the launch's grid, block and registers where the trace has them.
"""

from __future__ import annotations

import argparse
import collections
import json

from execrt.bench.timing import (
    critical_path_us,
    short_kernel_name,
    span_critical_us,
    union_length,
)

#: Trace categories that run on the GPU.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events(path: str) -> list[dict]:
    """The trace's GPU spans, in start order."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    found = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    return sorted(found, key=lambda e: float(e["ts"]))


def spans_of(events: list[dict]) -> list[tuple[float, float, str]]:
    return [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), short_kernel_name(e["name"]))
        for e in events
    ]


def timeline(
    events: list[dict], spans: list[tuple[float, float, str]], first: int, count: int
) -> list[str]:
    """One line per span ``first .. first + count`` (``spans``: ``spans_of(events)``): its
    times from span 0's start, its duration, what it adds past every earlier-started span,
    and its launch shape."""
    t0 = spans[0][0]
    lines = [f"  {'start':>10} {'end':>10} {'dur':>7} {'crit':>7}  kernel (grid, block, registers)"]
    rows = list(zip(events, spans, span_critical_us(spans), strict=True))
    for e, (start, stop, name), crit in rows[first : first + count]:
        a = e.get("args", {})
        shape = f"grid {a.get('grid')} block {a.get('block')} regs {a.get('registers per thread')}"
        lines.append(
            f"  {start - t0:10.2f} {stop - t0:10.2f} {stop - start:7.2f} {crit:7.2f}  {name}"
            + (f" ({shape})" if "grid" in a else "")
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds (default 1)")
    ap.add_argument("--layers", type=int, default=0, help="also per layer (default off)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--timeline", default="", help="FIRST:COUNT spans in start order instead")
    args = ap.parse_args()
    events = gpu_events(args.trace)
    spans = spans_of(events)
    if not spans:
        raise SystemExit(f"{args.trace}: no GPU spans (categories {GPU_CATEGORIES})")
    if args.timeline:
        first, count = (int(v) for v in args.timeline.split(":"))
        print("\n".join(timeline(events, spans, first, count)))
        return
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
