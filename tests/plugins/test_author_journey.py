"""A plugin author's mistakes, as the docs promise to report them: named before anything runs."""

from __future__ import annotations

from execrt.core.batch import ForwardBatch
from execrt.core.interfaces import AttentionBackend, AttentionCapabilities
from execrt.core.selection import resolve_backend
from execrt.inventory import usability
from execrt.plugins.host import PluginHost
from execrt.testing.report import format_table
from tests.plugins.test_plugins import CPU_FP32

GRAPH_CLAIM = AttentionCapabilities(devices=frozenset({"cpu"}), graph=True)


class EagerOnly(AttentionBackend):
    """Plans and attends, but claims graph capture without the graph methods."""

    def plan(self, fb: ForwardBatch) -> None:
        return None

    def attend(self, q, layer, step, kv=None):  # type: ignore[no-untyped-def]
        return q


def _register_graph_claim(host: PluginHost) -> None:
    host.registry.register(
        "attention", "graph_liar", f"{__name__}:EagerOnly", GRAPH_CLAIM, priority=1000
    )


def test_backends_lists_a_graph_claim_without_graph_methods_as_unusable(
    plugin_host: PluginHost,
) -> None:
    # `execrt backends` said "yes" here, while every build of it was refused.
    _register_graph_claim(plugin_host)
    usable, reasons = usability(plugin_host.registry.get("attention", "graph_liar"))
    assert not usable
    assert any(
        "EagerOnly declares capabilities.graph = True" in r
        and "init_graph_state and plan_graph" in r
        for r in reasons
    ), reasons


def test_auto_skips_a_graph_claim_without_graph_methods_naming_why(
    plugin_host: PluginHost,
) -> None:
    _register_graph_claim(plugin_host)
    # "auto" did not build it, so it chose the class the engine then refused to build.
    resolution = resolve_backend(plugin_host.registry, "attention", "auto", CPU_FP32)
    assert resolution.chosen != "graph_liar"
    rejected = dict(resolution.rejected)
    assert "plan_graph" in " ".join(rejected["graph_liar"])


def test_conformance_table_keeps_the_cause_of_a_failure() -> None:
    # The table cut every reason at 100 characters: a failure lost its cause (the import
    # error, or where the worst error sits), which sits at the end of the line.
    cause = "ModuleNotFoundError(\"No module named 'my_pkg.nomodule'\")"
    failed = (
        "execrt.core.errors.BackendUnavailableError: attention backend 'mine' unavailable: "
        f"plugin 'my-pkg': cannot load my_pkg.nomodule:X: {cause}"
    )
    skipped = "capability head_dims does not include 80 " + "x" * 200
    report = {
        "kind": "attention",
        "name": "mine",
        "summary": "0 passed, 1 failed, 1 skipped, 0 xfailed on cpu",
        "results": [
            {
                "id": "t[a]",
                "outcome": "failed",
                "max_error": None,
                "tolerance": None,
                "reason": failed + "\nsecond line",
            },
            {
                "id": "t[b]",
                "outcome": "skipped",
                "max_error": None,
                "tolerance": None,
                "reason": skipped,
            },
        ],
    }
    lines = format_table(report).splitlines()
    assert lines[1].endswith(cause)
    assert "second line" not in lines[1]
    assert len(lines[2]) < len(skipped)  # skip reasons stay short: they repeat by the dozen


def test_a_graph_capable_class_is_still_usable(plugin_host: PluginHost) -> None:
    class Graphs(EagerOnly):
        def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
            return None

        def plan_graph(self, fb: ForwardBatch) -> None:
            return None

    plugin_host.registry.register("attention", "graph_ok", Graphs, GRAPH_CLAIM)
    assert usability(plugin_host.registry.get("attention", "graph_ok")) == (True, [])
