"""Where the time of one short prefill goes: host (Python) against device, per prompt length.

Times ``Engine.generate`` of one fresh prompt (1 new token, so the step is all prefill) and
profiles a few of them: the torch profiler's CPU self time by op, the kernels launched per
step, and cProfile's Python functions by own time. A prefill whose host time exceeds its GPU
time is bound by launches and bookkeeping, not by FLOPs.

    python benchmarks/profile_extend.py --model qwen3-0.6b --lens 32,418,2048
    python benchmarks/profile_extend.py --device cpu --hidden 64 --lens 64   # host path on CPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from execrt.bench.models import RandomWeightsLoader, model_config
from execrt.bench.timing import synchronize
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


class _Prefill:
    """``Engine.generate`` of a prompt of ``n`` tokens, 1 new token, on a cold prefix cache
    (flushed first, as ``bench decode`` times prefills): seconds, device synchronised."""

    def __init__(self, engine: Engine, vocab: int, device: torch.device) -> None:
        self.engine, self.vocab, self.device = engine, vocab, device
        self.params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        self.prompts: dict[int, list[int]] = {}

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def __call__(self, n: int) -> float:
        if n not in self.prompts:
            g = torch.Generator().manual_seed(n)
            self.prompts[n] = torch.randint(0, self.vocab, (n,), generator=g).tolist()
        self.engine.flush_cache()
        synchronize(self.device)
        start = time.perf_counter()
        self.engine.generate([self.prompts[n]], self.params)
        synchronize(self.device)
        return time.perf_counter() - start


def _profile(prefill: _Prefill, n: int, runs: int = 3) -> None:
    """The torch profiler's ops by CPU self time and cProfile's functions by own time."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if prefill.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(runs):
            prefill(n)
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in LAUNCHES) / runs
    gpu_ms = sum(e.self_device_time_total for e in ka) / runs / 1e3 if prefill.cuda else 0.0
    print(f"kernel launches per prefill {launches:.0f}; GPU busy per prefill {gpu_ms:.2f} ms")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(runs):
        prefill(n)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None, help="shrink the hidden size (CPU runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--lens", default="32,418,2048")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    cfg = model_config(args.model, args.layers)
    if args.hidden:
        heads = max(1, args.hidden // cfg["head_dim"])
        cfg |= {
            "hidden_size": args.hidden,
            "intermediate_size": 3 * args.hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": args.hidden // heads,
            "vocab_size": 1024,
        }
    lens = [int(x) for x in args.lens.split(",")]
    engine = Engine(
        loader=RandomWeightsLoader(cfg, 0),
        device=args.device,
        attention_backend=args.attention,
        max_running_requests=4,
        context_len=max(lens) + 64,
        kv_cache_tokens=4 * (max(lens) + 64),
        seed=0,
    )
    with engine:
        print("resolution:", engine.resolution)
        prefill = _Prefill(engine, cfg["vocab_size"], torch.device(args.device))
        for n in lens:
            for _ in range(3):
                prefill(n)
            times = sorted(prefill(n) for _ in range(args.reps))
            median_ms = times[len(times) // 2] * 1e3
            print(f"\n== prompt {n}: generate (1 token) median {median_ms:.2f} ms")
            _profile(prefill, n)


if __name__ == "__main__":
    main()
