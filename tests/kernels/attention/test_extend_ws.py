"""The warp-specialised (Gluon) extend kernel: its refusals and choice everywhere, its sm90
compile on any machine with Triton's ptxas, and its output against the float64 oracle on an
sm90 GPU (ragged batches, prefix 0 and long, one-token extends, head dims 64/128, GQA 1/4/8,
the issue's shapes, graph replay)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from execrt.kernels import attention as tk
from execrt.kernels.attention import extend as ext
from execrt.kernels.attention import extend_ws as ws
from tests.kernels.attention.test_decode import CUDA, GPU_TOL, SMALL, assert_close
from tests.kernels.attention.test_extend import ISSUE_SHAPES, check_issue_shape, run_extend
from tests.kernels.helpers import needs_ptxas, run_compile_probe


def _sm90() -> bool:
    return CUDA and torch.cuda.get_device_capability()[0] == 9


sm90 = pytest.mark.skipif(
    not ws.gluon_on_sm90(), reason="needs an sm90 GPU and Gluon (the kernel uses Hopper's wgmma)"
)
CUDA_DEV = torch.device("cuda")


# ----------------------------------------------------------------------------------------------
# Refusals and choice (every machine)
# ----------------------------------------------------------------------------------------------


def test_the_kernel_is_refused_by_name_where_it_cannot_run() -> None:
    q = torch.zeros(3, 4, 64, device=SMALL)
    k = torch.zeros(10, 2, 64, device=SMALL)
    i32 = torch.zeros(2, dtype=torch.int32, device=SMALL)
    why = ws.ws_unsupported(q, k, k, None, 64, 64)
    if not _sm90():
        assert why is not None
        with pytest.raises(ValueError, match="kernel 'ws' cannot run this call: "):
            tk.extend_attention(q, k, k, q.clone(), i32, i32, i32, i32[:1], 3, 0.1, kernel="ws")
    # Whatever the machine, these calls are refused with what they ask for.
    fp32 = ws.ws_unsupported(q.float(), k.float(), k.float(), None, 64, 64)
    assert fp32 is not None
    if ws.GLUON_IMPORT_ERROR is None and _sm90():
        qc, kc = q.to(CUDA_DEV, torch.bfloat16), k.to(CUDA_DEV, torch.bfloat16)
        assert ws.ws_unsupported(qc, kc, kc, None, 64, 64) is None
        assert "fp16 or bf16" in str(ws.ws_unsupported(qc, kc.half(), kc, None, 64, 64))
        assert "fp16 or bf16" in str(ws.ws_unsupported(qc, kc, kc, torch.ones(2), 64, 64))
        assert "head dims 96/96" in str(ws.ws_unsupported(qc, kc, kc, None, 96, 96))
        assert "head dims 64/32" in str(ws.ws_unsupported(qc, kc, kc, None, 64, 32))


@pytest.mark.parametrize(
    ("tiles", "why"),
    [
        ((128, 128, 8, 2, 128), None),
        ((64, 64, 4, 3, 128), "num_warps 4 / block_m 64"),
        ((128, 128, 8, 3, 64), None),
        ((64, 128, 8, 2, 128), "num_warps 8 / block_m 64"),
        ((128, 128, 2, 2, 128), "num_warps 2"),
        ((256, 64, 8, 2, 128), "block_m 256"),
        ((128, 512, 8, 2, 128), "block_n 512"),
        ((128, 128, 8, 1, 128), "num_stages 1"),
        ((128, 128, 8, 3, 128), None),  # 224 KB: fits
        ((128, 128, 8, 4, 128), "288 KB"),
        ((128, 64, 8, 8, 128), "288 KB"),
    ],
)
def test_tiles_the_kernel_takes(tiles: tuple[int, ...], why: str | None) -> None:
    got = ws.ws_tiles_unsupported(*tiles, elem_bytes=2)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got


def test_a_table_that_uses_ws_falls_back_where_it_cannot_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fresh = ext.ExtendChoice(ext.ExtendTiles(128, 64, 8, 3))
    gather = ext.ExtendChoice(ext.ExtendTiles(128, 64, 8, 3))
    kernel_ws = ext.ExtendChoice(ext.ExtendTiles(128, 128, 8, 2), 4, None)
    entry = ext.TableEntry("ws", {"fresh": fresh, "gather": gather, "ws": kernel_ws})
    monkeypatch.setattr(ext, "table_entry", lambda *a: entry)
    q = torch.zeros(3, 4, 64, device=SMALL)
    k = torch.zeros(10, 2, 64, device=SMALL)
    if _sm90() and ws.GLUON_IMPORT_ERROR is None:
        qc, kc = q.to(CUDA_DEV, torch.bfloat16), k.to(CUDA_DEV, torch.bfloat16)
        assert ext.choose_kernel(qc, kc, None, None, 64) == "ws"
        # an fp8 cache (scales given) or a head dim it does not take: the next kernel
        assert ext.choose_kernel(qc, kc, kc[:3], torch.ones(2), 64) == "gather"
        assert ext.choose_kernel(qc, kc, kc[:3], None, 64, head_dim_v=32) == "fresh"
    else:  # here the kernel cannot run: the table's other kernels serve the call
        assert ext.choose_kernel(q, k, None, None, 64) == "gather"
        new = k[:3]
        assert ext.choose_kernel(q, k, new, None, 64) == ("fresh" if not CUDA else "gather")
    # the tuned launch of the ws kernel is read back from its entry
    assert ext.extend_choice(torch.bfloat16, 128, CUDA_DEV, "ws") == kernel_ws


def test_the_persistent_choice_goes_through_the_table() -> None:
    choice = ext.ExtendChoice(ext.ExtendTiles(128, 128, 8, 2), None, 3, True, True)
    assert ext.ExtendChoice.from_json(choice.to_json()) == choice
    # tables written before the field existed read as one program per tile
    old = {k: v for k, v in choice.to_json().items() if k != "persistent"}
    assert ext.ExtendChoice.from_json(old).persistent is False


def test_untuned_ws_tiles_fit_the_kernel() -> None:
    for d, tiles in ext._WS_TILES.items():
        why = ws.ws_tiles_unsupported(
            tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages, d, 2
        )
        assert why is None, (d, why)
    assert ext.extend_choice(torch.bfloat16, 128, CUDA_DEV, "ws").tiles == ext._WS_TILES[128]


# ----------------------------------------------------------------------------------------------
# sm90 compile (no GPU needed)
# ----------------------------------------------------------------------------------------------

PROBE = """
import json
from benchmarks.kernel_sass import compile_gluon
from execrt.kernels.attention import extend as ext
from execrt.kernels.attention import extend_ws as ws

result = {}
for d, t in sorted(ext._WS_TILES.items()):
    for dtype in ("bf16", "fp16"):
        ptrs = {n: "*" + dtype for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
        ptrs |= {n: "*i32" for n in ("qo_indptr_ptr", "kv_indptr_ptr", "kv_indices_ptr",
                                     "prefix_lens_ptr")}
        consts = dict(GROUP=4, HEADS=4, HEAD_DIM=d, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                      STAGES=t.num_stages, LOAD_WARPS=ws.LOAD_WARPS, LOAD_REGS=ws.LOAD_REGS,
                      CONSUMER_REGS=ws.CONSUMER_REGS, OVERLAP=True, num_warps=4)
        k = compile_gluon(ws._extend_ws_kernel, ptrs, consts, num_warps=4)
        ptx = k.asm["ptx"]
        arrives = [ln.strip() for ln in ptx.splitlines() if "cp.async.mbarrier.arrive" in ln]
        result[f"{dtype}-d{d}"] = {
            "shared": k.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"),
            "cp_async": ptx.count("cp.async.cg.shared.global"),
            "arrives": arrives,
            "setmaxnreg": ptx.count("setmaxnreg"),
        }
print(json.dumps(result))
"""


@needs_ptxas
def test_the_kernel_compiles_for_sm90_with_its_protocol(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Compiled ahead of time for sm90 (the installed triton's Gluon and ptxas): wgmmas,
    cp.async gathers, registers moved between the warp groups, the shared memory the tiles
    promise, and every barrier arrival per thread (``noinc``, unpredicated: the barriers
    count every thread of a side, so one thread's arrival alone would never fill them)."""
    import json

    if ws.GLUON_IMPORT_ERROR is not None:
        pytest.skip(ws.GLUON_IMPORT_ERROR)
    got = json.loads(run_compile_probe(tmp_path, PROBE).strip().splitlines()[-1])
    assert set(got) == {f"{t}-d{d}" for t in ("bf16", "fp16") for d in ext._WS_TILES}
    for name, k in got.items():
        d = int(name.split("-d")[1])
        t = ext._WS_TILES[d]
        assert k["wgmma"] > 0 and k["cp_async"] > 0 and k["setmaxnreg"] > 0, name
        promised = (t.block_m + 2 * t.num_stages * t.block_n) * d * 2
        assert promised <= k["shared"] <= promised + 1024, (name, k["shared"])
        # k and v ready (the producer); empty in the loop and after it (each of the two
        # consumer partitions, one per warp group)
        assert len(k["arrives"]) == 2 + 2 * 2, (name, k["arrives"])
        for line in k["arrives"]:
            assert line.startswith("cp.async.mbarrier.arrive.noinc"), (name, line)


# ----------------------------------------------------------------------------------------------
# sm90 GPU: against the float64 oracle
# ----------------------------------------------------------------------------------------------


def _run(prefix_lens: list[int], extend_lens: list[int], **kw: object) -> None:
    dtype = kw.pop("dtype", torch.bfloat16)
    o, ref = run_extend(
        prefix_lens, extend_lens, device=CUDA_DEV, dtype=dtype,  # type: ignore[arg-type]
        **({"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_m": None,
            "block_n": None, "pad_rows": 5, "kernel": "ws"} | kw),  # type: ignore[arg-type]
    )  # fmt: skip
    assert_close(o, ref, GPU_TOL[dtype])  # type: ignore[index]


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens"),
    [([0, 0], [1000, 333]), ([0, 5, 2000, 4000], [700, 1, 1024, 77]), ([100] * 8, [1] * 8),
     ([0], [1]), ([127, 128, 129], [128, 129, 255])],
    ids=["no-prefix", "mixed-prefix", "single-token", "one-token", "block-edges"],
)  # fmt: skip
def test_gpu_ws(dtype: torch.dtype, prefix_lens: list[int], extend_lens: list[int]) -> None:
    _run(prefix_lens, extend_lens, dtype=dtype, seed=520)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(32, 8, 64), (8, 8, 128), (32, 4, 128), (24, 8, 128), (64, 8, 64)],
    ids=["d64-gqa4", "mha", "gqa8", "gqa3", "d64-gqa8"],
)
def test_gpu_ws_heads(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    _run(
        [0, 300, 1], [500, 129, 64], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, seed=530,
    )  # fmt: skip


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize(
    "tiles",
    [
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 4},
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
        {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "heads_per_tile": 1},
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "pairs_per_chunk": 1},
        {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "persistent": True},
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 4, "persistent": True},
    ],
    ids=["128x64s4", "128x64s2", "h1", "c1", "persistent", "persistent-128x64"],
)
def test_gpu_ws_tuning_candidates(tiles: dict[str, int]) -> None:
    # The tiles the tuning sweep times must be right too, the idle tiles of short requests
    # (extra_grid) included.
    _run([0, 700, 33], [900, 200, 1], seed=540, extra_grid=300, **tiles)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize(("bs", "new", "prefix"), ISSUE_SHAPES)
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
def test_gpu_ws_issue_shapes(bs: int, new: int, prefix: int, persistent: bool) -> None:
    check_issue_shape(bs, new, prefix, 550 + bs, kernel="ws", persistent=persistent)


@sm90
@pytest.mark.gpu
def test_gpu_ws_persistent_programs_walk_many_ragged_tiles() -> None:
    # More tiles than programs, of every length (idle ones included): each program's ring
    # carries over from tile to tile, and a program whose tiles are all idle still exits.
    lens = [1 + (37 * i) % 700 for i in range(60)]
    prefixes = [(53 * i) % 900 for i in range(60)]
    _run(prefixes, lens, seed=545, extra_grid=100, persistent=True)


@sm90
@pytest.mark.gpu
def test_gpu_ws_replays_in_a_graph_bit_for_bit() -> None:
    from tests.kernels.attention.test_decode import flat_indices, make_cache

    gen = torch.Generator().manual_seed(560)
    cache = make_cache([300, 41, 1000], 8, 128, 128, torch.bfloat16, CUDA_DEV, gen)
    kv_indptr, kv_indices = flat_indices(cache)
    extend = [200, 41, 17]
    q = torch.randn(sum(extend), 32, 128, generator=gen).to(torch.bfloat16).to(CUDA_DEV)
    qo_indptr = torch.tensor([0, 200, 241, 258], dtype=torch.int32, device=CUDA_DEV)
    prefix_lens = torch.tensor([100, 0, 983], dtype=torch.int32, device=CUDA_DEV)

    def call(o: torch.Tensor) -> None:
        tk.extend_attention(
            q, cache.k, cache.v, o, qo_indptr, kv_indptr, kv_indices, prefix_lens, 200,
            128**-0.5, max_kv_len=1000, kernel="ws",
        )  # fmt: skip

    eager = torch.full_like(q, float("nan"))
    call(eager)
    replayed = torch.full_like(q, float("nan"))
    call(replayed)  # compiled before the capture
    replayed.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(replayed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)


@pytest.mark.skipif(ws.GLUON_IMPORT_ERROR is not None, reason="this triton has no Gluon")
@pytest.mark.parametrize(("persistent", "grid"), [(False, 600), (True, 132)])
def test_the_launch_binds_every_kernel_parameter(monkeypatch, persistent: bool, grid: int) -> None:  # type: ignore[no-untyped-def]
    """Without a GPU: what ``launch_ws`` passes binds to the kernel's parameters exactly
    (a missing or misspelt constexpr would otherwise surface only on an sm90 machine), on
    the grid the schedule asks for."""
    import inspect

    kernel = ws._extend_ws_kernel
    launched = {}

    class Recorder:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            def run(*args, **kwargs):  # type: ignore[no-untyped-def]
                launched.update(grid=grid, args=args, kwargs=kwargs)

            return run

    monkeypatch.setattr(ws, "_extend_ws_kernel", Recorder())
    monkeypatch.setattr(ws, "sm_count", lambda device: 132)
    q = torch.zeros(40, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(100, 2, 128, dtype=torch.bfloat16)
    i32 = torch.zeros(3, dtype=torch.int32)
    ws.launch_ws(
        q, k, k, q.clone(), i32, i32, i32, i32, 0.1, (3, 2, 200, 2), group=4, heads=4,
        block_m=128, block_n=128, num_warps=8, num_stages=2, persistent=persistent,
    )  # fmt: skip
    # 600 tiles (200 pairs x 3 query tiles): one program each, or one per SM (160 KB each)
    assert launched["grid"] == (grid,)
    kwargs = dict(launched["kwargs"])
    assert kwargs["num_warps"] == 4  # per consumer partition: 8 consumer warps in two
    signature = inspect.signature(kernel.fn)
    bound = signature.bind(*launched["args"], **kwargs)
    assert set(bound.arguments) == set(signature.parameters)


def test_a_table_that_uses_ws_yields_to_tiles_the_caller_names(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The H200's table says ws; a caller naming tiles ws cannot run (64-row tiles, 4 warps)
    # gets the kernel the table would pick without ws, not a refusal.
    entry = ext.TableEntry("ws", {"ws": ext.ExtendChoice(ext.ExtendTiles(128, 64, 8, 4))})
    monkeypatch.setattr(ext, "table_entry", lambda *a: entry)
    monkeypatch.setattr(ext, "ws_unsupported", lambda *a: None)  # "runs here"
    launched = []
    monkeypatch.setattr(ext, "launch_ws", lambda *a, **k: launched.append("ws"))
    o, ref = run_extend([0, 5], [7, 3], block_m=64, block_n=64, num_warps=4)
    assert launched == []  # gather ran (the interpreter) and gave the right output
    assert_close(o, ref, GPU_TOL[torch.float32] if CUDA else (1e-5, 1e-5))
    run_extend([0, 5], [7, 3], block_m=None, block_n=None)  # the table's own tiles: ws
    assert launched == ["ws"]
