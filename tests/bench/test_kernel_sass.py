"""benchmarks/kernel_sass.py compiles the Triton decode split kernel for sm90 without a GPU and
reads its K/V loop as the GPU would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "kernel_sass.py")
triton = pytest.importorskip("triton")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(
    not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
    reason="this triton has no bundled ptxas/cuobjdump (no NVIDIA backend)",
)


def _run(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    # The tool compiles whatever TRITON_INTERPRET the suite runs under (it turns it off).
    env = {**os.environ, "TRITON_INTERPRET": "1", **extra_env}
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=env,
    )  # fmt: skip


def _loops(stdout: str) -> list[tuple[str, dict[str, int]]]:
    """(head line, opcode counts) of each inner loop the tool printed."""
    lines = stdout.strip().splitlines()
    return [
        (line, dict((op, int(n)) for op, n in re.findall(r"([A-Z][\w.]+) (\d+)", lines[i + 1])))
        for i, line in enumerate(lines)
        if line.startswith("  loop of ")
    ]


def test_the_decode_loop_is_compiled_as_the_jit_would_with_vector_loads_and_mma() -> None:
    run = _run("--kv", "bf16", "--tiles", "128,4,2", "--top", "200")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("decode bf16 block_n 128, 4 warps, 2 stages: ")
    # The item loop holds the K/V loop: reported as an outer loop, not timed as a pass.
    assert "outer loop of " in run.stdout and "1 loop(s) inside" in run.stdout
    [(head, counts)] = _loops(run.stdout)
    # The JIT's 16-byte divisibility is given: K/V arrive by 16-byte cp.async, never as
    # scalar 2-byte loads (which is what the loop looked like without it).
    assert counts.get("LDGSTS.E.BYPASS.128", 0) > 0
    assert "LDG.E.U16" not in counts
    assert counts.get("HMMA.16816.F32.BF16", 0) > 0
    loop = int(re.search(r"loop of (\d+) instructions", head).group(1))  # type: ignore[union-attr]
    assert loop == sum(counts.values()) and 100 < loop < 3000
    # 4 warps: the issue floor is the loop's instruction count (x 4 warps / 4 per clock).
    assert re.search(rf"issue floor {loop} clk vs memory floor \d+ clk", head), head


def test_fp8_converts_pairs_and_extend_uses_wgmma() -> None:
    run = _run("--kv", "fp8", "--tiles", "64,4,2", "--top", "200")
    assert run.returncode == 0, run.stderr[-2000:]
    [(_, counts)] = _loops(run.stdout)
    assert counts.get("F2FP.F16.E4M3.UNPACK_B", 0) > 0
    ext = _run("--kernel", "extend", "--tiles", "128,64,8,2", "--top", "200")
    assert ext.returncode == 0, ext.stderr[-2000:]
    loops = _loops(ext.stdout)
    assert len(loops) == 2  # whole blocks, then the diagonal
    assert all("vs tensor floor" in head for head, _ in loops)
    assert all(any(op.startswith("HGMMA.") for op in counts) for _, counts in loops)


def test_fp8_words_keep_two_value_operand_fragments() -> None:
    """With ``EXECRT_FP8_WORDS_OPAQUE=1`` the fp8-words loop converts each word in registers
    and feeds the dots 2-value (kWidth 2) fragments: no register moves assembling 4-value
    ones, which the joins behind the dots give on triton 3.6 (the H200's) unless an identity
    (``_opaque``) hides them. (Off by default: slower on the H200, docs/kernels.md.)"""
    run = _run("--kv", "fp8w", "--tiles", "128,4,3", "--top", "400", EXECRT_FP8_WORDS_OPAQUE="1")
    assert run.returncode == 0, run.stderr[-2000:]
    [(head, counts)] = _loops(run.stdout)
    assert counts.get("F2FP.F16.E4M3.UNPACK_B", 0) == 128  # 2 x 128 x 128 values / 128 threads / 2
    assert counts.get("HMMA.16816.F32", 0) == 64
    moves = counts.get("IMAD.MOV.U32", 0) + counts.get("MOV", 0)
    assert moves < 64, counts
    loop = int(re.search(r"loop of (\d+) instructions", head).group(1))  # type: ignore[union-attr]
    assert loop < 760, head  # 883 with 4-value fragments (triton 3.6), 617-680 without


def warps_per_sm(registers: int) -> int:
    """Warps an sm90 SM holds at this many registers per thread (64K registers, allocated
    per warp in units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(64, 65536 // per_warp)


def test_the_prologue_compiles_for_sm90_without_lowering_the_shipped_tiles_occupancy() -> None:
    """The q/k rotation and K/V store inside the split launch (bf16, and fp8 words with the
    Hadamard rotation) compile as the GPU's JIT would: the interpreter types nothing, this
    does. At the shipped tiles (4 warps) the prologue may cost registers but not a resident
    program, counting what shared memory allows too (228 KB per SM): the H200's triton 3.6
    took bf16 64/4/3 from 142 to 168 registers, still 3 programs of 4 warps per SM."""
    programs = {}
    for prologue in ((), ("--prologue",)):
        for kv, tiles in (("bf16", "64,4,3"), ("fp8w", "128,4,3")):
            run = _run("--kv", kv, "--tiles", tiles, "--top", "1", *prologue)
            assert run.returncode == 0, run.stderr[-2000:]
            head = run.stdout.splitlines()[0]
            assert (", prologue:" in head) is bool(prologue), head
            regs = int(re.search(r"(\d+) registers", head).group(1))  # type: ignore[union-attr]
            shared = int(re.search(r"(\d+) KiB shared", head).group(1))  # type: ignore[union-attr]
            programs[kv, bool(prologue)] = min(warps_per_sm(regs) // 4, 228 // max(1, shared))
    for kv in ("bf16", "fp8w"):
        assert programs[kv, True] >= programs[kv, False], programs
    assert warps_per_sm(168) // 4 == warps_per_sm(142) // 4 == 3  # (the H200's numbers)
    assert warps_per_sm(169) // 4 == 2  # one register more would have cost a program


def test_the_sampling_race_and_finish_report_registers_spills_and_waves() -> None:
    """``--kernel sampling``: per setting of ``triton_sampling``'s knobs, each launch's
    registers, spills, programs an SM and the waves of a bs-256 draw (768 race programs of 4
    warps, 256 finish programs of 8, 132 SMs), consistent with the registers; under the
    80-register cap the race fits 6 programs an SM, one wave."""
    run = _run("--kernel", "sampling", "--logits", "fp32")
    assert run.returncode == 0, run.stderr[-2000:]
    head, *rows = run.stdout.strip().splitlines()
    assert "bs 256 races 256 x 3 programs of 4 warps, finishes 256 of 8 (132 SMs)" in head, head
    assert len(rows) == 10, rows
    cell = re.compile(r"(race|finish) (\d+) regs, (\d+) B spilled, (\d+)/SM, ([\d.]+) waves")
    for row in rows:
        cells = cell.findall(row)
        assert [c[0] for c in cells] == (["race"] if "RACE_REGS" in row else ["race", "finish"])
        for launch, regs, _spilled, fit, waves in cells:
            warps, programs = (4, 768) if launch == "race" else (8, 256)
            assert int(fit) == min(warps_per_sm(int(regs)) // warps, 32), row
            assert float(waves) == pytest.approx(programs / (int(fit) * 132), abs=0.01), row
        if "RACE_REGS 80" in row:
            regs, spilled, fit = (int(x) for x in cells[0][1:4])
            assert regs <= 80 and spilled <= 16 and fit == 6, row


def test_the_shipped_sampling_row_caps_the_race_only_where_the_launch_does() -> None:
    """The launch applies RACE_REGS only to a race grid above RACE_REGS_ABOVE programs per SM:
    at bs 32 (32 x 17 = 544 programs on 132 SMs) the shipped row is compiled uncapped, with
    its finish, and says so; the rows named RACE_REGS 80 stay capped."""
    run = _run("--kernel", "sampling", "--logits", "bf16", "--batch", "32")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = run.stdout.strip().splitlines()[1:]
    shipped = [r for r in rows if "shipped" in r]
    assert len(shipped) == 1 and "uncapped at bs 32" in shipped[0], rows
    assert "finish" in shipped[0] and "RACE_REGS" not in shipped[0], shipped
    assert sum("RACE_REGS 80" in r for r in rows) == 2, rows


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--kv", "fp4"), "--kv 'fp4' unsupported (supported: bf16, fp8, fp8w)"),
        (("--kernel", "sampling", "--logits", "fp8"), "--logits 'fp8' unsupported"),
        (("--tiles", "128,4"), "--tiles '128,4' unsupported (need 3 positive integers)"),
        (("--kernel", "extend", "--tiles", "a,b,c,d"), "need 4 positive integers"),
    ],
)
def test_bad_arguments_are_refused(args: tuple[str, ...], message: str) -> None:
    bad = _run(*args)
    assert bad.returncode == 2 and message in bad.stderr
