"""GPU, bf16, NCCL at world size 1: a run inside an NCCL process group of one rank produces the
logits and greedy tokens of the same run without torch.distributed (issue 12, "GPU").

How execrt decides it is distributed, and what that means at world size 1:

- ``RuntimeContext.parallel`` holds the world; ``ParallelState.from_process_group()`` wraps the
  initialised group (here ``world_size`` 1, ``backend`` "nccl"). ``Engine`` does the same
  through ``init_parallel`` when a group already exists; without one, ``init_parallel`` makes
  none at ``WORLD_SIZE`` 1, so ``torchrun --nproc-per-node 1`` runs with no group at all. This
  test initialises the group itself, as a launcher would.
- ``ModelRunner`` lays ``tp_size`` / ``ep_size`` over the world (``with_layout``): at world 1
  both are 1, so ``tp_group`` and ``ep_group`` are ``CommGroup()`` of size 1, and the MoE
  dispatcher is selected with ``process_group_backend`` "none".
- Every collective execrt issues is skipped at size 1: ``ParallelState.all_reduce`` (o_proj /
  down_proj row-parallel sums, the allreduce dispatcher's combine on the EP group),
  ``broadcast`` (sampled tokens), ``all_gather_counts`` (KV slots), ``barrier``, and the
  all_to_all dispatchers' ``exchange``.

So world size 1 takes the no-communication path even with NCCL initialised: the NCCL
communicator is never touched by execrt. The test asserts exactly that (a spy on
torch.distributed's collectives counts zero calls during every run, after counting the probe's
own call), and exercises the communicator itself with one eager and one graph-captured
``all_reduce``, so a broken NCCL on the machine fails here rather than on the first multi-GPU
run. CUDA graphs are released before the process group is destroyed (graphs holding NCCL work
make ``destroy_process_group`` hang; wave2-notes pitfall 10).

The group lives in a spawned process, never in the pytest process.
"""

from __future__ import annotations

import functools
import gc
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from execrt.core.context import RuntimeContext
from execrt.core.parallel import ParallelState
from execrt.core.schedule import SamplingParams
from execrt.engine import Engine
from execrt.plugins.host import PluginHost
from tests.drivers import make_worker, prefill_then_decode, rel_err


def _nccl_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if not dist.is_available() or not dist.is_nccl_available():
        return "needs torch.distributed with NCCL"
    return None


pytestmark = pytest.mark.skipif(_nccl_missing() is not None, reason=str(_nccl_missing()))

PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77], [9] * 13]
STEPS = 4
GRAPHS = ("none", "full_cuda_graph")
# case -> (checkpoint of tests/checkpoints.py, RuntimeConfig overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("dense-untied-hd128-sharded", {}),
    "moe-allreduce": ("moe-8x2", {"moe_dispatcher": "allreduce"}),
    "moe-all_to_all_fixed": ("moe-8x2", {"moe_dispatcher": "all_to_all_fixed"}),
}
# Small pools: 3 requests decode in the graph bucket of 4; all_to_all_fixed sizes its buffers
# by max_prefill_tokens (its per-rank token capacity).
CONFIG: dict[str, Any] = dict(
    device="cuda",
    dtype="bfloat16",
    tp_size=1,
    max_running_requests=4,
    max_prefill_tokens=64,
    kv_cache_tokens=512,
    cuda_graph_max_bs=4,
)
ENGINE_CASE = ("moe-allreduce", "full_cuda_graph")
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
)
CHILD_TIMEOUT_S = 300.0


def run_case(path: str, context: RuntimeContext, graph: str, **overrides: Any) -> dict[str, Any]:
    """Prefill PROMPTS, decode STEPS greedy steps; what the run produced and how it ran."""
    worker = make_worker(path, context, **CONFIG, graph_backend=graph, **overrides)
    try:
        mr = worker.model_runner
        trace = prefill_then_decode(worker, PROMPTS, STEPS, full_logits=True)
        assert trace.prefill_full_logits is not None
        p = mr.parallel
        return {
            "logits": [t.float().cpu() for t in trace.logits],
            "prefill": trace.prefill_full_logits.float().cpu(),
            "tokens": [list(t) for t in trace.tokens],
            "graphed": trace.graphed,
            "parallel": (p.world_size, p.backend, p.tp_group.size, p.ep_group.size),
            "chosen": {r.kind: r.chosen for r in mr.resolution.resolutions},
        }
    finally:
        worker.close()  # the graphs go first (ModelRunner.close)


def run_engine(path: str, **overrides: Any) -> dict[str, Any]:
    """Greedy Engine.generate, the entry a torchrun launch takes; its world as it saw it."""
    params = SamplingParams(max_new_tokens=STEPS + 1, temperature=0.0, ignore_eos=True)
    host = PluginHost(autoload=False)  # the built-in backends only, as make_worker uses
    with Engine(path, plugin_host=host, **CONFIG, **overrides) as engine:
        results = engine.generate(PROMPTS, params)
        p = engine.parallel
        world = (p.world_size, p.backend, p.tp_group.size, p.ep_group.size)
    assert all(r.error is None for r in results), [r.error for r in results]
    return {"tokens": [r.token_ids for r in results], "parallel": world}


def run_all(paths: dict[str, str], parallel: ParallelState | None) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for case, (_, overrides) in CASES.items():
        for graph in GRAPHS:
            ctx = RuntimeContext(parallel=parallel)
            try:
                out[case, graph] = run_case(paths[case], ctx, graph, **overrides)
            finally:
                ctx.close()
    case, graph = ENGINE_CASE
    out["engine"] = run_engine(paths[case], graph_backend=graph, **CASES[case][1])
    return out


def _spy_on_collectives() -> Counter[str]:
    """Count every torch.distributed collective called from now on (execrt calls them as
    ``dist.<name>``, looked up at call time). For a spawned process only: never undone."""
    calls: Counter[str] = Counter()
    for name in COLLECTIVES:
        real = getattr(dist, name)

        @functools.wraps(real)
        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, spy)
    return calls


def _probe_nccl(calls: Counter[str]) -> None:
    """One eager and one graph-captured all_reduce on the world group; the graph is reset
    before anything else runs, long before the group is destroyed."""
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    dist.all_reduce(x)  # NCCL makes its communicator on the first collective
    torch.cuda.synchronize()
    assert x.tolist() == [float(i) for i in range(8)], x  # a sum over one rank
    assert calls == Counter(all_reduce=1), f"the collective spy missed the probe: {calls}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        dist.all_reduce(y)
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert y.tolist() == [6.0] * 8, y
    graph.reset()
    del graph, y
    calls.clear()


def _rank_main(rank: int, paths: dict[str, str], init_file: str, out_file: str) -> None:
    torch.cuda.set_device(0)  # NCCL binds the communicator to the current device
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
        calls = _spy_on_collectives()
        _probe_nccl(calls)
        out = run_all(paths, ParallelState.from_process_group())
        out["collectives"] = dict(calls)
        # The engine found the group it did not create and left it alone.
        out["still_initialised"] = dist.is_initialized()
        torch.save(out, out_file)
    finally:
        # Every worker and engine has closed, so every graph is reset; nothing on the device
        # may still run when the communicator goes.
        gc.collect()
        try:
            torch.cuda.synchronize()
        finally:
            dist.destroy_process_group()


def _spawn(paths: dict[str, str], init_file: str, out_file: str) -> None:
    procs = mp.start_processes(
        _rank_main,
        args=(paths, init_file, out_file),
        nprocs=1,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not procs.join(timeout=5):  # re-raises the child's exception with its traceback
        if time.monotonic() > deadline:
            for proc in procs.processes:
                proc.kill()
            pytest.fail(f"the NCCL world-1 process ran past {CHILD_TIMEOUT_S:.0f} s (hung?)")


def test_nccl_world_of_one_matches_no_process_group(
    checkpoint: Callable[[str], str], tmp_path: Path
) -> None:
    paths = {case: checkpoint(spec[0]) for case, spec in CASES.items()}
    ref = run_all(paths, None)  # this process: torch.distributed never initialised
    assert not dist.is_initialized()
    out_file = str(tmp_path / "nccl-world1.pt")
    _spawn(paths, str(tmp_path / "init"), out_file)
    got = torch.load(out_file)
    assert not dist.is_initialized()  # the group never leaked into this process

    assert got["still_initialised"], "Engine destroyed a process group it did not create"
    assert got["collectives"] == {}, (
        f"collectives ran at world size 1 ({got['collectives']}): execrt no longer skips "
        "communication on groups of one; update this test's docstring"
    )
    for case, (_, overrides) in CASES.items():
        for graph in GRAPHS:
            a, b = got[case, graph], ref[case, graph]
            where = f"{case} graph={graph}"
            assert a["parallel"] == (1, "nccl", 1, 1), f"{where}: {a['parallel']}"
            assert b["parallel"] == (1, "none", 1, 1), f"{where}: {b['parallel']}"
            for run in (a, b):
                if "moe_dispatcher" in overrides:
                    assert run["chosen"]["moe_dispatch"] == overrides["moe_dispatcher"], where
                assert run["chosen"]["graph"] == (None if graph == "none" else graph), where
                # The prefill runs eagerly; every decode step (3 requests) replays a graph.
                captured = graph != "none"
                assert run["graphed"] == [False] + [captured] * STEPS, f"{where}: {run['graphed']}"
            assert a["tokens"] == b["tokens"], f"{where}: greedy tokens differ"
            err = rel_err(a["prefill"], b["prefill"])
            assert err < 2e-2, f"{where} prefill: relative error {err:.2e}"
            for step, (x, y) in enumerate(zip(a["logits"], b["logits"], strict=True)):
                err = rel_err(x, y)
                assert err < 2e-2, f"{where} step {step}: relative error {err:.2e}"
    assert got["engine"]["parallel"] == (1, "nccl", 1, 1), got["engine"]["parallel"]
    assert ref["engine"]["parallel"] == (1, "none", 1, 1), ref["engine"]["parallel"]
    assert got["engine"]["tokens"] == ref["engine"]["tokens"]
    assert [len(t) for t in got["engine"]["tokens"]] == [STEPS + 1] * len(PROMPTS)
