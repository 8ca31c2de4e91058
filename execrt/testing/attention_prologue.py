"""The attention suite's q/k prologue cases: a backend that rotates and stores a decode step's
q and k itself (``fuses_qk_prologue``), against the float64 rotation and attention."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

from execrt.core.kv_quant import KVScales
from execrt.testing.attention_harness import Outcome
from execrt.testing.attention_scenarios import SCENARIOS
from execrt.testing.suite import Case, dtype_name

if TYPE_CHECKING:
    from execrt.testing.attention import AttentionBackendSuite

#: variant -> (q/k norm, Hadamard rotation, graph plan)
VARIANTS = {
    "norm": (True, False, False),
    "no-norm": (False, False, False),
    "hadamard": (True, True, False),
    "graph": (True, False, True),
}
#: Per-layer (k_scale, v_scale) of the fp8 cases: a kernel that ignores either is off by 4x.
KV_SCALES = KVScales((0.25, 1.0), (4.0, 1.0))


def prologue_cases(suite: type[AttentionBackendSuite]) -> list[Case]:
    """On every device at the primary shape: each variant with a cache in the model dtype,
    then the Hadamard variant over each fp8 cache dtype (skipped where not declared)."""
    out = []
    caps = suite.caps()
    for device in suite.device_axis(caps.devices):
        dtype, head_dim, ratio = suite.primary(device)
        prefix = f"{device}-{dtype_name(dtype)}"
        for name, (norm, hadamard, graph) in VARIANTS.items():
            out.append(
                suite.make_case(
                    f"{prefix}-{name}",
                    device,
                    dtype,
                    head_dim,
                    ratio,
                    mode="decode",
                    graph=graph,
                    norm=norm,
                    hadamard=hadamard,
                )  # fmt: skip
            )
        for kv in suite.kv_dtype_axis():
            out.append(
                suite.make_case(
                    f"{prefix}-kv_{dtype_name(kv)}-hadamard",
                    device,
                    dtype,
                    head_dim,
                    ratio,
                    mode="decode",
                    kv_dtype=kv,
                    norm=True,
                    hadamard=True,
                )  # fmt: skip
            )
    return out


def run_prologue_case(
    suite: AttentionBackendSuite, case: Case, record_property: Callable[[str, object], None]
) -> None:
    """Run one prologue case (see ``AttentionBackendSuite.test_qk_prologue``)."""
    cls, kv = type(suite), case["kv_dtype"]
    tol = cls.tolerance(case.device, case.dtype or torch.float32)
    stored_tol = tol if kv is None else cls.kv_dtype_budgets[kv]
    if case["graph"]:
        steps = list(cls.profile(case.device).graph_steps)
        bucket = max(s.batch_size + s.padded_rows for s in steps)
    else:
        steps, bucket = [SCENARIOS["decode-ragged"][1 if case.device.startswith("cuda") else 0]], 0
    fp8 = {} if kv is None else {"kv_dtype": kv, "scales": KV_SCALES}
    geometry = suite.geometry(case, num_layers=2)
    seed = zlib.crc32(case.id.encode())
    options = {**cls.options, **cls.prologue_options}
    harness = suite.harness(case, geometry, steps, seed, bucket, options=options, **fp8)
    total = Outcome()
    try:
        for i, step in enumerate(steps):
            p = harness.prepare_prologue(
                step, graph=bool(bucket), norm=case["norm"], hadamard=case["hadamard"]
            )
            plan = harness.plan(p.prepared)
            if not harness.backend.fuses_qk_prologue(plan):
                pytest.skip(
                    "the backend does not fuse the q/k prologue (fuses_qk_prologue is False "
                    f"for a decode step with options {options})"
                )
            outs = harness.attend_with_prologue(p, plan)
            label = f"{case.id} step {i}"
            total.add(harness.check(p.prepared, outs, tol, label, stored_tolerance=stored_tol))
    finally:
        harness.close()
    suite.finish(case, total, record_property)
