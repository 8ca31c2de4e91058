"""Host time of one engine decode step on the CPU, per batch size: what the engine, the scheduler
and sampling cost beside the model.

A tiny random model (1 layer, hidden 64) runs on the CPU, so the forward itself costs little;
for each batch size the script times (a) ``Engine.generate`` by difference (S + 1 new tokens
minus 1 new token, over S: the full decode step as a user gets it) and (b) the worker's
forward + sample replayed on one decode batch (what ``bench decode``'s forward path times).
``host`` = (a) - (b) is the per-step cost of everything outside the model: scheduling, input
staging, sampling parameters, D2H of the tokens, and per-request bookkeeping.

Usage: ``PYTHONPATH=$PWD python benchmarks/engine_host_time.py [--bs 1 8 128 256]
[--steps 64] [--temperature 0.6] [--profile 256]`` (``--profile N``: cProfile of the generate
at bs N, top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import time
from typing import Any

import torch

from execrt.bench.models import RandomWeightsLoader
from execrt.core.batch import ForwardBatch
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.engine import Engine

TINY: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
}
PROMPT = 8


def _engine(max_bs: int, overlap: bool) -> Engine:
    return Engine(
        loader=RandomWeightsLoader(TINY, 0),
        device="cpu",
        max_running_requests=max_bs,
        kv_cache_tokens=max_bs * 1024,
        context_len=1024,
        max_prefill_tokens=max(4096, max_bs * PROMPT),
        overlap_schedule=overlap,
        seed=0,
    )


def _params(temperature: float, n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True)


def _prompts(bs: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(bs)
    return torch.randint(1, TINY["vocab_size"], (bs, PROMPT), generator=g).tolist()


def generate_step_s(engine: Engine, bs: int, steps: int, temperature: float, reps: int) -> float:
    """(t(1 + steps) - t(1)) / steps, each the best of ``reps``."""
    prompts = _prompts(bs)

    def best(n: int) -> float:
        out = math.inf
        for _ in range(reps):
            start = time.perf_counter()
            engine.generate(prompts, _params(temperature, n))
            out = min(out, time.perf_counter() - start)
        return out

    best(2)  # warm-up
    return (best(1 + steps) - best(1)) / steps


def forward_step_s(engine: Engine, bs: int, steps: int, temperature: float, reps: int) -> float:
    """Forward + sample of one decode batch (no scheduling, no bookkeeping)."""
    worker, memory = engine.worker, engine.worker.memory
    mr = worker.model_runner
    reqs = [Req(-1 - i, p, _params(temperature, 16)) for i, p in enumerate(_prompts(bs))]
    try:
        inputs = memory.reserve_extend(reqs, [PROMPT] * bs)
        assert inputs is not None
        result = worker.forward_batch_generation(ScheduleBatch.of(reqs, inputs, memory.stager))
        for req, token in zip(reqs, result.token_ids(), strict=True):
            req.kv_len = req.seq_len
            req.output_ids.append(int(token))
        inputs = memory.reserve_decode(reqs)
        assert inputs is not None
        fb = ForwardBatch.init_new(ScheduleBatch.of(reqs, inputs, memory.stager))
        out = math.inf
        for _ in range(reps + 1):
            start = time.perf_counter()
            for _ in range(steps):
                mr.sample(mr.forward(fb).logits_output, fb)
            out = min(out, (time.perf_counter() - start) / steps)
        return out
    finally:
        for req in reqs:
            memory.release(req)


def profile(engine: Engine, bs: int, steps: int, temperature: float, top: int = 25) -> str:
    prompts = _prompts(bs)
    engine.generate(prompts, _params(temperature, 2))
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, _params(temperature, steps))
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 128, 256])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--profile", type=int, default=0, help="cProfile generate at this bs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    max_bs = max([*args.bs, args.profile])
    with _engine(max_bs, not args.no_overlap) as engine:
        if args.profile:
            for t in args.temperature:
                print(f"# cProfile, bs {args.profile}, temperature {t}, {args.steps} steps")
                print(profile(engine, args.profile, args.steps, t))
            return
        print(f"{'temp':>5} {'bs':>4} {'generate us':>12} {'forward us':>11} {'host us':>8} "
              f"{'host us/req':>11}")  # fmt: skip
        for t in args.temperature:
            for bs in args.bs:
                gen = generate_step_s(engine, bs, args.steps, t, args.reps)
                fwd = forward_step_s(engine, bs, args.steps, t, args.reps)
                host = gen - fwd
                print(
                    f"{t:>5} {bs:>4} {gen * 1e6:>12.0f} {fwd * 1e6:>11.0f} {host * 1e6:>8.0f} "
                    f"{host * 1e6 / bs:>11.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
