"""resolve_backend / build_backend over a registry of fake factories, and the report's text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from execrt.core.errors import BackendUnavailableError
from execrt.core.interfaces import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionRequirements,
    GraphBackend,
    GraphCapabilities,
    GraphRequirements,
)
from execrt.core.plugins import BackendRegistry, BackendSpec
from execrt.core.prefix_cache import PrefixCache, PrefixCacheCapabilities, PrefixCacheRequirements
from execrt.core.selection import (
    Resolution,
    ResolutionReport,
    build_backend,
    resolve_backend,
)

CPU_REQ = AttentionRequirements("cpu", torch.float32, 64, 8, 2)
HD64 = AttentionCapabilities(head_dims=frozenset({64}))
HD128 = AttentionCapabilities(head_dims=frozenset({128}))
MISSING = "execrt_no_such_module_for_tests:Backend"


@dataclass
class Built(AttentionBackend, GraphBackend, PrefixCache):
    """What a fake factory returns: which backend, from which init record. A backend of
    either kind selection builds here (registration checks the type, not the contract)."""

    name: str
    init: Any


Built.__abstractmethods__ = frozenset()


class Factory:
    """A backend factory (a callable on the init record) that counts its calls."""

    def __init__(self, name: str, error: Exception | None = None) -> None:
        self.name, self.error, self.calls = name, error, 0

    def __call__(self, init: Any) -> Built:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return Built(self.name, init)


def make_init(spec: BackendSpec) -> tuple[str, str]:
    return ("init-for", spec.name)


def registry(*entries: tuple[str, Any, int], plugin: str = "p") -> BackendRegistry:
    """Attention backends ``(name, capabilities, priority)`` with counting factories."""
    reg = BackendRegistry()
    with reg.attributed_to(plugin, "1.0"):
        for name, caps, priority in entries:
            reg.register("attention", name, Factory(name), caps, priority=priority)
    return reg


def factory_of(reg: BackendRegistry, name: str, kind: str = "attention") -> Factory:
    factory = reg.get(kind, name).factory
    assert isinstance(factory, Factory)
    return factory


# -- explicit names -------------------------------------------------------------------------------
def test_an_explicit_usable_name_is_chosen_and_built_from_make_init() -> None:
    reg = registry(("low", HD64, 0), ("high", HD64, 9))
    res = resolve_backend(reg, "attention", "low", CPU_REQ)
    assert res == Resolution("attention", "low", "low")
    assert factory_of(reg, "low").calls == 0  # resolving builds nothing
    backend, res = build_backend(reg, "attention", "low", CPU_REQ, make_init)
    assert backend == Built("low", ("init-for", "low")) and res.chosen == "low"
    assert factory_of(reg, "high").calls == 0  # an explicit name never tries the others


def test_an_explicit_unusable_name_raises_with_its_reasons() -> None:
    reg = registry(("b", HD128, 0))
    with pytest.raises(BackendUnavailableError) as info:
        resolve_backend(reg, "attention", "b", CPU_REQ)
    assert (info.value.kind, info.value.name) == ("attention", "b")
    assert info.value.reasons == ["head_dim 64 unsupported (supported: 128)"]


def test_an_explicit_name_whose_constructor_fails_is_an_error_naming_the_plugin() -> None:
    reg = BackendRegistry()
    with reg.attributed_to("vendor-kernels", "0.3"):
        reg.register("attention", "v", Factory("v", RuntimeError("no device")), HD64)
    with pytest.raises(BackendUnavailableError) as info:
        build_backend(reg, "attention", "v", CPU_REQ, make_init)
    assert info.value.reasons == [
        "plugin 'vendor-kernels': constructor raised RuntimeError('no device')"
    ]


def test_an_unknown_name_lists_the_registered_ones() -> None:
    reg = registry(("zeta", HD64, 0), ("alpha", HD64, 5))
    with pytest.raises(BackendUnavailableError) as info:
        resolve_backend(reg, "attention", "beta", CPU_REQ)
    # The keywords the kind accepts are named too ("None" for none, say, lists "none").
    assert info.value.reasons == ["not registered (registered: alpha, zeta; or auto)"]
    with pytest.raises(BackendUnavailableError) as info:
        resolve_backend(reg, "moe_dispatch", "alpha", CPU_REQ)
    assert info.value.reasons == ["not registered (registered: none; or auto)"]
    with pytest.raises(BackendUnavailableError) as info:
        resolve_backend(reg, "prefix_cache", "None", CPU_REQ)
    assert info.value.reasons == ["not registered (registered: none; or auto, none)"]


def test_none_outside_graphs_is_just_an_unknown_name() -> None:
    reg = registry(("a", HD64, 0))
    with pytest.raises(BackendUnavailableError, match=r"'none'.*not registered"):
        resolve_backend(reg, "attention", "none", CPU_REQ)  # "none" disables graphs only


# -- auto -----------------------------------------------------------------------------------------
def test_auto_takes_the_highest_priority_then_the_first_name() -> None:
    reg = registry(("mid", HD64, 5), ("top_b", HD64, 10), ("top_a", HD64, 10), ("neg", HD64, -1))
    res = resolve_backend(reg, "attention", "auto", CPU_REQ)
    assert res == Resolution("attention", "auto", "top_a")  # nothing rejected on the way


def test_auto_skips_refusing_candidates_and_reports_why() -> None:
    reg = registry(("fast", HD128, 10), ("faster", HD128, 20), ("slow", HD64, 0))
    res = resolve_backend(reg, "attention", "auto", CPU_REQ)
    assert res.chosen == "slow"
    assert res.rejected == (
        ("faster", ("head_dim 64 unsupported (supported: 128)",)),
        ("fast", ("head_dim 64 unsupported (supported: 128)",)),
    )


def test_auto_skips_a_factory_that_does_not_import_even_without_building() -> None:
    reg = BackendRegistry()
    with reg.attributed_to("third-party", "2.0"):
        reg.register(
            "attention", "broken", MISSING, HD64, priority=10, install_hint="pip install tp"
        )
        reg.register("attention", "fallback", Factory("fallback"), HD64)
    res = resolve_backend(reg, "attention", "auto", CPU_REQ)
    assert res.chosen == "fallback"
    [(name, (reason,))] = res.rejected
    assert name == "broken"
    assert reason.startswith(f"plugin 'third-party': cannot load {MISSING}: ModuleNotFoundError(")
    assert reason.endswith(" (pip install tp)")


def test_build_under_auto_skips_a_constructor_that_raises() -> None:
    reg = BackendRegistry()
    with reg.attributed_to("gpu-plugin", "1"):
        explodes = Factory("explodes", ValueError("bad"))
        reg.register("attention", "explodes", explodes, HD64, priority=5)
        reg.register("attention", "works", Factory("works"), HD64)
    # Resolving alone does not build, so the broken constructor looks fine there.
    assert resolve_backend(reg, "attention", "auto", CPU_REQ).chosen == "explodes"
    backend, res = build_backend(reg, "attention", "auto", CPU_REQ, make_init)
    assert backend == Built("works", ("init-for", "works"))
    assert res.rejected == (
        ("explodes", ("plugin 'gpu-plugin': constructor raised ValueError('bad')",)),
    )


def test_a_constructor_refusing_with_backend_unavailable_keeps_its_own_reasons() -> None:
    refusal = BackendUnavailableError("attention", "picky", ["needs sm90 (got sm80)", "x"])
    reg = BackendRegistry()
    reg.register("attention", "picky", Factory("picky", refusal), HD64, priority=1)
    reg.register("attention", "plain", Factory("plain"), HD64)
    backend, res = build_backend(reg, "attention", "auto", CPU_REQ, make_init)
    assert backend.name == "plain"
    assert res.rejected == (("picky", ("needs sm90 (got sm80)", "x")),)


def test_the_environment_check_is_a_refusal_too() -> None:
    reg = BackendRegistry()
    seen: list[Any] = []

    def check(req: Any) -> list[str]:
        seen.append(req)
        return ["driver 535 too old (supported: >= 550)"]

    reg.register("attention", "new", Factory("new"), HD64, priority=1, check=check)
    reg.register("attention", "old", Factory("old"), HD64)
    res = resolve_backend(reg, "attention", "auto", CPU_REQ)
    assert res.chosen == "old" and seen == [CPU_REQ]
    assert res.rejected == (("new", ("driver 535 too old (supported: >= 550)",)),)


def test_auto_only_tries_candidates_that_claim_the_device() -> None:
    reg = BackendRegistry()
    gpu_caps = AttentionCapabilities(devices=frozenset({"cuda"}))
    reg.register("attention", "gpu", Factory("gpu"), gpu_caps, priority=10)
    # Supports the CPU but asks not to be picked there by auto.
    only_cuda = frozenset({"cuda"})
    reg.register("attention", "shy", Factory("shy"), HD64, priority=5, auto_devices=only_cuda)
    reg.register("attention", "cpu", Factory("cpu"), HD64)
    res = resolve_backend(reg, "attention", "auto", CPU_REQ)
    assert res.chosen == "cpu" and res.rejected == ()  # the others were not even tried
    assert resolve_backend(reg, "attention", "shy", CPU_REQ).chosen == "shy"  # by name: fine
    cuda = AttentionRequirements("cuda", torch.float32, 64, 8, 2)
    assert resolve_backend(reg, "attention", "auto", cuda).chosen == "gpu"


def test_auto_with_every_candidate_refusing_lists_each_one() -> None:
    fp16_only = AttentionCapabilities(dtypes=frozenset({torch.float16}))
    reg = registry(("a", HD128, 1), ("b", fp16_only, 0))
    with pytest.raises(BackendUnavailableError) as info:
        resolve_backend(reg, "attention", "auto", CPU_REQ)
    assert info.value.name == "auto"
    assert info.value.reasons == [
        "a: head_dim 64 unsupported (supported: 128)",
        "b: dtype float32 unsupported (supported: float16)",
    ]


def test_auto_with_no_candidate_for_the_device() -> None:
    gpu = AttentionCapabilities(devices=frozenset({"cuda"}))
    for reg in (BackendRegistry(), registry(("g", gpu, 0))):
        with pytest.raises(BackendUnavailableError) as info:
            resolve_backend(reg, "attention", "auto", CPU_REQ)
        assert info.value.reasons == ["no attention backend claims device cpu"]


# -- strict ---------------------------------------------------------------------------------------
def test_strict_refuses_to_fall_back_past_a_refused_preferred_candidate() -> None:
    reg = registry(("best", HD128, 10), ("good", HD64, 0))
    with pytest.raises(BackendUnavailableError) as info:
        resolve_backend(reg, "attention", "auto", CPU_REQ, strict=True)
    assert info.value.reasons == [
        "strict: preferred best unusable (head_dim 64 unsupported (supported: 128))"
    ]
    assert factory_of(reg, "good").calls == 0


def test_strict_also_covers_a_constructor_failure_while_building() -> None:
    reg = BackendRegistry()
    reg.register("attention", "best", Factory("best", RuntimeError("oom")), HD64, priority=10)
    reg.register("attention", "good", Factory("good"), HD64)
    with pytest.raises(BackendUnavailableError, match="strict: preferred best unusable"):
        build_backend(reg, "attention", "auto", CPU_REQ, make_init, strict=True)
    assert factory_of(reg, "good").calls == 0


def test_strict_is_satisfied_by_a_usable_first_choice() -> None:
    reg = registry(("best", HD64, 10), ("other", HD128, 0))
    backend, res = build_backend(reg, "attention", "auto", CPU_REQ, make_init, strict=True)
    assert backend.name == "best" and res.rejected == ()


# -- graphs ---------------------------------------------------------------------------------------
def graph_registry(*entries: tuple[str, GraphCapabilities, Any]) -> BackendRegistry:
    reg = BackendRegistry()
    with reg.attributed_to("g-plugin", "1"):
        for name, caps, factory in entries:
            reg.register("graph", name, factory, caps)
    return reg


CPU_GRAPHS = GraphCapabilities(devices=frozenset({"cpu"}), real_capture=False)


def test_graph_none_disables_graphs_and_builds_nothing() -> None:
    reg = graph_registry(("reexec", CPU_GRAPHS, Factory("reexec")))
    calls: list[BackendSpec] = []
    backend, res = build_backend(
        reg, "graph", "none", GraphRequirements("cpu"), lambda s: calls.append(s)
    )
    assert backend is None and calls == []
    assert res == Resolution("graph", "none", None, note="graphs disabled")


def test_graph_auto_without_candidates_means_no_graphs() -> None:
    reg = graph_registry(("cuda_graph", GraphCapabilities(), Factory("cuda_graph")))
    backend, res = build_backend(reg, "graph", "auto", GraphRequirements("cpu"), make_init)
    assert backend is None
    assert res == Resolution("graph", "auto", None, (), note="no graph backend for cpu")


def test_graph_auto_with_refused_candidates_reports_them_unless_strict() -> None:
    reg = graph_registry(("broken", CPU_GRAPHS, MISSING))
    res = resolve_backend(reg, "graph", "auto", GraphRequirements("cpu"))
    assert res.chosen is None and res.note == "no graph backend for cpu"
    assert [name for name, _ in res.rejected] == ["broken"]
    with pytest.raises(BackendUnavailableError) as info:
        resolve_backend(reg, "graph", "auto", GraphRequirements("cpu"), strict=True)
    [reason] = info.value.reasons
    assert reason.startswith("broken: plugin 'g-plugin': cannot load")


def test_graph_auto_builds_a_usable_candidate() -> None:
    reg = graph_registry(("reexec", CPU_GRAPHS, Factory("reexec")))
    backend, res = build_backend(reg, "graph", "auto", GraphRequirements("cpu"), make_init)
    assert backend == Built("reexec", ("init-for", "reexec")) and res.chosen == "reexec"


# -- prefix caches: optional like graphs ----------------------------------------------------------
def test_prefix_cache_none_builds_nothing_and_says_the_cache_is_off() -> None:
    reg = BackendRegistry()
    reg.register("prefix_cache", "radix", Factory("radix"), PrefixCacheCapabilities())
    calls: list[BackendSpec] = []
    backend, res = build_backend(
        reg, "prefix_cache", "none", PrefixCacheRequirements("cpu"), lambda s: calls.append(s)
    )
    assert backend is None and calls == []
    assert res == Resolution("prefix_cache", "none", None, note="prefix cache disabled")
    assert res.describe() == "prefix_cache: requested 'none' -> none (prefix cache disabled)"


def test_prefix_cache_by_name_or_auto_builds_the_usable_one() -> None:
    reg = BackendRegistry()
    reg.register("prefix_cache", "radix", Factory("radix"), PrefixCacheCapabilities(), priority=1)
    gpu = PrefixCacheCapabilities(devices=frozenset({"cuda"}))
    reg.register("prefix_cache", "hicache", Factory("hicache"), gpu, priority=9)
    for requested in ("radix", "auto"):
        backend, res = build_backend(
            reg, "prefix_cache", requested, PrefixCacheRequirements("cpu"), make_init
        )
        assert backend == Built("radix", ("init-for", "radix")) and res.chosen == "radix"
    with pytest.raises(BackendUnavailableError, match="device cpu unsupported"):
        resolve_backend(reg, "prefix_cache", "hicache", PrefixCacheRequirements("cpu"))


def test_prefix_cache_auto_without_a_usable_one_means_no_cache_unless_strict() -> None:
    reg = BackendRegistry()
    reg.register("prefix_cache", "broken", MISSING, PrefixCacheCapabilities())
    res = resolve_backend(reg, "prefix_cache", "auto", PrefixCacheRequirements("cpu"))
    assert res.chosen is None and res.note == "no prefix_cache backend for cpu"
    assert [name for name, _ in res.rejected] == ["broken"]
    with pytest.raises(BackendUnavailableError, match="broken: plugin"):
        resolve_backend(reg, "prefix_cache", "auto", PrefixCacheRequirements("cpu"), strict=True)


# -- the report -----------------------------------------------------------------------------------
def test_resolution_describe_and_as_dict() -> None:
    res = Resolution(
        "attention",
        "auto",
        "torch_native",
        (("flashinfer", ("module 'flashinfer' not installed",)), ("triton", ("a", "b"))),
    )
    assert res.describe() == (
        "attention: requested 'auto' -> torch_native\n"
        "  rejected flashinfer: module 'flashinfer' not installed\n"
        "  rejected triton: a; b"
    )
    assert res.as_dict() == {
        "kind": "attention",
        "requested": "auto",
        "chosen": "torch_native",
        "rejected": {"flashinfer": ["module 'flashinfer' not installed"], "triton": ["a", "b"]},
        "note": "",
    }


def test_resolution_describe_shows_none_and_the_note() -> None:
    res = Resolution("graph", "none", None, note="graphs disabled")
    assert res.describe() == "graph: requested 'none' -> none (graphs disabled)"
    assert res.as_dict()["chosen"] is None and res.as_dict()["rejected"] == {}


def test_report_describes_one_resolution_after_another() -> None:
    report = ResolutionReport()
    assert report.describe() == ""
    report.resolutions += [
        Resolution("attention", "triton", "triton"),
        Resolution("graph", "auto", None, (("x", ("r",)),), note="no graph backend for cpu"),
    ]
    assert report.describe() == (
        "attention: requested 'triton' -> triton\n"
        "graph: requested 'auto' -> none (no graph backend for cpu)\n"
        "  rejected x: r"
    )
    assert ResolutionReport().resolutions is not report.resolutions  # no shared default
