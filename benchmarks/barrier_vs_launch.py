"""What a dependent phase costs: a kernel boundary (PDL chain) against a grid barrier inside one
persistent kernel (issue 29's question before a per-layer persistent kernel is built).

Each phase is a bs-1 projection ``x_{i+1} = W_i @ x_i`` (``W_i`` ``[K, K]`` bf16, every phase its
own matrix, so the weights stream from DRAM as a decode step's do), split over ``P`` programs of
``BN`` rows. ``x_{i+1}`` depends on every program of phase ``i``: that is the dependency every
kernel boundary of a decode layer carries. Arms, each a CUDA graph of ``--phases`` phases:

- ``chain``: one launch per phase, PDL, every load after ``griddepcontrol.wait`` (today's kernels);
- ``chain-early-w``: the same, the weight slice loaded into registers before the wait (no kernel
  writes a weight);
- ``persist``: one launch; phases separated by a grid barrier (an arrival counter, spin until
  all ``P`` programs arrived), each program loading its next weight slice before it arrives;
- ``persist-late-w``: the same, the next weight slice loaded after the barrier;
- ``*-sync``: the same without weights (the dependency alone).

Usage (GPU): ``python benchmarks/barrier_vs_launch.py [--k 2048] [--phases 112] [--json OUT]``.
Every arm's final ``x`` is checked against the chain's; a persistent arm runs only where its
``P`` programs can all be resident (else it would deadlock).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import triton
import triton.language as tl

from execrt.bench.common import copy_bandwidth_gbps, graph_us
from execrt.bench.environment import write_run
from execrt.kernels.triton_pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _phase_kernel(x_in, w_ptr, x_out, K: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr,
                  EARLY_W: tl.constexpr, LOAD_W: tl.constexpr):  # fmt: skip
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, K)
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    if LOAD_W and EARLY_W:
        w = tl.load(w_ptrs)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if LOAD_W and not EARLY_W:
        w = tl.load(w_ptrs)
    x = tl.load(x_in + rk).to(tl.float32)
    if LOAD_W:
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    else:
        y = tl.sum(x) / K + rn.to(tl.float32) * 0.0
    tl.store(x_out + rn, y.to(x_out.dtype.element_ty))


@triton.jit
def _persist_kernel(x_buf, w_ptr, count_ptr, n_phases, K: tl.constexpr, BN: tl.constexpr,
                    EARLY_W: tl.constexpr, LOAD_W: tl.constexpr,
                    VOLATILE_SPIN: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, K)
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    phase_elems = K * K
    if LOAD_W:
        w = tl.load(w_ptrs)
    for i in range(n_phases):
        x = tl.load(x_buf + i * K + rk, cache_modifier=".cg").to(tl.float32)
        if LOAD_W:
            y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            if EARLY_W:  # the next phase's slice, in flight while this program waits
                w = tl.load(w_ptrs + tl.minimum(i + 1, n_phases - 1) * phase_elems)
        else:
            y = tl.sum(x) / K + rn.to(tl.float32) * 0.0
        tl.store(x_buf + (i + 1) * K + rn, y.to(x_buf.dtype.element_ty))
        # Grid barrier: every thread's store before the arrival (CTA barrier), released at GPU
        # scope; the poll acquires the other programs' stores.
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
        target = (i + 1) * progs
        if VOLATILE_SPIN:
            c = tl.load(count_ptr, volatile=True)
            while c < target:
                c = tl.load(count_ptr, volatile=True)
            tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        else:
            c = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
            while c < target:
                c = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        if LOAD_W and not EARLY_W:
            w = tl.load(w_ptrs + tl.minimum(i + 1, n_phases - 1) * phase_elems)
    # The last program out resets the counters for the next launch (every program has passed
    # every barrier once it counts itself here).
    ticket = tl.atomic_add(count_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if ticket == progs - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(count_ptr + 1, 0, sem="relaxed", scope="gpu")


def _max_resident(kernel, num_warps: int) -> int:
    """Programs of ``kernel`` (compiled) that fit on the GPU at once, from its registers and
    shared memory."""
    props = torch.cuda.get_device_properties(0)
    threads = 32 * num_warps
    kernel._init_handles()  # loads the module: n_regs is known from then on
    regs = max(kernel.n_regs, 1) * threads
    by_regs = 65536 // regs
    by_threads = 2048 // threads
    shared = kernel.metadata.shared
    by_smem = props.shared_memory_per_multiprocessor // shared if shared else 32
    return props.multi_processor_count * max(0, min(by_regs, by_threads, by_smem, 32))


def _chain(buf, w, phases, progs, **meta) -> None:
    for i in range(phases):
        _phase_kernel[(progs,)](buf[i], w[i], buf[i + 1], PDL=True, launch_pdl=True, **meta)


def _persist(buf, w, counts, phases, progs, **meta) -> None:
    _persist_kernel[(progs,)](buf, w, counts, phases, **meta)


def _arms(w, x0, k, phases, bn, warps, load_w) -> tuple[dict, list[dict]]:
    """The arms of one (BN, weights or not) case: name -> (function, its x buffer); and the
    records of the persistent arms that cannot run (more programs than fit at once)."""
    progs = k // bn
    suffix = "" if load_w else "-sync"
    arms, skipped = {}, []

    def fresh():
        buf = torch.zeros(phases + 1, k, dtype=torch.bfloat16, device=w.device)
        buf[0] = x0
        return buf

    for early in (False, True):
        buf = fresh()
        meta = dict(K=k, BN=bn, EARLY_W=early, LOAD_W=load_w, num_warps=warps)
        name = ("chain-early-w" if early else "chain") + suffix
        arms[name] = (functools.partial(_chain, buf, w, phases, progs, **meta), buf)
    for early in (True, False):
        for volatile in (False, True):
            buf = fresh()
            counts = torch.zeros(2, dtype=torch.int32, device=w.device)
            meta = dict(K=k, BN=bn, EARLY_W=early, LOAD_W=load_w, VOLATILE_SPIN=volatile,
                        num_warps=warps)  # fmt: skip
            compiled = _persist_kernel.warmup(buf, w, counts, phases, grid=(progs,), **meta)
            resident = _max_resident(compiled, warps)
            name = "persist" if early else "persist-late-w"
            name += ("-vol" if volatile else "") + suffix
            if progs > resident:
                note = f"{progs} programs > {resident} resident"
                skipped.append({"arm": name, "bn": bn, "programs": progs, "note": note})
                continue
            arms[name] = (functools.partial(_persist, buf, w, counts, phases, progs, **meta), buf)
    return arms, skipped


def run(k: int, phases: int, bn_list: list[int], warps: int) -> list[dict]:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = (torch.randn(phases, k, k, device=dev) / k**0.5).to(torch.bfloat16)
    x0 = torch.randn(k, device=dev).to(torch.bfloat16)
    copy_gbps = copy_bandwidth_gbps()
    records: list[dict] = []
    for bn in bn_list:
        for load_w in (True, False):
            arms, skipped = _arms(w, x0, k, phases, bn, warps, load_w)
            records += skipped
            ref = None
            for name, (fn, buf) in arms.items():
                us = graph_us(fn, 20, 5)
                got = buf[phases].float()
                ref = got if ref is None else ref
                err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                floor_us = (phases * k * k * 2 if load_w else 0) / copy_gbps / 1e3
                records.append({
                    "arm": name, "bn": bn, "programs": k // bn, "warps": warps, "k": k,
                    "phases": phases, "us": round(us, 2), "us_per_phase": round(us / phases, 3),
                    "floor_us_per_phase": round(floor_us / phases, 3),
                    "pct_copy": round(100 * floor_us / us, 1) if load_w else None,
                    "copy_gbps": round(copy_gbps, 1), "max_rel_err_vs_chain": err,
                })  # fmt: skip
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--phases", type=int, default=112)
    ap.add_argument("--bn", default="8,16")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("barrier_vs_launch: needs a CUDA GPU", file=sys.stderr)
        return 2
    records = run(args.k, args.phases, [int(b) for b in args.bn.split(",")], args.warps)
    print(f"GPU {torch.cuda.get_device_name(0)}, triton {triton.__version__}")
    for rec in records:
        print(json.dumps(rec))
    if args.json:
        write_run(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
