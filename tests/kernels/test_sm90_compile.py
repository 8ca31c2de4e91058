"""The sampling kernels compile for sm90 (ahead of time, Triton's bundled ptxas, no GPU).

The interpreter that runs the CPU suite executes a kernel as Python: it does not type the
loops, so a loop-carried value whose type changes between iterations, or an ``if`` whose
branches yield different types, passes there and fails only when the GPU compiles it. This
compiles both launches of ``_sample_kernel`` for an H100/H200 in a fresh process (the suite's
process has the interpreter on; ``benchmarks/kernel_sass.py`` compiles them as a launch
specializes them), for bf16 and fp32 logits, with each setting of the finish's
block maxima (``SKIP_BLOCKS``), ``COUNT_BLOCKS``, ``RACE_SUMS`` and ``RACE_AHEAD``, and the
race under an 80-register cap (``RACE_REGS``), which may spill a couple of registers at most
(checked with Triton's bundled ``cuobjdump`` where it is installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, sys.argv[2])
    import kernel_sass as K

    # both launches with every knob off (no block maxima, one count block, the first pass
    # summing Z, no load ahead) and with every knob on (block maxima, two blocks a trip, the race's
    # sums, the race's blocks loaded a trip ahead); and the race under its register cap
    # (RACE_REGS), whose resources cuobjdump shows, the shipped setting among them
    settings = {setting[0]: setting for setting in K.SAMPLING_SETTINGS}
    for name, finish in [
        ("knobs off", False), ("all four", False), ("knobs off", True), ("all four", True),
        ("knobs off, RACE_REGS 80", False), ("shipped: 3 knobs, RACE_REGS 80", False),
        ("all four, RACE_REGS 80", False),
    ]:
        setting = settings[name]
        kernel = K.compile_sampling_kernel(sys.argv[1], finish, setting, 8 if finish else 4)
        assert kernel.asm["cubin"], "no cubin"
        print("compiled", sys.argv[1], "finish" if finish else "race", name)
        if setting[5] and os.path.exists(K._tool("cuobjdump")):
            use = K.resources(kernel)
            print("capped", setting[5], " ".join(f"{k}:{use.get(k, 0)}" for k in
                                                 ("REG", "STACK", "LOCAL")))
    """
)


#: What the race may spill under its register cap (RACE_REGS 80), in bytes.
MAX_SPILL_BYTES = 16


@pytest.mark.parametrize("logits", ["*bf16", "*fp32"])
def test_the_sampling_kernels_compile_for_sm90(logits: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, logits, BENCHMARKS],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if done.returncode and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("Triton's ptxas is not installed here")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("compiled") == 7
    # the race under RACE_REGS: within the cap, and at most a couple of registers spilled
    # (sm90, every knob on: 8 bytes with triton 3.9, none with 3.6; a 40-register cap: ~180)
    for line in done.stdout.splitlines():
        if line.startswith("capped"):
            cap = int(line.split()[1])
            usage = dict(w.split(":", 1) for w in line.split()[2:])
            spilled = int(usage["STACK"]) + int(usage["LOCAL"])  # ptxas spills to the stack
            assert int(usage["REG"]) <= cap and spilled <= MAX_SPILL_BYTES, line
