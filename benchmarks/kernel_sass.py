"""The Triton decode split kernel's main loop as the GPU would run it, without a GPU.

Compiles ``_decode_split_kernel`` ahead of time for sm90 (Triton's bundled ptxas), with the
16-byte divisibility of pointers and strides that the JIT infers from real tensors (without
it every K/V load is a scalar ``LDG.E.U16``, and the numbers say nothing about the GPU's).
Prints registers, shared memory, and the instruction mix of the kernel's longest loop (the
K/V block loop): instructions per token, per KiB of K/V, and the issue floor they set beside
the memory floor.

    python benchmarks/kernel_sass.py                      # bf16 and fp8, the shipped tiles
    python benchmarks/kernel_sass.py --kv bf16 --tiles 128,4,2 --top 30

The issue floor: a block of ``block_n`` tokens costs ``loop instructions x num_warps``
warp-instructions, and an sm90 SM issues at most 4 per clock. The memory floor: the block's
K/V bytes at ``--gbps`` (copy bandwidth, default the H200's measured ~4,170 GB/s) shared by
``--sms`` SMs at ``--mhz``. A loop whose issue floor is near or above its memory floor cannot
stream at the copy bandwidth, whatever its tiles.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

# Compiled kernels, not the interpreter's (which the CPU test suite turns on): read before
# execrt's kernels are imported.
os.environ["TRITON_INTERPRET"] = "0"

import triton
from triton.backends.compiler import GPUTarget

from execrt.kernels.attention import decode as D

KV_TYPES = {"bf16": ("*bf16", 2), "fp8": ("*fp8e4nv", 1)}
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass(frozen=True)
class LoopMix:
    kv: str
    block_n: int
    num_warps: int
    num_stages: int
    registers: int
    shared_bytes: int
    instructions: int
    mix: dict[str, int]

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one loop iteration reads (head dim 128)."""
        return 2 * self.block_n * 128 * KV_TYPES[self.kv][1]

    def issue_clocks(self) -> float:
        return self.instructions * self.num_warps / 4

    def memory_clocks(self, gbps: float, sms: int, mhz: float) -> float:
        return self.kv_bytes / (gbps * 1e9 / sms) * mhz * 1e6


def compile_split_kernel(kv: str, block_n: int, num_warps: int, num_stages: int, group: int = 4):
    """The compiled kernel (``triton.compile``'s object) for a 128-dim head, ``group`` query
    heads per KV head, bf16 q."""
    fn = D._decode_split_kernel
    names = fn.arg_names
    kv_type = KV_TYPES[kv][0]
    pointers = {
        "q_ptr": "*bf16", "k_ptr": kv_type, "v_ptr": kv_type, "kv_indptr_ptr": "*i32",
        "kv_indices_ptr": "*i32", "num_splits_ptr": "*i32", "work_ptr": "*i32",
        "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "kv_scales_ptr": "*fp32",
        "o_ptr": "*bf16", "arrivals_ptr": "*i32",
    }  # fmt: skip
    constants = {
        "GROUP": group, "HEAD_DIM": 128, "HEAD_DIM_V": 128, "BLOCK_H": max(16, group),
        "BLOCK_N": block_n, "BLOCK_D": 128, "BLOCK_DV": 128, "BLOCK_S": 32,
        "KV_SCALED": kv == "fp8", "DOT_F16": kv == "fp8", "FUSED": False, "PDL": True,
    }  # fmt: skip
    signature = {
        n: "constexpr" if n in constants else pointers.get(n, "fp32" if n == "qk_scale" else "i32")
        for n in names
    }
    # What the JIT specializes for real tensors: 16-byte aligned pointers, strides that are
    # multiples of 16 elements (the per-head lse stride is the split count: not assumed).
    aligned = [n for n in names if n in pointers or (n.startswith("stride") and n != "stride_plh")]
    src = triton.compiler.ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_of(kernel) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    """(the SASS text, registers per thread) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
        usage = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    match = re.search(r"REG:(\d+)", usage)
    return sass, int(match.group(1)) if match else -1


def longest_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (opcodes with modifiers)."""
    matches = map(INSTRUCTION.match, sass.splitlines())
    found = [(int(m.group(1), 16), m.group(2)) for m in matches if m]
    index = {addr: i for i, (addr, _) in enumerate(found)}
    best: tuple[int, int] | None = None
    for i, (addr, text) in enumerate(found):
        m = BRANCH_TARGET.search(text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            start = index[int(m.group(1), 16)]
            if best is None or i - start > best[1] - best[0]:
                best = (start, i)
    if best is None:
        raise RuntimeError("no loop found in the SASS")
    return [PREDICATE.sub("", text).split()[0] for _, text in found[best[0] : best[1] + 1]]


def loop_mix(kv: str, block_n: int, num_warps: int, num_stages: int) -> LoopMix:
    kernel = compile_split_kernel(kv, block_n, num_warps, num_stages)
    sass, registers = sass_of(kernel)
    ops = longest_loop(sass)
    return LoopMix(
        kv, block_n, num_warps, num_stages, registers, int(kernel.metadata.shared), len(ops),
        dict(collections.Counter(ops).most_common()),
    )  # fmt: skip


def describe(m: LoopMix, gbps: float, sms: int, mhz: float, top: int) -> str:
    issue, memory = m.issue_clocks(), m.memory_clocks(gbps, sms, mhz)
    head = (
        f"{m.kv} block_n {m.block_n}, {m.num_warps} warps, {m.num_stages} stages: "
        f"{m.registers} registers, {m.shared_bytes // 1024} KiB shared; loop "
        f"{m.instructions} instructions ({m.instructions / m.block_n:.1f} per token, "
        f"{m.instructions * m.num_warps / (m.kv_bytes / 1024):.0f} warp-instructions per KiB); "
        f"issue floor {issue:.0f} clk vs memory floor {memory:.0f} clk per block per SM "
        f"({issue / memory:.2f})"
    )
    mix = ", ".join(f"{op} {n}" for op, n in list(m.mix.items())[:top])
    return f"{head}\n    {mix}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv", default="bf16,fp8", help="KV dtypes, comma-separated: bf16, fp8")
    p.add_argument(
        "--tiles",
        default="",
        help="block_n,num_warps,num_stages (default: bf16 64,4,2 and 128,4,2; fp8 128,4,2 "
        "and 128,4,3)",
    )
    p.add_argument("--gbps", type=float, default=4170.0, help="copy bandwidth for the memory floor")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--mhz", type=float, default=1755.0, help="SM clock for the floors")
    p.add_argument("--top", type=int, default=20, help="opcodes listed per loop")
    args = p.parse_args()
    defaults = {"bf16": [(64, 4, 2), (128, 4, 2)], "fp8": [(128, 4, 2), (128, 4, 3)]}
    for kv in (k.strip() for k in args.kv.split(",") if k.strip()):
        if kv not in KV_TYPES:
            p.error(f"--kv {kv!r} unsupported (supported: {', '.join(KV_TYPES)})")
        tiles = [tuple(int(x) for x in args.tiles.split(","))] if args.tiles else defaults[kv]
        for block_n, warps, stages in tiles:
            m = loop_mix(kv, block_n, warps, stages)
            print(describe(m, args.gbps, args.sms, args.mhz, args.top), flush=True)


if __name__ == "__main__":
    main()
