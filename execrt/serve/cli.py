"""The ``execrt serve`` command: its flags (every engine flag ``generate`` takes, and where to
listen), rank 0 serving HTTP under torchrun while the other ranks follow its schedule."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from execrt.core.errors import ConfigError, ExecrtError
from execrt.serve import GENERATION_CONFIGS
from execrt.serve.reasoning import PARSERS

if TYPE_CHECKING:
    from execrt.core.config import RuntimeConfig
    from execrt.engine import Engine

#: ``generate``'s flags that configure the engine (RuntimeConfig keys, the model, the file)
ENGINE_FLAGS = (
    "model",
    "config",
    "attention_backend",
    "moe_dispatcher",
    "graph_backend",
    "prefix_cache",
    "flashinfer_prefill_backend",
    "device",
    "dtype",
    "kv_cache_dtype",
    "kv_cache_rotation",
    "tp_size",
    "ep_size",
    "strict",
)


#: ``--engine`` choices
ENGINE_RUNNERS = ("auto", "process", "thread")


def engine_runner(choice: str, world_size: int) -> str:
    """``process`` or ``thread`` for ``--engine choice`` in a torchrun world of
    ``world_size`` processes (1 without torchrun)."""
    if choice == "auto":
        return "process" if world_size == 1 else "thread"
    if choice == "process" and world_size > 1:  # the same on every rank: rank 0 says it
        raise ConfigError(
            f"serve: --engine process needs a single process, not a torchrun world of "
            f"{world_size} (rank 0 steps its engine on a thread, in lockstep with the other "
            "ranks); use --engine thread or auto"
        )
    return choice


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``execrt`` subcommands, with ``generate``'s engine flags."""
    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over HTTP (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics). Under torchrun (--tp N), rank 0 serves and the "
        "other ranks follow it. Prints one line with the URL once the model is ready.",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: 8000)")
    serve.add_argument(
        "--served-model-name", help="the model name clients use (default: the checkpoint's name)"
    )
    serve.add_argument(
        "--reasoning-parser",
        default="none",
        choices=PARSERS,
        help="chat answers' <think> part as reasoning_content: qwen3 (an answer that begins "
        "with <think>), deepseek_r1 (the answer reasons until </think>), or none (it is "
        "content) (default: none)",
    )
    serve.add_argument(
        "--generation-config",
        default="auto",
        choices=GENERATION_CONFIGS,
        help="auto: the sampling fields a request leaves out (temperature, top_p, top_k, "
        "min_p, repetition_penalty) take the checkpoint's generation_config.json values, the "
        "model creator's recommendation, as vLLM and SGLang do; none: OpenAI's defaults "
        "(default: auto)",
    )
    serve.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level; info logs every request (default: warning)",
    )
    serve.add_argument(
        "--engine",
        dest="engine_runner",
        default="auto",
        choices=list(ENGINE_RUNNERS),
        help="where the engine runs: 'process', a process of its own (the HTTP side and the "
        "engine's step loop then never wait for each other's interpreter lock), or 'thread', a "
        "thread of the HTTP server's process; 'auto' is 'process' for a single process and "
        "'thread' under torchrun, where rank 0 steps the engine in lockstep with the other "
        "ranks (default: auto)",
    )
    serve.add_argument(
        "--step-timeout-s",
        type=float,
        default=None,
        help="an engine step running longer fails /health with 503 and refuses new requests "
        "until it ends (a hung TP rank or device); 0 = auto: 300 on CUDA, none elsewhere; inf "
        "= none (default: the config's, else auto)",
    )
    generate = sub.choices["generate"]
    for action in generate._actions:  # the same flags, help and defaults as generate's
        if action.dest in ENGINE_FLAGS:
            serve._add_action(action)
    return serve


def cmd_serve(args: argparse.Namespace) -> int:
    from execrt.cli import config_flags
    from execrt.core.config import RuntimeConfig
    from execrt.core.parallel import launch_rank
    from execrt.engine import Engine

    cli: dict[str, Any] = {
        k: getattr(args, k) for k in ENGINE_FLAGS if k not in ("model", "config")
    }
    cli["step_timeout_s"] = args.step_timeout_s
    config = RuntimeConfig.load(file=args.config, cli=cli | {"model": args.model})
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"serve: --port {args.port} must be in 0..65535")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ConfigError(
            f"serve: --served-model-name {args.served_model_name!r} must be a non-empty name "
            "(leave it out for the checkpoint's name)"
        )
    runner = engine_runner(args.engine_runner, int(os.environ.get("WORLD_SIZE", "1")))
    if launch_rank():  # a load failure propagates: main says it, with set_by_env's note
        return _follow(Engine(config=config))
    try:
        import execrt.serve.server as server
        from execrt.engine.process import ProcessEngineClient
        from execrt.engine.threaded import ThreadedEngineClient
    except ImportError as exc:
        raise ExecrtError(f"serve: {exc.name} is missing (pip install 'execrt[serve]')") from None
    build = functools.partial(build_engine, config, config_flags(args))
    client: Any
    if runner == "process":
        client = ProcessEngineClient(build, name=args.served_model_name)
    else:
        client = ThreadedEngineClient(build, name=args.served_model_name)
    try:
        sock_status = server.serve(
            client,
            args.host,
            args.port,
            log_level=args.log_level,
            reasoning_parser=args.reasoning_parser,
            generation_config=args.generation_config,
        )
    except OSError as exc:
        client.close()
        raise ExecrtError(
            f"serve: cannot listen on {args.host}:{args.port} ({exc.strerror})"
        ) from None
    except KeyboardInterrupt:  # before uvicorn took the signals: the engine must stop too
        client.close()
        raise
    return sock_status


def build_engine(config: RuntimeConfig, flags: frozenset[str]) -> Engine:
    """``Engine(config=config)``, built in the engine's process or thread: the front end
    prints only the message of a failure, so an error about a key that an ``EXECRT_*``
    variable set and no flag (``flags``) overrode names the variable there, as ``execrt
    generate`` says it (``execrt.cli.set_by_env``)."""
    from execrt.cli import set_by_env
    from execrt.engine import Engine

    try:
        return Engine(config=config)
    except ExecrtError as exc:
        note = set_by_env(exc, flags)
        if note:
            exc.args = (f"{exc}{note}",)
        raise


def _follow(engine: Any) -> int:
    """A rank other than 0: step rank 0's schedule until it stops. Interrupts are left to rank
    0, which stops every rank (torchrun ends a rank that outlives a failed rank 0)."""
    from execrt.engine.threaded import follow

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    with engine:
        summary = follow(engine)
        stats = engine.stats()
        rank = engine.parallel.rank
    print(
        f"execrt serve: rank {rank} stopped with rank 0: {summary.requests} requests, "
        f"{summary.aborted} aborted, {summary.steps} steps; KV slots free "
        f"{stats.kv_slots_free} of {stats.kv_slots_total}, {stats.kv_slots_cached} cached",
        file=sys.stderr,
        flush=True,
    )
    return 0


def add_bench_serve_parser(bench_sub: Any) -> argparse.ArgumentParser:
    """Add ``bench serve``: the load generator against the HTTP server."""
    b = bench_sub.add_parser(
        "serve",
        help="HTTP serving: TTFT, ITL, throughput under load vs the Engine in-process",
    )
    b.add_argument("--model", help="random-weight shape (default: qwen3-0.6b)")
    b.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    b.add_argument(
        "--workload",
        default="random",
        choices=["random", "shared-prefix"],
        help="random prompts, or groups of prompts sharing a prefix (default: random)",
    )
    b.add_argument("--input-len", type=int, help="prompt tokens, at most (default: 512)")
    b.add_argument("--output-len", type=int, help="output tokens, at most (default: 128)")
    b.add_argument(
        "--range-ratio",
        type=float,
        default=0.5,
        help="lengths are uniform in [ratio * len, len]; 1 fixes them (default: 0.5)",
    )
    b.add_argument("--prefix-len", type=int, help="shared-prefix: prefix tokens (default: 1024)")
    b.add_argument("--num-groups", type=int, help="shared-prefix: distinct prefixes (default: 8)")
    b.add_argument(
        "--max-concurrency",
        help="closed-loop runs, comma-separated client counts; '' for none (default: 1,32,256)",
    )
    b.add_argument(
        "--request-rate",
        help="Poisson runs, comma-separated requests/s; '' for none (default: 8,32)",
    )
    b.add_argument(
        "--rate-concurrency",
        type=int,
        help="cap on in-flight requests of rate runs (default: none)",
    )
    b.add_argument("--num-prompts", type=int, help="requests per run (default: by the load)")
    b.add_argument("--max-running-requests", type=int, help="engine batch limit (default: 256)")
    b.add_argument("--attention", default="auto", help="attention backend (default: auto)")
    b.add_argument("--graph", default="auto", help="graph backend (default: auto)")
    b.add_argument(
        "--device",
        default="cuda",
        help="cuda, or cpu for a smoke run: what no flag sets takes tiny values, a check that "
        "the method runs (default: cuda)",
    )
    b.add_argument(
        "--engine",
        dest="engine_runner",
        default="process",
        choices=["process", "thread"],
        help="where the server's engine runs, as execrt serve --engine (default: process, "
        "what execrt serve does on one GPU)",
    )
    b.add_argument(
        "--client-procs",
        type=int,
        help="load processes the HTTP clients run in (default: one per 16 streams of a run)",
    )
    b.add_argument("--no-engine", action="store_true", help="skip the in-process Engine comparison")
    b.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    b.add_argument(
        "--out",
        default="benchmarks/results",
        help="directory for the JSON file (default: %(default)s)",
    )
    return b


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        from execrt.bench import serve
    except ImportError as exc:
        raise ExecrtError(
            f"bench serve: {exc.name} is missing (pip install 'execrt[serve,bench]')"
        ) from None

    def numbers(text: str, kind: type, flag: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise ExecrtError(
                f"bench serve: {flag} {text!r} must be comma-separated numbers"
            ) from None

    # The flags a --device cpu smoke run keeps at any value (None: not typed, the default).
    typed: dict[str, Any] = {
        "model": args.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "num_groups": args.num_groups,
        "num_prompts": args.num_prompts,
        "max_running_requests": args.max_running_requests,
    }
    if args.max_concurrency is not None:
        typed["concurrencies"] = numbers(args.max_concurrency, int, "--max-concurrency")
    if args.request_rate is not None:
        typed["request_rates"] = numbers(args.request_rate, float, "--request-rate")
    typed = {name: value for name, value in typed.items() if value is not None}
    opts = serve.Options(
        layers=args.layers,
        workload=args.workload,
        range_ratio=args.range_ratio,
        rate_concurrency=args.rate_concurrency,
        attention=args.attention,
        graph=args.graph,
        device=args.device,
        engine_runner=args.engine_runner,
        client_procs=args.client_procs,
        engine=not args.no_engine,
        plot=args.plot,
        out_dir=args.out,
        typed=frozenset(typed),
        **typed,
    )
    serve.run(opts)
    return 0
