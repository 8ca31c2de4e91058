"""The scheduling side's host cost on the prefix-cache bench workloads, on CPU, without a model.

The real Engine, Scheduler, KVMemory and prefix cache run the workloads of ``execrt bench
prefix`` (shared-prefix 32 x 16 of 2048 + 128 tokens, or 64 random prompts, 256 tokens out,
every request submitted at once, the engine sized as on an H200: 512 running, 16384 prefill
tokens); the forward pass is replaced by a stub that returns a token at once. Reported per
cache setting:

- host CPU ms (thread time, best of ``--repeat``) of the steps taken while prompts wait (the
  TTFT path: extends are not overlapped with the device) and of the decode-only steps;
- a GPU-time estimate from a cost model of the Qwen3-8B shape at 12 layers (linear layers at
  ``--us-per-token``, causal attention FLOPs, a fixed cost per step; decode by KV bytes read):
  extend steps, the mean TTFT and the whole run, host time excluded. It shows what the
  scheduler's batches cost, not what a GPU measures.

    python benchmarks/prefix_host_cost.py --workload shared-prefix
    python benchmarks/prefix_host_cost.py --workload random --steps
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import statistics
import time
from typing import Any

import torch

from execrt.bench.models import MODELS, RandomWeightsLoader
from execrt.core.schedule import SamplingParams, ScheduleBatch
from execrt.core.step import StepInputs
from execrt.core.worker import GenerationBatchResult
from execrt.engine import Engine
from execrt.engine.client import RequestOutput
from execrt.engine.scheduler import Scheduler

VOCAB = 151_000
# A one-layer stub of the shape: the engine builds it, the stub forward never runs it.
STUB = dict(MODELS["qwen3-0.6b"]) | {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 12, 32, 8, 128  # Qwen3-8B at 12 layers


def extend_seconds(inputs: StepInputs, us_per_token: float) -> float:
    lens, prefixes = inputs.extend_lens_cpu, inputs.prefix_lens_cpu
    pairs = sum(n * (p + n / 2) for n, p in zip(lens, prefixes, strict=True))
    return 2e-3 + sum(lens) * us_per_token * 1e-6 + pairs * LAYERS * HEADS * HEAD_DIM * 4 / 350e12


def decode_seconds(inputs: StepInputs) -> float:
    kv_bytes = sum(inputs.seq_lens_cpu) * LAYERS * KV_HEADS * HEAD_DIM * 2 * 2
    return 2.5e-3 + kv_bytes / 3.5e12


def prompts(workload: str, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    if workload == "random":
        return [tokens(2048 + 128) for _ in range(64)]
    out = []
    for _ in range(32):
        prefix = tokens(2048)
        out += [prefix + tokens(128) for _ in range(16)]
    rng.shuffle(out)
    return out


def run(workload: str, cache: str, us_per_token: float) -> dict[str, Any]:
    host = {"waiting": 0.0, "decode": 0.0}
    real_step = Scheduler.step

    def timed_step(self: Scheduler) -> None:
        phase = "waiting" if self.waiting else "decode"
        start = time.thread_time()
        real_step(self)
        host[phase] += time.thread_time() - start

    clock, extends = [0.0], [0]

    def stub_forward(batch: ScheduleBatch) -> GenerationBatchResult:
        if batch.mode.is_extend():
            clock[0] += extend_seconds(batch.inputs, us_per_token)
            extends[0] += 1
        else:
            clock[0] += decode_seconds(batch.inputs)
        ids = torch.full((len(batch.reqs),), 7, dtype=torch.int64)
        return GenerationBatchResult(None, ids, False, None)  # type: ignore[arg-type]

    first: dict[int, float] = {}

    def on_output(i: int) -> Any:
        def record(out: RequestOutput) -> None:
            if out.token_ids and i not in first:
                first[i] = clock[0]

        return record

    caches = {"on": {"prefix_cache": "radix"}, "off": {"prefix_cache": "none"}}
    with Engine(
        loader=RandomWeightsLoader(STUB),
        device="cpu",
        dtype="float32",
        context_len=2048 + 128 + 256 + 8,
        max_running_requests=512,
        max_prefill_tokens=16384,
        kv_cache_tokens=2_400_000,
        overlap_schedule=False,
        **caches[cache],
    ) as engine:
        engine.worker.forward_batch_generation = stub_forward  # type: ignore[method-assign]
        params = SamplingParams(max_new_tokens=256, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(prompts(workload)):
            engine.submit(prompt, params, on_output=on_output(i))
        Scheduler.step = timed_step  # type: ignore[method-assign]
        try:
            while engine.step():
                pass
        finally:
            Scheduler.step = real_step  # type: ignore[method-assign]
        stats = engine.stats()
    return {
        "host_waiting_ms": 1e3 * host["waiting"],
        "host_decode_ms": 1e3 * host["decode"],
        "extend_steps": extends[0],
        "ttft_ms": 1e3 * statistics.fmean(first.values()),
        "run_s": clock[0],
        "hit_rate": stats.prefix_hit_tokens / max(1, stats.prefix_query_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("shared-prefix", "random"), default="shared-prefix")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--us-per-token", type=float, default=7.0, help="linear layers, per token")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for cache in ("on", "off"):
        runs = []
        for _ in range(args.repeat):
            with contextlib.redirect_stdout(io.StringIO()):
                runs.append(run(args.workload, cache, args.us_per_token))
        best = min(runs, key=lambda r: r["host_waiting_ms"] + r["host_decode_ms"])
        print(
            f"{args.workload} cache {cache}: host ms {best['host_waiting_ms']:.0f} while prompts "
            f"wait, {best['host_decode_ms']:.0f} decoding | model: {best['extend_steps']} "
            f"extends, TTFT mean {best['ttft_ms']:.0f} ms, run {best['run_s']:.2f} s, "
            f"hit rate {best['hit_rate']:.3f}"
        )


if __name__ == "__main__":
    main()
