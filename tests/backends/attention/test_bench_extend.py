"""The extend benchmark's problem, FLOP count and peers, run once on the CPU (no timing)."""

from __future__ import annotations

import pytest
import torch

from execrt.bench import extend as bench
from execrt.core.context import RuntimeContext
from execrt.plugins.host import PluginHost


def test_causal_flops_counts_visible_pairs() -> None:
    # 2 requests, 3 new tokens after 4 cached: rows see 5, 6, 7 keys -> 18 pairs each.
    assert bench.causal_flops(2, 3, 4, 8, 64) == 4 * 64 * 8 * 2 * 18
    # The first row: 1 x 8192 from scratch in 1.97 ms is 280 TFLOP/s.
    tflops = bench.causal_flops(1, 8192, 0, 32, 128) / 1.97e-3 / 1e12
    assert 279 < tflops < 280


@pytest.mark.parametrize("name", ["triton", "sdpa"])
def test_problem_peers_agree_with_the_fp32_reference(name: str) -> None:
    pytest.importorskip("triton")
    # Triton runs compiled on CUDA machines and under the interpreter elsewhere.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = bench.ExtendProblem(2, 20, 13, 4, 2, 64, torch.float32, device=device)
    fb = p.forward_batch()
    assert fb.out_cache_loc.tolist() == p.pool.req_to_token[1:, 13:].reshape(-1).tolist()
    context = RuntimeContext()
    try:
        if name == "sdpa":
            calls = bench.sdpa_calls(p)
        else:
            calls, backend = bench.backend_calls(PluginHost(autoload=False), name, p, context)
        # Every layer holds different K/V: the check reads layer 0, so call 0 must be layer 0.
        outs = [call() for call in calls[:2]]
        # fp32 runs in TF32 on a GPU (as the backend documents), exactly under the interpreter.
        assert p.rel_err(outs[0]) < (5e-3 if device == "cuda" else 1e-5)
        if len(outs) > 1:
            assert p.rel_err(outs[1]) > 1e-2
    finally:
        context.close()
