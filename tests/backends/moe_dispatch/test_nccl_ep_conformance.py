"""nccl_ep through MoEDispatcherSuite: with the nccl.ep double on CPU, and as registered."""

from __future__ import annotations

import dataclasses
import zlib

from execrt.backends.moe_dispatch.nccl_ep import NcclEpDispatcher
from execrt.backends.moe_dispatch.nccl_ep_native import NcclApi
from execrt.core.interfaces import MoEDispatcherInit
from execrt.plugins.builtin import NCCL_EP_DISPATCH
from execrt.testing.moe import MoEDispatcherSuite
from tests.doubles.nccl_ep import FakeNccl


class _CheckedDispatcher(NcclEpDispatcher):
    """The real dispatcher over a fresh double; at close, the double must be clean."""

    def __init__(self, init: MoEDispatcherInit) -> None:
        seed = zlib.crc32(repr((init.num_experts, init.top_k, init.hidden_size)).encode())
        self.fake = FakeNccl(seed=seed)
        super().__init__(init, NcclApi(self.fake.ep, self.fake.core, self.fake.is_capturing))

    def close(self) -> None:
        super().close()
        fake = self.fake
        assert not fake.violations, f"nccl.ep double: library misuse {fake.violations}"
        assert not fake.live_groups() and not fake.live_handles(), "native objects leaked"


def double_dispatcher(init: MoEDispatcherInit) -> NcclEpDispatcher:
    return _CheckedDispatcher(init)


class TestNcclEpWithDouble(MoEDispatcherSuite):
    # The double emulates one rank on any device: CPU here, world size 1. Larger worlds skip
    # ("capability world_sizes does not include 2"); CUDA-graph capture is CUDA-only and the
    # graph lifecycle has its own tests (test_nccl_ep_lifecycle.py). top_k stops at 8: the
    # CPU profile has 8 experts and the suite's routings draw distinct experts per token.
    factory = double_dispatcher
    capabilities = dataclasses.replace(
        NCCL_EP_DISPATCH, devices=frozenset({"cpu"}), world_sizes=frozenset({1}), max_top_k=8
    )
    devices = ("cpu",)


class TestNcclEpRegistered(MoEDispatcherSuite):
    # The real backend: every case skips with its reason where NCCL EP cannot run (here: no
    # CUDA; on a GPU without nccl.ep or with NCCL < 2.29: the probe's reasons).
    backend = "nccl_ep"
    expected_failures = {
        # The suite captures a bare dispatcher; nccl_ep is captured through its graph backend's
        # GraphResourceProvider lifecycle (test_nccl_ep_lifecycle.py, test_nccl_ep_gpu.py) and
        # refuses a capture without warmed-up graph resources, as it must.
        "test_cuda_graph_capture": "needs the GraphResourceProvider lifecycle the suite skips",
    }
