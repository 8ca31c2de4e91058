"""The offline workload's prefill phase on its own, traced: where the GPU waits between the
extend steps of ``bench throughput``.

Builds the engine as ``bench throughput``'s defaults do, warms it up, then generates the
workload's prompts with ``--new-tokens`` each (1: nothing but the ~9 extends of 16k tokens)
under torch.profiler with the host's ops. Prints wall against GPU busy, the longest idle
gaps with the host ops inside them, and writes a chrome trace (``--trace``).

    python benchmarks/prefill_phase_trace.py --trace /tmp/out/prefill-trace.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from execrt.bench.models import RandomWeightsLoader, model_config
from execrt.bench.throughput import draw_workload
from execrt.bench.timing import jit_compiles, profile_kernels, synchronize
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--new-tokens", type=int, default=1)
    ap.add_argument("--gaps", type=int, default=25)
    ap.add_argument("--trace", default=None, help="write the chrome trace here")
    ap.add_argument("--cprofile", type=int, default=40, help="cProfile rows (0: none)")
    args = ap.parse_args()
    device = torch.device("cuda")
    wl = draw_workload()
    engine = Engine(loader=RandomWeightsLoader(model_config(args.model), 0), device="cuda", seed=0)
    params = [
        SamplingParams(
            max_new_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True
        )
        for _ in wl.prompts
    ]

    def run() -> None:  # every prompt prefilled: nothing cached from the run before
        engine.flush_cache()
        engine.generate(wl.prompts, params)

    with engine:
        for _ in range(2):  # warm: every extend shape of the phase once
            run()
        synchronize(device)
        start = time.perf_counter()
        with jit_compiles() as compiled:
            run()
        synchronize(device)
        print(f"timed: {time.perf_counter() - start:.3f} s, {len(compiled)} JIT compiles")
        gpu_only = profile_kernels(run, device)
        print(f"GPU busy {gpu_only.gpu_busy_s:.3f} s of {gpu_only.wall_s:.3f} s (GPU-only profile)")
        if args.cprofile:
            pr = cProfile.Profile()
            pr.enable()
            run()
            synchronize(device)
            pr.disable()
            for order in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(pr, stream=out).sort_stats(order).print_stats(args.cprofile)
                print(out.getvalue())
        prof = profile_kernels(run, device, gaps=args.gaps, host=True, trace_path=args.trace)
        print(prof.describe())


if __name__ == "__main__":
    main()
