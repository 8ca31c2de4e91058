"""``triton_dot.dot``: fp32 operands multiply in IEEE fp32 on the GPU, not in TF32 (Triton's
default, about 5e-4 relative error per product, which an fp32 model's attention showed as
4e-4 in its logits on the H200). Compiled for sm90 with Triton's bundled ptxas, no GPU needed:
the interpreter computes fp32 either way, so it cannot tell."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.kernels.helpers import needs_ptxas, run_compile_probe

pytestmark = needs_ptxas

PROBE = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "0"  # read when a kernel is defined
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from execrt.kernels.triton_dot import dot

    @triton.jit
    def exact(a_ptr, b_ptr, c_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        tl.store(c_ptr + r[:, None] * 16 + r[None, :], dot(a, b, tl.zeros([16, 16], tl.float32)))

    @triton.jit
    def default(a_ptr, b_ptr, c_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        tl.store(c_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))

    for fn in (exact, default):
        for ty in ("fp32", "bf16"):
            sig = {"a_ptr": "*" + ty, "b_ptr": "*" + ty, "c_ptr": "*fp32"}
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
            mma = sorted({ln.split()[0] for ln in ptx.splitlines() if "mma." in ln})
            print(fn.__name__, ty, ",".join(mma) or "-")
    """
)


def test_fp32_operands_multiply_in_ieee_fp32_and_half_ones_on_the_tensor_cores(
    tmp_path: Path,
) -> None:
    out = run_compile_probe(tmp_path, PROBE)
    got = dict(line.rsplit(" ", 1) for line in out.strip().splitlines())
    assert "tf32" in got["default fp32"], got  # the probe can see what it guards against
    assert got["exact fp32"] == "-", got  # no tensor-core instruction: fp32 FMAs
    assert ".bf16.bf16" in got["exact bf16"], got  # half operands keep the tensor cores
