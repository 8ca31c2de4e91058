"""Sweep the Triton decode kernel's tile and split parameters on the GPU (one-off tuning aid).

Prints % of copy bandwidth per configuration and shape; writes every row as JSON to the first
argument. The second picks the sweep:

- ``long`` (default): the split policy and tiles over long contexts (bf16);
- ``short``: the split policy over the short contexts of a decode step (``execrt bench
  decode`` runs ctx 512);
- ``ragged``: split targets, tiles and the work list's order (longest split first, the
  backend's default, against request order) over serving batches (bs 32/64/128/256, each
  request's context uniform in [100, 2048], the offline throughput workload's range), 16/8
  heads as Qwen3-0.6B; the tuned tiles also over uniform contexts of the same total;
- ``tiles``: the stage-1 tiles (``DecodeTiles``) per KV cache dtype (``--kv-dtypes``, default
  ``fp8_e4m3,auto``) at bs 1/32/128 x ctx 512/8192 with the default split policy. Each tile is
  checked against the fp32 oracle over the dequantized K/V before it is timed; per batch size
  the tile with the lowest mean time relative to the best at each context wins, and the
  winners are written as ``decode_tiles`` reads them, ``device_name=..,dtype=<kv dtype>.json``,
  next to the rows (copy them into ``execrt/kernels/attention/decode_configs/`` to ship them);
- ``fp8``: the fp8 decode kernels (``decode_attention(fp8_kernel=...)``) at the same shapes:
  ``words`` at the tuned tiles, ``mma`` (Gluon) at each ``ahead,tokens,maxnreg`` launch shape
  of ``--mma-shapes``, and the bf16 cache at its tuned tiles for scale; the merge fused where
  the backend's ``auto`` fuses it. Each is checked against the fp32 oracle at bs 1 x 512 first.
  The mma arms split as the backend does, under the wave rule (``--waves off|both`` for
  without). A decode step runs at ctx + n, not ctx: ``--ctx-extra 40`` times that (at 32 x
  8192 it is 5 splits a request instead of 4, which only the wave rule brings back to one
  wave).

    python benchmarks/tune_triton_decode.py "$OUT/tune-decode.json" tiles --kv-dtypes fp8_e4m3,auto
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton

from execrt.bench.attention import DecodeProblem, copy_bandwidth_gbps
from execrt.bench.common import utc_now
from execrt.core.kv_quant import KV_CACHE_DTYPES, kv_storage_dtype
from execrt.kernels import attention as K
from execrt.kernels._triton import tuned_table_name
from execrt.kernels.kv_indices import fill_kv_index

SHAPES = [(1, 4096), (1, 32768), (16, 4096), (64, 4096), (256, 2048), (64, 16384)]
SHORT_SHAPES = [(1, 512), (1, 2048), (8, 512), (32, 512), (128, 512), (1, 32768), (64, 4096)]
# (min_split_len, block_n, programs_per_sm) with target 2048, 4 warps, 2 stages
SHORT_GRID = [
    (256, 128, 2), (128, 128, 2), (128, 64, 2), (128, 64, 4), (64, 64, 2), (64, 64, 4),
    (64, 32, 4), (32, 32, 4), (32, 32, 8),
]  # fmt: skip
TILE_SHAPES = [(bs, ctx) for bs in (1, 8, 32, 128) for ctx in (512, 8192)]
# (block_n, warps, stages) by the cache's bytes per element; the 16-bit grid is there to compare
# against with the same kernel (slot ids carried a block ahead). 256-token fp8 blocks spilled
# registers in an AOT compile for sm90 (255 registers, triton 3.6), at 3 stages they need
# 280 KB of shared memory; a tile the GPU cannot launch is reported and skipped.
TILE_GRID = {
    1: [
        (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 4, 4),
        (128, 8, 2), (128, 8, 3),
    ],
    2: [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2)],
}  # fmt: skip
MAX_REL_ERR = 3e-2  # vs the fp32 oracle: fp16/bf16 rounding of q, p and the output


def bench(
    p: DecodeProblem,
    policy: K.SplitPolicy,
    block_n: int,
    warps: int,
    stages: int,
    check: bool = False,
    longest_first: bool = True,
    fused: bool = False,
    fp8_kernel: str | None = None,
    interleave: bool = False,
    wave: bool = True,
) -> tuple[float, float]:
    """(µs per layer call, timed over CUDA-graph replays of every layer; relative error of
    layer 0 against the fp32 oracle when ``check``, else 0). ``longest_first``: the work list
    in the backend's default order (longest split first), else request after request.
    ``fused``: the merge inside the split launch (arrival counters), else its own launch.
    ``interleave``: each layer call follows a small PDL kernel (an RMSNorm over ``[bs,
    4096]``, as the step's q/k norm kernel precedes its attention), whose time alone is
    subtracted: the launch as it starts inside a decode step, not back to back. ``wave``:
    the split counts under the backend's wave rule (``decode_wave``), else the policy's."""
    bs, sms = p.bs, torch.cuda.get_device_properties(0).multi_processor_count
    seq = p.seq_lens()
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    indices = torch.empty(sum(p.lens), dtype=torch.int32, device="cuda")
    fill_kv_index(p.pool.req_to_token, torch.arange(1, bs + 1, device="cuda"), seq, indptr, indices)
    max_splits = policy.max_splits(bs, p.ctx, p.hkv, sms)
    splits = torch.empty(bs, dtype=torch.int32, device="cuda")
    cache = p.kv_cache
    w = K.decode_wave(p.q, cache.k_buffers[0], cache.v_buffers[0], fp8_kernel=fp8_kernel)
    K.decode_num_splits(seq, splits, max_splits, policy, policy.min_splits(bs, p.hkv, sms),
                        wave=w if wave else 0)  # fmt: skip
    work = torch.empty(K.work_size(bs, max_splits), dtype=torch.int32, device="cuda")
    # once, as the backend's metadata launch does
    K.decode_work(splits, max_splits, work, seq if longest_first else None)
    po = torch.empty(bs, p.hq, max_splits, p.d, dtype=torch.float32, device="cuda")
    pl = torch.empty(bs, p.hq, max_splits, dtype=torch.float32, device="cuda")
    outs = [torch.empty_like(p.q) for _ in p.layers]
    arrivals = torch.zeros(bs * p.hkv, dtype=torch.int32, device="cuda") if fused else None

    from execrt.kernels.triton_norm import rmsnorm_triton

    x = torch.randn(bs, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")

    def norms() -> None:
        for _ in p.layers:
            rmsnorm_triton(x, w, 1e-6)

    def run() -> None:
        for layer, o in zip(p.layers, outs, strict=True):
            if interleave:
                rmsnorm_triton(x, w, 1e-6)
            i = layer.layer_id
            K.decode_attention(
                p.q, cache.k_buffers[i], cache.v_buffers[i], o, indptr, indices, splits, po,
                pl, layer.scaling, max_splits,
                kv_scales=cache.layer_scales[i] if cache.is_fp8 else None,
                block_n=block_n, num_warps=warps, num_stages=stages, work=work,
                arrivals=arrivals, fp8_kernel=fp8_kernel,
            )  # fmt: skip

    run()
    err = 0.0
    if check:
        torch.cuda.synchronize()
        ref = p.reference()
        err = float((outs[0].float() - ref).norm() / ref.norm())
    us = _graph_us(run, len(p.layers))
    if interleave:
        us -= _graph_us(norms, len(p.layers))
    return us, err


def _graph_us(fn: Any, calls: int) -> float:
    """µs per call of ``fn``'s ``calls`` launches, median of CUDA-graph replays."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (10 * calls))
    return statistics.median(times)


def sweep_policy(
    short: bool,
    copy_bw: float,
    merges: tuple[str, ...] = ("separate",),
    shapes: list[tuple[int, int]] | None = None,
    short_grid: list[tuple[int, int, int, int, int]] | None = None,
    interleave: bool = False,
) -> list[dict[str, Any]]:
    """``short_grid``: (min_split_len, block_n, warps, stages, programs_per_sm) rows for the
    short sweep instead of ``SHORT_GRID`` (4 warps, 2 stages); ``shapes``: (bs, ctx) instead of
    the mode's."""
    shapes = shapes or (SHORT_SHAPES if short else SHAPES)
    problems = {s: DecodeProblem(*s, 32, 8, 128, torch.bfloat16) for s in shapes}
    rows: list[dict[str, Any]] = []
    if short:
        rows_ = short_grid or [(m, n, 4, 2, ppsm) for m, n, ppsm in SHORT_GRID]
        grid = [(2048, m, n, w, st, ppsm) for m, n, w, st, ppsm in rows_]
    else:
        tiles = itertools.product([512, 1024, 2048], [128, 256], [64, 128], [4, 8], [2, 3])
        grid = [(*t, K.DEFAULT_PROGRAMS_PER_SM) for t in tiles]
    for (target, min_len, block_n, warps, stages, ppsm), merge in itertools.product(grid, merges):
        policy = K.SplitPolicy(min_split_len=min_len, target_split_len=target, programs_per_sm=ppsm)
        cells = []
        for shape, p in problems.items():
            try:
                us, err = bench(p, policy, block_n, warps, stages, check=short_grid is not None,
                                fused=merge == "fused", interleave=interleave)  # fmt: skip
            except Exception as exc:  # a tile the GPU cannot launch (shared memory)
                print(f"# n{block_n} w{warps} s{stages} {shape}: {type(exc).__name__}", flush=True)
                cells.append("  -  ")
                continue
            pct = 100 * p.kv_bytes / (us * 1e-6) / 1e9 / copy_bw
            rows.append(
                dict(
                    bs=shape[0], ctx=shape[1], target=target, min_len=min_len, block_n=block_n,
                    warps=warps, stages=stages, programs_per_sm=ppsm, merge=merge, us=us,
                    pct=pct, err=err,
                )
            )  # fmt: skip
            bad = " BAD" if err > MAX_REL_ERR else ""
            cells.append(f"{pct:5.1f}" if short_grid is None else f"{us:6.2f} us{bad}")
        print(
            f"target {target:>4} min {min_len:>3} n{block_n:>3} w{warps} s{stages} p{ppsm} "
            f"{merge}: " + " ".join(cells),
            flush=True,
        )
    return rows


RAGGED_BATCHES = (32, 64, 128, 256)
RAGGED_TARGETS = (2048, 1024, 512)
# (block_n, warps, stages); the 32-token tiles fit 4-5 programs per SM (sm90 AOT: 96 registers,
# 37 / 53 KiB), not yet timed
RAGGED_TILES = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (32, 4, 3), (32, 4, 4))


def sweep_ragged(
    copy_bw: float,
    tiles_grid: tuple[tuple[int, int, int], ...] = RAGGED_TILES,
    targets: tuple[int, ...] = RAGGED_TARGETS,
    orders: tuple[str, ...] = ("longest", "request"),
) -> list[dict[str, Any]]:
    """Split targets and tiles over ragged batches, and the tuned tiles over uniform ones of
    the same total (see the module docstring)."""
    rows: list[dict[str, Any]] = []
    g = torch.Generator().manual_seed(0)
    print("# % of copy bandwidth by (block_n, warps, stages) and split target", flush=True)
    for bs in RAGGED_BATCHES:
        lens = torch.randint(100, 2049, (bs,), generator=g).tolist()
        mean = round(sum(lens) / bs)
        ragged = DecodeProblem(bs, max(lens), 16, 8, 128, torch.bfloat16, lens=lens)
        uniform = DecodeProblem(bs, mean, 16, 8, 128, torch.bfloat16)
        t = K.decode_tiles(torch.bfloat16, 128, bs, torch.device("cuda"))
        tuned = (t.block_n, t.num_warps, t.num_stages)
        print(f"# bs {bs}, mean ctx {mean}, tuned tiles {tuned}", flush=True)
        for tiles in dict.fromkeys((tuned, *tiles_grid)):
            cells = []
            for target in targets:
                policy = K.SplitPolicy.with_target(target)
                # (kind, problem, order): the work list longest first (the backend's
                # default) and in request order, on the ragged batch
                kinds = [("ragged", ragged, order) for order in orders]
                if tiles == tuned:
                    kinds.append(("uniform", uniform, "longest"))
                for kind, p, order in kinds:
                    label = f"t{target} {kind} {order[:4]}"
                    try:
                        us, _ = bench(p, policy, *tiles, longest_first=order == "longest")
                    except Exception as exc:  # out of shared memory or registers
                        cells.append(f"{label}: {type(exc).__name__}")
                        continue
                    pct = 100 * p.kv_bytes / (us * 1e-6) / 1e9 / copy_bw
                    rows.append(
                        dict(kind=kind, order=order, bs=bs, mean_ctx=mean, target=target,
                             block_n=tiles[0], warps=tiles[1], stages=tiles[2], us=us, pct=pct)
                    )  # fmt: skip
                    cells.append(f"{label} {pct:5.1f}")
            print(f"  n{tiles[0]:>3} w{tiles[1]} s{tiles[2]}: " + "  ".join(cells), flush=True)
    return rows


@dataclass
class TileRow:
    kv_dtype: str
    bs: int
    ctx: int
    block_n: int
    warps: int
    stages: int
    us: float | None = None
    pct: float | None = None
    err: float | None = None  # vs the fp32 oracle (first shape only)
    note: str = ""

    @property
    def tiles(self) -> K.DecodeTiles:
        return K.DecodeTiles(self.block_n, self.warps, self.stages)


def best_tiles(rows: list[TileRow]) -> dict[int, K.DecodeTiles]:
    """Per batch size: the tile with the lowest mean of (its µs / the best µs at that shape)
    over the contexts, among tiles measured at every context."""
    timed = [r for r in rows if r.us is not None and not r.note]
    best_us: dict[tuple[int, int], float] = {}
    for r in timed:
        assert r.us is not None
        best_us[(r.bs, r.ctx)] = min(best_us.get((r.bs, r.ctx), float("inf")), r.us)
    rel: dict[int, dict[K.DecodeTiles, list[float]]] = {}
    for r in timed:
        assert r.us is not None
        rel.setdefault(r.bs, {}).setdefault(r.tiles, []).append(r.us / best_us[(r.bs, r.ctx)])
    chosen = {}
    for bs, by_tile in rel.items():
        full = max(map(len, by_tile.values()))
        complete = {t: v for t, v in by_tile.items() if len(v) == full}
        chosen[bs] = min(complete, key=lambda t: statistics.fmean(complete[t]))
    return chosen


def sweep_tiles(kv_names: list[str], copy_bw: float, out_dir: str) -> list[TileRow]:
    policy = K.SplitPolicy()
    device = torch.cuda.get_device_name()
    rows: list[TileRow] = []
    chosen_us: dict[str, dict[tuple[int, int], float]] = {}
    shapes = ", ".join(f"{bs}x{ctx}" for bs, ctx in TILE_SHAPES)
    for kv_name in kv_names:
        kv_dtype = kv_storage_dtype(kv_name, torch.bfloat16)
        size = torch.empty((), dtype=kv_dtype).element_size()
        print(f"# {kv_name} ({kv_dtype}): % of copy bandwidth at {shapes}", flush=True)
        problems = [
            DecodeProblem(bs, ctx, 32, 8, 128, torch.bfloat16, kv_dtype=kv_dtype)
            for bs, ctx in TILE_SHAPES
        ]
        kv_rows: list[TileRow] = []
        for block_n, warps, stages in TILE_GRID[size]:
            cells = []
            for i, p in enumerate(problems):
                row = TileRow(kv_name, p.bs, p.ctx, block_n, warps, stages)
                kv_rows.append(row)
                try:
                    row.us, err = bench(p, policy, block_n, warps, stages, check=i == 0)
                except Exception as exc:  # out of shared memory or registers: no candidate
                    row.note = f"{type(exc).__name__}: {str(exc)[:120]}"
                    cells.append(f"failed ({row.note})")
                    break
                row.pct = 100 * p.kv_bytes / (row.us * 1e-6) / 1e9 / copy_bw
                if i == 0:
                    row.err = err
                    if err > MAX_REL_ERR:
                        row.note = f"error {err:.3g} vs the fp32 oracle"
                        cells.append(f"wrong ({row.note})")
                        break
                cells.append(f"{row.pct:5.1f}")
            print(f"n{block_n:>3} w{warps} s{stages}: " + " ".join(cells), flush=True)
        rows += kv_rows
        table = best_tiles(kv_rows)
        chosen_us[kv_name] = {
            (r.bs, r.ctx): r.us for r in kv_rows if r.us is not None and table.get(r.bs) == r.tiles
        }
        picks = ", ".join(
            f"bs {bs}: n{t.block_n} w{t.num_warps} s{t.num_stages}"
            for bs, t in sorted(table.items())
        )
        print(f"# {kv_name} chosen: {picks}", flush=True)
        path = os.path.join(out_dir, tuned_table_name(device, kv_dtype))
        data = K.tile_table_json(
            {128: table}, device_name=device, date=utc_now(), torch=torch.__version__,
            triton=triton.__version__,
            note="benchmarks/tune_triton_decode.py tiles: 32/8 heads, D 128, bf16 q, random slots",
        )  # fmt: skip
        with open(path, "w") as fh:
            json.dump(data, fh, indent=1)
        print(f"# wrote {path}", flush=True)
    auto = chosen_us.get("auto", {})
    for kv_name in (k for k in chosen_us if k != "auto" and auto):
        print(f"# {kv_name} vs auto at the chosen tiles (µs per layer call):", flush=True)
        for (bs, ctx), us in sorted(chosen_us[kv_name].items()):
            if (bs, ctx) in auto:
                ref = auto[(bs, ctx)]
                print(f"#   bs {bs:>3} ctx {ctx:>5}: {ref:7.1f} -> {us:7.1f} ({ref / us:.2f}x)")
    return rows


MMA_SHAPES = (
    "1,16,168,0,4;0,16,0,4,4;0,16,128,3,4;0,16,0,6,4;0,32,0,3,4;0,16,0,4,1;0,32,0,3,1;"
    "0,32,128,4,1;0,16,0,6,1;0,16,0,4,2"
)


def sweep_fp8(
    copy_bw: float,
    mma_shapes: str,
    programs_per_sm: tuple[int, ...] = (),
    split_targets: tuple[int, ...] = (),
    steal: tuple[bool, ...] = (False,),
    interleave: bool = False,
    waves: tuple[bool, ...] = (True,),
    ctx_extra: int = 0,
) -> list[dict[str, Any]]:
    """The bf16 and fp8-words kernels, then each mma launch shape under the default split
    policy, each of ``programs_per_sm`` (the policy's stage-1 programs per SM before splits
    get longer: more splits of short contexts, for the mma kernel's 1-warp programs) and each
    of ``split_targets`` (tokens per split), with and/or without work stealing (``steal``:
    ``decode_mma.MMA_STEAL``). ``interleave``: each launch after a small PDL kernel, as in
    a decode step (see :func:`bench`). ``waves``: the mma arms with and/or without the
    wave rule; ``ctx_extra``: tokens added to every shape's context (a decode step past an
    8k prompt has 8k + n)."""
    from execrt.kernels.attention import decode_mma

    default = K.SplitPolicy()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tile_shapes = [(bs, ctx + ctx_extra) for bs, ctx in TILE_SHAPES]
    shapes = ", ".join(f"{bs}x{ctx}" for bs, ctx in tile_shapes)
    print(f"# % of copy bandwidth ({copy_bw:.0f} GB/s) at {shapes}", flush=True)
    Shape = tuple[int, int, int, int, int]
    arms: list[tuple[str, str, str | None, Shape | None, K.SplitPolicy, bool, bool]] = [
        ("bf16", "auto", None, None, default, False, False),
        ("words", "fp8_e4m3", "words", None, default, False, False),
    ]
    policies = [(default, "")]
    policies += [
        (K.SplitPolicy(programs_per_sm=n), f" pps{n}")
        for n in programs_per_sm
        if n != default.programs_per_sm
    ]
    policies += [(K.SplitPolicy.with_target(n), f" split{n}") for n in split_targets]
    for spec in (x for x in mma_shapes.split(";") if x):
        ahead, tokens, maxnreg, ring, warps = (int(v) for v in spec.split(","))
        for policy, tag in policies:
            for st in steal:
                for wv in waves:
                    name = f"mma w{warps} a{ahead} t{tokens} r{maxnreg or '-'} ring{ring}{tag}"
                    name += (" steal" if st else "") + ("" if wv else " nowave")
                    shape = (ahead, tokens, maxnreg, ring, warps)
                    arms.append((name, "fp8_e4m3", "mma", shape, policy, st, wv))
    rows: list[dict[str, Any]] = []
    problems: dict[str, list[DecodeProblem]] = {}
    for name, kv_name, kernel, shape, policy, st, wv in arms:
        kv_dtype = kv_storage_dtype(kv_name, torch.bfloat16)
        if kv_name not in problems:
            problems[kv_name] = [
                DecodeProblem(bs, ctx, 32, 8, 128, torch.bfloat16, kv_dtype=kv_dtype)
                for bs, ctx in tile_shapes
            ]
        saved = (
            decode_mma.MMA_AHEAD, decode_mma.MMA_TOKENS, decode_mma.MMA_MAXNREG,
            decode_mma.MMA_RING, decode_mma.MMA_WARPS, decode_mma.MMA_STEAL,
        )  # fmt: skip
        decode_mma.MMA_STEAL = st
        if shape is not None:
            decode_mma.MMA_WARPS = shape[4]
            decode_mma.MMA_AHEAD = shape[0] or decode_mma.MMA_AHEAD
            decode_mma.MMA_TOKENS, decode_mma.MMA_RING = shape[1], shape[3]
            decode_mma.MMA_MAXNREG = shape[2]  # 0: as ptxas allocates
        cells = []
        try:
            for i, p in enumerate(problems[kv_name]):
                t = K.decode_tiles(kv_dtype, 128, p.bs, torch.device("cuda"))
                fused = policy.min_splits(p.bs, p.hkv, sms) == 1
                try:
                    us, err = bench(p, policy, t.block_n, t.num_warps, t.num_stages,
                                    check=i == 0, fused=fused, fp8_kernel=kernel,
                                    interleave=interleave, wave=wv)  # fmt: skip
                except Exception as exc:  # a launch shape the GPU cannot run
                    cells.append(f"failed ({type(exc).__name__}: {str(exc)[:100]})")
                    break
                pct = 100 * p.kv_bytes / (us * 1e-6) / 1e9 / copy_bw
                splits = policy.max_splits(p.bs, p.ctx, p.hkv, sms)
                rows.append(dict(arm=name, bs=p.bs, ctx=p.ctx, us=us, pct=pct, fused=fused,
                                 max_splits=splits, programs_per_sm=policy.programs_per_sm,
                                 split_target=policy.target_split_len, steal=st, wave=wv,
                                 interleave=interleave,
                                 err=err if i == 0 else None))  # fmt: skip
                if i == 0 and err > MAX_REL_ERR:
                    cells.append(f"wrong (error {err:.3g} vs the fp32 oracle)")
                    break
                cells.append(f"{pct:5.1f} ({us:6.1f} us)")
        finally:
            (
                decode_mma.MMA_AHEAD, decode_mma.MMA_TOKENS, decode_mma.MMA_MAXNREG,
                decode_mma.MMA_RING, decode_mma.MMA_WARPS, decode_mma.MMA_STEAL,
            ) = saved  # fmt: skip
        print(f"{name:>20}: " + " ".join(cells), flush=True)
    return rows


MODES = ("long", "short", "tiles", "ragged", "fp8")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser (for its errors) and the arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "out", nargs="?", help="JSON file for every row (a mode's name alone is the mode)"
    )
    parser.add_argument("mode", nargs="?", choices=MODES, help="the sweep (default: long)")
    for flag, default, text in (
        (
            "--mma-shapes",
            MMA_SHAPES,
            "fp8: the mma kernel's ahead,tokens,maxnreg,ring,warps launch shapes, ';'-separated "
            "(maxnreg 0: as ptxas allocates; ring 0: loads into registers ahead steps ahead, else "
            "a cp.async ring of that many stages)",
        ),
        (
            "--programs-per-sm",
            "",
            "fp8: split policies (stage-1 programs per SM) to time each mma shape under too, "
            "comma-separated (the default policy always runs)",
        ),
        (
            "--split-targets",
            "",
            "fp8: split policies by tokens per split to time each mma shape under too, "
            "comma-separated",
        ),
        (
            "--steal",
            "off",
            "fp8: the mma kernel's work stealing (decode_mma.MMA_STEAL): off, on, or both",
        ),
        (
            "--waves",
            "on",
            "fp8: the mma arms under the backend's wave rule (decode_wave): on, off, or both",
        ),
        (
            "--kv-dtypes",
            "fp8_e4m3,auto",
            f"tiles: kv_cache_dtype names, comma-separated ({', '.join(KV_CACHE_DTYPES)})",
        ),
        (
            "--ragged-tiles",
            "",
            "ragged: block_n,warps,stages tiles, ';'-separated (default: "
            + "; ".join(",".join(map(str, t)) for t in RAGGED_TILES)
            + ")",
        ),
        (
            "--ragged-targets",
            ",".join(map(str, RAGGED_TARGETS)),
            "ragged: split targets, comma-separated",
        ),
        (
            "--ragged-orders",
            "longest,request",
            "ragged: work orders, comma-separated",
        ),
        (
            "--shapes",
            "",
            "long/short: BSxCTX shapes, comma-separated, instead of the mode's (1x512,8x512)",
        ),
        (
            "--short-grid",
            "",
            "short: min_split_len,block_n,warps,stages,programs_per_sm rows, ';'-separated, "
            "instead of the built-in grid (4 warps, 2 stages)",
        ),
        (
            "--merges",
            "separate",
            "long/short: the split merge, comma-separated: separate (its own launch), fused "
            "(inside the split launch)",
        ),
    ):
        parser.add_argument(flag, default=default, help=text)
    parser.add_argument(
        "--interleave", action="store_true",
        help="fp8: each launch after a small PDL kernel (as in a decode step), its time "
        "subtracted",
    )  # fmt: skip
    parser.add_argument(
        "--ctx-extra", type=int, default=0,
        help="fp8: tokens added to every shape's context (a step past an 8k prompt: 8k + n)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.mode is None:  # `tune_triton_decode.py short`: the mode, not a file named "short"
        args.out, args.mode = (None, args.out) if args.out in MODES else (args.out, "long")
    return parser, args


def main() -> None:
    parser, args = parse_args()
    kv_names = [k for k in args.kv_dtypes.split(",") if k]
    bad = [k for k in kv_names if k not in KV_CACHE_DTYPES]
    if bad:
        parser.error(f"--kv-dtypes {bad} unsupported (supported: {', '.join(KV_CACHE_DTYPES)})")
    merges = tuple(m for m in args.merges.split(",") if m)
    if not merges or set(merges) - {"separate", "fused"}:
        parser.error(f"--merges {args.merges!r} unsupported (supported: separate, fused)")
    copy_bw = copy_bandwidth_gbps()
    rows: list[dict[str, Any]]
    if args.mode == "tiles":
        out_dir = (os.path.dirname(args.out) if args.out else "") or "."
        rows = [asdict(r) for r in sweep_tiles(kv_names, copy_bw, out_dir)]
    elif args.mode == "fp8":
        pps = tuple(int(n) for n in args.programs_per_sm.split(",") if n)
        targets = tuple(int(n) for n in args.split_targets.split(",") if n)
        steal = {"off": (False,), "on": (True,), "both": (False, True)}.get(args.steal)
        if steal is None:
            parser.error(f"--steal {args.steal!r} unsupported (supported: off, on, both)")
        waves = {"off": (False,), "on": (True,), "both": (True, False)}.get(args.waves)
        if waves is None:
            parser.error(f"--waves {args.waves!r} unsupported (supported: off, on, both)")
        rows = sweep_fp8(copy_bw, args.mma_shapes, pps, targets, steal, args.interleave, waves,
                         args.ctx_extra)  # fmt: skip
    elif args.mode == "ragged":
        grid = tuple(
            (n, w, st)
            for n, w, st in (map(int, t.split(",")) for t in args.ragged_tiles.split(";") if t)
        )
        rows = sweep_ragged(
            copy_bw,
            grid or RAGGED_TILES,
            tuple(int(t) for t in args.ragged_targets.split(",") if t),
            tuple(o for o in args.ragged_orders.split(",") if o),
        )
    else:
        shapes = [tuple(map(int, t.split("x"))) for t in args.shapes.split(",") if t]
        short_grid = [tuple(map(int, t.split(","))) for t in args.short_grid.split(";") if t]
        if any(len(t) != 2 for t in shapes) or any(len(t) != 5 for t in short_grid):
            parser.error("--shapes: BSxCTX,...; --short-grid: min,block_n,warps,stages,ppsm;...")
        rows = sweep_policy(
            args.mode == "short",
            copy_bw,
            merges,
            shapes or None,  # type: ignore[arg-type]
            short_grid or None,  # type: ignore[arg-type]
            args.interleave,
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
