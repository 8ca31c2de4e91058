"""benchmarks/tune_triton_decode.py's positionals: the docs write `tune_triton_decode.py short`
(the mode alone), which once ran the long sweep into a file named "short"."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tune_triton_decode.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tune_triton_decode", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "out", "mode"),
    [
        ([], None, "long"),
        (["short", "--interleave"], None, "short"),
        (["tiles"], None, "tiles"),
        (["rows.json"], "rows.json", "long"),
        (["rows.json", "ragged"], "rows.json", "ragged"),
        (["short", "fp8"], "short", "fp8"),  # two words: a file, then the mode
    ],
)
def test_a_mode_alone_is_the_mode_and_a_file_alone_runs_the_long_sweep(
    argv: list[str], out: str | None, mode: str
) -> None:
    _, args = _script().parse_args(argv)
    assert (args.out, args.mode) == (out, mode)
