"""run_conformance: the generated suite run, the table, the JSON report and last_conformance."""

from __future__ import annotations

import importlib.metadata
import io
import json
import re
from pathlib import Path

import pytest

from execrt.core.errors import BackendUnavailableError, ConfigError
from execrt.inventory import backend_inventory, conformance_report_path, last_conformance
from execrt.plugins.host import PluginHost
from execrt.testing.report import run_conformance, run_suite_source

KEYS = {"kind", "name", "plugin", "version", "date", "device", "passed", "failed", "skipped"}
KEYS |= {"xfailed", "summary", "results"}


def test_passing_run_writes_both_reports_and_backends_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    code = run_conformance(
        "attention", "torch_native", str(out), extra_pytest_args=("-k", "single")
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report) == KEYS
    assert (report["kind"], report["name"], report["plugin"]) == (
        "attention",
        "torch_native",
        "execrt.builtin",
    )
    assert report["failed"] == 0 and report["passed"] >= 2
    assert report["passed"] + report["skipped"] == len(report["results"])
    row = next(
        r for r in report["results"] if r["id"] == "test_scenario[cpu-float32-decode-single]"
    )
    assert row["outcome"] == "passed" and 0 <= row["max_error"] < row["tolerance"]
    assert (
        json.loads(Path(conformance_report_path("attention", "torch_native")).read_text())["date"]
        == report["date"]
    )
    assert report["summary"].endswith(" (partial run: pytest -k single)")
    assert last_conformance("attention", "torch_native")["summary"] == report["summary"]
    rows = backend_inventory(host=PluginHost(autoload=False))["backends"]
    shown = next(r for r in rows if r["name"] == "torch_native")["last_conformance"]
    assert shown["passed"] == report["passed"]
    table = capsys.readouterr().out
    assert "test_scenario[cpu-float32-decode-single]" in table and "passed" in table


def test_failing_run_returns_1_with_errors_in_the_report(tmp_path: Path) -> None:
    source = """
from execrt.testing.attention import AttentionBackendSuite
from tests.testing import fake_backends as fakes
class TestBroken(AttentionBackendSuite):
    factory = "tests.testing.fake_backends:WrongScaleAttention"
    capabilities = fakes.NATIVE_CAPS
    devices = ("cpu",)
"""
    out = tmp_path / "r.json"
    code = run_suite_source(
        source,
        kind="attention",
        name="broken",
        json_path=str(out),
        extra_pytest_args=("-k", "head_dim and d64"),
    )
    report = json.loads(out.read_text())
    assert code == 1 and report["failed"] == 2 and report["passed"] == 0
    assert all(r["max_error"] > r["tolerance"] for r in report["results"])


def test_expected_failures_are_strict_xfail(tmp_path: Path) -> None:
    source = """
from execrt.testing.attention import AttentionBackendSuite
from tests.testing import fake_backends as fakes
class TestKnown(AttentionBackendSuite):
    factory = "tests.testing.fake_backends:WrongScaleAttention"
    capabilities = fakes.NATIVE_CAPS
    devices = ("cpu",)
    expected_failures = {"decode-d64": "wrong scale, https://example.invalid/1"}
class TestStale(AttentionBackendSuite):
    backend = "torch_native"
    devices = ("cpu",)
    expected_failures = {
        "test_head_dim[cpu-float32-decode-d64]": "fixed since, https://example.invalid/2",
        "no-such-test": "typo, https://example.invalid/3",
    }
"""
    out = tmp_path / "r.json"
    code = run_suite_source(
        source,
        kind="attention",
        name="xfail",
        json_path=str(out),
        extra_pytest_args=("-k", "decode-d64 or expected_failures"),
    )
    results = {r["id"]: r for r in json.loads(out.read_text())["results"]}
    assert code == 1
    known = results["test_head_dim[cpu-float32-decode-d64]"]  # ids repeat per class: last wins
    assert known["outcome"] == "failed" and "XPASS(strict)" in known["reason"]
    stale = results["test_expected_failures_name_real_tests"]
    assert stale["outcome"] == "failed" and "'no-such-test' matches no test id" in stale["reason"]


def test_xfailed_cases_are_counted(tmp_path: Path) -> None:
    source = """
from execrt.testing.attention import AttentionBackendSuite
from tests.testing import fake_backends as fakes
class TestKnown(AttentionBackendSuite):
    factory = "tests.testing.fake_backends:WrongScaleAttention"
    capabilities = fakes.NATIVE_CAPS
    devices = ("cpu",)
    expected_failures = {"-d64]": "wrong scale, https://example.invalid/1"}
"""
    out = tmp_path / "r.json"
    code = run_suite_source(
        source,
        kind="attention",
        name="x",
        json_path=str(out),
        extra_pytest_args=("-k", "head_dim and d64"),
    )
    report = json.loads(out.read_text())
    assert code == 0 and report["xfailed"] == 2 and report["failed"] == 0
    assert {r["reason"] for r in report["results"]} == {"wrong scale, https://example.invalid/1"}


def test_unknown_kind_and_name_are_user_errors() -> None:
    with pytest.raises(ConfigError, match="unknown kind 'attn'"):
        run_conformance("attn", "triton", None)
    with pytest.raises(BackendUnavailableError, match="not registered"):
        run_conformance("attention", "no_such_backend", None)


def test_example_plugin_passes_through_the_runner(tmp_path: Path) -> None:
    names = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    if "execrt-example-plugin" not in names:
        pytest.skip("pip install -e examples/execrt-example-plugin")
    out = tmp_path / "r.json"
    code = run_conformance(
        "attention", "sdpa_example", str(out), extra_pytest_args=("-k", "ragged or prefix")
    )
    report = json.loads(out.read_text())
    assert code == 0 and report["plugin"] == "execrt-example-plugin" and report["passed"] >= 6


def test_a_run_where_every_case_skipped_is_nothing_ran_not_a_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `execrt conformance attention triton` on a CPU without the interpreter: only the
    declaration checks run. Status 3, the reasons, and no report for `execrt backends`."""
    from execrt.testing.report import NOTHING_RAN

    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path / "cache"))
    source = """
from execrt.core.interfaces import AttentionCapabilities
from execrt.testing.attention import AttentionBackendSuite
class TestElsewhere(AttentionBackendSuite):
    factory = "execrt.backends.attention.torch_native:TorchNativeAttnBackend"
    capabilities = AttentionCapabilities(devices=frozenset({"cuda"}))
    devices = ("cpu",)
"""
    out = tmp_path / "r.json"
    code = run_suite_source(source, kind="attention", name="elsewhere", json_path=str(out))
    assert code == NOTHING_RAN == 3
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(
        r"attention elsewhere: nothing ran here: (\d+) of (\d+) tests skipped \(\1 x "
        r"capability devices does not include cpu\), and the (\d+) that ran only check "
        r"declarations; no report written",
        last,
    )
    assert match is not None, last
    skipped, total, ran = map(int, match.groups())
    assert skipped + ran == total and ran >= 1
    assert not out.exists()
    assert last_conformance("attention", "elsewhere") is None


def test_a_selection_matching_nothing_is_nothing_ran_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path))
    code = run_conformance("attention", "torch_native", None, extra_pytest_args=("-k", "nomatch"))
    assert code == 3
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "attention torch_native: nothing ran here: no test was selected by pytest -k nomatch; "
        "no report written"
    )
    assert last_conformance("attention", "torch_native") is None


def test_declaration_checks_alone_are_nothing_ran(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path))
    code = run_conformance(
        "attention", "torch_native", None, extra_pytest_args=("-k", "refusals_explain")
    )
    assert code == 3 and last_conformance("attention", "torch_native") is None


def test_an_interrupted_run_passes_the_interrupt_on_and_writes_no_report(tmp_path: Path) -> None:
    # A Ctrl-C (or a time limit's SIGINT) inside the suite is the caller's interrupt: pytest
    # swallows it and returns INTERRUPTED, and the runner must not turn that into a result.
    source = """
def test_interrupted():
    raise KeyboardInterrupt
"""
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        run_suite_source(source, kind="attention", name="x", json_path=str(out), out=io.StringIO())
    assert not out.exists()


def test_the_report_path_check_keeps_a_report_and_leaves_no_folder_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check opens the file to append (it does not truncate) and removes what it made: a
    # run that writes no report (nothing ran) leaves both paths as they were.
    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path / "cache"))
    kept = tmp_path / "kept.json"
    kept.write_text("an earlier report")
    for path in (kept, tmp_path / "new" / "sub" / "r.json"):
        code = run_conformance(
            "attention", "torch_native", str(path), extra_pytest_args=("-k", "nomatch")
        )
        assert code == 3
    assert kept.read_text() == "an earlier report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]


def test_a_report_that_cannot_be_written_after_the_run_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import execrt.testing.report as report

    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path / "cache"))
    # Writable when checked, not when written (its folder replaced by a file meanwhile).
    monkeypatch.setattr(report, "_check_writable", lambda path: None)
    (tmp_path / "gone").write_text("")
    path = tmp_path / "gone" / "r.json"
    message = f"conformance: cannot write the report '{path}': "
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_conformance(
            "attention", "torch_native", str(path), extra_pytest_args=("-k", "decode-single")
        )


def test_a_failure_is_a_short_traceback_unless_asked_for_a_long_one(tmp_path: Path, capfd) -> None:
    """Every case of a backend that cannot be built fails the same way: pages of frames each
    buried the table. The short form keeps the failing line and the message."""
    source = """
def helper():
    # A-LINE-ONLY-THE-LONG-FORM-SHOWS
    assert False, "boom"

def test_fails():
    helper()
"""
    for extra, long_form in (((), False), (("--tb=long",), True)):
        code = run_suite_source(
            source, kind="attention", name="tb", extra_pytest_args=extra, out=io.StringIO()
        )
        printed = capfd.readouterr().out
        assert code == 1 and "boom" in printed
        assert ("A-LINE-ONLY-THE-LONG-FORM-SHOWS" in printed) == long_form, printed


def test_no_shrink_reaches_the_generated_class_and_its_hypothesis_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hypothesis

    from execrt.cli import main
    from execrt.testing import report
    from execrt.testing.suite import generated_settings

    sources: list[str] = []
    monkeypatch.setattr(
        report, "run_suite_source", lambda source, **kw: sources.append(source) or 0
    )
    assert main(["conformance", "prefix_cache", "radix", "--no-shrink"]) == 0
    assert main(["conformance", "prefix_cache", "radix"]) == 0
    assert "shrink_failures = False" in sources[0] and "shrink_failures = True" in sources[1]
    assert hypothesis.Phase.shrink not in generated_settings(5, shrink=False).phases
    assert hypothesis.Phase.shrink in generated_settings(5).phases
