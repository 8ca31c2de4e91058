"""A second harness for issue 29's numbers, written apart from ``execrt.bench``: it measures
what a user of the public API gets, the way the published peers measure themselves.

- The model is a checkpoint on disk, written here by transformers (a randomly initialised
  ``Qwen3ForCausalLM`` of the Qwen3-0.6B shape, bf16 safetensors), and loaded by
  ``Engine(path)`` with nothing else set: the engine's defaults, as a user starts it.
- ``throughput``: the offline workload nano-vllm's ``bench.py`` publishes, drawn here from its
  recipe (Python's ``random`` seeded 0; 256 prompts of ``randint(100, 1024)`` token ids each
  ``randint(0, 10000)``, then 256 ``max_tokens`` of ``randint(100, 1024)``; ``ignore_eos``),
  one ``generate`` call timed by the wall clock after a short warm-up generate. Output tok/s
  is the output tokens over those seconds. Repeats flush the prefix cache first (the same
  prompts would otherwise be served from it). A ``--max-input`` or ``--max-output`` below
  100 (a smoke run) draws that length alone.
- ``decode``: the decode step by difference: for each batch size, prompts of ``--ctx``
  random tokens generate 1 and then ``1 + --steps`` tokens (prefix cache flushed before each
  call, so both prefill the same prompts); the step is the difference over ``--steps``.

It imports nothing from ``execrt.bench``. Results go to stdout and, with ``--out``, to JSON.

    python benchmarks/harness_generate.py throughput --temperature 0.6 --repeats 2
    python benchmarks/harness_generate.py decode --bs 1,8,32,128 --ctx 512
    python benchmarks/harness_generate.py throughput --shape tiny --device cpu --num-seqs 4 \\
        --max-input 40 --max-output 8           # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from execrt.core.schedule import SamplingParams  # noqa: E402
from execrt.engine import Engine  # noqa: E402

#: Qwen3-0.6B's published config (the shape nano-vllm and mini-sglang benchmark)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "tiny": {  # CPU smoke runs
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 10240,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}


def write_checkpoint(shape: str, where: Path, device: str) -> Path:
    """A randomly initialised Qwen3 of ``shape`` saved by transformers (bf16 safetensors)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[shape], torch_dtype="bfloat16")
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(where, safe_serialization=True)
    del model
    return where


def nano_vllm_workload(
    num_seqs: int, max_input: int, max_output: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py draw: every prompt first, then every output length, each uniform
    in [100, max] (the published recipe); a max below 100 (a smoke run) draws in [max, max]."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, 10000) for _ in range(rng.randint(min(100, max_input), max_input))]
        for _ in range(num_seqs)
    ]
    outputs = [rng.randint(min(100, max_output), max_output) for _ in range(num_seqs)]
    return prompts, outputs


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (``timeout``, a job's end) unwinds as SystemExit, as Ctrl-C unwinds as
    KeyboardInterrupt: the engine closes and the temporary checkpoint is removed."""
    raise SystemExit(128 + signum)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams], device: str
) -> float:
    engine.flush_cache()
    sync(device)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - start
    for res, p in zip(results, params, strict=True):
        if res.error or len(res.token_ids) != p.max_new_tokens:
            raise RuntimeError(
                f"generate gave {len(res.token_ids)} of {p.max_new_tokens} tokens "
                f"({res.error or 'no error'})"
            )
    return seconds


def throughput(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts, outputs = nano_vllm_workload(args.num_seqs, args.max_input, args.max_output)
    # warm-up as nano-vllm does: one short generate
    engine.generate([prompts[0][:16]], SamplingParams(max_new_tokens=8))
    rows = []
    for temperature in args.temperature:
        params = [
            SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True)
            for n in outputs
        ]
        runs = [timed_generate(engine, prompts, params, args.device) for _ in range(args.repeats)]
        out_tokens, in_tokens = sum(outputs), sum(map(len, prompts))
        for i, s in enumerate(runs):
            print(
                f"throughput temperature {temperature} run {i}: {s:.3f} s, "
                f"{out_tokens / s:,.0f} output tok/s, {(in_tokens + out_tokens) / s:,.0f} total",
                flush=True,
            )
        median = statistics.median(runs)
        rows.append(
            {
                "kind": "throughput",
                "temperature": temperature,
                "num_seqs": args.num_seqs,
                "input_tokens": in_tokens,
                "output_tokens": out_tokens,
                "seconds_each": runs,
                "seconds": median,
                "out_tok_s": out_tokens / median,
                "total_tok_s": (in_tokens + out_tokens) / median,
            }
        )
    return rows


def decode(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    g = random.Random(1)
    for bs in args.bs:
        prompts = [[g.randint(0, 10000) for _ in range(args.ctx)] for _ in range(bs)]

        def timed(n: int, prompts: list[list[int]] = prompts) -> float:
            params = [SamplingParams(max_new_tokens=n, ignore_eos=True)] * len(prompts)
            return min(timed_generate(engine, prompts, params, args.device) for _ in range(3))

        timed(args.steps + 1)  # warm-up (graphs, kernels of this batch size)
        short, long = timed(1), timed(args.steps + 1)
        ms = (long - short) / args.steps * 1e3
        print(
            f"decode bs {bs} ctx {args.ctx}: {ms:.3f} ms per step "
            f"(generate of 1 token {short * 1e3:.1f} ms, of {args.steps + 1} {long * 1e3:.1f} ms)",
            flush=True,
        )
        rows.append(
            {
                "kind": "decode",
                "bs": bs,
                "ctx": args.ctx,
                "steps": args.steps,
                "ms_per_step": ms,
                "generate_1_s": short,
                "generate_n_s": long,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["throughput", "decode"])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--checkpoint", help="an existing checkpoint directory (else one is written)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting (JSON value); none: the defaults, as the issue measures",
    )
    ap.add_argument("--temperature", type=lambda s: [float(t) for t in s.split(",")], default=[0.6])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--bs", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 32, 128])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", help="write the records to this JSON file")
    args = ap.parse_args(argv)
    for flag in ("num_seqs", "max_input", "max_output", "ctx", "steps", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    settings: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="execrt-harness-") as tmp:
        path = args.checkpoint or str(write_checkpoint(args.shape, Path(tmp), args.device))
        start = time.perf_counter()
        engine = Engine(path, device=args.device, **settings)
        startup = time.perf_counter() - start
        limits = engine.worker.limits
        print(
            f"engine ready in {startup:.1f} s: max_running_requests {limits.max_running_requests}, "
            f"max_prefill_tokens {limits.max_prefill_tokens}, "
            f"KV slots {engine.stats().kv_slots_total}, settings {settings or 'none'}",
            flush=True,
        )
        with engine:
            rows = throughput(engine, args) if args.what == "throughput" else decode(engine, args)
    meta = {
        "harness": "benchmarks/harness_generate.py",
        "shape": args.shape,
        "settings": settings,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "startup_s": startup,
        "max_running_requests": limits.max_running_requests,
        "max_prefill_tokens": limits.max_prefill_tokens,
    }
    if args.out:
        Path(args.out).write_text(json.dumps([meta | row for row in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: the temporary checkpoint is already removed
        sys.exit(128 + signal.SIGINT)
