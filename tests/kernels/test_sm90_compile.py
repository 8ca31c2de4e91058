"""The sampling kernels compile for sm90 (ahead of time, Triton's bundled ptxas, no GPU).

The interpreter that runs the CPU suite executes a kernel as Python: it does not type the
loops, so a loop-carried value whose type changes between iterations, or an ``if`` whose
branches yield different types, passes there and fails only when the GPU compiles it. This
compiles both launches of ``_sample_kernel`` for an H100/H200 in a fresh process (the suite's
process has the interpreter on), for bf16 and fp32 logits, with each setting of the finish's
block maxima (``SKIP_BLOCKS``), ``COUNT_BLOCKS``, ``RACE_SUMS`` and ``RACE_AHEAD``, and the
race under an 80-register cap (``RACE_REGS``), which may spill a couple of registers at most
(checked with Triton's bundled ``cuobjdump`` where it is installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from execrt.kernels import triton_sampling as S

    INTS_16 = ["stride_row", "vocab", "chunk"]
    fn = S._sample_kernel
    names = fn.arg_names
    pointers = {
        "logits_ptr": sys.argv[1], "temps_ptr": "*fp32", "top_ks_ptr": "*i64",
        "top_ps_ptr": "*fp32", "seeds_ptr": "*i64", "steps_ptr": "*i64", "part_ptr": "*fp32",
        "part_id_ptr": "*i32", "best_ptr": "*fp32", "maxes_ptr": "*fp32", "out_ptr": "*i64",
    }
    # both settings of each knob: the defaults (no block maxima: MAX_BLOCK 0, one count
    # block, the first pass summing Z, no load ahead), and block maxima, two blocks a trip, the
    # race's sums, the race's blocks loaded a trip ahead; and the race under a register cap
    # (RACE_REGS), whose spills the resource usage shows
    import subprocess, tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for finish, max_block, count_blocks, race_sums, ahead, maxnreg in [
        (False, 0, 1, False, False, None), (False, 1024, 1, True, True, None),
        (True, 0, 1, False, False, None), (True, 1024, 2, True, False, None),
        (False, 0, 1, False, False, 80), (False, 1024, 1, True, True, 80),
    ]:
        constants = {
            "FINISH": finish, "ROUND_SHARE": S.ROUND_SHARE, "SHARE": not finish,
            "MAX_BLOCK": max_block, "COUNT_BLOCKS": count_blocks, "RACE_SUMS": race_sums,
            "AHEAD": ahead, "BLOCK": 1024, "BLOCK_P": 256, "PDL": True, "FAST_LOG": True,
        }
        signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
        source = triton.compiler.ASTSource(
            fn=fn,
            signature=signature,
            constexprs={(names.index(k),): v for k, v in constants.items()},
            # as a launch specializes them: the pointers and the ints a 151936 vocabulary makes
            # (stride, vocabulary, tokens per part) divisible by 16
            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in [*pointers, *INTS_16]},
        )
        options = {"num_warps": 8 if finish else 4}
        if maxnreg:
            options["maxnreg"] = maxnreg
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert kernel.asm["cubin"], "no cubin"
        print("compiled", sys.argv[1], "finish" if finish else "race", max_block, count_blocks,
              race_sums, ahead, maxnreg)
        if maxnreg and os.path.exists(tool):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True,
                                       text=True, check=True).stdout
            print("capped", maxnreg, " ".join(w for w in usage.split() if ":" in w))
    """
)


#: What the race may spill under its register cap (RACE_REGS 80), in bytes.
MAX_SPILL_BYTES = 16


@pytest.mark.parametrize("logits", ["*bf16", "*fp32"])
def test_the_sampling_kernels_compile_for_sm90(logits: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, logits], capture_output=True, text=True, env=env, timeout=300
    )
    if done.returncode and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("Triton's ptxas is not installed here")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("compiled") == 6
    # the race under RACE_REGS: within the cap, and at most a couple of registers spilled
    # (sm90, every knob on: 8 bytes with triton 3.9, none with 3.6; a 40-register cap: ~180)
    for line in done.stdout.splitlines():
        if line.startswith("capped"):
            cap = int(line.split()[1])
            usage = dict(w.split(":", 1) for w in line.split()[2:])
            spilled = int(usage["STACK"]) + int(usage["LOCAL"])  # ptxas spills to the stack
            assert int(usage["REG"]) <= cap and spilled <= MAX_SPILL_BYTES, line
