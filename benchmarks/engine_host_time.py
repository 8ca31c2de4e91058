"""Host time of one engine decode step on the CPU, per batch size: what the engine, the scheduler
and the sampling bookkeeping cost beside the model.

The engine runs a tiny random model (1 layer, hidden 64) on the CPU with the model's forward
replaced by a null one (a fixed logits row per request) and sampling by an argmax, so what is
timed is the host work of a decode step and nothing else: scheduling (the overlapped decode),
reserving slots, staging the inputs and the sampling parameters, the token copy, the
per-request bookkeeping (appending tokens, stop checks, sinks). The step time is
``Engine.generate`` by difference, (t(1 + S new tokens) - t(1 new token)) / S, in this thread's
CPU time (the CPU is shared), the best of ``--reps``. ``--model`` keeps the real forward and
sampler, and prints the forward + sample of one decode batch beside it.

Usage: ``PYTHONPATH=$PWD python benchmarks/engine_host_time.py [--bs 1 8 128 256]
[--steps 64] [--temperature 0 0.6] [--model] [--profile 256]`` (``--profile N``: cProfile of
one generate at bs N, the top functions by own time).
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
from execrt.core.batch import ForwardBatch, LogitsOutput
from execrt.core.model_runner import ModelRunnerOutput
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
#: This thread's CPU time: the CPU is shared (other processes would inflate wall time), the
#: model runs on this thread (torch.set_num_threads(1)), and nothing here waits for a device.
CLOCK = time.thread_time


def _engine(max_bs: int, overlap: bool, null_model: bool) -> Engine:
    engine = Engine(
        loader=RandomWeightsLoader(TINY, 0),
        device="cpu",
        max_running_requests=max_bs,
        kv_cache_tokens=max_bs * 1024,
        context_len=1024,
        max_prefill_tokens=max(4096, max_bs * PROMPT),
        overlap_schedule=overlap,
        seed=0,
    )
    if null_model:
        _null_model(engine)
    return engine


def _null_model(engine: Engine) -> None:
    """Replace the forward by fixed logits (row i favours token i + 1) and the draw by argmax:
    the step keeps all of its host work and loses the model's."""
    mr = engine.worker.model_runner
    vocab = TINY["vocab_size"]
    rows = torch.arange(engine.worker.limits.max_prefill_tokens) % (vocab - 1) + 1
    logits = torch.nn.functional.one_hot(rows, vocab).float()  # [T, V]

    def forward(fb: ForwardBatch) -> ModelRunnerOutput:
        return ModelRunnerOutput(LogitsOutput(logits[: fb.batch_size]), can_run_graph=False)

    def sample(out: LogitsOutput, fb: ForwardBatch) -> torch.Tensor:
        return torch.argmax(out.next_token_logits, dim=-1)

    mr.forward = forward  # type: ignore[method-assign]
    mr.sample = sample  # type: ignore[method-assign]


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
            start = CLOCK()
            engine.generate(prompts, _params(temperature, n))
            out = min(out, CLOCK() - start)
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
            start = CLOCK()
            for _ in range(steps):
                mr.sample(mr.forward(fb).logits_output, fb)
            out = min(out, (CLOCK() - start) / steps)
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
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--model", action="store_true", help="keep the real forward and sampler")
    ap.add_argument("--profile", type=int, default=0, help="cProfile generate at this bs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    max_bs = max([*args.bs, args.profile])
    with _engine(max_bs, not args.no_overlap, null_model=not args.model) as engine:
        if args.profile:
            for t in args.temperature:
                print(f"# cProfile, bs {args.profile}, temperature {t}, {args.steps} steps")
                print(profile(engine, args.profile, args.steps, t))
            return
        fwd_head = f" {'forward us':>11}" if args.model else ""
        print(f"{'temp':>5} {'bs':>4} {'step us':>8}{fwd_head} {'us/request':>10}")
        for t in args.temperature:
            for bs in args.bs:
                step = generate_step_s(engine, bs, args.steps, t, args.reps)
                fwd = ""
                if args.model:
                    fwd = f" {forward_step_s(engine, bs, args.steps, t, args.reps) * 1e6:>11.0f}"
                print(
                    f"{t:>5} {bs:>4} {step * 1e6:>8.0f}{fwd} {step * 1e6 / bs:>10.2f}", flush=True
                )


if __name__ == "__main__":
    main()
