"""Plugin loading, failure isolation, clashes, entry points, allow-list and selection."""

from __future__ import annotations

import pytest
import torch

from execrt.core.errors import BackendUnavailableError, PluginError
from execrt.core.interfaces import AttentionRequirements, GraphRequirements
from execrt.core.prefix_cache import PrefixCacheInit, PrefixCacheRequirements
from execrt.core.selection import resolve_backend
from execrt.plugins.host import PluginHost
from tests.plugins import fakes

CPU_FP32 = AttentionRequirements("cpu", torch.float32, 64, 8, 2)


def test_builtins_register_through_the_hook(plugin_host: PluginHost) -> None:
    names = {(s.kind, s.name) for s in plugin_host.registry.specs()}
    assert {
        ("attention", "torch_native"),
        ("attention", "triton"),
        ("attention", "flashinfer"),
        ("moe_dispatch", "allreduce"),
        ("prefix_cache", "radix"),
    } <= names
    assert all(s.plugin == "execrt.builtin" for s in plugin_host.registry.specs())
    assert plugin_host.failures == []


def test_registering_imports_no_kernel_library() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from execrt.plugins.host import PluginHost; PluginHost(autoload=False); "
        "print(any(m in sys.modules for m in ('triton', 'flashinfer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_raising_plugin_is_reported_skipped_and_rolled_back(plugin_host: PluginHost) -> None:
    assert not plugin_host.add_plugin(fakes.RaisingPlugin(), "raiser")
    assert plugin_host.add_plugin(fakes.GoodPlugin(), "good")
    assert [f.plugin for f in plugin_host.failures] == ["raiser"]
    assert "kernel library exploded" in plugin_host.failures[0].error
    assert "half_done" not in plugin_host.registry.names("attention")
    assert "fake_attn" in plugin_host.registry.names("attention")


def test_a_name_not_found_says_which_plugins_were_skipped_and_why(
    plugin_host: PluginHost,
) -> None:
    # The backend asked for is likely the skipped plugin's: the lookup says why it is missing.
    assert not plugin_host.add_plugin(fakes.RaisingPlugin(), "raiser")
    assert not plugin_host.add_plugin(fakes.UnmarkedPlugin(), "unmarked-plugin")
    with pytest.raises(BackendUnavailableError) as info:
        plugin_host.registry.get("attention", "half_done")
    message = str(info.value)
    assert "not registered (registered: " in message
    assert "plugin 'raiser' was skipped: " in message and "kernel library exploded" in message
    assert "plugin 'unmarked-plugin' was skipped: registers nothing" in message
    assert "@hookimpl" in message


def test_duplicate_names_are_an_error_naming_both_plugins(plugin_host: PluginHost) -> None:
    plugin_host.add_plugin(fakes.GoodPlugin(), "first-plugin")
    assert not plugin_host.add_plugin(fakes.ClashingPlugin(), "second-plugin")
    failure = plugin_host.failures[-1]
    assert failure.plugin == "second-plugin"
    assert "already registered by plugin 'first-plugin', which keeps it" in failure.error
    assert plugin_host.registry.get("attention", "fake_attn").plugin == "first-plugin"
    conflicts = plugin_host.registry.conflicts()
    assert conflicts[("attention", "fake_attn")] == ("first-plugin", "second-plugin")


def test_a_name_registered_twice_by_one_plugin_refuses_it_saying_so(
    plugin_host: PluginHost,
) -> None:
    assert not plugin_host.add_plugin(fakes.TwiceSelfPlugin(), "twice-plugin")
    failure = plugin_host.failures[-1]
    assert "attention backend 'twice' is registered twice by this plugin" in failure.error
    assert "keeps it" not in failure.error and "twice" not in plugin_host.registry.names(
        "attention"
    )


def test_a_plugin_cannot_take_a_builtin_name(plugin_host: PluginHost) -> None:
    assert not plugin_host.add_plugin(fakes.BuiltinClashPlugin(), "usurper")
    failure = plugin_host.failures[-1]
    assert failure.plugin == "usurper" and "'execrt.builtin', which keeps it" in failure.error
    names = plugin_host.registry.names("attention")
    assert "torch_native" in names, "the built-in lost its name to a plugin"
    assert "newcomer_extra" not in names, "the refused plugin must be rolled back whole"
    assert plugin_host.registry.get("attention", "torch_native").plugin == "execrt.builtin"
    assert resolve_backend(plugin_host.registry, "attention", "auto", CPU_FP32).chosen == (
        "torch_native"
    )


def test_a_plugin_that_swallows_its_refusal_is_still_rejected_whole(
    plugin_host: PluginHost,
) -> None:
    assert not plugin_host.add_plugin(fakes.SwallowingClashPlugin(), "swallower")
    assert [f.plugin for f in plugin_host.failures] == ["swallower"]
    assert plugin_host.failures[0].error == (
        "moe_dispatch backend 'allreduce' is already registered by plugin 'execrt.builtin', "
        "which keeps it"
    )
    names = plugin_host.registry.names("attention")
    assert "swallow_extra" not in names and "swallow_late" not in names
    assert plugin_host.registry.get("moe_dispatch", "allreduce").plugin == "execrt.builtin"
    assert plugin_host.add_plugin(fakes.GoodPlugin(), "good"), "a later plugin is unaffected"


def test_the_skip_report_names_the_plugin_once(plugin_host: PluginHost, caplog) -> None:
    with caplog.at_level("WARNING", logger="execrt.plugins.host"):
        plugin_host.add_plugin(fakes.BuiltinClashPlugin(), "evil")
    assert not plugin_host.failures[0].error.startswith("plugin ")
    assert caplog.messages == [
        "plugin 'evil' skipped: attention backend 'torch_native' is already registered by "
        "plugin 'execrt.builtin', which keeps it"
    ]


def test_broken_factories_are_unusable_and_auto_falls_through(
    plugin_host: PluginHost, runtime_context
) -> None:
    from execrt.core.memory import KVCache, ReqToTokenPool
    from execrt.core.selection import build_backend
    from execrt.inventory import backend_inventory

    plugin_host.add_plugin(fakes.BrokenFactoryPlugin(), "broken-kernels")
    rows = {r["name"]: r for r in backend_inventory(host=plugin_host)["backends"]}
    assert not rows["unimportable"]["usable"]
    assert "plugin 'broken-kernels': cannot load" in rows["unimportable"]["reasons"][0]
    resolution = resolve_backend(plugin_host.registry, "attention", "auto", CPU_FP32)
    assert resolution.chosen == "explodes"  # importable; building it is what fails
    pool, cache = ReqToTokenPool(2, 8, "cpu"), KVCache(8, 1, 2, 64, torch.float32, "cpu")

    def make_init(spec):  # type: ignore[no-untyped-def]
        from execrt.core.interfaces import AttentionBackendInit

        return AttentionBackendInit(
            capabilities=spec.capabilities,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=64,
            v_head_dim=64,
            num_layers=1,
            dtype=torch.float32,
            device=torch.device("cpu"),
            req_to_token_pool=pool,
            kv_cache=cache,
            max_batch_size=2,
            max_context_len=8,
            context=runtime_context,
        )

    backend, res = build_backend(plugin_host.registry, "attention", "auto", CPU_FP32, make_init)
    assert res.chosen == "torch_native" and type(backend).__name__ == "TorchNativeAttnBackend"
    rejected = dict(res.rejected)
    assert "plugin 'broken-kernels': cannot load" in rejected["unimportable"][0]
    assert "constructor raised RuntimeError('cuda context lost')" in rejected["explodes"][0]
    with pytest.raises(BackendUnavailableError, match="plugin 'broken-kernels': constructor"):
        build_backend(plugin_host.registry, "attention", "explodes", CPU_FP32, make_init)
    with pytest.raises(BackendUnavailableError, match="strict: preferred unimportable"):
        build_backend(plugin_host.registry, "attention", "auto", CPU_FP32, make_init, strict=True)


def test_capabilities_must_match_the_kind(plugin_host: PluginHost) -> None:
    assert not plugin_host.add_plugin(fakes.WrongCapabilitiesPlugin(), "confused")
    assert "must declare AttentionCapabilities" in plugin_host.failures[-1].error


def test_unknown_hooks_are_rejected(plugin_host: PluginHost) -> None:
    assert not plugin_host.add_plugin(fakes.UnknownHookPlugin(), "typo")
    assert "unknown hook" in plugin_host.failures[-1].error


def test_hook_impls_may_take_a_subset_of_arguments(plugin_host: PluginHost) -> None:
    assert plugin_host.add_plugin(fakes.NoArgsPlugin(), "noargs")
    assert fakes.NoArgsPlugin.called


def _fake_distribution(
    tmp_path, monkeypatch, entries: dict[str, str], name: str = "fake-dist"
) -> None:
    """Install a dist-info on sys.path so importlib.metadata sees real entry points."""
    dist = tmp_path / f"{name.replace('-', '_')}-1.2.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entries.items())
    (dist / "entry_points.txt").write_text(f"[execrt]\n{lines}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_entry_points_load_and_import_failures_are_reported(tmp_path, monkeypatch) -> None:
    (tmp_path / "broken_execrt_plugin.py").write_text("raise ImportError('needs libfoo.so')\n")
    _fake_distribution(
        tmp_path,
        monkeypatch,
        {
            "goodone": "tests.plugins.fakes:good",
            "broken": "broken_execrt_plugin",
        },
    )
    host = PluginHost(autoload=True, environ={})
    assert "fake_attn" in host.registry.names("attention")
    spec = host.registry.get("attention", "fake_attn")
    assert spec.plugin == "goodone" and spec.version == "1.2.3"
    failure = {f.plugin: f.error for f in host.failures}
    assert "needs libfoo.so" in failure["broken"]


def test_allow_list_and_autoload_switch(tmp_path, monkeypatch) -> None:
    _fake_distribution(tmp_path, monkeypatch, {"goodone": "tests.plugins.fakes:good"})
    assert "fake_attn" not in PluginHost(environ={"EXECRT_PLUGINS": "other"}).registry.names(
        "attention"
    )
    assert "fake_attn" in PluginHost(environ={"EXECRT_PLUGINS": "goodone,x"}).registry.names(
        "attention"
    )
    assert "fake_attn" not in PluginHost(
        environ={"EXECRT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    ).registry.names("attention")


def test_allow_list_reports_a_name_no_entry_point_has(tmp_path, monkeypatch) -> None:
    _fake_distribution(tmp_path, monkeypatch, {"goodone": "tests.plugins.fakes:good"})
    host = PluginHost(environ={"EXECRT_PLUGINS": "goodnoe,goodone,execrt.builtin"})
    assert "fake_attn" in host.registry.names("attention")
    [failure] = host.failures  # the built-in plugin is always loaded: naming it is no typo
    assert failure.plugin == "goodnoe"
    assert failure.error.startswith(
        "named in EXECRT_PLUGINS, but no installed entry point of group 'execrt' has that name "
        "(installed: "
    )
    assert "goodone" in failure.error.split("(installed: ", 1)[1]


def test_installed_test_distribution_is_discovered() -> None:
    """The tiny distribution in tests/entrypoint_plugin is pip-installed by CI (see README)."""
    import importlib.metadata

    names = {ep.name for ep in importlib.metadata.entry_points(group="execrt")}
    assert "execrt-testplugin" in names, "pip install -e tests/entrypoint_plugin"
    host = PluginHost(environ={"EXECRT_PLUGINS": "execrt-testplugin"})
    spec = host.registry.get("attention", "testplugin_native")
    assert spec.plugin == "execrt-testplugin" and spec.version == "0.1.0"
    assert host.failures == []


def test_auto_picks_highest_priority_usable_and_reports_rejections(plugin_host: PluginHost) -> None:
    plugin_host.add_plugin(fakes.GpuOnlyPlugin(), "gpu")
    req = AttentionRequirements("cuda", torch.bfloat16, 128, 32, 8)
    res = resolve_backend(plugin_host.registry, "attention", "auto", req)
    rejected = dict(res.rejected)
    assert "pip install gpu-only" in "; ".join(rejected["gpu_only"])
    assert res.chosen in {"flashinfer", "triton", "torch_native"}
    cpu = resolve_backend(plugin_host.registry, "attention", "auto", CPU_FP32)
    assert cpu.chosen == "torch_native"  # gpu_only does not claim cpu, so it is not even tried
    assert "gpu_only" not in dict(cpu.rejected)


def test_strict_turns_fallback_into_error(plugin_host: PluginHost) -> None:
    plugin_host.add_plugin(fakes.GpuOnlyPlugin(), "gpu")
    req = AttentionRequirements("cuda", torch.bfloat16, 128, 32, 8)
    with pytest.raises(BackendUnavailableError, match="strict: preferred gpu_only unusable"):
        resolve_backend(plugin_host.registry, "attention", "auto", req, strict=True)


def test_explicit_unusable_backend_fails_with_reason_and_hint(plugin_host: PluginHost) -> None:
    import importlib.util

    # Without flashinfer the refusal carries the install hint; with it, the CPU device reason.
    hint = r"pip install execrt\[flashinfer\]"
    if importlib.util.find_spec("flashinfer") is not None:
        hint = "device cpu unsupported"
    with pytest.raises(BackendUnavailableError, match=rf"flashinfer.*{hint}"):
        resolve_backend(plugin_host.registry, "attention", "flashinfer", CPU_FP32)
    with pytest.raises(BackendUnavailableError, match="head_dim 80 unsupported"):
        resolve_backend(
            plugin_host.registry,
            "attention",
            "triton",
            AttentionRequirements("cpu", torch.float32, 80, 8, 2),
        )
    with pytest.raises(BackendUnavailableError, match="not registered.*torch_native"):
        resolve_backend(plugin_host.registry, "attention", "nope", CPU_FP32)


def test_graph_none_and_auto_without_candidates(plugin_host: PluginHost) -> None:
    none = resolve_backend(plugin_host.registry, "graph", "none", GraphRequirements("cpu"))
    assert none.chosen is None and none.note == "graphs disabled"
    auto = resolve_backend(plugin_host.registry, "graph", "auto", GraphRequirements("cpu"))
    assert auto.chosen is None


def test_the_builtin_prefix_cache_is_radix_and_none_turns_it_off(plugin_host: PluginHost) -> None:
    from execrt.backends.prefix_cache.radix import RadixCache
    from execrt.core.selection import build_backend

    reg = plugin_host.registry
    for device in ("cpu", "cuda"):
        auto = resolve_backend(reg, "prefix_cache", "auto", PrefixCacheRequirements(device))
        assert auto.chosen == "radix", auto.describe()
    none = resolve_backend(reg, "prefix_cache", "none", PrefixCacheRequirements("cpu"))
    assert none.chosen is None and none.note == "prefix cache disabled"

    def init(spec):  # type: ignore[no-untyped-def]
        return PrefixCacheInit(spec.capabilities, torch.device("cpu"), lambda slots: None)

    cache, res = build_backend(reg, "prefix_cache", "radix", PrefixCacheRequirements("cpu"), init)
    assert isinstance(cache, RadixCache) and res.chosen == "radix"


def test_registration_validates_names_and_factories(plugin_host: PluginHost) -> None:
    from execrt.core.interfaces import AttentionCapabilities

    reg = plugin_host.registry
    with pytest.raises(PluginError, match="invalid backend name 'auto'"):
        reg.register("attention", "auto", fakes.NATIVE, AttentionCapabilities())
    with pytest.raises(PluginError, match="must look like 'module:attr'"):
        reg.register("attention", "x", "no_colon", AttentionCapabilities())
    with pytest.raises(PluginError, match="unknown backend kind 'sampler'"):
        reg.register("sampler", "x", fakes.NATIVE, AttentionCapabilities())
    reg.register(
        "attention",
        "lazy_missing",
        "no_such_module:Cls",
        AttentionCapabilities(),
        install_hint="pip install lazy",
    )
    with pytest.raises(
        BackendUnavailableError, match="cannot load no_such_module:Cls.*pip install lazy"
    ):
        reg.get("attention", "lazy_missing").load_factory()


@pytest.mark.parametrize(
    ("plugin", "error"),
    [
        (
            fakes.IntFactoryPlugin(),
            "attention backend 'int_factory': factory must be 'module:attr' or a callable, got 42",
        ),
        (
            fakes.WordPriorityPlugin(),
            "attention backend 'word_priority': priority must be an int, got 'high'",
        ),
        (
            fakes.StringHeadDimsPlugin(),
            "attention backend 'string_dims': capabilities.devices must be frozenset[str], got "
            "'cuda'; capabilities.head_dims must be frozenset[int] | None, got {'64'}",
        ),
    ],
)
def test_a_badly_typed_registration_refuses_the_plugin_in_one_line(
    plugin_host: PluginHost, plugin: object, error: str
) -> None:
    assert not plugin_host.add_plugin(plugin, "sloppy")
    [failure] = plugin_host.failures
    assert (failure.plugin, failure.error) == ("sloppy", error)
    assert all(s.plugin == "execrt.builtin" for s in plugin_host.registry.specs())


def test_bad_plugins_installed_leave_backends_and_generate_working(
    tmp_path, monkeypatch, capsys, caplog
) -> None:
    """Installed through entry points: `execrt backends` lists the refusals and exits 0;
    `generate` falls through a raising check and factories that build no backend."""
    import execrt.plugins.host as host_module
    from execrt.cli import main

    names = ("int_factory", "word_priority", "string_dims", "raising_check", "not_a_backend")
    entries = {n.replace("_", "-"): f"tests.plugins.fakes:{n}" for n in names}
    _fake_distribution(tmp_path, monkeypatch, entries, name="sloppy-plugins")
    monkeypatch.delenv("EXECRT_PLUGINS", raising=False)
    monkeypatch.delenv("EXECRT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setattr(host_module, "_HOST", None)  # a fresh host sees the new entry points

    with caplog.at_level("WARNING", logger="execrt.plugins.host"):
        assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in ("int-factory", "word-priority", "string-dims"):
        [line] = [ln for ln in out.splitlines() if ln.startswith(f"plugin {name!r} skipped: ")]
    assert "skipped" not in caplog.text  # the listing says it: no warning says it twice
    rows = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith("attention ")}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # what `backends` probes here
    assert (
        f"no: {device}: plugin 'raising-check': check raised RuntimeError('nvml not found')"
        in (rows["raising_check"])
    )
    assert "json.decoder.JSONDecoder does not implement AttentionBackend" in rows["wrong_class"]

    argv = ["generate", "1,2,3", "--token-ids", "--max-new-tokens", "2", "--device", "cpu", "-v"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "attention: requested 'auto' -> torch_native" in err
    assert "rejected raising_check: plugin 'raising-check': check raised" in err
    assert (
        "rejected not_a_backend: plugin 'not-a-backend': factory built dict, which does not "
        "implement AttentionBackend" in err
    )
    assert "rejected wrong_class: plugin 'not-a-backend': json.decoder.JSONDecoder" in err


def test_a_backend_class_missing_an_abstract_method_is_unusable_naming_it() -> None:
    from execrt.core.interfaces import AttentionBackend
    from execrt.core.registration import interface_problem

    class PlanOnly(AttentionBackend):  # attend left out
        def plan(self, fb):  # type: ignore[no-untyped-def]
            return None

    problem = interface_problem("attention", PlanOnly)
    assert problem is not None and "does not implement AttentionBackend's attend" in problem
    from execrt.backends.attention.torch_native import TorchNativeAttnBackend

    assert interface_problem("attention", TorchNativeAttnBackend) is None
