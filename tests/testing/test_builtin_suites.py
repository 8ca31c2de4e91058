"""The built-in backends run their conformance suites (on CPU: interpreter, gloo, reexec)."""

from __future__ import annotations

import torch

from execrt.testing.attention import AttentionBackendSuite
from execrt.testing.graph import GraphBackendSuite
from execrt.testing.moe import MoEDispatcherSuite
from execrt.testing.prefix_cache import PrefixCacheSuite
from execrt.testing.suite import Case


def _one_fp8_format_on_cpu(case: Case) -> bool:
    """A decode variant changes how splits are laid out and merged, not how fp8 is loaded:
    on CPU (the interpreter, ~0.7 s a case) it runs e4m3 alone, the base class both formats."""
    return case.device != "cpu" or case.get("kv_dtype") != torch.float8_e5m2


class TestTorchNativeAttention(AttentionBackendSuite):
    backend = "torch_native"


class TestTritonAttention(AttentionBackendSuite):
    # On CPU the backend's own check refuses bfloat16 under the interpreter: those cases skip
    # with its reason; every other declared value runs (tests/conftest.py sets TRITON_INTERPRET).
    backend = "triton"
    prologue_options = {"decode_prologue": "on"}  # off by default: the prologue cases need it


class TestTritonAttentionFusedMerge(AttentionBackendSuite):
    # The decode merge inside the split launch (last split merges). Extend never merges, so
    # its cases would repeat TestTritonAttention's exactly: only the others run.
    backend = "triton"
    options = {"decode_merge": "fused"}
    prologue_options = {"decode_prologue": "on"}  # the fused merge after the split's rotation

    @classmethod
    def keep_case(cls, test_name: str, case: Case) -> bool:
        return case.get("mode") != "extend" and _one_fp8_format_on_cpu(case)


class TestTritonAttentionOneWave(AttentionBackendSuite):
    # decode_programs "sm": one wave of split programs, each taking several requests' items
    # (on the interpreter's one SM: one program per kv head). Extend is unaffected.
    backend = "triton"
    options = {"decode_programs": "sm"}
    prologue_options = {"decode_prologue": "on"}  # each program rotates all its items' heads

    @classmethod
    def keep_case(cls, test_name: str, case: Case) -> bool:
        return case.get("mode") != "extend" and _one_fp8_format_on_cpu(case)


class TestTritonAttentionWs(AttentionBackendSuite):
    # The warp-specialised Gluon extend kernel (extend_kernel "ws"): the suite's extend cases
    # it takes (sm90, 16-bit q and cache, head dims 64 and 128). Elsewhere the backend refuses
    # it at build, so on CPU and other GPUs the class has no cases.
    backend = "triton"
    options = {"extend_kernel": "ws"}

    @classmethod
    def keep_case(cls, test_name: str, case: Case) -> bool:
        import torch

        from execrt.kernels.attention.extend_ws import WS_DTYPES, WS_HEAD_DIMS, gluon_on_sm90

        return (
            gluon_on_sm90()
            and case.get("mode") == "extend"
            and case.dtype in WS_DTYPES
            and case.get("head_dim") in WS_HEAD_DIMS
            and case.get("kv_dtype") in (None, case.dtype)
            and torch.device(case.device).type == "cuda"
        )


class TestFlashInferAttention(AttentionBackendSuite):
    # Registered but unusable without CUDA and the flashinfer module: every case skips saying so.
    # Its default prefill is FA3 on sm90 (the H200), FA2 elsewhere; the class below runs FA2.
    backend = "flashinfer"


class TestFlashInferAttentionFa2(AttentionBackendSuite):
    backend = "flashinfer"
    options = {"prefill_backend": "fa2"}

    @classmethod
    def kv_dtype_cases(cls) -> list[Case]:
        # "auto" already runs FA2 for an fp8 cache (FA3 cannot read one), so the class above
        # runs these exact kernels; repeating them here only doubles the GPU suite's JIT time.
        return []


class TestAllReduceDispatch(MoEDispatcherSuite):
    backend = "allreduce"


class TestReexecGraph(GraphBackendSuite):
    backend = "reexec"


class TestFullCudaGraph(GraphBackendSuite):
    # CUDA only: on a machine without one every case skips, saying so.
    backend = "full_cuda_graph"


class TestAllToAllDispatch(MoEDispatcherSuite):
    backend = "all_to_all"


class TestAllToAllFixedDispatch(MoEDispatcherSuite):
    backend = "all_to_all_fixed"


class TestRadixPrefixCache(PrefixCacheSuite):
    backend = "radix"
