"""The Triton attention kernels' inner loops as the GPU would run them, without a GPU.

Compiles the decode split kernel (``--kernel decode``) or the extend kernel over the cache
(``--kernel extend``) ahead of time for sm90 (Triton's bundled ptxas), with the 16-byte
divisibility of pointers and strides that the JIT infers from real tensors (without it every
K/V load is a scalar ``LDG.E.U16``, and the numbers say nothing about the GPU's). Prints
registers, shared memory, and for each loop of the kernel the instruction mix and the issue
floor it sets beside the floor of the work it does.

    python benchmarks/kernel_sass.py                      # decode: bf16 and fp8, shipped tiles
    python benchmarks/kernel_sass.py --kv bf16 --tiles 128,4,2 --top 30
    python benchmarks/kernel_sass.py --kernel extend      # the H200 table's gather tile
    python benchmarks/kernel_sass.py --kernel sampling    # the draw's launches, per knob

``--kernel sampling`` prints, for each setting of ``triton_sampling``'s knobs, the registers and
spilled bytes of the parts' race and of the finish, the programs an SM then holds, and the
waves a ``--batch``-row draw takes (a second wave of the race costs every row of the batch).

The issue floor: one pass of a loop costs ``its instructions x num_warps`` warp-instructions,
and an sm90 SM issues at most 4 per clock. Decode's floor is memory: the pass's K/V bytes at
``--gbps`` (copy bandwidth, default the H200's measured ~4,170 GB/s) shared by ``--sms`` SMs at
``--mhz``. Extend's is the tensor cores: the pass's QK^T and PV FLOPs at ``--tflops`` (dense
bf16, default the H200's 989) over the SMs. A loop whose issue floor is near or above its
work's floor cannot reach that floor, whatever its tiles; one well below it can, if its
instructions overlap the loads or the wgmmas.
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

from execrt.kernels._triton import fp8_words_opaque, programs_per_sm
from execrt.kernels.attention import decode as D
from execrt.kernels.attention import extend as E

#: name -> (K/V pointer type, bytes per value); fp8w: the fp8 cache read as int32 words
KV_TYPES = {"bf16": ("*bf16", 2), "fp8": ("*fp8e4nv", 1), "fp8w": ("*i32", 1)}
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass(frozen=True)
class Loop:
    """One loop of a compiled kernel: its opcodes' counts, and what one pass does."""

    instructions: int
    mix: dict[str, int]
    num_warps: int
    kv_bytes: int  # K and V bytes one pass reads
    flops: int  # tensor-core FLOPs one pass does (QK^T and PV)
    inner: int = 0  # loops nested inside this one (then one pass is not one K/V block)

    def issue_clocks(self) -> float:
        return self.instructions * self.num_warps / 4

    def memory_clocks(self, gbps: float, sms: int, mhz: float) -> float:
        return self.kv_bytes / (gbps * 1e9 / sms) * mhz * 1e6

    def tensor_clocks(self, tflops: float, sms: int, mhz: float) -> float:
        return self.flops / (tflops * 1e12 / sms) * mhz * 1e6


@dataclass(frozen=True)
class KernelLoops:
    name: str
    registers: int
    shared_bytes: int
    loops: list[Loop]


def compile_split_kernel(
    kv: str,
    block_n: int,
    num_warps: int,
    num_stages: int,
    group: int = 4,
    prologue: bool = False,
    prefetch: bool = False,
    fused: bool = False,
    merge_chunk: int = 0,
):  # type: ignore[no-untyped-def]
    """The compiled kernel (``triton.compile``'s object) for a 128-dim head, ``group`` query
    heads per KV head, bf16 q; ``prologue``: with q/k norm, RoPE and the K/V store inside
    (``decode_attention(prologue=)``); ``prefetch``: with the K/V prefetch ahead of the PDL
    wait; ``fused``: with the merge inside (``arrivals``), ``merge_chunk`` its ``CHUNK`` (0:
    two passes)."""
    fn = D._decode_split_kernel
    names = fn.arg_names
    kv_type = KV_TYPES[kv][0]
    cache_type = "*bf16" if kv == "bf16" else "*fp8e4nv"  # the store's typed cache
    pointers = {
        "q_ptr": "*bf16", "k_ptr": kv_type, "v_ptr": kv_type, "kv_indptr_ptr": "*i32",
        "kv_indices_ptr": "*i32", "num_splits_ptr": "*i32", "work_ptr": "*i32",
        "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "kv_scales_ptr": "*fp32",
        "o_ptr": "*bf16", "arrivals_ptr": "*i32", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16",
        "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_w_ptr": "*bf16",
        "k_w_ptr": "*bf16", "loc_ptr": "*i64", "k_cache_ptr": cache_type,
        "v_cache_ptr": cache_type,
    }  # fmt: skip
    constants = {
        "GROUP": group, "HEAD_DIM": 128, "HEAD_DIM_V": 128, "BLOCK_H": max(16, group),
        "BLOCK_N": block_n, "BLOCK_D": 128, "BLOCK_DV": 128, "BLOCK_S": 32,
        "MERGE_CHUNK": merge_chunk, "KV_SCALED": kv != "bf16", "DOT_F16": kv != "bf16",
        "FUSED": fused, "PDL": True,
        "F8_WORDS": kv == "fp8w", "F8_E5M2": False, "F8_ASM": True, "F8_OPAQUE": fp8_words_opaque(),
        "SLOT_I32": True, "PROLOGUE": prologue,
        "HAS_Q_NORM": True, "HAS_K_NORM": True, "HADAMARD": kv != "bf16", "HALF": 64,
        "BLOCK_HALF": 64, "BLOCK_G": group, "FP8_MAX": 448.0, "FP8_MANT": 3, "FP8_EMIN": -6,
        "K_INV": 2, "V_INV": 3, "PREFETCH": prefetch, "PF_TOKENS": D.prefetch_tokens(block_n),
        "PF_LINES_K": D.prefetch_lines(128, KV_TYPES[kv][1]),
        "PF_LINES_V": D.prefetch_lines(128, KV_TYPES[kv][1]),
    }  # fmt: skip
    # What the JIT specializes for real tensors: 16-byte aligned pointers, strides that are
    # multiples of 16 elements (the per-head lse stride is the split count: not assumed).
    aligned = [n for n in names if n in pointers or (n.startswith("stride") and n != "stride_plh")]
    return _compile(fn, pointers, constants, aligned, num_warps, num_stages)


def compile_extend_kernel(block_m: int, block_n: int, num_warps: int, num_stages: int,
                          group: int = 4, heads: int = 1):  # fmt: skip
    """The extend kernel over the cache (gathered K/V, the prefix path), bf16, 128-dim heads,
    ``heads`` query heads of a ``group`` packed per tile."""
    fn = E._extend_kernel
    names = fn.arg_names
    pointers = {
        "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16",
        "qo_indptr_ptr": "*i32", "kv_indptr_ptr": "*i32", "kv_indices_ptr": "*i32",
        "prefix_lens_ptr": "*i32", "kv_scales_ptr": "*fp32",
    }  # fmt: skip
    constants = {
        "GROUP": group, "HEADS": heads, "HEAD_DIM": 128, "HEAD_DIM_V": 128,
        "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": 128, "BLOCK_DV": 128,
        "KV_SCALED": False, "DOT_F16": False, "SLOT_I32": True,
    }  # fmt: skip
    aligned = [n for n in names if n in pointers or n.startswith("stride")]
    return _compile(fn, pointers, constants, aligned, num_warps, num_stages)


def _compile(fn, pointers, constants, aligned, num_warps, num_stages, maxnreg=None):  # type: ignore[no-untyped-def]
    names = fn.arg_names
    signature = {
        n: "constexpr"
        if n in constants
        else pointers.get(n, "fp32" if n in ("qk_scale", "eps") else "i32")
        for n in names
    }
    src = triton.compiler.ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gluon(fn, pointers, constants, num_warps):  # type: ignore[no-untyped-def]
    """A Gluon kernel compiled for sm90 (no GPU needed): ``pointers`` types the pointer
    arguments it names (any other ``*_ptr`` is ``*i32``), ``qk_scale`` is fp32 and the rest
    i32; pointers and strides are 16-aligned, as the launches pass them."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = fn.arg_names

    def pointer(n: str) -> str | None:
        return pointers.get(n, "*i32" if n.endswith("_ptr") else None)

    signature = {
        n: "constexpr" if n in constants else pointer(n) or ("fp32" if n == "qk_scale" else "i32")
        for n in names
    }
    aligned = [n for n in names if pointer(n) or n.startswith("stride")]
    src = GluonASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuobjdump(kernel, flag: str) -> str:  # type: ignore[no-untyped-def]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run(
            [_tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)


def resources(kernel) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """What ptxas gave a compiled kernel: REG (per thread), STACK and LOCAL (bytes per thread:
    spills go to the stack), SHARED, ..."""
    usage = _cuobjdump(kernel, "-res-usage")
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+):(\d+)", usage)}


def sass_of(kernel) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    """(the SASS text, registers per thread) of a compiled kernel."""
    return _cuobjdump(kernel, "-sass"), resources(kernel).get("REG", -1)


def loops(sass: str, min_len: int = 64) -> list[tuple[list[str], int]]:
    """The bodies of the backward branches of at least ``min_len`` instructions, in address
    order (opcodes with modifiers, predicates dropped), each with the number of such loops
    nested inside it."""
    matches = map(INSTRUCTION.match, sass.splitlines())
    found = [(int(m.group(1), 16), m.group(2)) for m in matches if m]
    index = {addr: i for i, (addr, _) in enumerate(found)}
    spans = []
    for i, (addr, text) in enumerate(found):
        m = BRANCH_TARGET.search(text)
        target = int(m.group(1), 16) if m else addr
        if target < addr and target in index:
            start = index[target]
            if i + 1 - start >= min_len:
                spans.append((start, i))
    return [
        (
            [PREDICATE.sub("", t).split()[0] for _, t in found[a : b + 1]],
            sum(1 for c, d in spans if a <= c and d <= b and (c, d) != (a, b)),
        )
        for a, b in spans
    ]


def kernel_loops(kernel, name: str, num_warps: int, kv_bytes: int, flops: int) -> KernelLoops:  # type: ignore[no-untyped-def]
    sass, registers = sass_of(kernel)
    found = loops(sass)
    if not found:
        raise RuntimeError(f"{name}: no loop found in the SASS")
    return KernelLoops(
        name, registers, int(kernel.metadata.shared),
        [
            Loop(
                len(ops), dict(collections.Counter(ops).most_common()), num_warps, kv_bytes,
                flops, inner,
            )
            for ops, inner in found
        ],
    )  # fmt: skip


def decode_loops(
    kv: str, block_n: int, num_warps: int, num_stages: int, prologue: bool = False
) -> KernelLoops:
    """The decode split kernel at GQA 4 (16 padded query rows), head dim 128."""
    kernel = compile_split_kernel(kv, block_n, num_warps, num_stages, prologue=prologue)
    name = f"decode {kv} block_n {block_n}, {num_warps} warps, {num_stages} stages"
    if prologue:
        name += ", prologue"
    flops = 2 * 2 * 16 * block_n * 128
    return kernel_loops(kernel, name, num_warps, 2 * block_n * 128 * KV_TYPES[kv][1], flops)


def extend_loops(block_m: int, block_n: int, num_warps: int, num_stages: int) -> KernelLoops:
    """The extend kernel over the cache, bf16, head dim 128, one query head per tile."""
    kernel = compile_extend_kernel(block_m, block_n, num_warps, num_stages)
    name = (
        f"extend bf16 block_m {block_m} block_n {block_n}, {num_warps} warps, {num_stages} stages"
    )
    flops = 2 * 2 * block_m * block_n * 128
    return kernel_loops(kernel, name, num_warps, 2 * block_n * 128 * 2, flops)


def describe(k: KernelLoops, floor: str, gbps: float, tflops: float, sms: int, mhz: float,
             top: int) -> str:  # fmt: skip
    lines = [f"{k.name}: {k.registers} registers, {k.shared_bytes // 1024} KiB shared"]
    for loop in k.loops:
        if loop.inner:
            lines.append(
                f"  outer loop of {loop.instructions} instructions, {loop.inner} loop(s) inside"
            )
            continue
        issue = loop.issue_clocks()
        work = (
            loop.memory_clocks(gbps, sms, mhz)
            if floor == "memory"
            else loop.tensor_clocks(tflops, sms, mhz)
        )
        lines.append(
            f"  loop of {loop.instructions} instructions "
            f"({loop.instructions * loop.num_warps / (loop.kv_bytes / 1024):.0f} "
            f"warp-instructions per KiB of K/V): issue floor {issue:.0f} clk vs {floor} floor "
            f"{work:.0f} clk per pass per SM ({issue / work:.2f})"
        )
        lines.append("    " + ", ".join(f"{op} {n}" for op, n in list(loop.mix.items())[:top]))
    return "\n".join(lines)


#: ``--kernel sampling``: (name, MAX_BLOCK, COUNT_BLOCKS, RACE_SUMS, AHEAD, maxnreg) of each
#: setting compiled: every knob of ``triton_sampling`` off, each alone, all of them, the cap.
#: Shipped since session 44: SKIP_BLOCKS + COUNT_BLOCKS 2 + RACE_SUMS, and RACE_REGS 80 for
#: a race grid above RACE_REGS_ABOVE programs per SM (a bs-256 draw).
SAMPLING_SETTINGS = (
    ("knobs off", 0, 1, False, False, None),
    ("SKIP_BLOCKS", 1024, 1, False, False, None),
    ("COUNT_BLOCKS 2", 0, 2, False, False, None),
    ("RACE_SUMS", 0, 1, True, False, None),
    ("SKIP_BLOCKS + COUNT_BLOCKS 2 + RACE_SUMS", 1024, 2, True, False, None),
    ("RACE_AHEAD", 0, 1, False, True, None),
    ("all four", 1024, 2, True, True, None),
    ("knobs off, RACE_REGS 80", 0, 1, False, False, 80),
    ("shipped: 3 knobs, RACE_REGS 80", 1024, 2, True, False, 80),
    ("all four, RACE_REGS 80", 1024, 2, True, True, 80),
)


def compile_sampling_kernel(logits: str, finish: bool, setting: tuple, warps: int):  # type: ignore[no-untyped-def,type-arg]
    """One launch of ``_sample_kernel`` (the parts' race, or the finish) for ``logits``
    (``*bf16`` / ``*fp32``) at a ``SAMPLING_SETTINGS`` row, BLOCK 1024, with the 16-byte
    divisibility a launch infers for its pointers and for the row stride, vocabulary and
    tokens per part of a 151936-token vocabulary."""
    from execrt.kernels import triton_sampling as S

    _name, max_block, count_blocks, race_sums, ahead, maxnreg = setting
    fn = S._sample_kernel
    pointers = {n: "*fp32" for n in fn.arg_names if n.endswith("_ptr")}
    pointers.update(logits_ptr=logits, top_ks_ptr="*i64", seeds_ptr="*i64", steps_ptr="*i64")
    pointers.update(part_id_ptr="*i32", out_ptr="*i64")
    constants = {
        "FINISH": finish, "ROUND_SHARE": S.ROUND_SHARE, "SHARE": not finish,
        "MAX_BLOCK": max_block, "COUNT_BLOCKS": count_blocks, "RACE_SUMS": race_sums,
        "AHEAD": ahead and not finish, "BLOCK": 1024, "BLOCK_P": 256, "PDL": True,
        "FAST_LOG": True,
    }  # fmt: skip
    aligned = [*pointers, "stride_row", "vocab", "chunk"]
    return _compile(fn, pointers, constants, aligned, warps, 3, maxnreg)


#: An sm90 SM: 228 KiB of shared memory, 2048 threads, 32 blocks.
SM90 = {"shared_per_sm": 233472, "threads_per_sm": 2048, "blocks_per_sm": 32}


def describe_sampling(logits: str, batch: int, vocab: int, sms: int) -> str:
    """Registers, spills and residency of the race and the finish at each setting, and the
    waves of a ``batch``-row draw (the race split as ``triton_sampling`` splits it)."""
    from execrt.kernels import triton_sampling as S

    parts, _chunk = S._parts(batch, vocab, 1024, sms)
    lines = [
        f"_sample_kernel, {logits[1:]} logits, {vocab} tokens: bs {batch} races {batch} x "
        f"{parts} programs of 4 warps, finishes {batch} of 8 ({sms} SMs)"
    ]
    shipped_cap = S.race_regs(batch * parts, sms)
    for setting in SAMPLING_SETTINGS:
        if setting[0].startswith("shipped") and setting[5] != shipped_cap:
            # the launch applies the cap only above RACE_REGS_ABOVE programs per SM
            setting = (f"shipped: 3 knobs, uncapped at bs {batch}", *setting[1:5], shipped_cap)
        cells = []
        for finish, warps, programs in ((False, 4, batch * parts), (True, 8, batch)):
            if finish and setting[5]:
                continue  # the cap is the race's
            use = resources(compile_sampling_kernel(logits, finish, setting, warps))
            fit = programs_per_sm(use["REG"], warps, use.get("SHARED", 0), **SM90)
            waves = programs / (fit * sms)
            spill = use.get("STACK", 0) + use.get("LOCAL", 0)
            cells.append(
                f"{'finish' if finish else 'race'} {use['REG']} regs, {spill} B spilled, "
                f"{fit}/SM, {waves:.2f} waves"
            )
        lines.append(f"  {setting[0]:<42} " + "; ".join(cells))
    return "\n".join(lines)


def _tiles(text: str, size: int, p: argparse.ArgumentParser) -> tuple[int, ...]:
    try:
        tiles = tuple(int(x) for x in text.split(","))
    except ValueError:
        tiles = ()
    if len(tiles) != size or min(tiles) < 1:
        p.error(f"--tiles {text!r} unsupported (need {size} positive integers)")
    return tiles


TILES_HELP = (
    "decode: block_n,num_warps,num_stages (default: bf16 64,4,2 and 128,4,2; fp8 128,4,2 and "
    "128,4,3); extend: block_m,block_n,num_warps,num_stages (default 128,64,8,4, the H200 "
    "table's gather tile)"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", default="decode", choices=("decode", "extend", "sampling"))
    p.add_argument("--logits", default="bf16,fp32", help="sampling: the logits' dtypes")
    p.add_argument("--batch", type=int, default=256, help="sampling: the rows drawn")
    p.add_argument(
        "--kv",
        default="bf16,fp8",
        help="decode: KV dtypes, comma-separated: bf16, fp8, fp8w (fp8 read as int32 words)",
    )
    p.add_argument("--tiles", default="", help=TILES_HELP)
    p.add_argument(
        "--prologue",
        action="store_true",
        help="decode: with q/k norm, RoPE and the K/V store in the launch (fp8: with the "
        "Hadamard rotation)",
    )
    p.add_argument("--gbps", type=float, default=4170.0, help="copy bandwidth (decode floor)")
    p.add_argument("--tflops", type=float, default=989.0, help="dense bf16 peak (extend floor)")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--mhz", type=float, default=1755.0, help="SM clock for the floors")
    p.add_argument("--top", type=int, default=20, help="opcodes listed per loop")
    args = p.parse_args()
    floors = (args.gbps, args.tflops, args.sms, args.mhz, args.top)
    if args.kernel == "sampling":
        for dtype in args.logits.split(","):
            if dtype not in ("bf16", "fp32"):
                p.error(f"--logits {dtype!r} unsupported (supported: bf16, fp32)")
            print(describe_sampling(f"*{dtype}", args.batch, 151936, args.sms), flush=True)
        return
    if args.kernel == "extend":
        bm, bn, warps, stages = _tiles(args.tiles or "128,64,8,4", 4, p)
        print(describe(extend_loops(bm, bn, warps, stages), "tensor", *floors), flush=True)
        return
    fp8_tiles = [(128, 4, 2), (128, 4, 3)]
    defaults = {"bf16": [(64, 4, 2), (128, 4, 2)], "fp8": fp8_tiles, "fp8w": fp8_tiles}
    for kv in (k.strip() for k in args.kv.split(",") if k.strip()):
        if kv not in KV_TYPES:
            p.error(f"--kv {kv!r} unsupported (supported: {', '.join(KV_TYPES)})")
        tiles = [_tiles(args.tiles, 3, p)] if args.tiles else defaults[kv]
        for block_n, warps, stages in tiles:
            loops = decode_loops(kv, block_n, warps, stages, args.prologue)
            print(describe(loops, "memory", *floors), flush=True)


if __name__ == "__main__":
    main()
