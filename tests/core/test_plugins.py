"""BackendSpec (refusals, lazy factory, create) and BackendRegistry validation and bookkeeping.

Plugin loading through pluggy and entry points is tested in tests/plugins/test_plugins.py.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from execrt.core.errors import BackendUnavailableError, PluginError
from execrt.core.interfaces import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionRequirements,
    GraphCapabilities,
    MoEDispatcherCapabilities,
)
from execrt.core.plugins import BackendRegistry, BackendSpec
from execrt.core.prefix_cache import PrefixCacheCapabilities, PrefixCacheRequirements

CPU_REQ = AttentionRequirements("cpu", torch.float32, 64, 8, 2)
MISSING_MODULE = "execrt_no_such_module_for_tests"


class Built(AttentionBackend):
    """An attention backend that records its init record and does nothing else."""

    def __init__(self, init: Any) -> None:
        self.init = init


# Only the type is under test here, not the contract (whose abstract methods may change).
Built.__abstractmethods__ = frozenset()


def spec(**overrides: Any) -> BackendSpec:
    fields: dict[str, Any] = dict(
        kind="attention",
        name="fake",
        factory=lambda init: ("built", init),
        capabilities=AttentionCapabilities(),
        plugin="fake-plugin",
        version="1.0",
    )
    return BackendSpec(**(fields | overrides))


# -- BackendSpec.refusals / unusable_here ---------------------------------------------------------
def test_missing_required_modules_are_refusals_with_the_install_hint() -> None:
    s = spec(requires=("json", MISSING_MODULE), install_hint="pip install execrt[fake]")
    assert s.refusals(CPU_REQ) == [
        f"module '{MISSING_MODULE}' not installed (pip install execrt[fake])"
    ]
    assert spec(requires=(MISSING_MODULE,)).refusals(CPU_REQ) == [
        f"module '{MISSING_MODULE}' not installed"
    ]


def test_a_submodule_of_a_missing_package_is_just_missing() -> None:
    # find_spec raises ModuleNotFoundError for the parent: reported, not propagated.
    s = spec(requires=(f"{MISSING_MODULE}.ops",))
    assert s.refusals(CPU_REQ) == [f"module '{MISSING_MODULE}.ops' not installed"]


def test_module_and_capability_refusals_come_together() -> None:
    s = spec(
        requires=(MISSING_MODULE,), capabilities=AttentionCapabilities(head_dims=frozenset({128}))
    )
    assert s.refusals(CPU_REQ) == [
        f"module '{MISSING_MODULE}' not installed",
        "head_dim 64 unsupported (supported: 128)",
    ]


def test_check_runs_only_when_nothing_else_refused() -> None:
    seen: list[Any] = []

    def check(req: Any) -> list[str]:
        seen.append(req)
        return ["needs compute capability >= 9.0"]

    refused = spec(capabilities=AttentionCapabilities(devices=frozenset({"cuda"})), check=check)
    assert refused.refusals(CPU_REQ) == ["device cpu unsupported (supported: cuda)"]
    assert seen == []  # an environment probe is skipped when the answer is already no
    missing = spec(requires=(MISSING_MODULE,), check=check)
    assert len(missing.refusals(CPU_REQ)) == 1 and seen == []
    assert spec(check=check).refusals(CPU_REQ) == ["needs compute capability >= 9.0"]
    assert seen == [CPU_REQ]
    assert spec(check=lambda req: []).refusals(CPU_REQ) == []


def test_unusable_here_ignores_requirements() -> None:
    caps = AttentionCapabilities(devices=frozenset({"cuda"}))
    assert spec(capabilities=caps).unusable_here() == []
    assert spec(requires=("json",)).unusable_here() == []
    assert spec(requires=(MISSING_MODULE,), install_hint="pip install x").unusable_here() == [
        f"module '{MISSING_MODULE}' not installed (pip install x)"
    ]


def test_claims_for_auto_defaults_to_the_capability_devices() -> None:
    s = spec(capabilities=AttentionCapabilities(devices=frozenset({"cpu", "cuda"})))
    assert s.claims_for_auto("cpu") and s.claims_for_auto("cuda") and not s.claims_for_auto("xpu")
    only_cuda = spec(auto_devices=frozenset({"cuda"}))
    assert only_cuda.claims_for_auto("cuda") and not only_cuda.claims_for_auto("cpu")
    assert not spec(auto_devices=frozenset()).claims_for_auto("cpu")  # never picked by auto


# -- factories ------------------------------------------------------------------------------------
def test_a_callable_factory_is_used_as_is() -> None:
    def factory(init: Any) -> Built:
        return Built(f"built from {init}")

    s = spec(factory=factory)
    assert s.load_factory() is factory and s.factory_problems() == []
    assert s.create("init").init == "built from init"


def test_a_string_factory_is_imported_on_first_use() -> None:
    s = spec(factory=f"{__name__}:Built")
    assert s.load_factory() is Built
    built = s.create("init")
    assert type(built) is Built and built.init == "init"


def test_a_factory_that_builds_no_backend_is_refused_naming_what_it_built() -> None:
    s = spec(factory="json:dumps")  # a function: what it builds is known only once it ran
    assert s.load_factory() is json.dumps and s.factory_problems() == []
    with pytest.raises(BackendUnavailableError) as info:
        s.create([1, 2])
    assert info.value.reasons == [
        "plugin 'fake-plugin': factory built str, which does not implement AttentionBackend"
    ]


def test_a_factory_class_of_another_interface_is_refused_before_building() -> None:
    s = spec(factory="json:JSONDecoder")
    [reason] = s.factory_problems()
    assert reason == (
        "plugin 'fake-plugin': json.decoder.JSONDecoder does not implement AttentionBackend "
        "(subclass it)"
    )
    with pytest.raises(BackendUnavailableError, match="does not implement AttentionBackend"):
        s.create(None)
    graph_class = spec(kind="graph", capabilities=GraphCapabilities(), factory=Built)
    assert "Built does not implement GraphBackend" in graph_class.factory_problems()[0]


class GraphClaimWithoutMethods(Built):
    capabilities = AttentionCapabilities(graph=True)


class ZeroFillBackend(Built):
    capabilities = AttentionCapabilities()
    graph_seq_len_fill_value = 0


@pytest.mark.parametrize(
    ("factory", "reason"),
    [
        (
            GraphClaimWithoutMethods,
            "GraphClaimWithoutMethods declares capabilities.graph = True but does not implement "
            "init_graph_state and plan_graph (implement them, or declare graph = False)",
        ),
        (
            ZeroFillBackend,
            "ZeroFillBackend.graph_seq_len_fill_value must be an int >= 1 (the context length "
            "of a padded graph row, which reads slot 0), got 0",
        ),
    ],
)
def test_a_backend_breaking_the_graph_contract_is_refused_when_built(
    factory: Any, reason: str
) -> None:
    # Both surfaced mid-run as tracebacks naming neither the backend nor its plugin.
    with pytest.raises(BackendUnavailableError) as info:
        spec(factory=factory).create("init")
    assert info.value.reasons == [f"plugin 'fake-plugin': {reason}"]
    assert str(info.value).startswith("attention backend 'fake' unavailable: plugin 'fake-plugin'")


def test_a_factory_string_naming_no_callable_is_refused() -> None:
    [reason] = spec(factory="json:__name__").factory_problems()
    assert reason == "plugin 'fake-plugin': factory json:__name__ is 'json', not a callable"


@pytest.mark.parametrize(
    ("factory", "error"),
    [(f"{MISSING_MODULE}:Cls", "ModuleNotFoundError("), ("json:no_such_attr", "AttributeError(")],
)
def test_an_unloadable_factory_names_plugin_factory_error_and_hint(
    factory: str, error: str
) -> None:
    s = spec(factory=factory, install_hint="pip install fake")
    with pytest.raises(BackendUnavailableError) as info:
        s.load_factory()
    assert (info.value.kind, info.value.name) == ("attention", "fake")
    [reason] = info.value.reasons
    assert reason.startswith(f"plugin 'fake-plugin': cannot load {factory}: {error}")
    assert reason.endswith(" (pip install fake)")
    assert s.factory_problems() == [reason]


def test_a_factory_module_that_fails_at_import_is_reported_not_raised(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "execrt_test_bad_kernels.py").write_text("raise OSError('libcuda.so.1 missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = spec(factory="execrt_test_bad_kernels:Backend")
    [reason] = s.factory_problems()
    assert "cannot load execrt_test_bad_kernels:Backend: OSError('libcuda.so.1 missing')" in reason
    with pytest.raises(BackendUnavailableError, match="libcuda.so.1 missing"):
        s.create(None)


def test_create_wraps_a_constructor_error_in_one_line_naming_the_plugin() -> None:
    cause = KeyError("num_heads")

    def factory(init: Any) -> Any:
        raise cause

    with pytest.raises(BackendUnavailableError) as info:
        spec(factory=factory).create("init")
    assert str(info.value) == (
        "attention backend 'fake' unavailable: plugin 'fake-plugin': constructor raised "
        "KeyError('num_heads')"
    )
    assert info.value.__cause__ is cause


def test_create_passes_a_backends_own_refusal_through_unchanged() -> None:
    refusal = BackendUnavailableError("attention", "fake", ["needs sm90"])

    def factory(init: Any) -> Any:
        raise refusal

    with pytest.raises(BackendUnavailableError) as info:
        spec(factory=factory).create("init")
    assert info.value is refusal


def test_spec_as_dict() -> None:
    s = spec(
        kind="graph",
        name="reexec",
        capabilities=GraphCapabilities(devices=frozenset({"cpu"}), real_capture=False),
        requires=("json",),
        install_hint="pip install x",
        priority=3,
        description="re-runs the function",
    )
    assert s.as_dict() == {
        "kind": "graph",
        "name": "reexec",
        "plugin": "fake-plugin",
        "version": "1.0",
        "priority": 3,
        "requires": ["json"],
        "install_hint": "pip install x",
        "description": "re-runs the function",
        "capabilities": {
            "devices": ["cpu"],
            "real_capture": False,
            "shared_memory_pool": True,
            "graph_resources": False,
        },
    }


# -- BackendRegistry.register validation ----------------------------------------------------------
def factory(init: Any) -> Any:
    return init


def test_register_returns_a_spec_with_every_option() -> None:
    reg = BackendRegistry()
    check = lambda req: []  # noqa: E731
    s = reg.register(
        "moe_dispatch",
        "a2a",
        factory,
        MoEDispatcherCapabilities(),
        requires=["json"],  # type: ignore[arg-type]  # a list is stored as a tuple
        install_hint="pip install y",
        priority=7,
        auto_devices=frozenset({"cuda"}),
        description="all to all",
        check=check,
    )
    assert reg.get("moe_dispatch", "a2a") is s
    assert (s.kind, s.name, s.factory, s.plugin, s.version) == (
        "moe_dispatch",
        "a2a",
        factory,
        "<direct>",
        "",
    )
    assert s.requires == ("json",) and s.priority == 7 and s.check is check
    assert s.auto_devices == {"cuda"} and s.install_hint == "pip install y"


def test_register_refuses_an_unknown_kind_listing_the_kinds() -> None:
    with pytest.raises(PluginError) as info:
        BackendRegistry().register("sampler", "x", factory, AttentionCapabilities())
    assert str(info.value) == (
        "plugin '<direct>': unknown backend kind 'sampler' "
        "(kinds: attention, moe_dispatch, graph, prefix_cache)"
    )


def test_register_refuses_a_capability_record_of_another_kind() -> None:
    reg = BackendRegistry()
    with reg.attributed_to("confused", "1"), pytest.raises(PluginError) as info:
        reg.register("graph", "g", factory, AttentionCapabilities())
    assert str(info.value) == (
        "plugin 'confused': graph backend 'g' must declare GraphCapabilities, "
        "got AttentionCapabilities"
    )
    assert info.value.plugin == "confused"


@pytest.mark.parametrize("name", ["", "auto", "none", "has space", "a/b", "mod:attr", "x!"])
def test_register_refuses_invalid_names_saying_what_is_accepted(name: str) -> None:
    with pytest.raises(PluginError) as info:
        BackendRegistry().register("attention", name, factory, AttentionCapabilities())
    assert str(info.value) == (
        f"plugin '<direct>': invalid backend name {name!r} "
        "(use letters, digits, '_', '-' and '.'; 'auto' and 'none' are reserved)"
    )


def test_a_prefix_cache_registers_with_its_capability_record_and_never_as_none() -> None:
    reg = BackendRegistry()
    spec = reg.register("prefix_cache", "lfu", factory, PrefixCacheCapabilities(reuses=True))
    assert reg.names("prefix_cache") == ["lfu"] and spec.kind == "prefix_cache"
    assert spec.refusals(PrefixCacheRequirements("cpu", page_size=16)) == [
        "page size 16 unsupported (supported: 1)"
    ]
    with pytest.raises(PluginError, match="must declare PrefixCacheCapabilities"):
        reg.register("prefix_cache", "x", factory, GraphCapabilities())
    with pytest.raises(PluginError, match="'none' are reserved"):
        reg.register("prefix_cache", "none", factory, PrefixCacheCapabilities())


@pytest.mark.parametrize("name", ["triton", "flash-infer", "v1.2_beta", "X9"])
def test_register_accepts_names_of_letters_digits_dash_dot_underscore(name: str) -> None:
    reg = BackendRegistry()
    reg.register("attention", name, factory, AttentionCapabilities())
    assert reg.names("attention") == [name]


def test_register_checks_the_factory_string_shape_but_imports_nothing() -> None:
    reg = BackendRegistry()
    with pytest.raises(PluginError, match=r"factory 'pkg\.module' must look like 'module:attr'"):
        reg.register("attention", "x", "pkg.module", AttentionCapabilities())
    s = reg.register("attention", "lazy", f"{MISSING_MODULE}:Cls", AttentionCapabilities())
    assert s.factory == f"{MISSING_MODULE}:Cls"  # registered; it fails only when loaded


# -- BackendRegistry bookkeeping ------------------------------------------------------------------
def test_attributed_to_applies_inside_the_block_only_and_nests() -> None:
    reg = BackendRegistry()
    caps = AttentionCapabilities()
    with reg.attributed_to("outer", "1.0"):
        reg.register("attention", "a", factory, caps)
        with reg.attributed_to("inner", "2.0"):
            reg.register("attention", "b", factory, caps)
        reg.register("attention", "c", factory, caps)
    with pytest.raises(RuntimeError), reg.attributed_to("failing", "3.0"):
        raise RuntimeError("hook failed")
    reg.register("attention", "d", factory, caps)
    got = {s.name: (s.plugin, s.version) for s in reg.specs()}
    assert got == {
        "a": ("outer", "1.0"),
        "b": ("inner", "2.0"),
        "c": ("outer", "1.0"),
        "d": ("<direct>", ""),  # restored after the exception too
    }


def test_a_name_is_per_kind() -> None:
    reg = BackendRegistry()
    reg.register("attention", "shared", factory, AttentionCapabilities())
    reg.register("graph", "shared", factory, GraphCapabilities())
    assert reg.names("attention") == ["shared"] and reg.names("graph") == ["shared"]
    assert reg.conflicts() == {}


def test_the_first_registrant_keeps_a_name_and_the_first_clash_is_recorded() -> None:
    reg = BackendRegistry()
    caps = AttentionCapabilities()
    with reg.attributed_to("first", "1"):
        reg.register("attention", "same", factory, caps)
    for plugin in ("second", "third"):
        with reg.attributed_to(plugin, "1"), pytest.raises(PluginError) as info:
            reg.register("attention", "same", factory, caps)
        assert str(info.value) == (
            f"plugin '{plugin}': attention backend 'same' is already registered by plugin "
            "'first', which keeps it"
        )
    assert reg.get("attention", "same").plugin == "first"
    assert reg.conflicts() == {("attention", "same"): ("first", "second")}
    reg.conflicts().clear()  # a copy: the registry's record is not affected
    assert reg.conflicts() != {}


def test_remove_plugin_forgets_only_that_plugins_backends() -> None:
    reg = BackendRegistry()
    with reg.attributed_to("half-done", "1"):
        reg.register("attention", "x", factory, AttentionCapabilities())
        reg.register("graph", "g", factory, GraphCapabilities())
    with reg.attributed_to("other", "1"):
        reg.register("attention", "y", factory, AttentionCapabilities())
    reg.remove_plugin("half-done")
    assert [s.name for s in reg.specs()] == ["y"]
    reg.remove_plugin("never-registered")  # nothing to do, no error
    with reg.attributed_to("retry", "1"):  # the name is free again
        assert reg.register("attention", "x", factory, AttentionCapabilities()).plugin == "retry"


def test_the_first_refusal_per_plugin_is_recorded_until_the_plugin_is_removed() -> None:
    reg = BackendRegistry()
    with reg.attributed_to("first", "1"):
        reg.register("attention", "same", factory, AttentionCapabilities())
    assert reg.refusal("first") is None
    with reg.attributed_to("second", "1"):
        for name in ("same", "auto"):  # a clash, then an invalid name: the clash is kept
            with pytest.raises(PluginError):
                reg.register("attention", name, factory, AttentionCapabilities())
    refusal = reg.refusal("second")
    assert refusal is not None and "already registered by plugin 'first'" in str(refusal)
    reg.remove_plugin("second")
    assert reg.refusal("second") is None


def test_specs_order_by_kind_then_priority_then_name() -> None:
    reg = BackendRegistry()
    reg.register("graph", "g", factory, GraphCapabilities(), priority=100)
    reg.register("moe_dispatch", "m", factory, MoEDispatcherCapabilities())
    for name, priority in (("b", 1), ("c", 5), ("a", 1), ("d", -3)):
        reg.register("attention", name, factory, AttentionCapabilities(), priority=priority)
    assert [(s.kind, s.name) for s in reg.specs()] == [
        ("attention", "c"),
        ("attention", "a"),
        ("attention", "b"),
        ("attention", "d"),
        ("moe_dispatch", "m"),
        ("graph", "g"),
    ]
    assert [s.name for s in reg.specs("attention")] == ["c", "a", "b", "d"]
    assert reg.names("attention") == ["a", "b", "c", "d"]  # names: alphabetical
    assert reg.specs("graph")[0].name == "g" and reg.names("nothing") == []


def test_get_of_an_unknown_name_lists_the_kinds_names() -> None:
    reg = BackendRegistry()
    with pytest.raises(BackendUnavailableError) as info:
        reg.get("graph", "cuda")
    assert str(info.value) == "graph backend 'cuda' unavailable: not registered (registered: none)"
    reg.register("graph", "reexec", factory, GraphCapabilities())
    reg.register("graph", "full", factory, GraphCapabilities())
    with pytest.raises(BackendUnavailableError, match=r"\(registered: full, reexec\)$"):
        reg.get("graph", "cuda")


# -- BackendRegistry.register: every field typed, element types too -------------------------------
def _caps(**fields: Any) -> AttentionCapabilities:
    return AttentionCapabilities(**fields)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"factory": 42}, "factory must be 'module:attr' or a callable, got 42"),
        ({"priority": "high"}, "priority must be an int, got 'high'"),
        ({"priority": True}, "priority must be an int, got True"),
        ({"check": "gpu"}, "check must be a callable or None, got 'gpu'"),
        ({"requires": "triton"}, "requires must be a tuple of module names (str), got 'triton'"),
        ({"requires": ("triton", 3)}, "requires must be a tuple of module names (str), got "),
        ({"auto_devices": {"cuda"}}, "auto_devices must be a frozenset of str or None, got "),
        ({"auto_devices": frozenset({0})}, "auto_devices must be a frozenset of str or None"),
        ({"install_hint": None}, "install_hint must be a str, got None"),
        ({"description": 7}, "description must be a str, got 7"),
        (
            {"capabilities": _caps(head_dims={"64"})},
            "capabilities.head_dims must be frozenset[int] | None, got {'64'}",
        ),
        (
            {"capabilities": _caps(head_dims=frozenset({"64"}))},
            "capabilities.head_dims must be frozenset[int] | None, got frozenset({'64'})",
        ),
        (
            {"capabilities": _caps(devices="cuda")},
            "capabilities.devices must be frozenset[str], got 'cuda'",
        ),
        (
            {"capabilities": _caps(dtypes=frozenset({"float16"}))},
            "capabilities.dtypes must be frozenset[torch.dtype], got frozenset({'float16'})",
        ),
        (
            {"capabilities": _caps(gqa_ratios=frozenset())},
            "capabilities.gqa_ratios is empty (use None for 'any')",
        ),
        ({"capabilities": _caps(graph="yes")}, "capabilities.graph must be bool, got 'yes'"),
        # the right types, values no backend can mean (a typo made a backend unusable anywhere)
        (
            {"capabilities": _caps(devices=frozenset({"gpu", "cpu"}))},
            "capabilities.devices holds 'gpu' (accepted: device types such as 'cpu' and 'cuda')",
        ),
        (
            {"capabilities": _caps(kv_dtypes=frozenset({torch.float32, torch.int8}))},
            "capabilities.kv_dtypes holds torch.int8 (accepted: floating-point dtypes)",
        ),
        (
            {"capabilities": _caps(gqa_ratios=frozenset({0, 2}))},
            "capabilities.gqa_ratios holds 0 (accepted: integers >= 1)",
        ),
    ],
)
def test_register_refuses_a_badly_typed_field_naming_plugin_field_and_value(
    kwargs: dict[str, Any], error: str
) -> None:
    reg = BackendRegistry()
    args: dict[str, Any] = {"factory": factory, "capabilities": AttentionCapabilities()}
    args |= kwargs
    with reg.attributed_to("sloppy", "1"), pytest.raises(PluginError) as info:
        reg.register("attention", "x", **args)
    message = str(info.value)
    assert message.startswith(f"plugin 'sloppy': attention backend 'x': {error}"), message
    assert "\n" not in message and info.value.plugin == "sloppy"
    assert reg.names("attention") == [] and reg.refusal("sloppy") is info.value


def test_register_refuses_badly_typed_moe_capabilities() -> None:
    reg = BackendRegistry()
    bad = MoEDispatcherCapabilities(output_format="standard", max_top_k="8")  # type: ignore[arg-type]
    with pytest.raises(PluginError) as info:
        reg.register("moe_dispatch", "m", factory, bad)
    assert str(info.value) == (
        "plugin '<direct>': moe_dispatch backend 'm': capabilities.output_format must be "
        "DispatchFormat, got 'standard'; capabilities.max_top_k must be int | None, got '8'"
    )


@pytest.mark.parametrize("name", [None, 5, ("a",)])
def test_register_refuses_a_name_that_is_not_a_string(name: Any) -> None:
    with pytest.raises(PluginError, match="invalid backend name"):
        BackendRegistry().register("attention", name, factory, AttentionCapabilities())
    with pytest.raises(PluginError, match="unknown backend kind"):
        BackendRegistry().register(["attention"], "x", factory, AttentionCapabilities())  # type: ignore[arg-type]


def test_register_accepts_every_builtin_capability_record() -> None:
    from execrt.plugins import builtin

    reg = BackendRegistry()
    builtin.execrt_register_backends(registry=reg)
    assert len(reg.specs()) >= 9


def test_a_check_that_raises_is_a_refusal_not_a_crash() -> None:
    def check(req: Any) -> list[str]:
        raise RuntimeError("nvml not found")

    assert spec(check=check).refusals(CPU_REQ) == [
        "plugin 'fake-plugin': check raised RuntimeError('nvml not found')"
    ]


@pytest.mark.parametrize("answer", ["needs sm90", None, [1], "", {"a": 1}])
def test_a_check_that_answers_no_list_of_str_is_one_refusal(answer: Any) -> None:
    assert spec(check=lambda req: answer).refusals(CPU_REQ) == [
        f"plugin 'fake-plugin': check returned {answer!r}, not a list of str"
    ]
    assert spec(check=lambda req: ("a", "b")).refusals(CPU_REQ) == ["a", "b"]
