"""MoE dispatch runs: one rank's check of the routing scenarios, and the multi-process launcher."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import queue as queue_module
import tempfile
import time
import traceback
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from execrt.core.context import RuntimeContext
from execrt.core.interfaces import (
    DispatchFormat,
    ExpertMajorDispatchOutput,
    MoEDispatcherCapabilities,
    MoEDispatcherInit,
    StandardDispatchOutput,
)
from execrt.core.parallel import ParallelState
from execrt.core.plugins import BackendSpec
from execrt.plugins.host import PluginHost
from execrt.testing.moe_cases import routing
from execrt.testing.oracles import compare, moe_oracle

FORMAT_TYPES: dict[DispatchFormat, type[StandardDispatchOutput | ExpertMajorDispatchOutput]] = {
    DispatchFormat.STANDARD: StandardDispatchOutput,
    DispatchFormat.EXPERT_MAJOR: ExpertMajorDispatchOutput,
}


@dataclass(frozen=True)
class MoEJob:
    """Everything one rank needs, picklable: the backend, the shapes, the scenarios."""

    kind: str
    backend: str | None  # registered name; else factory + capabilities
    factory: Any
    capabilities: MoEDispatcherCapabilities
    check: Any
    device: str
    dtype: torch.dtype
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_tokens: int
    routings: tuple[str, ...]
    seed: int
    tolerance: float
    world_size: int = 1
    process_group_backend: str = "none"
    many_tokens: int = 300  # tokens per rank of the many_tokens scenario

    def spec(self) -> BackendSpec:
        if self.backend is not None:
            return PluginHost().registry.get(self.kind, self.backend)
        return BackendSpec(
            self.kind, "factory", self.factory, self.capabilities, "<suite>", "", check=self.check
        )


@dataclass
class RankResult:
    rank: int
    routing: str
    num_tokens: int
    max_error: float = 0.0
    problems: list[str] = field(default_factory=list)


def expert_weights(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def rank_tokens(job: MoEJob, name: str, rank: int, replicated: bool) -> int:
    """Tokens rank ``rank`` brings: replicated ranks agree; otherwise uneven, one rank empty."""
    if name == "zero_tokens":
        return 0 if replicated or rank == 0 else job.num_tokens
    base = job.many_tokens if name == "many_tokens" else job.num_tokens
    return base if replicated else base + 3 * rank


def token_bound(job: MoEJob, name: str, replicated: bool) -> int:
    """``max_tokens_per_rank`` of the dispatcher running scenario ``name``: what the largest
    rank brings in ``random`` (or in ``many_tokens``, which gets a dispatcher of its own), so
    that the bound is reached exactly (it is inclusive; an engine's is at least 1)."""
    probe = "many_tokens" if name == "many_tokens" else "random"
    return max(1, *(rank_tokens(job, probe, r, replicated) for r in range(job.world_size)))


@contextmanager
def open_dispatcher(
    job: MoEJob, parallel: ParallelState, max_tokens_per_rank: int
) -> Iterator[tuple[Any, MoEDispatcherInit]]:
    """The job's dispatcher on this rank (on ``job.device``) and its init record; on exit the
    dispatcher and its runtime context are closed."""
    spec = job.spec()
    caps = spec.capabilities
    assert isinstance(caps, MoEDispatcherCapabilities)
    context = RuntimeContext(parallel)
    init = MoEDispatcherInit(
        capabilities=caps,
        num_experts=job.num_experts,
        top_k=job.top_k,
        hidden_size=job.hidden_size,
        dtype=job.dtype,
        device=torch.device(job.device),
        max_tokens_per_rank=max_tokens_per_rank,
        parallel=parallel,
        context=context,
    )
    try:
        dispatcher = spec.create(init)
        try:
            yield dispatcher, init
        finally:
            dispatcher.close()
    finally:
        context.close()


OnRouting = Callable[[str, int], None]


def run_rank(
    job: MoEJob, parallel: ParallelState, on_routing: OnRouting | None = None
) -> list[RankResult]:
    """Build the dispatcher on this rank and run every routing scenario of ``job`` through
    ``combine(run_experts(dispatch(x)))``, comparing with the naive MoE on global weights.
    ``on_routing(name, tokens)`` is told of each scenario as it begins.

    Scenarios run in order on one dispatcher per token bound (``token_bound``). Across the
    calls of one dispatcher it also checks that an earlier call's output is not overwritten by
    a later call, and that the dispatcher keeps no tensor of a call (inputs, output) once the
    next one has run and the caller dropped them."""
    w13, w2 = expert_weights(
        job.num_experts, job.hidden_size, job.intermediate_size, job.dtype, job.seed
    )
    replicated = job.capabilities.replicated_tokens
    groups: dict[int, list[str]] = {}
    for name in job.routings:
        groups.setdefault(token_bound(job, name, replicated), []).append(name)
    results: list[RankResult] = []
    for bound, names in groups.items():
        with open_dispatcher(job, parallel, bound) as (dispatcher, init):
            first, n_local = init.first_local_expert, init.num_local_experts
            local = (
                w13[first : first + n_local].to(init.device),
                w2[first : first + n_local].to(init.device),
            )
            results += _run_calls(
                job, names, parallel.rank, dispatcher, init, (w13, w2), local, on_routing
            )
    return results


def _run_calls(
    job: MoEJob,
    names: list[str],
    rank: int,
    dispatcher: Any,
    init: MoEDispatcherInit,
    weights_global: tuple[torch.Tensor, torch.Tensor],
    weights_local: tuple[torch.Tensor, torch.Tensor],
    on_routing: OnRouting | None,
) -> list[RankResult]:
    """The scenarios ``names`` one after the other on ``dispatcher``."""
    results: list[RankResult] = []
    kept: list[list[weakref.ref[torch.Tensor]]] = []  # each call's inputs and output
    previous: tuple[str, torch.Tensor, torch.Tensor] | None = None  # name, output, its copy
    for name in names:
        if on_routing is not None:
            on_routing(name, rank_tokens(job, name, rank, init.capabilities.replicated_tokens))
        result, tensors = _run_routing(
            job, name, rank, dispatcher, init.capabilities, weights_global, weights_local
        )
        results.append(result)
        if previous is not None and not torch.equal(previous[1], previous[2]):
            result.problems.append(
                f"combine's output for routing {previous[0]} changed when the dispatcher ran "
                f"this routing: combine must hand out a tensor the caller owns (a view of a "
                "buffer the dispatcher reuses is overwritten by its next call)"
            )
        out = tensors[-1]
        previous = None if out is None else (name, out, out.clone())
        kept.append([weakref.ref(t) for t in tensors if t is not None])
        del tensors, out
    previous = None
    if len(names) > 1:
        gc.collect()
        for result, refs in zip(results[:-1], kept[:-1], strict=True):
            alive = sum(r() is not None for r in refs)
            if alive:
                result.problems.append(
                    f"the dispatcher still holds {alive} tensor(s) of this call (its inputs or "
                    "output) after later calls, although the caller dropped them: memory that "
                    "grows with every call"
                )
                break
    return results


def _run_routing(
    job: MoEJob,
    name: str,
    rank: int,
    dispatcher: Any,
    caps: MoEDispatcherCapabilities,
    weights_global: tuple[torch.Tensor, torch.Tensor],
    weights_local: tuple[torch.Tensor, torch.Tensor],
) -> tuple[RankResult, tuple[torch.Tensor | None, ...]]:
    """One routing scenario on this rank against the naive MoE over the global weights; the
    result, and the tensors the dispatcher was given and combine returned (None if it failed)."""
    from execrt.core.experts import run_experts

    # Every rank draws every rank's tokens from one seed, so the oracle needs no traffic.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{job.seed}-{name}".encode()))
    per_rank = []
    for r in range(job.world_size):
        t = rank_tokens(job, name, r, caps.replicated_tokens)
        x = torch.randn(t, job.hidden_size, generator=gen).to(job.dtype)
        ids, weights = routing(name, t, job.num_experts, job.top_k, job.world_size, gen)
        per_rank.append((x, ids, weights))
        if caps.replicated_tokens:
            per_rank = per_rank[:1] * job.world_size
            break
    x, ids, weights = per_rank[rank]
    result = RankResult(rank, name, x.shape[0])
    device = torch.device(job.device)
    given, out = _dispatch_combine(
        dispatcher, run_experts, caps, x.to(device), ids, weights, *weights_local, result
    )
    if out is None:
        return result, (*given, None)
    ref = moe_oracle(x, ids, weights, *weights_global)
    cmp = compare(out, ref.to(device))
    result.max_error = cmp.rel_error
    if not cmp.ok(job.tolerance):
        token = cmp.worst_index[0] if cmp.worst_index else -1
        past = " (rows past expert_counts are NaN before combine: it must not read them)"
        expert_major = caps.output_format == DispatchFormat.EXPERT_MAJOR
        what = (
            f"{cmp.num_nonfinite} non-finite values" + (past if expert_major else "")
            if cmp.num_nonfinite
            else f"max {cmp.kind} error {cmp.rel_error:.3g} exceeds tolerance {job.tolerance:.3g}"
        )
        result.problems.append(f"{what}; worst at token {token} (routed to {ids[token].tolist()})")
    return result, (*given, out)


def _dispatch_combine(
    dispatcher: Any,
    run_experts: Any,
    caps: MoEDispatcherCapabilities,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    result: RankResult,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """The tensors given to dispatch, and combine's output (None where it is unusable)."""
    device = x.device
    # The dispatcher gets copies; the originals (the oracle's inputs) show what it wrote.
    originals = (x, ids.to(device), weights.to(device))
    given = tuple(t.clone() for t in originals)
    d = dispatcher.dispatch(*given)
    want = FORMAT_TYPES[caps.output_format]
    if not isinstance(d, want):
        result.problems.append(
            f"dispatch returned {type(d).__name__}, but capabilities declare output_format "
            f"{caps.output_format.value} ({want.__name__})"
        )
        return given, None
    experts_out = run_experts(d, w13, w2)
    if isinstance(d, ExpertMajorDispatchOutput):
        experts_out = _past_counts_poisoned(experts_out, d.expert_counts)
    out = dispatcher.combine(experts_out, d)
    names = ("hidden_states", "topk_ids", "topk_weights")
    written = [n for n, a, b in zip(names, given, originals, strict=True) if not torch.equal(a, b)]
    if written:
        result.problems.append(
            f"dispatch or combine wrote into the caller's {', '.join(written)} (read-only: the "
            "model reads them again)"
        )
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        result.problems.append(f"combine returned {shape}, expected {tuple(x.shape)} [T, H]")
        return given, None
    if out.dtype != x.dtype:
        result.problems.append(f"combine returned {out.dtype}, expected {x.dtype}")
    if not out.is_contiguous():
        result.problems.append(
            f"combine returned a non-contiguous tensor (strides {tuple(out.stride())}): the "
            "model's fused norm and projections read contiguous rows"
        )
    return given, out


def _past_counts_poisoned(experts_out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The expert outputs with every row past ``counts[e]`` NaN: the engine's fused expert
    path leaves those rows unwritten, so a ``combine`` that reads them (or counts that are
    wrong) must show here, not only on a GPU."""
    rows = torch.arange(experts_out.shape[1], device=experts_out.device)
    past = rows[None, :] >= counts.to(experts_out.device).long()[:, None]  # [E_local, rows]
    return experts_out.masked_fill(past[..., None], float("nan"))


# ---------------------------------------------------------------------------------------------
# Several processes
# ---------------------------------------------------------------------------------------------
def _worker(rank: int, job: MoEJob, store: str, results: Any, environ: dict[str, str]) -> None:
    import torch.distributed as dist

    in_environment(environ)
    try:
        # Ranks share the machine's cores: one thread each avoids OpenMP oversubscription,
        # which slows small CPU ops by orders of magnitude.
        torch.set_num_threads(1)
        device = job.device
        if job.device.startswith("cuda"):
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        dist.init_process_group(
            job.process_group_backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=job.world_size,
            timeout=timedelta(seconds=60),
        )
        parallel = ParallelState(job.world_size, rank, job.process_group_backend)
        local = dataclasses.replace(job, device=device)

        def began(name: str, tokens: int) -> None:
            results.put((rank, "routing", f"routing {name} ({tokens} tokens)"))

        results.put((rank, "done", run_rank(local, parallel, began)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc(limit=8)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_context(device: str) -> Any:
    """Spawn for CUDA ranks (a forked CUDA context is unusable); on CPU a fork server that has
    imported torch and this module once, so each rank starts without importing them again
    (seconds per rank on a loaded machine). Both pickle the job, as a launcher would. A fork
    server's children have the environment the server started with: pass ``os.environ`` to
    the rank and apply it there (``in_environment``), as a spawned rank would inherit it."""
    if device.startswith("cuda") or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    return ctx


def in_environment(environ: dict[str, str]) -> None:
    """Make this rank's environment ``environ`` (its parent's when it started the rank)."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)


def run_multiprocess(job: MoEJob, timeout_s: float = 120.0) -> tuple[list[RankResult], list[str]]:
    """Run ``job`` on ``job.world_size`` spawned processes; (results, per-rank errors).

    A rank that raises reports its traceback; one that dies or hangs is reported after it
    exits or after ``timeout_s`` (15 s once another rank has failed: it may wait forever in a
    collective the failed rank never joins). Each report says where every rank was (the
    scenario it last began, or that it had finished): a rank that skips a collective the others
    run fails in another rank. Every process is gone when this returns.
    """
    ctx = rank_context(job.device)
    results: Any = ctx.Queue()
    errors: list[str] = []
    collected: list[RankResult] = []
    with tempfile.TemporaryDirectory(prefix="execrt-moe-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker, args=(r, job, store, results, dict(os.environ)), daemon=True
            )
            for r in range(job.world_size)
        ]
        for p in procs:
            p.start()
        pending = set(range(job.world_size))
        where = dict.fromkeys(range(job.world_size), "starting")  # what each rank last began

        def ranks() -> str:
            return "; ".join(f"rank {r}: {w}" for r, w in where.items())

        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            try:
                rank, what, payload = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r in pending if procs[r].exitcode is not None]
                for r in dead:
                    errors.append(
                        f"rank {r} exited with code {procs[r].exitcode}, no result ({ranks()})"
                    )
                    pending.discard(r)
                continue
            if what == "routing":
                where[rank] = payload
                continue
            pending.discard(rank)
            if what == "done":
                collected += payload
                where[rank] = "finished every routing"
            else:
                errors.append(f"rank {rank} raised in {where[rank]} ({ranks()}):\n{payload}")
                where[rank] = f"raised in {where[rank]}"
                deadline = min(deadline, time.monotonic() + 15.0)
        if pending:
            errors.append(f"rank(s) {sorted(pending)} gave no result in time (hung?) ({ranks()})")
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()
    return collected, errors
