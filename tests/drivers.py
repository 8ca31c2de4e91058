"""One test driver for stepping a worker by hand: prefill every prompt, then decode N steps."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from execrt.core.config import RuntimeConfig
from execrt.core.context import RuntimeContext
from execrt.core.plugins import hookimpl
from execrt.core.schedule import Req, SamplingParams, ScheduleBatch
from execrt.core.worker import TpModelWorker
from execrt.models import CheckpointLoader
from execrt.plugins.host import PluginHost


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-relative error ``||got - ref|| / ||ref||`` of two logit (or output) tensors."""
    return float((got - ref).norm() / ref.norm())


def hf_trace_errors(hf: Any, prompts: list[list[int]], trace: Trace) -> list[float]:
    """``rel_err`` of every prefill position and decode step of ``trace`` (run with
    ``full_logits``) against the transformers model ``hf`` fed the same tokens."""
    assert trace.prefill_full_logits is not None
    errors, offset = [], 0
    with torch.no_grad():
        for prompt in prompts:
            ref = hf(torch.tensor([prompt])).logits[0]  # [n, V]
            errors.append(rel_err(trace.prefill_full_logits[offset : offset + len(prompt)], ref))
            offset += len(prompt)
        for step, logits in enumerate(trace.logits[1:], start=1):
            for i, (prompt, tokens) in enumerate(zip(prompts, trace.tokens, strict=True)):
                ref = hf(torch.tensor([prompt + tokens[:step]])).logits[0, -1]
                errors.append(rel_err(logits[i], ref))
    return errors


def in_environment(rank: int, environ: dict[str, str], fn: Any, *args: Any) -> None:
    """``fn(rank, *args)`` in a rank whose environment is made ``environ`` first (a fork
    server's child starts with the server's)."""
    from execrt.testing import moe_harness

    moe_harness.in_environment(environ)
    fn(rank, *args)


def spawn_ranks(fn: Any, args: tuple[Any, ...], nprocs: int, out_dir: Path) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; each rank writes its traceback
    to ``out_dir/rank<r>.err`` on failure, and any such file fails the caller here."""
    import torch.multiprocessing as mp

    from execrt.testing.moe_harness import rank_context

    # CPU ranks fork from a server that has imported torch once (a spawned rank imports it
    # again: seconds each on 2 cores); each gets this process's environment, as if spawned.
    method = rank_context("cpu").get_start_method()
    try:
        mp.start_processes(
            in_environment,
            args=(dict(os.environ), fn, *args),
            nprocs=nprocs,
            join=True,
            start_method=method,
        )
    except mp.ProcessRaisedException:
        pass  # the per-rank tracebacks below say more
    errors = [p.read_text() for p in sorted(out_dir.glob("rank*.err"))]
    assert not errors, "\n".join(errors)


def assert_traces_agree(got: Trace, ref: Trace, tol: float = 2e-2) -> None:
    """Two runs fed the same tokens (``follow``), in bf16 on different paths: every step's
    logits within ``tol`` relative error, and the same greedy token wherever the reference's
    top-2 margin is wider than twice their disagreement (at least one such row, so the
    comparison checks something)."""
    checked = 0
    for step, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
        a, b = a.float(), b.float()
        assert bool(torch.isfinite(a).all()), f"step {step}: non-finite logits"
        err = rel_err(a, b)
        assert err < tol, f"step {step}: relative error {err:.2e}"
        top2 = b.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (a - b).abs().amax(dim=-1)
        same = a.argmax(-1) == b.argmax(-1)
        assert bool(same[clear].all()), f"step {step}: greedy token differs at a clear margin"
        checked += int(clear.sum())
    assert checked > 0, "no step had a clear top-2 margin: the comparison checked nothing"


#: A graph-capable CPU attention backend (torch_native with static graph metadata), so that
#: decode graphs run on CPU under ``graph_backend="reexec"``; workers get it from
#: ``graph_attention_host()``.
STATIC_GRAPH = "static_graph"


class _FakeAttentionPlugin:
    """Registers one attention backend of ``tests.testing.fake_backends`` under ``name``."""

    def __init__(self, name: str, cls: str, caps: str) -> None:
        self.name, self.cls, self.caps = name, cls, caps

    @hookimpl
    def execrt_register_backends(self, registry):  # type: ignore[no-untyped-def]
        from tests.testing import fake_backends

        factory = f"{fake_backends.__name__}:{self.cls}"
        registry.register("attention", self.name, factory, getattr(fake_backends, self.caps))


def fake_attention_host(name: str, cls: str, caps: str) -> PluginHost:
    """A fresh plugin host: the built-in plugin plus fake attention backend ``cls`` (declaring
    ``fake_backends.<caps>``) registered as ``name``."""
    host = PluginHost(autoload=False)
    assert host.add_plugin(_FakeAttentionPlugin(name, cls, caps), f"fake-{name}")
    return host


def graph_attention_host() -> PluginHost:
    """A fresh plugin host: the built-in plugin plus the ``static_graph`` attention backend."""
    return fake_attention_host(STATIC_GRAPH, "StaticGraphAttention", "GRAPH_CAPS")


def make_worker(
    path: str, context: RuntimeContext, host: PluginHost | None = None, **config: Any
) -> TpModelWorker:
    """A worker for the checkpoint at ``path`` (CPU unless ``device`` is given)."""
    cfg = RuntimeConfig(**({"device": "cpu"} | config))
    registry = (host or PluginHost(autoload=False)).registry
    return TpModelWorker(CheckpointLoader(path), cfg, context, registry)


@dataclass
class Trace:
    """What one prefill + decode run produced, step by step."""

    logits: list[torch.Tensor]  # per step: next-token logits [B, V] (cloned)
    tokens: list[list[int]]  # per request: every generated token
    prefill_full_logits: torch.Tensor | None  # [T, V] of the prefill, when asked for
    graphed: list[bool] = field(default_factory=list)  # per step: replayed a captured graph


def _extend(worker: TpModelWorker, prompts: list[list[int]]) -> tuple[list[Req], ScheduleBatch]:
    reqs = [Req(i, list(p), SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    inputs = worker.memory.reserve_extend(reqs, [len(p) for p in prompts])
    assert inputs is not None, "the test's KV cache is too small for its prompts"
    return reqs, ScheduleBatch.of(reqs, inputs, worker.memory.stager)


def _decode(worker: TpModelWorker, reqs: list[Req]) -> ScheduleBatch:
    inputs = worker.memory.reserve_decode(reqs)
    assert inputs is not None, "the test's KV cache is too small for its decode steps"
    return ScheduleBatch.of(reqs, inputs, worker.memory.stager)


def _advance(reqs: list[Req], batch: ScheduleBatch, tokens: list[int]) -> None:
    """Each request has cached what ``batch`` computed and takes its next token."""
    for req, n, tok in zip(reqs, batch.inputs.extend_lens_cpu, tokens, strict=True):
        req.kv_len += n
        req.output_ids.append(int(tok))


def prefill(worker: TpModelWorker, prompts: list[list[int]]) -> tuple[list[Req], ScheduleBatch]:
    """Prefill all ``prompts`` in one greedy extend; the requests and their next decode batch
    (its KV slots reserved, not yet run). ``release`` frees what the requests hold."""
    reqs, batch = _extend(worker, prompts)
    _advance(reqs, batch, worker.forward_batch_generation(batch).next_token_ids.tolist())
    return reqs, _decode(worker, reqs)


def release(worker: TpModelWorker, reqs: list[Req]) -> None:
    """Free the request rows and every KV slot they hold (a decode batch's new slots too)."""
    for req in reqs:
        assert worker.memory.holds(req)
        worker.memory.release(req)


def prefill_then_decode(
    worker: TpModelWorker,
    prompts: list[list[int]],
    steps: int,
    *,
    full_logits: bool = False,
    follow: list[list[int]] | None = None,
) -> Trace:
    """Prefill all ``prompts`` in one extend, then ``steps`` greedy decode steps.

    ``follow`` (per request, the tokens of another run) feeds those tokens instead of this
    run's samples, so two backends compared step by step always see the same inputs (bf16
    near-ties would otherwise send them down different continuations)."""
    reqs, batch = _extend(worker, prompts)
    batch.return_full_logits = full_logits
    trace = Trace([], [r.output_ids for r in reqs], None)
    for step in range(steps + 1):
        if step:
            batch = _decode(worker, reqs)
        result = worker.forward_batch_generation(batch)
        if step == 0 and full_logits:
            assert result.logits_output.full_logits is not None
            trace.prefill_full_logits = result.logits_output.full_logits.clone()
        trace.logits.append(result.logits_output.next_token_logits.clone())
        trace.graphed.append(result.can_run_graph)
        sampled = result.next_token_ids.tolist()
        _advance(reqs, batch, sampled if follow is None else [t[step] for t in follow])
    return trace


def live_children(pid: int) -> list[tuple[int, str]]:
    """The (pid, command line) of ``pid``'s live children."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline") as fh:
                cmdline = fh.read().replace("\0", " ")
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        if stat[1] == str(pid) and stat[0] != "Z":
            found.append((int(entry), cmdline))
    return found
