"""``execrt serve`` on the command line: generate's engine flags, one line for a failure."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

from execrt.cli import build_parser, main
from execrt.serve.cli import ENGINE_FLAGS, ENGINE_RUNNERS, engine_runner
from tests.drivers import live_children


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_serve_takes_every_engine_flag_of_generate() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    generate, serve = _options(sub.choices["generate"]), _options(sub.choices["serve"])
    engine = {opt: a for opt, a in generate.items() if a.dest in ENGINE_FLAGS}
    assert {"--model", "--config", "--attention", "--tp", "--ep", "--dtype", "--strict"} <= set(
        engine
    )
    assert {"--kv-cache-dtype", "--prefix-cache"} <= set(engine)
    for opt, action in engine.items():
        assert serve[opt].dest == action.dest and serve[opt].help == action.help
    assert {"--host", "--port", "--served-model-name"} <= set(serve)
    args = build_parser().parse_args(["serve", "--tp", "2", "--attention", "torch", "--port", "0"])
    assert (args.tp_size, args.attention_backend, args.port, args.host) == (
        2,
        "torch",
        0,
        "127.0.0.1",
    )


def test_a_model_that_fails_to_load_is_one_line_and_status_2(tmp_path, capsys) -> None:
    missing = str(tmp_path / "nope")
    assert main(["serve", "--model", missing, "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a directory or a .gguf file" in err, err
    assert "Error:" not in err  # execrt's own errors are sentences, without a class name


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--port", "70000"], "--port 70000 must be in 0..65535"),
        (["serve", "--served-model-name", " "], "--served-model-name ' ' must be a non-empty"),
        (["bench", "serve", "--max-concurrency", "a,b"], "--max-concurrency 'a,b' must be"),
        (["bench", "serve", "--max-concurrency", "", "--request-rate", ""], "at least one"),
        (["serve", "--step-timeout-s", "-1"], "step_timeout_s must be >= 0"),
        (["serve", "--step-timeout-s", "nan"], "step_timeout_s must be >= 0"),
    ],
)
def test_bad_arguments_are_one_line(argv, needle, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_the_step_timeout_flag() -> None:
    """``--step-timeout-s`` is a config value like the engine flags (a bad one is refused by
    the config, ``test_bad_arguments_are_one_line``); left out, the config's own holds."""
    args = build_parser().parse_args(["serve", "--step-timeout-s", "2.5"])
    assert args.step_timeout_s == 2.5
    assert build_parser().parse_args(["serve"]).step_timeout_s is None  # the config's own
    from execrt.core.config import RuntimeConfig

    config = RuntimeConfig.load(cli={"step_timeout_s": args.step_timeout_s})
    assert config.step_timeout("cpu") == 2.5 and config.step_timeout("cuda") == 2.5
    assert RuntimeConfig.load(cli={"step_timeout_s": float("inf")}).step_timeout("cuda") is None


def test_the_engine_runs_in_its_own_process_unless_under_torchrun(monkeypatch, capsys) -> None:
    assert [engine_runner(c, 1) for c in ENGINE_RUNNERS] == ["process", "process", "thread"]
    assert [engine_runner(c, 2) for c in ("auto", "thread")] == ["thread", "thread"]
    assert build_parser().parse_args(["serve"]).engine_runner == "auto"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["serve", "--engine", "process", "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--engine process needs a single process" in err, err
    # Every torchrun rank refuses alike: rank 0 says it, the others only exit 2 (it was
    # printed once per rank).
    monkeypatch.setenv("RANK", "1")
    assert main(["serve", "--engine", "process", "--device", "cpu", "--port", "0"]) == 2
    assert capsys.readouterr().err == ""


def test_stopped_while_loading_says_nothing(monkeypatch, capsys) -> None:
    # Ctrl-C or SIGTERM before the model is ready: the client is closed, nothing failed, so
    # no "execrt: error: None" line.
    import execrt.serve.server as server
    from tests.serve.fakes import FakeClient

    class Closed(FakeClient):
        def wait_ready(self, timeout: float | None = None) -> bool:
            return False

    def interrupted(self: server.UvicornServer) -> None:  # the signal, then the shutdown
        time.sleep(0.1)
        self.server.should_exit = True
        time.sleep(0.3)

    client = Closed(is_ready=False)
    monkeypatch.setattr(server.UvicornServer, "run", interrupted)
    assert server.serve(client, "127.0.0.1", 0) == 0
    assert capsys.readouterr().err == ""
    client.close()


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_before_the_model_is_ready_is_a_quiet_interrupted_status(
    monkeypatch, capsys, sig, status
) -> None:  # type: ignore[no-untyped-def]
    # Before the server starts, a Ctrl-C is 130 (the CLI's KeyboardInterrupt); while the
    # model loads it was 0, or 2 when the engine process died of it first.
    import execrt.serve.server as server
    from tests.serve.fakes import FakeClient

    class Loading(FakeClient):
        def wait_ready(self, timeout: float | None = None) -> bool:
            time.sleep(0.2)  # closed by the shutdown meanwhile
            return False

    def interrupted(self: server.UvicornServer) -> None:  # what uvicorn's handler runs
        self.server.handle_exit(sig, None)
        time.sleep(0.3)

    client = Loading(is_ready=False)
    monkeypatch.setattr(server.UvicornServer, "run", interrupted)
    assert server.serve(client, "127.0.0.1", 0) == status
    assert capsys.readouterr().err == ""
    client.close()


def test_a_signal_once_ready_is_how_a_server_ends_status_0(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import execrt.serve.server as server
    from tests.serve.fakes import FakeClient

    def serving_then_interrupted(self: server.UvicornServer) -> None:
        self.server.started = True
        deadline = time.monotonic() + 10
        while "ready at" not in capsys.readouterr().out:  # announced
            assert time.monotonic() < deadline
            time.sleep(0.01)
        self.server.handle_exit(signal.SIGINT, None)

    client = FakeClient()
    monkeypatch.setattr(server.UvicornServer, "run", serving_then_interrupted)
    monkeypatch.setattr(server, "settle_heap", lambda: None)  # gc.freeze: not in this process
    assert server.serve(client, "127.0.0.1", 0) == 0
    client.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the child in Linux's /proc")
def test_ctrl_c_while_the_engine_process_starts_is_quiet_and_130() -> None:
    # The terminal's SIGINT reaches the whole group: the engine process, importing torch in
    # its spawn bootstrap, printed a 37-44 line KeyboardInterrupt traceback (or "Fatal Python
    # error: init_import_site"), and the status was 2 ("the engine process exited
    # unexpectedly") or 0, by the race.
    cmd = [sys.executable, "-m", "execrt", "serve", "--model", "builtin", "--device", "cpu"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    serve = subprocess.Popen(
        [*cmd, "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        start_new_session=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (engine := [p for p, c in live_children(serve.pid) if "spawn_main" in c]):
            assert serve.poll() is None and time.monotonic() < deadline, "no engine process"
            time.sleep(0.02)
        time.sleep(0.3)  # the front end past the start, the engine in its bootstrap or loading
        os.killpg(serve.pid, signal.SIGINT)
        out, err = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
    assert "Traceback" not in err and "Fatal" not in err and "error" not in err, err
    assert (serve.returncode, out) == (130, "")  # interrupted before it was ready
    deadline = time.monotonic() + 10  # the engine process stopped with it (init reaps it)
    while os.path.exists(f"/proc/{engine[0]}"):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.05)
