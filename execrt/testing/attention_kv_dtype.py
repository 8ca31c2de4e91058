"""The attention suite's KV-dtype cases: an fp8 cache against the oracle, with per-layer scales."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

from execrt.core.kv_quant import KVScales
from execrt.testing.attention_harness import Outcome, Step
from execrt.testing.attention_scenarios import SCENARIOS
from execrt.testing.suite import Case, dtype_name

if TYPE_CHECKING:
    from execrt.testing.attention import AttentionBackendSuite

#: (k_scale, v_scale) per layer: unit scales, then non-unit ones (one below 1, one above: a
#: kernel that ignores either, or swaps them, is off by 4x or 16x).
KV_SCALES = KVScales((1.0, 0.25), (1.0, 4.0))
MODES = ("decode", "extend", "graph")  # graph: decode planned through plan_graph


def kv_dtype_cases(suite: type[AttentionBackendSuite]) -> list[Case]:
    """Every KV cache dtype of ``suite.kv_dtype_axis()`` on every device: decode and extend
    over the head dims (at the primary GQA ratio) and the GQA ratios (at the primary head
    dim), and the graph path at the primary shape; decode and extend at the primary shape in
    every other model dtype too (an fp8 read of a 16-bit path of its own is held as well)."""
    from execrt.testing.attention import GQA_RATIOS, HEAD_DIMS

    out = []
    caps = suite.caps()
    for device in suite.device_axis(caps.devices):
        dtype, head_dim, ratio = suite.primary(device)
        shapes = [(hd, ratio) for hd in suite.value_axis(HEAD_DIMS, caps.head_dims)]
        shapes += [(head_dim, r) for r in suite.value_axis(GQA_RATIOS, caps.gqa_ratios)]
        for kv in suite.kv_dtype_axis():
            prefix = f"{device}-{dtype_name(dtype)}-kv_{dtype_name(kv)}"
            for mode in MODES:
                for hd, r in dict.fromkeys(shapes) if mode != "graph" else [(head_dim, ratio)]:
                    case_id = f"{prefix}-{mode}-d{hd}-gqa{r}"
                    graph = mode == "graph"
                    out.append(
                        suite.make_case(
                            case_id,
                            device,
                            dtype,
                            hd,
                            r,
                            kv_dtype=kv,
                            mode="decode" if graph else mode,
                            graph=graph,
                        )  # fmt: skip
                    )
            for other in (d for d in suite.dtype_axis() if d != dtype):
                for mode in ("decode", "extend"):
                    case_id = f"{device}-{dtype_name(other)}-kv_{dtype_name(kv)}-{mode}"
                    case_id += f"-d{head_dim}-gqa{ratio}"
                    out.append(
                        suite.make_case(
                            case_id, device, other, head_dim, ratio, kv_dtype=kv, mode=mode
                        )
                    )
    return out


def _steps(suite: type[AttentionBackendSuite], case: Case) -> tuple[list[Step], int]:
    """The case's steps and its graph bucket (0: eager)."""
    if case["graph"]:
        steps = list(suite.profile(case.device).graph_steps)
        return steps, max(s.batch_size + s.padded_rows for s in steps)
    name = "decode-ragged" if case["mode"] == "decode" else "extend-prefix"
    return [SCENARIOS[name][1 if case.device.startswith("cuda") else 0]], 0


def run_kv_dtype_case(
    suite: AttentionBackendSuite, case: Case, record_property: Callable[[str, object], None]
) -> None:
    """Run one KV-dtype case (see ``AttentionBackendSuite.test_kv_dtype``)."""
    cls, kv = type(suite), case["kv_dtype"]
    tol = min(cls.tolerance(case.device, case.dtype or torch.float32), cls.kv_dtype_tolerance)
    budget = cls.kv_dtype_budgets[kv]
    steps, bucket = _steps(cls, case)
    geometry = suite.geometry(case, num_layers=len(KV_SCALES.k))
    seed = zlib.crc32(case.id.encode())
    harness = suite.harness(case, geometry, steps, seed, bucket, kv_dtype=kv, scales=KV_SCALES)
    total = Outcome()
    try:
        for i, step in enumerate(steps):
            prepared = harness.prepare(step, graph=bool(bucket))
            outs = harness.run(prepared)
            label = f"{case.id} step {i} ({step.mode})"
            total.add(harness.check(prepared, outs, tol, label, exact_tolerance=budget))
    finally:
        harness.close()
    record_property("max_error", total.max_error)
    record_property("tolerance", tol)
    record_property("max_error_vs_unquantized", total.max_exact_error)
    record_property("budget_vs_unquantized", budget)
    if total.problems:
        hint = (
            "(an fp8 cache is read as it holds K/V, this step's too: the stored values times "
            "the layer's scales, not the unquantized kv handed to attend)"
        )
        pytest.fail("\n".join([*total.problems, hint]), pytrace=False)
