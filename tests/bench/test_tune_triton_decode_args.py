"""benchmarks/tune_triton_decode.py's positionals: the docs write `tune_triton_decode.py short`
(the mode alone), which once ran the long sweep into a file named "short"."""

from __future__ import annotations

import pytest

from tests.bench import load_benchmark

pytest.importorskip("triton")


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
    _, args = load_benchmark("tune_triton_decode").parse_args(argv)
    assert (args.out, args.mode) == (out, mode)
