"""MoE expert-compute benchmark: one Qwen3-30B-A3B layer, µs and % of copy bandwidth vs peers.

Each implementation's whole expert compute (for Triton: align, both GEMMs, SiLU*mul, top-k
sum) is captured in a CUDA graph and the replays are timed with CUDA events. Every replay
calls it ``ROUNDS`` times over each of ``NUM_WEIGHT_SETS`` distinct copies of the layer's
weights in turn, so consecutive calls never find their experts in L2: bs 1 alone reads
75 MB of experts (more than the L2), and between two uses of one copy at least two other
calls stream as much again. Bytes counted per call: the distinct experts the routing hits
(each 3·H·I weights) plus the hidden states read and the output written; the intermediates
each implementation writes and reads back are its own cost and are not counted. Each output
is checked against the float64 oracle: one past the dtype's tolerance is recorded as failed,
and an implementation that cannot run here is recorded with the reason. The records so far are
saved after each one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from execrt.bench.common import (
    SKIPPED,
    Checkpoint,
    cell,
    check_cell,
    check_error,
    copy_bandwidth_gbps,
    median_us,
    note_error,
    prepare_out_dir,
    utc_now,
)
from execrt.bench.environment import run_environment
from execrt.core.experts import grouped_mm_usable, standard_experts
from execrt.core.interfaces import StandardDispatchOutput
from execrt.testing.oracles import compare, moe_oracle

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
IMPLS = ("triton", "grouped_mm", "dense")
ExpertsFn = Callable[[StandardDispatchOutput, torch.Tensor, torch.Tensor], torch.Tensor]
NUM_WEIGHT_SETS = 3
ROUNDS = 2


@dataclass
class Record:
    impl: str
    tokens: int
    us: float | None  # None: it did not run (``note`` says why)
    pct_copy_bw: float | None  # gbps / copy_gbps x 100
    copy_gbps: float  # the run's device-to-device copy rate (read + write)
    gbps: float | None
    experts_hit: int
    mbytes: float
    rel_err: float | None
    gpu: str
    date: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: str
    check: str = ""  # passed, failed (past the tolerance), error or skipped (common.Checked)
    note: str = ""  # why it failed or did not run
    env: dict[str, str | None] = field(default_factory=dict)  # environment.run_environment


class MoELayerProblem:
    """Random routing (softmax of random logits, top-k, renormalised) of ``tokens`` tokens
    over ``weight_sets`` copies of one MoE layer's experts."""

    def __init__(
        self,
        tokens: int,
        weight_sets: Sequence[tuple[torch.Tensor, torch.Tensor]],
        top_k: int,
        seed: int = 0,
    ) -> None:
        w13, w2 = weight_sets[0]
        num_experts, _, hidden = w13.shape
        dev = w13.device
        g = torch.Generator(device=dev).manual_seed(seed + tokens)
        logits = torch.randn(tokens, num_experts, device=dev, generator=g)
        weights, ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        x = torch.randn(tokens, hidden, device=dev, generator=g).to(w13.dtype)
        self.dispatch = StandardDispatchOutput(x, ids, weights.float())
        self.weight_sets = weight_sets
        self.experts_hit = int(ids.unique().numel())
        elt = w13.element_size()
        expert_bytes = (w13[0].numel() + w2[0].numel()) * elt
        self.bytes = self.experts_hit * expert_bytes + 2 * x.numel() * elt

    def reference(self) -> torch.Tensor:
        d = self.dispatch
        w13, w2 = self.weight_sets[0]
        return moe_oracle(d.hidden_states, d.topk_ids, d.topk_weights, w13, w2)


def make_weight_sets(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str, count: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (default NUM_WEIGHT_SETS) random copies of one layer's ``(w13, w2)``."""
    g = torch.Generator(device=device).manual_seed(1234)
    e, h, i = num_experts, hidden, inter
    return [
        (
            (torch.randn(e, 2 * i, h, device=device, generator=g) * h**-0.5).to(dtype),
            (torch.randn(e, h, i, device=device, generator=g) * i**-0.5).to(dtype),
        )
        for _ in range(count or NUM_WEIGHT_SETS)
    ]


def implementation(name: str) -> ExpertsFn:
    """``fn(dispatch, w13, w2) -> [T, H]`` of a named implementation."""
    if name == "triton":
        from execrt.kernels.fused_moe import fused_experts

        return lambda d, w13, w2: fused_experts(d, w13, w2)
    if name in ("grouped_mm", "dense"):
        return lambda d, w13, w2: standard_experts(
            d.hidden_states,
            d.topk_ids,
            d.topk_weights,
            w13,
            w2,
            method=name,  # type: ignore[arg-type]
        )
    raise ValueError(f"bench moe: unknown implementation {name!r} (known: {', '.join(IMPLS)})")


def time_impl(
    fn: ExpertsFn, p: MoELayerProblem, iters: int, reps: int
) -> tuple[float, torch.Tensor]:
    """(µs per call, graph-timed; the output of a call on weight set 0)."""

    def run_all() -> torch.Tensor:
        outs = [fn(p.dispatch, w13, w2) for _ in range(ROUNDS) for w13, w2 in p.weight_sets]
        return outs[0]

    out = run_all()  # warm-up outside capture: JIT compilation, cuBLAS workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_all()
    graph.replay()
    calls = ROUNDS * len(p.weight_sets)
    return median_us(graph.replay, iters, reps) / calls, out


def run(
    tokens: Sequence[int] = DEFAULT_TOKENS,
    impls: Sequence[str] = IMPLS,
    *,
    num_experts: int = 128,
    top_k: int = 8,
    hidden_size: int = 2048,
    intermediate_size: int = 768,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 10,
    reps: int = 5,
    out_dir: str | None = "benchmarks/results",
) -> list[Record]:
    """Benchmark each implementation at each token count; print a table; save JSON, the
    records so far after each one."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench moe: needs a CUDA device")
    prepare_out_dir("moe", out_dir)
    saved = Checkpoint(out_dir, "moe")
    fns = {name: implementation(name) for name in impls}
    gpu, date, env = torch.cuda.get_device_name(), utc_now(), run_environment()
    copy_bw = copy_bandwidth_gbps()
    print(f"# {gpu}: device-to-device copy {copy_bw:.0f} GB/s (read + write)")
    e, h, i = num_experts, hidden_size, intermediate_size
    weight_sets = make_weight_sets(e, h, i, dtype, "cuda")
    records: list[Record] = []
    for t in tokens:
        problem = MoELayerProblem(t, weight_sets, top_k)
        ref = problem.reference()
        for name, fn in fns.items():
            record = Record(
                impl=name,
                tokens=t,
                us=None,
                pct_copy_bw=None,
                copy_gbps=copy_bw,
                gbps=None,
                experts_hit=problem.experts_hit,
                mbytes=problem.bytes / 1e6,
                rel_err=None,
                gpu=gpu,
                date=date,
                num_experts=e,
                top_k=top_k,
                hidden_size=h,
                intermediate_size=i,
                dtype=str(dtype).replace("torch.", ""),
                env=env,
            )
            if name == "grouped_mm" and not grouped_mm_usable(
                problem.dispatch.hidden_states, *weight_sets[0]
            ):
                record.check, record.note = SKIPPED, "no native grouped GEMM on this device/dtype"
                print(f"  {name:<11} T={t:<4} skipped: {record.note}")
            else:
                time_into(record, fn, problem, ref, iters, reps)
            records.append(record)
            saved.save(records)
        del problem
        torch.cuda.empty_cache()
    return saved.report(records, format_table)


def time_into(
    record: Record, fn: ExpertsFn, p: MoELayerProblem, ref: torch.Tensor, iters: int, reps: int
) -> None:
    """Time ``fn`` on ``p`` into ``record`` and check its output against ``ref`` (the oracle's,
    ``check_error``); one that cannot run here gets the reason as its note."""
    label = f"{record.impl:<11} T={record.tokens:<4}"
    try:
        us, out = time_impl(fn, p, iters, reps)
    except Exception as exc:  # recorded, and the run goes on
        note_error(record, exc, label)
        return
    record.us, record.rel_err = us, compare(out, ref).rel_error
    record.gbps = p.bytes / (us * 1e-6) / 1e9
    record.pct_copy_bw = 100 * record.gbps / record.copy_gbps
    check_error(record, record.rel_err, p.dispatch.hidden_states.dtype, label)


def format_table(records: Sequence[Record]) -> str:
    lines = [
        f"{'impl':<11} {'T':>4} {'experts':>7} {'MB':>7} {'us':>9} {'GB/s':>7} {'%copy':>6} "
        f"{'rel err':>8} {'check':<7} note"
    ]
    for r in records:
        pct = None if r.pct_copy_bw is None else r.pct_copy_bw / 100
        lines.append(
            f"{r.impl:<11} {r.tokens:>4} {r.experts_hit:>7} {r.mbytes:>7.1f} "
            f"{cell(r.us, 9, '.1f')} {cell(r.gbps, 7, '.0f')} {cell(pct, 6, '.1%')} "
            f"{cell(r.rel_err, 8, '.1e')} {check_cell(r):<7} {r.note}"
        )
    return "\n".join(lines)
