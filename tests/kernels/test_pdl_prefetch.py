"""The skinny GEMM asks L2 for its weight slice (or loads its first weight tile), and the
decode kernel for its first K/V rows, before they wait for the grid ahead (PDL); nothing is
written before the wait. Compiled for
sm90 with Triton's bundled ptxas, no GPU needed: the interpreter has neither PDL nor the
prefetch, so it cannot tell."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.kernels.helpers import needs_ptxas, run_compile_probe

pytestmark = needs_ptxas

PROBE = textwrap.dedent(
    """
    import os
    os.environ["TRITON_INTERPRET"] = "0"  # read when a kernel is defined
    import triton
    from triton.backends.compiler import GPUTarget
    from execrt.kernels import triton_linear as L

    def ptx(prefetch, swiglu_out, split, preload=False):
        ptrs = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "r_ptr", "nw_ptr", "nr_ptr")
        sig = {n: "*bf16" for n in ptrs}
        sig.update(part_ptr="*fp32", count_ptr="*i32")
        sig.update({n: "i32" for n in ("M", "N", "K", "k_per_split", "stride_xm", "stride_ym")})
        sig["eps"] = "fp32"
        sig["pf_cols"] = "i32"
        const = dict(HAS_BIAS=False, SWIGLU=False, SWIGLU_OUT=swiglu_out, NORM=False, ADD=False,
                     LATE_NORM=False, USE_DOT=False, EVEN_K=True, BLOCK_M=1,
                     BLOCK_N=4, BLOCK_K=512, SPLIT=split, PDL=True, PREFETCH=prefetch,
                     PF_LINES=16, PRELOAD=preload)
        sig.update({k: "constexpr" for k in const})
        src = triton.compiler.ASTSource(fn=L._skinny_linear_kernel, signature=sig, constexprs=const)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    MEMORY = ("ld.", "st.", "prefetch", "cp.", "atom.", "red.")
    LOCAL = ("ld.param", "st.param", "ld.shared", "st.shared")  # a call's arguments; smem

    def memory_ops(lines):
        return {ln.split()[0] for ln in lines if ln.startswith(MEMORY)
                and not ln.startswith(LOCAL)}

    def functions(lines):
        # each .func's body (a noinline helper; ptxas may still inline it later)
        bodies, name = {}, None
        for ln in lines:
            if ln.startswith((".func", ".visible .func")):
                name = ln.split("(")[-2].split()[-1] if "(" in ln else ln.split()[-1]
                bodies[name] = []
            elif ln.startswith(".entry") or ln.startswith(".visible .entry"):
                name = None
            elif name is not None:
                bodies[name].append(ln)
        return bodies

    def report(name, text):
        lines = [ln.strip() for ln in text.splitlines()]
        start = next(i for i, ln in enumerate(lines) if ".entry" in ln)
        wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
        ahead = lines[start:wait]
        # global memory instructions ahead of the wait, the functions called there included
        before = memory_ops(ahead)
        bodies = functions(lines)
        for ln in ahead:
            if ln.startswith("call"):
                callee = next(f for f in bodies if f in ln)
                before |= memory_ops(bodies[callee])
        print(name, sorted(before) or "-", sum(ln.startswith("prefetch.global.L2") for ln in lines))

    for prefetch, swiglu_out, split in ((False, False, False), (True, True, True)):
        report(f"linear-{prefetch}", ptx(prefetch, swiglu_out, split))
    report("linear-preload", ptx(False, True, True, preload=True))
    from benchmarks.kernel_sass import compile_split_kernel
    for kv in ("bf16", "fp8w"):
        for prefetch in (False, True):
            kernel = compile_split_kernel(kv, 128, 4, 3, prefetch=prefetch)
            report(f"decode-{kv}-{prefetch}", kernel.asm["ptx"])
    from execrt.kernels.attention import decode_mma as mma
    if mma.GLUON_IMPORT_ERROR is None:
        from benchmarks.kernel_sass import compile_gluon

        lk, lv, lvp, lq, sk, sv = mma.mma_layouts(1, 16, 128, 128)
        for prefetch in (False, True):
            consts = dict(GROUP=4, D=128, DV=128, W=1, T=16, AHEAD=1, FUSED=True, E5M2=False,
                          SLOT_I32=True, PDL=True, LK=lk, LV=lv, V_PAIRS=lvp, LQ=lq, RING=4,
                          SK=sk, SV=sv, PREFETCH=prefetch, PF_TOKENS=64, STEAL=False)
            ptrs = {"q_ptr": "*bf16", "o_ptr": "*bf16", "part_o_ptr": "*fp32",
                    "part_lse_ptr": "*fp32", "kv_scales_ptr": "*fp32"}
            kernel = compile_gluon(mma._decode_mma_kernel, ptrs, consts, num_warps=1)
            report(f"mma-{prefetch}", kernel.asm["ptx"])
    """
)


def test_the_prefetches_come_before_the_wait_and_nothing_else_does(tmp_path: Path) -> None:
    out = run_compile_probe(tmp_path, PROBE)
    got = dict(line.split(" ", 1) for line in out.strip().splitlines())
    # without it: no prefetch, no memory access before the wait
    for name in ("linear-False", "decode-bf16-False", "decode-fp8w-False"):
        assert got[name] == "- 0", got
    # with it: the prefetch, once for the gate rows and once for the up rows (SWIGLU_OUT)
    assert got["linear-True"] == "['prefetch.global.L2'] 2", got
    # the preload: the first weight tiles' loads (gate and up rows), no store, no prefetch
    before, count = got["linear-preload"].rsplit(" ", 1)
    loads = ast.literal_eval(before)  # the probe prints a sorted list of opcodes
    assert loads and all(op.startswith("ld.global") for op in loads), got
    assert count == "0", got
    # the decode kernel reads its work item and slot ids first, and stores nothing
    names = ["decode-bf16-True", "decode-fp8w-True"]
    if "mma-False" in got:  # a triton with Gluon: the fp8 mma kernel alike
        assert got["mma-False"] == "- 0", got
        names.append("mma-True")
    for name in names:
        before, count = got[name].rsplit(" ", 1)
        assert before == "['ld.global.b32', 'prefetch.global.L2']", got
        assert int(count) >= 2, got  # K and V
