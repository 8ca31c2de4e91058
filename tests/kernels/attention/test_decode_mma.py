"""The fp8 decode kernel that converts K/V into the mma registers (Gluon, ``fp8_kernel="mma"``):
its refusals and selection everywhere, its sm90 compile on any machine with Triton's ptxas (no
shared memory in the K/V loop), and its output against the float64 oracle on an sm89+ GPU
(GQA groups 1-8, head dims 64/128/256, e4m3/e5m2, fused and separate merges, ragged and
block-edge contexts, several items per program, int64 offsets, graph replay)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from execrt.core import envs
from execrt.core.config import ConfigError
from execrt.kernels import _triton
from execrt.kernels import attention as tk
from execrt.kernels.attention import decode as dec
from execrt.kernels.attention import decode_mma as mma
from tests.kernels.attention.test_decode import CUDA, GPU_TOL, assert_close, run_decode
from tests.kernels.helpers import needs_ptxas, run_compile_probe

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _mma_gpu() -> bool:
    return CUDA and mma.GLUON_IMPORT_ERROR is None and torch.cuda.get_device_capability() >= (8, 9)


mma_gpu = pytest.mark.skipif(
    not _mma_gpu(), reason="needs an sm89+ GPU and Gluon (fp8 conversions, mma.sync)"
)
CUDA_DEV = torch.device("cuda")


# ----------------------------------------------------------------------------------------------
# Refusals and selection (every machine)
# ----------------------------------------------------------------------------------------------


def _case(
    hq: int = 8, hkv: int = 2, d: int = 128, dv: int | None = None, q_dtype=torch.bfloat16,
    kv_dtype=E4M3,
):  # type: ignore[no-untyped-def]  # fmt: skip
    q = torch.zeros(2, hq, d, dtype=q_dtype)
    k = torch.zeros(16, hkv, d).to(kv_dtype)
    v = torch.zeros(16, hkv, d if dv is None else dv).to(kv_dtype)
    return q, k, v


@pytest.mark.skipif(mma.GLUON_IMPORT_ERROR is not None, reason="this triton has no Gluon")
@pytest.mark.parametrize(
    ("case", "prologue", "why"),
    [
        ({"kv_dtype": torch.bfloat16}, False, "it reads fp8 caches only"),
        ({"q_dtype": torch.float32}, False, "it needs 16-bit q, got torch.float32"),
        ({"d": 96}, False, "head dims 96/96 unsupported (supported: (64, 128, 256))"),
        ({"dv": 32}, False, "head dims 128/32 unsupported"),
        ({"hq": 32, "hkv": 2}, False, "a GQA group of 16 query heads unsupported (at most 8)"),
        ({}, True, "the decode prologue runs in the Triton kernel only"),
    ],
)
def test_the_kernel_names_what_a_call_lacks(case: dict, prologue: bool, why: str) -> None:
    q, k, v = _case(**case)
    assert why in str(mma.mma_unsupported(q, k, v, prologue=prologue))


@pytest.mark.skipif(mma.GLUON_IMPORT_ERROR is not None, reason="this triton has no Gluon")
def test_a_cpu_call_is_refused_for_its_device_or_the_interpreter() -> None:
    q, k, v = _case()
    why = str(mma.mma_unsupported(q, k, v))
    assert "CUDA device, got cpu" in why or "interpreter" in why
    strided = torch.zeros(16, 2, 136).to(E4M3)[:, :, :128]  # rows of 136 bytes
    assert "multiples of 16 bytes" in str(mma.mma_unsupported(q, strided, v))


def test_decode_attention_refuses_a_named_mma_kernel_that_cannot_run() -> None:
    if _mma_gpu():
        pytest.skip("the kernel runs here")
    with pytest.raises(ValueError, match=r"fp8_kernel='mma' unsupported here: "):
        run_decode([5, 9], device=torch.device("cpu"), dtype=torch.float16, kv_dtype=E4M3,
                   fp8_kernel="mma")  # fmt: skip


def test_a_words_option_names_the_words_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # fp8_words picks the Triton kernel's read, so it takes that kernel whatever the default;
    # asked of the mma kernel it is refused by name
    # (the GPU where there is one: CPU tensors run Triton only under the interpreter)
    device = CUDA_DEV if CUDA else torch.device("cpu")
    seen = []
    monkeypatch.setattr(dec, "_run_mma", lambda kernel, *a: seen.append(kernel) or False)
    run_decode([5, 9], device=device, dtype=torch.float16, kv_dtype=E4M3, fp8_words=False)
    assert seen == ["words"]
    with pytest.raises(ValueError, match=r"fp8_words applies to the words kernel"):
        run_decode([5], device=device, dtype=torch.float16, kv_dtype=E4M3, fp8_words=True,
                   fp8_kernel="mma")  # fmt: skip


def test_decode_attention_refuses_an_unknown_fp8_kernel() -> None:
    with pytest.raises(
        ValueError, match=r"fp8_kernel 'wide' unsupported \(supported: auto, words, mma\)"
    ):
        run_decode([5], device=torch.device("cpu"), dtype=torch.float16, kv_dtype=E4M3,
                   fp8_kernel="wide")  # fmt: skip


def test_the_environment_names_the_fp8_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(envs.FP8_DECODE_KERNEL, raising=False)
    assert _triton.fp8_decode_kernel() == _triton.DEFAULT_FP8_DECODE_KERNEL
    monkeypatch.setenv(envs.FP8_DECODE_KERNEL, " MMA ")
    assert _triton.fp8_decode_kernel() == "mma"
    assert envs.kernel_switches()[envs.FP8_DECODE_KERNEL] == " MMA "  # recorded by benchmarks
    monkeypatch.setenv(envs.FP8_DECODE_KERNEL, "bytes")
    with pytest.raises(ConfigError, match=r"EXECRT_FP8_DECODE_KERNEL='bytes' unsupported"):
        _triton.fp8_decode_kernel()


def test_the_launch_shape_follows_the_batch_unless_overridden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for least, shape in mma.MMA_SHAPES_BY_BATCH:
        want = (*shape[:2], shape[2] or None, shape[3])
        assert mma.mma_launch_shape(least) == want
    assert mma.mma_launch_shape(0)[0] in (1, 2, 4)  # an empty batch still has a shape
    # one override changes one field; maxnreg 0 means "as ptxas allocates"
    monkeypatch.setattr(mma, "MMA_WARPS", 2)
    monkeypatch.setattr(mma, "MMA_MAXNREG", 0)
    warps, tokens, maxnreg, ring = mma.mma_launch_shape(1024)
    big = dict(mma.MMA_SHAPES_BY_BATCH)[max(dict(mma.MMA_SHAPES_BY_BATCH))]
    assert (warps, tokens, maxnreg, ring) == (2, big[1], None, big[3])


@pytest.mark.parametrize(
    ("variable", "batch", "runs_mma"),
    [("", 1, False), ("", mma.MMA_MIN_BATCH, True), ("auto", mma.MMA_MIN_BATCH - 1, False),
     ("auto", 256, True), ("mma", 1, True), ("words", 256, False)],
)  # fmt: skip
def test_auto_takes_the_mma_kernel_from_its_least_batch(
    variable: str, batch: int, runs_mma: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the kernel's own refusals stubbed out: the choice is what is tested)
    monkeypatch.setattr(mma, "mma_unsupported", lambda *a, **k: None)
    monkeypatch.setenv(envs.FP8_DECODE_KERNEL, variable)
    q, k, v = _case()
    q = q[:1].expand(batch, -1, -1)
    assert dec._run_mma(None, q, k, v, False) is runs_mma
    # a kernel named by the call wins over the variable
    assert dec._run_mma("words", q, k, v, False) is False
    assert dec._run_mma("mma", q, k, v, False) is True
    # where the kernel cannot run, auto falls back whatever the batch
    monkeypatch.setattr(mma, "mma_unsupported", lambda *a, **k: "no Gluon here")
    assert dec._run_mma(None, q, k, v, False) is False


def test_work_stealing_programs_and_queue() -> None:
    # warps per SM over the heads, never more programs than items
    per_sm = mma.MMA_STEAL_WARPS_PER_SM
    assert mma.steal_programs(32, 4, 8, 1, 132) == min(128, -(-per_sm * 132 // 8))
    assert mma.steal_programs(32, 4, 8, 4, 132) == -(-per_sm * 132 // 32)
    assert mma.steal_programs(1, 1, 8, 1, 132) == 1
    assert mma.steal_programs(0, 3, 8, 1, 132) == 1  # an empty batch still launches
    # one zeroed queue per device and stream, two counters per kv head, grown when needed
    cpu = torch.device("cpu")
    q1 = mma.steal_queue(cpu, 8)
    assert q1.dtype == torch.int32 and q1.numel() >= 16 and not q1.any()
    assert mma.steal_queue(cpu, 8) is q1
    big = mma.steal_queue(cpu, q1.numel())  # more heads than it holds: a new one
    assert big is not q1 and big.numel() >= 2 * q1.numel()
    assert any(buf is q1 for buf in _triton._OUTGROWN)


def _h200(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H200's occupancy limits for mma_resident, on any machine."""
    from types import SimpleNamespace

    props = SimpleNamespace(
        multi_processor_count=132, shared_memory_per_multiprocessor=233472,
        max_threads_per_multi_processor=2048,
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(mma, "sm_count", lambda device: props.multi_processor_count)
    monkeypatch.setattr(mma, "cuda_capability", lambda device: (9, 0))


def test_a_wave_counts_the_programs_each_limit_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    _h200(monkeypatch)
    dev = torch.device("cuda", 0)
    assert mma.mma_shared_bytes(1, 32, 3, 128, 128) == 24576
    # shared memory: 233472 // (24576 + 1024) = 9 per SM
    assert mma.mma_resident((1, 32, None, 3), 128, 128, dev) == 9 * 132
    # registers: 160 a thread -> 5120 a warp -> 12 per SM (shared memory would allow 13)
    assert mma.mma_resident((1, 16, None, 4), 128, 128, dev) == 12 * 132
    # 4 warps of 128 registers: 4 per SM by registers and by shared memory (49152 + 1024)
    assert mma.mma_resident((4, 16, 128, 3), 128, 128, dev) == 4 * 132
    # no ring: registers, then the 32 blocks an SM holds
    assert mma.mma_resident((1, 16, 64, 0), 64, 64, dev) == 32 * 132
    monkeypatch.setattr(mma, "cuda_capability", lambda device: (8, 9))  # 24 blocks per SM
    assert mma.mma_resident((1, 16, 64, 0), 64, 64, dev) == 24 * 132


def test_decode_wave_is_the_mma_kernels_wave_per_kv_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the mma kernel runs the batch, the wave is its resident programs over the kv
    heads; with words, 0."""
    _h200(monkeypatch)
    monkeypatch.setattr(dec, "_run_mma", lambda kernel, *a: kernel != "words")
    q, k, v = _case(hq=32, hkv=8)
    q32 = q[:1].expand(32, -1, -1)
    assert tk.decode_wave(q32, k, v) == 9 * 132 // 8  # 32 requests: 32 tokens, 3 stages
    # 64 requests: 16 tokens, 4 stages, registers as ptxas allocates: 12 per SM by registers
    assert mma.mma_launch_shape(64) == (1, 16, None, 4)
    assert tk.decode_wave(q32[:1].expand(64, -1, -1), k, v) == 12 * 132 // 8
    assert tk.decode_wave(q32, k, v, fp8_kernel="words") == 0


def test_an_mma_default_that_cannot_run_falls_back_to_the_words_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where the environment asks for mma and the call cannot have it (here: the interpreter or
    # a CPU; on a GPU, a GQA group of 16), the Triton kernel runs and the answer is right.
    monkeypatch.setenv(envs.FP8_DECODE_KERNEL, "mma")
    device = CUDA_DEV if CUDA else torch.device("cpu")
    o, ref = run_decode([37, 5], num_q_heads=32, num_kv_heads=2, device=device,
                        dtype=torch.float16, kv_dtype=E4M3)  # fmt: skip
    assert_close(o, ref, (2e-2, 6e-2))


# ----------------------------------------------------------------------------------------------
# sm90 compile (no GPU needed)
# ----------------------------------------------------------------------------------------------

PROBE = """
import json
from benchmarks.kernel_sass import compile_gluon
from execrt.kernels.attention import decode_mma as mma

result = {}
for d, ahead, fused, e5m2, ring, steal in (
        (128, 2, False, False, 0, False), (128, 1, True, True, 0, False),
        (64, 2, True, False, 0, False), (256, 1, False, False, 0, False),
        (128, 1, False, False, 4, False), (64, 1, True, True, 3, False),
        (128, 1, True, False, 3, True)):
    lk, lv, lvp, lq, sk, sv = mma.mma_layouts(4, 16, d, d)
    consts = dict(GROUP=4, D=d, DV=d, W=4, T=16, AHEAD=ahead,
                  FUSED=fused, E5M2=e5m2, SLOT_I32=True, PDL=True, LK=lk, LV=lv, V_PAIRS=lvp,
                  LQ=lq, RING=ring, SK=sk, SV=sv, PREFETCH=False, PF_TOKENS=64, STEAL=steal)
    ptrs = {"q_ptr": "*bf16", "o_ptr": "*bf16", "k_ptr": "*i32", "v_ptr": "*i32",
            "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "kv_scales_ptr": "*fp32"}
    k = compile_gluon(mma._decode_mma_kernel, ptrs, consts, num_warps=4)
    ptx = k.asm["ptx"]
    lines = ptx.splitlines()
    moves = [i for i, ln in enumerate(lines) if "movmatrix" in ln]
    loop = lines[moves[0]:moves[-1] + 1] if moves else []
    fmt = "e5m2" if e5m2 else "e4m3"
    result[f"d{d}-ahead{ahead}-fused{fused}-{fmt}-ring{ring}" + ("-steal" if steal else "")] = {
        "movmatrix": len(moves),
        "mma": ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"),
        "cvt": ptx.count(f"cvt.rn.f16x2.{fmt}x2"),
        "prmt": ptx.count("prmt.b32"),
        "local": ptx.count("ld.local") + ptx.count("st.local"),
        "loop_shared": sum(("ld.shared" in ln or "st.shared" in ln) for ln in loop),
        "cp_async": ptx.count("cp.async.cg.shared.global") + ptx.count("cp.async.ca.shared.global"),
        "atomics": ptx.count("atom.") ,
    }
print(json.dumps(result))
"""


@needs_ptxas
def test_the_kernel_compiles_for_sm90_without_shared_memory_in_its_loop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Compiled ahead of time for sm90: every step of the unrolled loop has its two movmatrix
    transposes, QK and PV mmas (D / 16 + Dv / 16 per 16 tokens), one conversion per two
    values, and no shared-memory access from the first step's transpose to the last's (the
    whole point of the kernel); no local memory (spills); atomics only for the fused merge."""
    import json

    if mma.GLUON_IMPORT_ERROR is not None:
        pytest.skip(mma.GLUON_IMPORT_ERROR)
    got = json.loads(run_compile_probe(tmp_path, PROBE).strip().splitlines()[-1])
    assert len(got) == 7
    for name, k in got.items():
        d = int(name.split("-")[0][1:])
        ring = int(name.split("ring")[1].split("-")[0])
        # the loop's steps: unrolled ahead + 1 times for direct loads, once with a ring
        steps = int(name.split("ahead")[1].split("-")[0]) + 1 if ring == 0 else 1
        assert k["movmatrix"] == 2 * steps, (name, k)
        assert k["mma"] == steps * (d // 16 + d // 16), (name, k)
        # per step and thread: K and V, (T D / 4 / 32) words each, two cvt per word
        words = 16 * d // 4 // 32
        assert k["cvt"] == steps * 2 * 2 * words, (name, k)
        # from the first transpose to the last: no shared memory (converted values never go
        # through it; a ring's reads come before a step's first conversion)
        assert k["loop_shared"] == 0, (name, k)
        # a ring's stages filled ahead (none without a ring): per thread, 16-byte copies of
        # two K rows' D / 64 chunks, and one copy of up to 16 bytes of four V rows each
        assert k["cp_async"] == ring * (2 * (d // 64) + 4 * max(1, d // 128)), (name, k)
        assert k["local"] == 0, (name, k)
        # the fused merge's arrival and reset; work stealing's two draws, the programs'
        # count and the queue's two resets
        assert k["atomics"] == 2 * ("fusedTrue" in name) + 5 * ("steal" in name), (name, k)


# ----------------------------------------------------------------------------------------------
# On the GPU: against the float64 oracle
# ----------------------------------------------------------------------------------------------


def _run(seq_lens: list[int], **kw: object) -> None:
    dtype = kw.pop("dtype", torch.bfloat16)
    tol = kw.pop("tol", GPU_TOL[dtype])  # type: ignore[arg-type]
    num_kv_heads = kw.get("num_kv_heads", 8)
    max_splits = tk.SplitPolicy().max_splits(
        len(seq_lens), max(seq_lens), int(num_kv_heads),  # type: ignore[call-overload]
        torch.cuda.get_device_properties(0).multi_processor_count,
    )  # fmt: skip
    o, ref = run_decode(
        seq_lens, device=CUDA_DEV, dtype=dtype,  # type: ignore[arg-type]
        **({"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "max_splits": max_splits,
            "min_split_len": tk.DEFAULT_MIN_SPLIT_LEN, "kv_dtype": E4M3,
            "kv_scales": (4.0, 0.25), "fp8_kernel": "mma"} | kw),  # type: ignore[arg-type]
    )  # fmt: skip
    assert_close(o, ref, tol)  # type: ignore[arg-type]


@mma_gpu
@pytest.mark.gpu
def test_gpu_a_batch_just_past_a_wave_runs_in_one_wave_of_fewer_splits() -> None:
    """32 requests of 8,200 tokens (a decode step past an 8k prompt): the policy's 5 splits
    are 1,280 programs, past the 1,188 one-warp programs of 32 tokens and 3 stages that an
    sm90 GPU of 132 SMs holds. The wave rule cuts them to 4 (one wave), and the output
    still matches the oracle."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q = torch.empty(32, 32, 128, dtype=torch.bfloat16, device=CUDA_DEV)
    k = torch.empty(16, 8, 128, device=CUDA_DEV).to(E4M3)
    wave = tk.decode_wave(q, k, k)
    assert wave == mma.mma_resident(mma.mma_launch_shape(32), 128, 128, CUDA_DEV) // 8 > 0
    policy = tk.SplitPolicy()
    lens = torch.full((32,), 8200, dtype=torch.int64, device=CUDA_DEV)
    fill, top = policy.min_splits(32, 8, sms), policy.max_splits(32, 8200, 8, sms)
    plain = torch.empty(32, dtype=torch.int32, device=CUDA_DEV)
    tk.decode_num_splits(lens, plain, top, policy, fill)
    cut = torch.empty_like(plain)
    tk.decode_num_splits(lens, cut, top, policy, fill, wave=wave)
    assert plain.eq(5).all()
    want = tk.indices.wave_cap([8200] * 32, [5] * 32, wave)
    assert cut.tolist() == want
    if torch.cuda.get_device_capability() == (9, 0) and sms == 132:
        assert want == [4] * 32
    o, ref = run_decode(
        [8200] * 32, device=CUDA_DEV, dtype=torch.bfloat16, num_q_heads=32, num_kv_heads=8,
        head_dim=128, max_splits=top, num_splits=want, kv_dtype=E4M3, kv_scales=(4.0, 0.25),
        fp8_kernel="mma", seed=5,
    )  # fmt: skip
    assert_close(o, ref, GPU_TOL[torch.bfloat16])


@mma_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_mma_matches_the_oracle(dtype: torch.dtype, kv_dtype: torch.dtype, fused: bool) -> None:
    _run([8192, 1, 700, 4096], dtype=dtype, kv_dtype=kv_dtype, fused=fused, seed=31)


@mma_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hq", "hkv", "d"),
    [(8, 8, 64), (16, 8, 128), (9, 3, 64), (64, 8, 128), (16, 4, 256), (28, 4, 128)],
    ids=["g1-d64", "g2-d128", "g3-d64", "g8-d128", "g4-d256", "g7-d128"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_mma_groups_and_head_dims(hq: int, hkv: int, d: int, fused: bool) -> None:
    _run([1, 63, 64, 65, 191, 192, 193, 1000], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
         fused=fused, seed=hq + d)  # fmt: skip


@mma_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("maxnreg", [None, 168])
def test_gpu_mma_launch_shapes(ahead: int, maxnreg: int | None, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # K/V loaded straight into registers, ahead steps ahead (no ring)
    monkeypatch.setattr(mma, "MMA_WARPS", 4)
    monkeypatch.setattr(mma, "MMA_RING", 0)
    monkeypatch.setattr(mma, "MMA_AHEAD", ahead)
    monkeypatch.setattr(mma, "MMA_MAXNREG", maxnreg or 0)
    _run([3000, 17, 128, 129, 4095], seed=ahead)


def _force_table_row(monkeypatch: pytest.MonkeyPatch, row: int) -> None:
    """Every launch takes the shape of ``MMA_SHAPES_BY_BATCH[row]``, whatever its batch."""
    shape = mma.MMA_SHAPES_BY_BATCH[row][1]
    for name, value in zip(("WARPS", "TOKENS", "MAXNREG", "RING"), shape, strict=True):
        monkeypatch.setattr(mma, f"MMA_{name}", value)


@mma_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("row", range(len(mma.MMA_SHAPES_BY_BATCH)))
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_mma_every_shape_of_the_batch_table(row: int, fused: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Each shape the table gives some batch, forced on one ragged batch (block edges, one
    # token, several splits) and a GQA-3 head-dim-64 one.
    _force_table_row(monkeypatch, row)
    _run([3000, 17, 31, 32, 33, 4095, 1], fused=fused, seed=row)
    _run([1, 63, 64, 65, 191, 1000], num_q_heads=9, num_kv_heads=3, head_dim=64, fused=fused,
         seed=row + 1)  # fmt: skip


@mma_gpu
@pytest.mark.gpu
def test_gpu_mma_programs_with_several_items(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # One wave of programs (``programs="sm"``): each takes several items in turn, reusing the
    # shared memory of its combination step between them.
    lens = [
        int(x) for x in torch.randint(1, 3000, (300,), generator=torch.Generator().manual_seed(4))
    ]
    _run(lens, programs="sm", seed=5)
    _run(lens, programs="sm", fused=True, seed=6)


@mma_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("row", range(len(mma.MMA_SHAPES_BY_BATCH)))
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_mma_work_stealing_gives_the_same_bits(row: int, fused: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Items taken from the queue instead of every programs-th: each item is computed the
    # same way whichever program takes it, so the output keeps every bit; and every launch
    # leaves the queue zero for the next (here: several launches, and a graph replay).
    _force_table_row(monkeypatch, row)
    lens = [
        int(x) for x in torch.randint(1, 3000, (67,), generator=torch.Generator().manual_seed(2))
    ] + [1, 4095]
    outs = {}
    for steal in (False, True, True):
        monkeypatch.setattr(mma, "MMA_STEAL", steal)
        o, ref = run_decode(lens, device=CUDA_DEV, dtype=torch.bfloat16, num_q_heads=32,
                            num_kv_heads=8, head_dim=128, max_splits=8, min_split_len=128,
                            kv_dtype=E4M3, kv_scales=(4.0, 0.25), fp8_kernel="mma",
                            fused=fused, seed=row)  # fmt: skip
        torch.cuda.synchronize()
        assert_close(o, ref, GPU_TOL[torch.bfloat16])
        outs.setdefault(steal, []).append(o)
        if steal:
            assert not mma.steal_queue(CUDA_DEV, 8).any()
    assert torch.equal(outs[False][0], outs[True][0])
    assert torch.equal(outs[True][0], outs[True][1])


@mma_gpu
@pytest.mark.gpu
def test_gpu_mma_work_stealing_in_a_graph(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mma, "MMA_STEAL", True)
    _graph_replay_is_bitwise()


@mma_gpu
@pytest.mark.gpu
def test_gpu_mma_int64_offsets(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Caches past 2^31 elements address rows in int64: the same bits as int32 here.
    monkeypatch.setattr(dec, "int32_slot_offsets", lambda *_: False)
    _run([700, 5, 2048], seed=8)


@mma_gpu
@pytest.mark.gpu
def test_gpu_mma_agrees_with_the_words_kernel() -> None:
    # Same fp16 dots, same cache: the two kernels differ by summation order only.
    outs = []
    for kernel in ("words", "mma"):
        o, ref = run_decode(
            [513, 2048, 77], num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
            device=CUDA_DEV, max_splits=8, min_split_len=256, block_n=64, seed=12,
            kv_dtype=E4M3, kv_scales=(0.5, 2.0), fp8_kernel=kernel,
        )  # fmt: skip
        outs.append(o.float())
    rel = (outs[0] - outs[1]).norm() / outs[0].norm()
    assert rel < 5e-3, rel


@mma_gpu
@pytest.mark.gpu
def test_gpu_mma_graph_replay_is_bitwise() -> None:
    _graph_replay_is_bitwise()


def _graph_replay_is_bitwise() -> None:
    """Eager, then three replays of the captured launch: the same bits each time."""
    from tests.kernels.attention.test_decode import flat_indices, fp8_cache, make_cache

    gen = torch.Generator().manual_seed(3)
    lens = [900, 3, 4000]
    cache = make_cache(lens, 8, 128, 128, torch.bfloat16, CUDA_DEV, gen)
    cache, _, scales = fp8_cache(cache, E4M3, (2.0, 0.5))
    q = torch.randn(3, 32, 128, generator=gen).to(torch.bfloat16).to(CUDA_DEV)
    indptr, indices = flat_indices(cache)
    splits = torch.empty(3, dtype=torch.int32, device=CUDA_DEV)
    max_splits = 8
    tk.decode_num_splits(torch.tensor(lens, dtype=torch.int32, device=CUDA_DEV), splits,
                         max_splits, tk.SplitPolicy(256, 256))  # fmt: skip
    work = torch.empty(tk.work_size(3, max_splits), dtype=torch.int32, device=CUDA_DEV)
    tk.decode_work(splits, max_splits, work)
    part_o = torch.empty(3, 32, max_splits, 128, device=CUDA_DEV)
    part_lse = torch.empty(3, 32, max_splits, device=CUDA_DEV)
    o = torch.empty(3, 32, 128, dtype=torch.bfloat16, device=CUDA_DEV)

    def call() -> None:
        tk.decode_attention(
            q, cache.k, cache.v, o, indptr, indices, splits, part_o, part_lse, 128**-0.5,
            max_splits, kv_scales=scales, work=work, fp8_kernel="mma",
        )  # fmt: skip

    call()
    eager = o.clone()
    o.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, eager)


@mma_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("ring", [3, 4])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_mma_ring(ring: int, fused: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # K/V through a cp.async ring of shared memory: the same answer.
    monkeypatch.setattr(mma, "MMA_RING", ring)
    _run([3000, 17, 128, 129, 4095, 1], fused=fused, seed=ring)
    _run([1, 63, 64, 65, 191, 192, 193, 1000], num_q_heads=9, num_kv_heads=3, head_dim=64,
         fused=fused, seed=ring + 1)  # fmt: skip
    lens = [
        int(x) for x in torch.randint(1, 3000, (300,), generator=torch.Generator().manual_seed(9))
    ]
    _run(lens, programs="sm", fused=fused, seed=10)


@mma_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("warps", [1, 2])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_mma_smaller_programs(warps: int, fused: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Programs of one or two warps (each warp a whole item when one): the same answer.
    monkeypatch.setattr(mma, "MMA_WARPS", warps)
    monkeypatch.setattr(mma, "MMA_RING", 4)
    _run([3000, 17, 128, 129, 4095, 1], fused=fused, seed=warps)
    _run([1, 63, 64, 65, 191, 1000], num_q_heads=9, num_kv_heads=3, head_dim=64, fused=fused,
         seed=warps + 1)  # fmt: skip
