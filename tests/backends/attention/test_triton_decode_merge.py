"""The triton backend's ``decode_merge`` option: ``auto`` fuses the merge into the split launch
exactly where the split policy gives a batch's requests one split each (min_splits 1), and the
outputs are those of the separate merge either way."""

from __future__ import annotations

import sys

import pytest
import torch

from execrt.core.batch import ForwardBatch, ForwardMode
from execrt.core.context import RuntimeContext
from execrt.core.errors import ConfigError
from execrt.core.interfaces import AttentionBackendInit, AttentionLayer, AttentionStep
from execrt.core.memory import KVCache, ReqToTokenPool
from execrt.plugins.builtin import TRITON_ATTENTION

pytest.importorskip("triton")
# On CUDA machines the kernels run on the GPU; elsewhere under the interpreter (conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HQ, HKV, D, CTX = 4, 2, 32, 640
SMS = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE.type == "cuda" else 4
# The smallest batch the split policy gives one split per request (2 programs per SM):
# fused under auto; every smaller batch keeps the separate merge.
FILLS = -(-2 * SMS // HKV)
MAX_BS = FILLS


def _backend(merge: str, pool: ReqToTokenPool, cache: KVCache, **options):  # type: ignore[no-untyped-def]
    from execrt.backends.attention.triton import TritonAttnBackend

    return TritonAttnBackend(
        AttentionBackendInit(
            capabilities=TRITON_ATTENTION, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
            v_head_dim=D, num_layers=1, dtype=torch.float32, device=DEVICE,
            req_to_token_pool=pool, kv_cache=cache, max_batch_size=MAX_BS, max_context_len=CTX,
            context=RuntimeContext(), options={"decode_merge": merge, **options},
        )
    )  # fmt: skip


def _state(bs: int, lens: list[int]) -> tuple[ReqToTokenPool, KVCache, ForwardBatch]:
    g = torch.Generator().manual_seed(bs)
    total = sum(lens)
    pool = ReqToTokenPool(MAX_BS, CTX, DEVICE)
    cache = KVCache(total, 1, HKV, D, torch.float32, DEVICE)
    slots = torch.randperm(total, generator=g) + 1  # slot 0 is padding
    start = 0
    for row, n in enumerate(lens, start=1):
        pool.req_to_token[row, :n] = slots[start : start + n].to(torch.int32).to(DEVICE)
        start += n
    for buf in (cache.k_buffers[0], cache.v_buffers[0]):
        buf.copy_(torch.randn(buf.shape, generator=g))
    seq = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    fb = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        positions=seq - 1,
        req_pool_indices=torch.arange(1, bs + 1, device=DEVICE),
        seq_lens=seq,
        out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        seq_lens_cpu=list(lens),
        prefix_lens_cpu=[n - 1 for n in lens],
        extend_lens_cpu=[1] * bs,
    )
    return pool, cache, fb


def test_auto_fuses_where_requests_get_one_split_each() -> None:
    pool, cache, _ = _state(1, [4])
    auto, fused, separate = (_backend(m, pool, cache) for m in ("auto", "fused", "separate"))
    assert auto.num_sms == SMS
    for bs in range(1, MAX_BS + 1):
        one_split = auto.split_policy.min_splits(bs, HKV, SMS) == 1
        assert auto.fuses_merge(bs) is one_split is (bs >= FILLS), bs
        assert fused.fuses_merge(bs) and not separate.fuses_merge(bs)


@pytest.mark.parametrize("graph", [False, True])
def test_auto_gives_the_separate_merges_output_with_counters_only_where_it_fuses(graph) -> None:  # type: ignore[no-untyped-def]
    layer = AttentionLayer(0, HQ, HKV, D, D, D**-0.5)
    for bs in (1, FILLS - 1, FILLS):
        # Contexts of several minimum-length splits (128 tokens) and, in the larger batches,
        # one of a single token: below FILLS the long ones split, at FILLS none does.
        lens = [CTX - 1 - (97 * i) % 400 for i in range(bs - 1)] + [CTX - 1 if bs == 1 else 1]
        pool, cache, fb = _state(bs, lens)
        q = torch.randn(bs, HQ, D, generator=torch.Generator().manual_seed(7)).to(DEVICE)
        outs = {}
        for merge in ("separate", "auto"):
            backend = _backend(merge, pool, cache)
            if graph:
                backend.init_graph_state(MAX_BS, MAX_BS)
                assert ("arrivals" in backend._graph) is (merge == "auto")
            meta = backend.plan_graph(fb) if graph else backend.plan(fb)
            assert (meta.arrivals is not None) is backend.fuses_merge(bs)
            splits = meta.num_splits[:bs].tolist()
            assert (max(splits) == 1) is (bs >= FILLS), (bs, splits)
            step = AttentionStep(backend, meta, fb.out_cache_loc, fb.mode)
            outs[merge] = backend.attend(q, layer, step)
            if meta.arrivals is not None:
                assert int(meta.arrivals.abs().sum()) == 0  # every launch leaves them zero
        torch.testing.assert_close(outs["auto"], outs["separate"], rtol=1e-5, atol=1e-5)


def test_unknown_merge_is_refused_naming_the_value_and_the_choices() -> None:
    pool, cache, _ = _state(1, [4])
    with pytest.raises(
        ConfigError,
        match=r"decode_merge 'last' unsupported \(supported: separate, fused, auto\)",
    ):
        _backend("last", pool, cache)


def test_a_shorter_split_target_cuts_full_batches_into_more_splits_with_the_same_output() -> None:
    """``decode_split_target``: a full batch (one split per request by default) of contexts
    up to 639 tokens gets cdiv(len, 128) splits at target 128, and the same attention."""
    bs = FILLS
    lens = [CTX - 1 - (97 * i) % 400 for i in range(bs)]
    pool, cache, fb = _state(bs, lens)
    layer = AttentionLayer(0, HQ, HKV, D, D, D**-0.5)
    q = torch.randn(bs, HQ, D, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    outs, splits = {}, {}
    for target in (0, 128):
        backend = _backend("auto", pool, cache, decode_split_target=target)
        meta = backend.plan(fb)
        splits[target] = meta.num_splits[:bs].tolist()
        outs[target] = backend.attend(
            q, layer, AttentionStep(backend, meta, fb.out_cache_loc, fb.mode)
        )
    assert splits[0] == [1] * bs
    assert splits[128] == [-(-n // 128) for n in lens]
    # Other splits round differently: the interpreter's fp32 dots agree to 1e-5; a GPU's fp32
    # tl.dot runs in TF32 (10 mantissa bits; the H200 measured 9e-5 apart).
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-3
    torch.testing.assert_close(outs[128], outs[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("target", [-1, "512", 2.5, True])
def test_a_bad_split_target_is_refused_naming_the_value(target) -> None:  # type: ignore[no-untyped-def]
    pool, cache, _ = _state(1, [4])
    with pytest.raises(ConfigError, match=rf"decode_split_target {target!r} unsupported"):
        _backend("auto", pool, cache, decode_split_target=target)


def test_a_split_target_below_the_minimum_split_lowers_the_minimum() -> None:
    pool, cache, _ = _state(1, [4])
    policy = _backend("auto", pool, cache, decode_split_target=64).split_policy
    assert (policy.target_split_len, policy.min_split_len) == (64, 64)
    default = _backend("auto", pool, cache).split_policy
    assert default == _backend("auto", pool, cache, decode_split_target=0).split_policy


def test_a_minimum_split_gives_a_short_lone_request_one_split_and_the_same_output() -> None:
    """``decode_min_split``: a lone request (whose batch cannot fill the GPU, so the policy
    cuts it as fine as it may) gets cdiv(len, min) splits, one where it is no longer than the
    minimum; under the fused merge that one split writes the output itself."""
    lens = [CTX - 1]
    pool, cache, fb = _state(1, lens)
    layer = AttentionLayer(0, HQ, HKV, D, D, D**-0.5)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    outs, splits = {}, {}
    for merge, min_split in (("separate", 0), ("fused", CTX), ("separate", 256)):
        backend = _backend(merge, pool, cache, decode_min_split=min_split)
        meta = backend.plan(fb)
        splits[min_split] = meta.num_splits[:1].tolist()
        outs[min_split] = backend.attend(
            q, layer, AttentionStep(backend, meta, fb.out_cache_loc, fb.mode)
        )
    fill = -(-2 * SMS // HKV)  # the splits a lone request is cut into to fill the GPU
    assert splits == {m: [min(fill, -(-(CTX - 1) // (m or 128)))] for m in (0, CTX, 256)}
    assert splits[CTX] == [1] and splits[256] < splits[0]
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-3
    torch.testing.assert_close(outs[CTX], outs[0], rtol=tol, atol=tol)
    torch.testing.assert_close(outs[256], outs[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("graph", [False, True])
def test_a_tuned_entry_sets_its_batch_sizes_shortest_split_and_merge(graph, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A tile table entry with ``min_split_len`` and ``merge`` (docs/kernels.md: on an H100 a
    batch of 8-16 short requests is faster in one split each with no merge launch): its batch
    sizes get splits of at least that length and, under ``auto``, that merge; other batch
    sizes keep the policy's; ``decode_min_split`` and a named merge override the entry; the
    attention is the default plan's."""
    from dataclasses import replace

    from execrt.kernels import attention as kernels

    bs, lens = 3, [CTX - 1, 400, 100]
    pool, cache, fb = _state(bs, lens)
    plain = kernels.decode_tiles(torch.float32, D, bs, torch.device("cpu"))
    tuned = replace(plain, min_split_len=512, merge="fused")
    real = kernels.decode_tiles
    monkeypatch.setattr(
        kernels,
        "decode_tiles",
        lambda dtype, d, b, dev: tuned if b == bs else real(dtype, d, b, dev),
    )
    layer = AttentionLayer(0, HQ, HKV, D, D, D**-0.5)
    q = torch.randn(bs, HQ, D, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    fill = -(-2 * SMS // (bs * HKV))
    assert fill > 1, "the batch does not fill the GPU: the policy alone would split every request"
    policy = [min(fill, -(-n // 128)) for n in lens]
    shortest = [min(fill, -(-n // 512)) for n in lens]
    cases = [  # (merge, options, fuses, splits)
        ("auto", {}, True, shortest),
        ("auto", {"decode_min_split": 128}, True, policy),
        ("separate", {}, False, shortest),
    ]
    outs = []
    for merge, options, fuses, splits in cases:
        backend = _backend(merge, pool, cache, **options)
        assert backend.fuses_merge(bs) is fuses and backend.fuses_merge(bs - 1) is False
        if graph:
            backend.init_graph_state(MAX_BS, MAX_BS)
        meta = backend.plan_graph(fb) if graph else backend.plan(fb)
        assert meta.num_splits[:bs].tolist() == splits, (merge, options)
        assert (meta.arrivals is not None) is fuses
        outs.append(
            backend.attend(q, layer, AttentionStep(backend, meta, fb.out_cache_loc, fb.mode))
        )
        if fuses:
            assert int(meta.arrivals.abs().sum()) == 0
    assert shortest != policy  # the entry changed the splits
    reference = _backend("separate", pool, cache, decode_min_split=128)
    meta = reference.plan(fb)
    want = reference.attend(q, layer, AttentionStep(reference, meta, fb.out_cache_loc, fb.mode))
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-3
    for out in outs:
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("min_split", "why"),
    [(-1, "a token count"), (True, "a token count"), (4096, "at most the split target")],
)
def test_a_bad_minimum_split_is_refused_naming_the_value(min_split, why) -> None:  # type: ignore[no-untyped-def]
    pool, cache, _ = _state(1, [4])
    with pytest.raises(ConfigError, match=rf"decode_min_split {min_split!r} unsupported \({why}"):
        _backend("auto", pool, cache, decode_min_split=min_split)


@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize("graph", [False, True])
def test_one_wave_of_programs_gives_the_per_request_grids_output(merge, graph, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``decode_programs = sm``: fewer programs, each taking several work items (across
    requests, with the look-ahead), and the same attention as a program per request."""
    bs = 3 * FILLS  # three times the wave: programs of several requests each
    monkeypatch.setattr(sys.modules[__name__], "MAX_BS", bs)  # (the pool and the backend)
    layer = AttentionLayer(0, HQ, HKV, D, D, D**-0.5)
    lens = [CTX - 1 - (97 * i) % 400 for i in range(bs - 1)] + [1]
    pool, cache, fb = _state(bs, lens)
    q = torch.randn(bs, HQ, D, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    outs = {}
    for programs in ("request", "sm"):
        backend = _backend(merge, pool, cache, decode_programs=programs)
        if graph:
            backend.init_graph_state(bs, bs)
        meta = backend.plan_graph(fb) if graph else backend.plan(fb)
        step = AttentionStep(backend, meta, fb.out_cache_loc, fb.mode)
        outs[programs] = backend.attend(q, layer, step)
        if meta.arrivals is not None:
            assert int(meta.arrivals.abs().sum()) == 0
    per_head = backend.kernels.decode_programs(bs, HKV, meta.max_splits, SMS, "sm")
    assert per_head < bs  # the case does give programs several requests' items
    # The same items in the same order per program's share: bit for bit under the
    # interpreter; the GPU's programs may finish in another order (fused merge: the same sum)
    torch.testing.assert_close(outs["sm"], outs["request"], rtol=1e-6, atol=1e-6)


def test_unknown_programs_policy_is_refused_naming_the_value_and_the_choices() -> None:
    pool, cache, _ = _state(1, [4])
    with pytest.raises(
        ConfigError, match=r"decode_programs 'all' unsupported \(supported: request, sm\)"
    ):
        _backend("auto", pool, cache, decode_programs="all")


def test_a_named_extend_kernel_is_checked_when_the_backend_is_built() -> None:
    pool, cache, _ = _state(2, [5, 9])
    with pytest.raises(ConfigError, match=r"extend_kernel 'flash' unsupported \(supported: "):
        _backend("auto", pool, cache, extend_kernel="flash")
    # fp32 q over an fp32 cache: the ws kernel (16-bit, sm90, Gluon) cannot run here
    with pytest.raises(ConfigError, match="extend_kernel 'ws' cannot run here: "):
        _backend("auto", pool, cache, extend_kernel="ws")
    for kernel in ("auto", "gather", "fresh"):
        assert _backend("auto", pool, cache, extend_kernel=kernel).extend_kernel == kernel


def test_a_named_fp8_decode_kernel_is_checked_when_the_backend_is_built() -> None:
    pool, cache, _ = _state(2, [5, 9])
    with pytest.raises(ConfigError, match=r"decode_fp8_kernel 'bytes' unsupported \(supported: "):
        _backend("auto", pool, cache, decode_fp8_kernel="bytes")
    # this cache is fp32: the mma kernel reads fp8 caches only, and says so at build time
    with pytest.raises(ConfigError, match="decode_fp8_kernel 'mma' cannot run here: "):
        _backend("auto", pool, cache, decode_fp8_kernel="mma")
    for kernel in ("auto", "words"):
        assert _backend("auto", pool, cache, decode_fp8_kernel=kernel).decode_fp8_kernel == kernel


@pytest.mark.parametrize("option, passed", [("auto", None), ("words", "words")])
def test_the_fp8_decode_kernel_option_reaches_the_kernel(
    option: str, passed: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what the option names is what decode_attention is asked for (auto: the variable's or
    # the kernels' default, decided per launch)
    pool, cache, fb = _state(2, [5, 9])
    backend = _backend("auto", pool, cache, decode_fp8_kernel=option)
    seen = []
    real = backend.kernels.decode_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["fp8_kernel"])
        return real(*args, **kwargs)

    monkeypatch.setattr(backend.kernels, "decode_attention", spy)
    meta = backend.plan(fb)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    backend.attend(
        q,
        AttentionLayer(0, HQ, HKV, D, D, D**-0.5),
        AttentionStep(backend, meta, fb.out_cache_loc, fb.mode),
    )
    assert seen == [passed]


@pytest.mark.parametrize("graph", [False, True])
def test_the_wave_option_reaches_the_split_counts(
    graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``decode_wave`` auto hands the kernels' wave for the batch to the metadata launch,
    which cuts the splits by it (eager plans and graph buckets alike); ``off`` hands 0 and
    keeps the policy's counts; other values are refused by name."""
    from execrt.kernels.attention.indices import wave_cap

    pool, cache, _ = _state(1, [4])
    with pytest.raises(
        ConfigError, match=r"decode_wave 'always' unsupported \(supported: auto, off\)"
    ):
        _backend("auto", pool, cache, decode_wave="always")
    lens = [600] * 4  # 64-token splits below: 10 each (capped by max_splits)
    pool, cache, fb = _state(4, lens)
    asked = []

    def wave(q, k, v, *, fp8_kernel=None, prologue=False):  # type: ignore[no-untyped-def]
        asked.append((q.shape[0], fp8_kernel, prologue))
        return 12  # 4 requests: 3 splits each fit one wave, against 2+ waves of 10

    splits = {}
    for option in ("auto", "off"):
        backend = _backend("auto", pool, cache, decode_wave=option, decode_split_target=64)
        monkeypatch.setattr(backend.kernels, "decode_wave", wave)
        if graph:
            backend.init_graph_state(MAX_BS, MAX_BS)
        for _ in range(2):  # asked once per batch size
            meta = backend.plan_graph(fb) if graph else backend.plan(fb)
        splits[option] = meta.num_splits[:4].tolist()
    assert asked == [(4, None, False)]  # off never asks
    top = max(splits["off"])
    assert top > 3 and splits["off"] == [top] * 4
    assert splits["auto"] == wave_cap(lens, splits["off"], 12) == [3] * 4
