"""Fused decode-layer kernels vs the torch sequences they replace, timed in CUDA graphs (GPU only).

For each op (rmsnorm, fused_add_rmsnorm, qk_norm_rope with the K/V store, silu_and_mul), each
model shape and each token count: µs per call of the Triton kernel and of the torch reference,
both captured in a CUDA graph (so launch overhead is the GPU's, not Python's), plus the bytes
the op must move and the rate that implies against a device-to-device copy.

Each captured call reads its own copy of the inputs (``--calls`` sets, round robin), so large
shapes stream from HBM rather than from the 60 MB L2; small shapes are judged in µs anyway.

    python benchmarks/bench_layer_kernels.py [--tokens 1,32,128] [--json out.json]
    python benchmarks/bench_layer_kernels.py --sweep --tokens 128,256   # launch shapes

``--sweep`` times the Triton kernels alone over their launch shapes instead: qk_norm_rope's heads
per program and warps (the heuristics' choice marked ``*``), the norms' warps.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from execrt.bench.attention import copy_bandwidth_gbps
from execrt.bench.common import graph_us
from execrt.kernels._triton import next_power_of_2
from execrt.kernels.activation import silu_and_mul
from execrt.kernels.norm import fused_add_rmsnorm, rmsnorm
from execrt.kernels.rotary import qk_norm_rope

D = 128
EPS = 1e-6
ROPE_POSITIONS = 4096


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    hq: int
    hkv: int
    inter: int


SHAPES = [
    Shape("qwen3-0.6b", 1024, 16, 8, 3072),
    Shape("qwen3-8b", 4096, 32, 8, 12288),
]


@dataclass
class Row:
    op: str
    shape: str
    tokens: int
    torch_us: float
    triton_us: float
    bytes: int
    triton_gbps: float
    pct_copy: float
    max_rel_err: float


Call = Callable[[], object]


def bytes_moved(op: str, s: Shape, t: int, elem: int) -> int:
    """Bytes an ideal kernel reads plus writes (weights and table rows included)."""
    if op == "rmsnorm":
        return (2 * t * s.hidden + s.hidden) * elem
    if op == "fused_add_rmsnorm":
        return (4 * t * s.hidden + s.hidden) * elem
    if op == "qk_norm_rope+store":
        qkv = t * (s.hq + 2 * s.hkv) * D  # read
        written = t * (s.hq + s.hkv) * D + t * 2 * s.hkv * D  # q, k out; k, v cache rows
        return (qkv + written + 2 * D) * elem + 2 * t * D * 4 + 2 * t * 8
    if op == "silu_and_mul":
        return 3 * t * s.inter * elem
    raise ValueError(f"bench_layer_kernels: unknown op {op!r}")


def make_calls(
    op: str,
    s: Shape,
    t: int,
    sets: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str = "cuda",
) -> tuple[list[Call], list[Call]]:
    """(triton calls, torch calls) over ``sets`` independent input sets, same inputs for both."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    fused: list[Call] = []
    ref: list[Call] = []
    if op in ("rmsnorm", "fused_add_rmsnorm"):
        w = rand(s.hidden) * 0.1 + 1
        for _ in range(sets):
            x, r = rand(t, s.hidden), rand(t, s.hidden)
            if op == "rmsnorm":
                fused.append(lambda x=x: rmsnorm(x, w, EPS, use_triton=True))
                ref.append(lambda x=x: rmsnorm(x, w, EPS))
            else:
                fused.append(lambda x=x, r=r: fused_add_rmsnorm(x, r, w, EPS, use_triton=True))
                ref.append(lambda x=x, r=r: fused_add_rmsnorm(x, r, w, EPS))
    elif op == "qk_norm_rope+store":
        angles = torch.rand(ROPE_POSITIONS, D, generator=gen, device=device) * 6.3
        cos, sin = angles.cos(), angles.sin()
        qw, kw = rand(D) * 0.1 + 1, rand(D) * 0.1 + 1
        slots = sets * t + 1
        caches = [torch.zeros(slots, s.hkv, D, dtype=dtype, device=device) for _ in range(2)]
        perm = torch.randperm(slots - 1, generator=gen, device=device) + 1
        for i in range(sets):
            qkv = rand(t, (s.hq + 2 * s.hkv) * D)
            q = qkv[:, : s.hq * D].view(t, s.hq, D)
            k = qkv[:, s.hq * D : (s.hq + s.hkv) * D].view(t, s.hkv, D)
            v = qkv[:, (s.hq + s.hkv) * D :].view(t, s.hkv, D)
            pos = torch.randint(0, ROPE_POSITIONS, (t,), generator=gen, device=device)
            loc = perm[i * t : (i + 1) * t]
            args = (q, k, pos, cos, sin, qw, kw, EPS)
            store = {"v": v, "k_cache": caches[0], "v_cache": caches[1], "out_cache_loc": loc}
            fused.append(lambda a=args, st=store: qk_norm_rope(*a, **st, use_triton=True))
            ref.append(lambda a=args, st=store: qk_norm_rope(*a, **st))
    elif op == "silu_and_mul":
        for _ in range(sets):
            x = rand(t, 2 * s.inter)
            fused.append(lambda x=x: silu_and_mul(x, use_triton=True))
            ref.append(lambda x=x: silu_and_mul(x))
    else:
        raise ValueError(f"bench_layer_kernels: unknown op {op!r}")
    return fused, ref


def max_rel_err(fused: Call, ref: Call) -> float:
    """Largest difference of the first outputs relative to the reference's largest value."""
    a, b = fused(), ref()
    a, b = (a[0], b[0]) if isinstance(a, tuple) and isinstance(b, tuple) else (a, b)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def time_graph(calls: list[Call], replays: int, repeats: int) -> float:
    """µs per call of ``calls``, one CUDA graph of all of them replayed (``graph_us``)."""

    def run_all() -> None:
        for c in calls:
            c()

    return graph_us(run_all, replays, repeats) / len(calls)


#: ``--sweep``: qk_norm_rope's heads per program and warps, the norms' warps.
SWEEP_HEADS = (1, 2, 4, 8, 16)
SWEEP_WARPS = (1, 2, 4, 8)


def sweep(shapes: list[Shape], tokens: list[int], args: argparse.Namespace) -> None:
    """µs per call of each launch shape the heuristics could pick (``*``: what they pick)."""
    import execrt.kernels.triton_norm as tn
    import execrt.kernels.triton_rotary as tr

    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads_for, rope_warps, norm_warps = tr.heads_per_program, tr.rope_warps, tn.num_warps_for
    try:
        for s, t in itertools.product(shapes, tokens):
            fused, _ = make_calls("qk_norm_rope+store", s, t, args.calls, torch.bfloat16, gen)
            picked_bh = heads_for(t, s.hq, s.hkv, sms)
            picked = (picked_bh, rope_warps(picked_bh))
            cells = []
            for bh, warps in itertools.product(SWEEP_HEADS, SWEEP_WARPS):
                tr.heads_per_program = lambda *a, bh=bh: bh  # type: ignore[misc]
                tr.rope_warps = lambda heads, w=warps: w  # type: ignore[misc]
                us = time_graph(fused, args.replays, args.repeats)
                cells.append(f"{bh}h{warps}w {us:5.2f}{'*' if (bh, warps) == picked else ' '}")
            tr.heads_per_program, tr.rope_warps = heads_for, rope_warps
            print(f"qk_norm_rope+store {s.name} T={t}: " + "  ".join(cells), flush=True)
            for op in ("rmsnorm", "fused_add_rmsnorm"):
                fused, _ = make_calls(op, s, t, args.calls, torch.bfloat16, gen)
                picked_w = norm_warps(next_power_of_2(s.hidden))
                cells = []
                for warps in (*SWEEP_WARPS, 16):
                    tn.num_warps_for = lambda block, *a, w=warps: w  # type: ignore[misc]
                    us = time_graph(fused, args.replays, args.repeats)
                    cells.append(f"{warps}w {us:5.2f}{'*' if warps == picked_w else ' '}")
                tn.num_warps_for = norm_warps
                print(f"{op} {s.name} T={t}: " + "  ".join(cells), flush=True)
    finally:
        tr.heads_per_program, tr.rope_warps, tn.num_warps_for = heads_for, rope_warps, norm_warps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32,128", help="comma-separated token counts")
    parser.add_argument("--calls", type=int, default=32, help="calls (input sets) per graph")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="", help="write every row here as JSON")
    parser.add_argument("--sweep", action="store_true", help="time the launch shapes instead")
    parser.add_argument("--shapes", default="", help="model shapes (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer_kernels: needs a CUDA device")
    if args.sweep:
        chosen = [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(",")]
        sweep(chosen, [int(x) for x in args.tokens.split(",")], args)
        return
    dtype = torch.bfloat16
    elem = torch.empty((), dtype=dtype).element_size()
    copy_bw = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_bw:.0f} GB/s (r+w)")
    ops = ["rmsnorm", "fused_add_rmsnorm", "qk_norm_rope+store", "silu_and_mul"]
    rows: list[Row] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for s in SHAPES:
        for t in (int(x) for x in args.tokens.split(",")):
            for op in ops:
                fused, ref = make_calls(op, s, t, args.calls, dtype, gen)
                err = max_rel_err(fused[0], ref[0])
                torch_us = time_graph(ref, args.replays, args.repeats)
                triton_us = time_graph(fused, args.replays, args.repeats)
                nbytes = bytes_moved(op, s, t, elem)
                gbps = nbytes / (triton_us * 1e-6) / 1e9
                row = Row(
                    op, s.name, t, torch_us, triton_us, nbytes, gbps, 100 * gbps / copy_bw, err
                )
                rows.append(row)
                print(
                    f"  {op:<20} {s.name:<11} T={t:<4} torch {torch_us:7.2f} us  "
                    f"triton {triton_us:7.2f} us  err {err:.1e}",
                    flush=True,
                )
                del fused, ref
    if args.json:
        with open(args.json, "w") as f:
            meta = {"device": torch.cuda.get_device_name(), "copy_gbps": copy_bw}
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print()
    header = (
        f"{'op':<20} {'shape':<11} {'T':>4} {'torch us':>9} {'triton us':>9} {'speedup':>7} "
        f"{'KB':>8} {'GB/s':>7} {'%copy':>6} {'ok':>3}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ok = "ok" if r.max_rel_err <= 2e-2 else "BAD"
        print(
            f"{r.op:<20} {r.shape:<11} {r.tokens:>4} {r.torch_us:>9.2f} {r.triton_us:>9.2f} "
            f"{r.torch_us / r.triton_us:>6.2f}x {r.bytes / 1024:>8.1f} {r.triton_gbps:>7.0f} "
            f"{r.pct_copy:>5.1f}% {ok:>3}"
        )


if __name__ == "__main__":
    main()
