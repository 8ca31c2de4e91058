"""MoE dispatch runs: routing scenarios, one rank's check, and the multi-process launcher."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue as queue_module
import tempfile
import time
import traceback
import zlib
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
from execrt.testing.oracles import compare, moe_oracle

#: Routing scenarios every world size runs (see ``routing``).
ROUTINGS = (
    "random",
    "balanced",
    "some_masked",
    "hot_expert",
    "empty_rank",
    "all_masked",
    "duplicates_within_rank",
    "zero_tokens",
)
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


def routing(
    name: str, num_tokens: int, num_experts: int, top_k: int, world: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [T, K]`` int64 (-1 = none) and ``topk_weights [T, K]`` fp32 for a scenario."""
    t, e, k = num_tokens, num_experts, top_k
    per_rank = e // world
    ids = torch.zeros(t, k, dtype=torch.int64)
    for row in range(t):
        ids[row] = torch.randperm(e, generator=gen)[:k]
    if name == "balanced":  # every expert gets floor or ceil of T*K/E rows (K <= E)
        perm = torch.randperm(e, generator=gen)
        ids = perm[torch.arange(t * k).view(t, k) % e]
    elif name == "some_masked":
        ids[torch.rand(t, k, generator=gen) < 0.4] = -1
    elif name == "hot_expert":  # every token picks the last expert (on the last rank)
        for row in range(t):
            others = torch.randperm(e - 1, generator=gen)[: k - 1]
            ids[row] = torch.cat([torch.tensor([e - 1]), others])
    elif name == "empty_rank":  # nothing reaches the last rank's experts (or the upper half)
        allowed = per_rank * (world - 1) if world > 1 else max(e // 2, k)
        for row in range(t):
            pick = torch.randperm(allowed, generator=gen)[:k]
            ids[row] = torch.cat([pick, torch.full((k - pick.numel(),), -1)])
    elif name == "all_masked":
        ids.fill_(-1)
    elif name == "duplicates_within_rank":  # a token's experts all live on one rank
        for row in range(t):
            rank = row % world
            pick = torch.randperm(per_rank, generator=gen)[: min(k, per_rank)] + rank * per_rank
            ids[row] = torch.cat([pick, torch.full((k - pick.numel(),), -1)])
    weights = torch.softmax(torch.randn(t, k, generator=gen), -1).float()
    return ids.long(), weights


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
    return job.num_tokens if replicated else job.num_tokens + 3 * rank


def run_rank(job: MoEJob, parallel: ParallelState) -> list[RankResult]:
    """Build the dispatcher on this rank and run every routing scenario of ``job`` through
    ``combine(run_experts(dispatch(x)))``, comparing with the naive MoE on global weights."""
    from execrt.core.experts import run_experts

    spec = job.spec()
    caps = spec.capabilities
    assert isinstance(caps, MoEDispatcherCapabilities)
    device = torch.device(job.device)
    w13, w2 = expert_weights(
        job.num_experts, job.hidden_size, job.intermediate_size, job.dtype, job.seed
    )
    context = RuntimeContext(parallel)
    init = MoEDispatcherInit(
        capabilities=caps,
        num_experts=job.num_experts,
        top_k=job.top_k,
        hidden_size=job.hidden_size,
        dtype=job.dtype,
        device=device,
        max_tokens_per_rank=job.num_tokens + 3 * job.world_size,
        parallel=parallel,
        context=context,
    )
    first, n_local = init.first_local_expert, init.num_local_experts
    local13 = w13[first : first + n_local].to(device)
    local2 = w2[first : first + n_local].to(device)
    dispatcher = spec.create(init)
    results = []
    try:
        for name in job.routings:
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
            x, ids, weights = per_rank[parallel.rank]
            result = RankResult(parallel.rank, name, x.shape[0])
            results.append(result)
            out = _dispatch_combine(
                dispatcher, run_experts, caps, x.to(device), ids, weights, local13, local2, result
            )
            if out is None:
                continue
            ref = moe_oracle(x, ids, weights, w13, w2)
            cmp = compare(out, ref.to(device))
            result.max_error = cmp.rel_error
            if not cmp.ok(job.tolerance):
                token = cmp.worst_index[0] if cmp.worst_index else -1
                what = (
                    f"{cmp.num_nonfinite} non-finite values"
                    if cmp.num_nonfinite
                    else f"max relative error {cmp.rel_error:.3g} exceeds tolerance "
                    f"{job.tolerance:.3g}"
                )
                result.problems.append(
                    f"{what}; worst at token {token} (routed to {ids[token].tolist()})"
                )
    finally:
        dispatcher.close()
        context.close()
    return results


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
) -> torch.Tensor | None:
    device = x.device
    d = dispatcher.dispatch(x, ids.to(device), weights.to(device))
    want = FORMAT_TYPES[caps.output_format]
    if not isinstance(d, want):
        result.problems.append(
            f"dispatch returned {type(d).__name__}, but capabilities declare output_format "
            f"{caps.output_format.value} ({want.__name__})"
        )
        return None
    out = dispatcher.combine(run_experts(d, w13, w2), d)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        result.problems.append(f"combine returned {shape}, expected {tuple(x.shape)} [T, H]")
        return None
    if out.dtype != x.dtype:
        result.problems.append(f"combine returned {out.dtype}, expected {x.dtype}")
    return out


# ---------------------------------------------------------------------------------------------
# Several processes
# ---------------------------------------------------------------------------------------------
def _worker(rank: int, job: MoEJob, store: str, results: Any) -> None:
    import torch.distributed as dist

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
        results.put((rank, run_rank(local, parallel), None))
    except BaseException:
        results.put((rank, [], traceback.format_exc(limit=8)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_multiprocess(job: MoEJob, timeout_s: float = 120.0) -> tuple[list[RankResult], list[str]]:
    """Run ``job`` on ``job.world_size`` spawned processes; (results, per-rank errors).

    A rank that raises reports its traceback; one that dies or hangs is reported after it
    exits or after ``timeout_s`` (15 s once another rank has failed: it may wait forever in a
    collective the failed rank never joins). Every process is gone when this returns.
    """
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    errors: list[str] = []
    collected: list[RankResult] = []
    with tempfile.TemporaryDirectory(prefix="execrt-moe-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, job, store, results), daemon=True)
            for r in range(job.world_size)
        ]
        for p in procs:
            p.start()
        pending = set(range(job.world_size))
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            try:
                rank, rank_results, error = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r in pending if procs[r].exitcode is not None]
                for r in dead:
                    errors.append(f"rank {r} exited with code {procs[r].exitcode}, no result")
                    pending.discard(r)
                continue
            pending.discard(rank)
            collected += rank_results
            if error:
                errors.append(f"rank {rank} raised:\n{error}")
                deadline = min(deadline, time.monotonic() + 15.0)
        if pending:
            errors.append(f"rank(s) {sorted(pending)} gave no result in time (hung?)")
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()
    return collected, errors
