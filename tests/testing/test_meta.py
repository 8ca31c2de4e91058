"""Meta-tests: every capability field and hookspec is tested and documented; claims are honest."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from execrt.core.interfaces import (
    AttentionCapabilities,
    Capabilities,
    DispatchFormat,
    GraphCapabilities,
    MoEDispatcherCapabilities,
)
from execrt.core.plugins import Hookspecs, hookimpl
from execrt.core.prefix_cache import PrefixCacheCapabilities
from execrt.kernels._triton import interpreter_enabled
from execrt.plugins.host import PluginHost
from execrt.testing.attention import AttentionBackendSuite
from execrt.testing.graph import GraphBackendSuite
from execrt.testing.moe import MoEDispatcherSuite
from execrt.testing.prefix_cache import PrefixCacheSuite
from execrt.testing.suite import Case, ConformanceSuite, dtype_name
from tests.testing import test_builtin_suites as builtin
from tests.testing.fake_backends import REEXEC_CAPS

ROOT = Path(__file__).resolve().parents[2]
NATIVE = "execrt.backends.attention.torch_native:TorchNativeAttnBackend"
ALLREDUCE = "execrt.backends.moe_dispatch.allreduce:AllReduceDispatcher"
REEXEC = "execrt.backends.graph.reexec:ReexecGraphBackend"
RADIX = "execrt.backends.prefix_cache.radix:RadixCache"

#: Per capability record: the suite, a factory, a baseline record, and for every field a
#: changed value whose effect on the suite's cases proves some test reads that field.
RECORDS: dict[type[Capabilities], tuple[type[ConformanceSuite], str, Any, dict[str, Any]]] = {
    AttentionCapabilities: (
        AttentionBackendSuite,
        NATIVE,
        AttentionCapabilities(graph=True),
        {
            "devices": frozenset({"cuda"}),
            "dtypes": frozenset({torch.float16}),
            "head_dims": frozenset({128}),
            "gqa_ratios": frozenset({4}),
            "decode": False,
            "extend": False,
            "graph": False,
            "stores_kv": True,
            "kv_dtypes": frozenset({torch.bfloat16, torch.float8_e4m3fn}),
        },
    ),
    MoEDispatcherCapabilities: (
        MoEDispatcherSuite,
        ALLREDUCE,
        MoEDispatcherCapabilities(graph=True),
        {
            "output_format": DispatchFormat.EXPERT_MAJOR,
            "devices": frozenset({"cuda"}),
            "dtypes": frozenset({torch.float16}),
            "world_sizes": frozenset({1}),
            "process_group_backends": frozenset({"none", "nccl"}),
            "hidden_sizes": frozenset({64}),
            "max_top_k": 2,
            "graph": False,
            "replicated_tokens": False,
        },
    ),
    GraphCapabilities: (
        GraphBackendSuite,
        REEXEC,
        GraphCapabilities(devices=frozenset({"cpu", "cuda"}), graph_resources=True),
        {
            "devices": frozenset({"cuda"}),
            "real_capture": False,
            "shared_memory_pool": False,
            "graph_resources": False,
        },
    ),
    PrefixCacheCapabilities: (
        PrefixCacheSuite,
        RADIX,
        PrefixCacheCapabilities(),
        {"devices": frozenset({"cuda"}), "page_sizes": frozenset({16}), "reuses": False},
    ),
}


def suite_for(base: type[ConformanceSuite], factory: str, caps: Any) -> type[ConformanceSuite]:
    return type("Probe", (base,), {"factory": factory, "capabilities": caps})


def case_table(suite: type[ConformanceSuite]) -> dict[str, str | None]:
    return {f"{n}[{c.id}]": c.skip for n, cs in suite.collect_cases().items() for c in cs}


@pytest.mark.parametrize("record", list(RECORDS), ids=lambda r: r.__name__)
def test_every_capability_field_changes_what_the_suite_runs(record: type[Capabilities]) -> None:
    suite, factory, baseline, changes = RECORDS[record]
    fields = [f.name for f in dataclasses.fields(record)]  # type: ignore[arg-type]
    assert sorted(changes) == sorted(fields), (
        f"{record.__name__}: give each field a conformance test and an entry here "
        f"(missing: {sorted(set(fields) - set(changes))})"
    )
    before = case_table(suite_for(suite, factory, baseline))
    for name, value in changes.items():
        after = case_table(
            suite_for(suite, factory, dataclasses.replace(baseline, **{name: value}))
        )
        # A case that exists on one side only changed too (its skip may be None: it runs).
        gone = "<no such case>"
        changed = {
            k for k in before.keys() | after.keys() if before.get(k, gone) != after.get(k, gone)
        }
        assert changed, (
            f"{record.__name__}.{name}: no suite case depends on it "
            f"({len(before)} cases, e.g. {sorted(before)[:3]})"
        )
        mentions = [k for k in changed if name in str(after.get(k)) or name in str(before.get(k))]
        renamed = before.keys() != after.keys()
        assert mentions or renamed, f"{record.__name__}.{name}: changed cases do not name it"


def doc_section(path: Path, heading: str) -> str:
    text = path.read_text()
    pattern = rf"^#+ [^\n]*{re.escape(heading)}[^\n]*\n(.*?)(?=^#+ |\Z)"
    match = re.search(pattern, text, re.M | re.S)
    assert match, f"{path.name}: no section about {heading}"
    return match.group(1)


@pytest.mark.parametrize("record", list(RECORDS), ids=lambda r: r.__name__)
def test_every_capability_field_is_documented(record: type[Capabilities]) -> None:
    section = doc_section(ROOT / "docs" / "conformance.md", record.__name__)
    missing = [
        f.name
        for f in dataclasses.fields(record)  # type: ignore[arg-type]
        if f"`{f.name}`" not in section
    ]
    assert not missing, f"docs/conformance.md, {record.__name__}: document {missing}"


def hookspec_names() -> list[str]:
    return [n for n in dir(Hookspecs) if hasattr(getattr(Hookspecs, n), "execrt_spec")]


def test_every_hookspec_is_documented_and_tested() -> None:
    guide = (ROOT / "docs" / "writing-a-backend-plugin.md").read_text()
    assert hookspec_names(), "no hookspecs found"
    for name in hookspec_names():
        assert f"`{name}`" in guide, f"docs/writing-a-backend-plugin.md: document {name}"
        assert callable(globals().get(f"test_hook_{name}")), f"add test_hook_{name}"


def test_hook_execrt_register_backends() -> None:
    class Plugin:
        @hookimpl
        def execrt_register_backends(self, registry: Any) -> None:
            registry.register("graph", "probe_graph", REEXEC, REEXEC_CAPS)

    host = PluginHost(autoload=False, builtin=False)
    assert host.add_plugin(Plugin(), "probe-plugin", version="9.9")
    spec = host.registry.get("graph", "probe_graph")
    assert (spec.plugin, spec.version, spec.capabilities) == ("probe-plugin", "9.9", REEXEC_CAPS)


BUILTIN_SUITES = [
    builtin.TestTorchNativeAttention,
    builtin.TestTritonAttention,
    builtin.TestFlashInferAttention,
    builtin.TestAllReduceDispatch,
    builtin.TestReexecGraph,
    builtin.TestRadixPrefixCache,
]


def declared_values(caps: Capabilities) -> list[str]:
    """Id fragments of every declared dtype, head dim, GQA ratio, world size and top-k."""
    out = [dtype_name(d) for d in getattr(caps, "dtypes", ())]
    out += [f"-d{v}" for v in getattr(caps, "head_dims", None) or ()]
    out += [f"-gqa{v}" for v in getattr(caps, "gqa_ratios", None) or ()]
    out += [f"-w{v}-" for v in getattr(caps, "world_sizes", None) or ()]
    max_top_k = getattr(caps, "max_top_k", None)
    out += [f"-k{max_top_k}]"] if max_top_k else []
    return out


@pytest.mark.parametrize("suite", BUILTIN_SUITES, ids=lambda s: s.__name__)
def test_every_declared_value_appears_in_a_test_id(suite: type[ConformanceSuite]) -> None:
    ids = list(case_table(suite))
    for fragment in declared_values(suite.collection_spec().capabilities):
        assert any(fragment in i for i in ids), f"{suite.__name__}: no test id has {fragment}"


def cpu_cases(suite: type[ConformanceSuite]) -> list[tuple[str, Case]]:
    return [(n, c) for n, cs in suite.collect_cases().items() for c in cs if c.device == "cpu"]


@pytest.mark.parametrize("suite", BUILTIN_SUITES, ids=lambda s: s.__name__)
def test_cpu_skips_only_for_undeclared_values_or_the_backends_own_refusals(
    suite: type[ConformanceSuite],
) -> None:
    """A declared CPU capability never hides behind a suite-made skip."""
    allowed = ("capability ", "refused here: ", "torch.cuda.CUDAGraph capture needs a CUDA")
    for name, case in cpu_cases(suite):
        assert case.error is None, case.error
        if case.skip is not None:
            assert case.skip.startswith(allowed), f"{name}[{case.id}]: {case.skip}"


@pytest.mark.skipif(
    not interpreter_enabled(),
    reason="Triton runs on cpu only under its interpreter (tests/conftest.py sets it without CUDA)",
)
def test_triton_on_cpu_runs_every_declared_value_but_bfloat16() -> None:
    suite = builtin.TestTritonAttention
    running = [f"{n}[{c.id}]" for n, c in cpu_cases(suite) if c.skip is None]
    for fragment in ("float32", "float16", "-d64", "-d96", "-d128", "-d256", "-gqa8"):
        assert any(fragment in i for i in running), fragment
    bf16 = [c for _, c in cpu_cases(suite) if c.dtype == torch.bfloat16 and c.skip]
    assert bf16 and all("Triton interpreter" in c.skip for c in bf16)  # type: ignore[operator]


def test_a_variant_class_keeps_only_the_cases_its_option_can_change() -> None:
    # keep_case drops the fused-merge class's extend cases (and on CPU its e5m2 cases); its
    # decode and graph cases, and every test's other cases, are the base class's.
    base = builtin.TestTritonAttention.collect_cases()
    fused = builtin.TestTritonAttentionFusedMerge.collect_cases()
    assert fused.keys() == base.keys()
    for name, cases in base.items():
        kept = [
            c.id
            for c in cases
            if c.get("mode") != "extend"
            and (c.device != "cpu" or c.get("kv_dtype") != torch.float8_e5m2)
        ]
        assert [c.id for c in fused[name]] == kept, name
    assert any(c.get("mode") == "extend" for cs in base.values() for c in cs)
    assert any(c.get("mode") == "decode" for cs in fused.values() for c in cs)


def test_flashinfer_suite_skips_everything_with_its_reason() -> None:
    table = builtin.TestFlashInferAttention.collect_cases()
    del table["test_refusals_explain_themselves"]  # builds nothing, so it runs anywhere
    cases = [c for cs in table.values() for c in cs]
    on_cpu = [c for c in cases if c.device == "cpu"]
    assert on_cpu and all("capability devices does not include cpu" in str(c.skip) for c in on_cpu)
    if not torch.cuda.is_available():
        assert all(c.skip for c in cases)
        reasons = " ".join(str(c.skip) for c in cases)
        assert "capability devices does not include cpu" in reasons
        assert "no cuda device here" in reasons
        if "flashinfer" not in sys.modules:
            assert "module 'flashinfer' not installed (pip install execrt[flashinfer])" in reasons


def test_reexec_registration_matches_the_suites_capabilities() -> None:
    spec = PluginHost(autoload=False).registry.get("graph", "reexec")  # raises if it is gone
    assert spec.capabilities == REEXEC_CAPS
    assert spec.auto_devices == frozenset(), "'auto' must never pick reexec"


def test_importing_execrt_testing_needs_neither_pytest_nor_hypothesis() -> None:
    code = (
        "import sys; sys.modules['pytest'] = None; sys.modules['hypothesis'] = None\n"
        "import execrt\n"
        "assert 'execrt.testing' not in sys.modules\n"
        "import execrt.testing, execrt.testing.oracles, execrt.testing.report\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
