"""Sweep the Triton decode kernel's tile and split parameters on the GPU (one-off tuning aid).

Prints % of copy bandwidth per configuration and shape; writes every row as JSON to argv[1].
``argv[2] == "short"`` sweeps the split policy over the short contexts of a decode step
(``execrt bench decode`` runs ctx 512) instead of the tiles over long ones.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys

import torch

from execrt.bench.attention import DecodeProblem, copy_bandwidth_gbps
from execrt.kernels import attention as K
from execrt.kernels.kv_indices import fill_kv_index

SHAPES = [(1, 4096), (1, 32768), (16, 4096), (64, 4096), (256, 2048), (64, 16384)]
SHORT_SHAPES = [(1, 512), (1, 2048), (8, 512), (32, 512), (128, 512), (1, 32768), (64, 4096)]
# (min_split_len, block_n, programs_per_sm) with target 2048, 4 warps, 2 stages
SHORT_GRID = [
    (256, 128, 2), (128, 128, 2), (128, 64, 2), (128, 64, 4), (64, 64, 2), (64, 64, 4),
    (64, 32, 4), (32, 32, 4), (32, 32, 8),
]  # fmt: skip


def bench(p: DecodeProblem, policy: K.SplitPolicy, block_n: int, warps: int, stages: int) -> float:
    """µs per layer call, timed over CUDA-graph replays of every layer."""
    bs, sms = p.bs, torch.cuda.get_device_properties(0).multi_processor_count
    seq = torch.full((bs,), p.ctx, dtype=torch.int64, device="cuda")
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    indices = torch.empty(bs * p.ctx, dtype=torch.int32, device="cuda")
    fill_kv_index(p.pool.req_to_token, torch.arange(1, bs + 1, device="cuda"), seq, indptr, indices)
    max_splits = policy.max_splits(bs, p.ctx, p.hkv, sms)
    splits = torch.empty(bs, dtype=torch.int32, device="cuda")
    K.decode_num_splits(seq, splits, max_splits, policy, policy.min_splits(bs, p.hkv, sms))
    po = torch.empty(bs, p.hq, max_splits, p.d, dtype=torch.float32, device="cuda")
    pl = torch.empty(bs, p.hq, max_splits, dtype=torch.float32, device="cuda")
    outs = [torch.empty_like(p.q) for _ in p.layers]

    def run() -> None:
        for layer, o in zip(p.layers, outs, strict=True):
            K.decode_attention(
                p.q,
                p.kv_cache.k_buffers[layer.layer_id],
                p.kv_cache.v_buffers[layer.layer_id],
                o,
                indptr,
                indices,
                splits,
                po,
                pl,
                layer.scaling,
                max_splits,
                block_n=block_n,
                num_warps=warps,
                num_stages=stages,
            )

    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (10 * len(p.layers)))
    return statistics.median(times)


def main() -> None:
    copy_bw = copy_bandwidth_gbps()
    short = len(sys.argv) > 2 and sys.argv[2] == "short"
    shapes = SHORT_SHAPES if short else SHAPES
    problems = {s: DecodeProblem(*s, 32, 8, 128, torch.bfloat16) for s in shapes}
    rows = []
    if short:
        grid = [(2048, m, n, 4, 2, ppsm) for m, n, ppsm in SHORT_GRID]
    else:
        tiles = itertools.product([512, 1024, 2048], [128, 256], [64, 128], [4, 8], [2, 3])
        grid = [(*t, K.DEFAULT_PROGRAMS_PER_SM) for t in tiles]
    for target, min_len, block_n, warps, stages, ppsm in grid:
        policy = K.SplitPolicy(
            min_split_len=min_len, target_split_len=target, programs_per_sm=ppsm, block_n=block_n
        )
        cells = []
        for shape, p in problems.items():
            us = bench(p, policy, block_n, warps, stages)
            pct = 100 * p.kv_bytes / (us * 1e-6) / 1e9 / copy_bw
            rows.append(
                dict(
                    bs=shape[0],
                    ctx=shape[1],
                    target=target,
                    min_len=min_len,
                    block_n=block_n,
                    warps=warps,
                    stages=stages,
                    programs_per_sm=ppsm,
                    us=us,
                    pct=pct,
                )
            )
            cells.append(f"{pct:5.1f}")
        print(
            f"target {target:>4} min {min_len:>3} n{block_n:>3} w{warps} s{stages} p{ppsm}: "
            + " ".join(cells),
            flush=True,
        )
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
