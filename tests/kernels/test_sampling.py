"""Fused sampling: the Triton draw against the core Sampler token for token, its distribution,
its rules (ties, tiny temperature, tiny top_p, top_k beyond the vocabulary), batch invariance
and CUDA-graph capture."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from execrt.core.sampler import Sampler, SamplingBatchInfo, uniform_noise
from execrt.core.schedule import Req, SamplingParams
from execrt.kernels import triton_sampling
from execrt.kernels._triton import interpreter_enabled
from execrt.kernels.sampling import fused_sample, sample, sample_fn
from execrt.kernels.triton_sampling import _fast_gumbel as fast_gumbel
from tests.kernels.helpers import CUDA, DEVICE, needs_cuda, replay_matches_eager

# Draws per distribution test: the interpreter runs one program after another (~50 ms a row).
DRAWS = 4000 if CUDA else 400


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 128 tokens and more programs per SM: small vocabularies still take several
    blocks per program and several programs (parts, sharing their best key) per row, as 152k
    does with the real sizes."""
    monkeypatch.setattr(triton_sampling, "RACE_BLOCK", 128)
    monkeypatch.setattr(triton_sampling, "ROW_BLOCK", 128)
    # The interpreter counts one SM: 12 rows of 1500 tokens make 4 parts of 3 blocks.
    monkeypatch.setattr(triton_sampling, "PROGRAMS_PER_SM", 48)


def params(
    b: int,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = -1,
    top_p: float | list[float] = 1.0,
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
) -> SamplingBatchInfo:
    def column(value: float | list[float] | int | list[int], dtype: torch.dtype) -> torch.Tensor:
        values = value if isinstance(value, list) else [value] * b
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return SamplingBatchInfo(
        temperatures=column(temperature, torch.float32),
        top_ks=column(top_k, torch.int64),
        top_ps=column(top_p, torch.float32),
        seeds=column(seeds if seeds is not None else list(range(b)), torch.int64),
        steps=column(steps if steps is not None else [0] * b, torch.int64),
        all_greedy=False,
    )


def draw(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    return fused_sample(logits.to(DEVICE), info).cpu()


def reference(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    return Sampler.sample_torch(logits.to(DEVICE).float(), info).cpu()


def llm_like(b: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Logits shaped like a language model's: a broad bulk and a few strong candidates."""
    logits = torch.randn(b, vocab, generator=gen) * 2.5
    for row in range(b):
        top = torch.randperm(vocab, generator=gen)[:12]
        logits[row, top] += torch.rand(12, generator=gen) * 10 + 4
    return logits


def search_rows(
    half: int, vocab: int, gen: torch.Generator, tied: slice, fine: slice
) -> torch.Tensor:
    """``half`` llm-shaped rows then ``half`` nearly uniform ones (the unfiltered winner rarely
    kept: the search runs); rows ``tied`` rounded to halves (sets end inside runs of ties),
    rows ``fine`` to fortieths."""
    logits = torch.cat([llm_like(half, vocab, gen), torch.randn(half, vocab, generator=gen) * 0.05])
    logits[tied] = (logits[tied] * 2).round() / 2
    logits[fine] = (logits[fine] * 40).round() / 40
    return logits


# -- token for token against the core Sampler -----------------------------------------------------
CONFIGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.6": {"temperature": 0.6},
    "temperature 1.5": {"temperature": 1.5},
    "top-k 5": {"temperature": 0.8, "top_k": 5},
    "top-k 50": {"temperature": 1.0, "top_k": 50},
    "top-p 0.9": {"temperature": 0.6, "top_p": 0.9},
    "top-p 0.3": {"temperature": 1.0, "top_p": 0.3},
    "top-k 50 top-p 0.9": {"temperature": 0.6, "top_k": 50, "top_p": 0.9},
    "top-k 20 top-p 0.5": {"temperature": 1.2, "top_k": 20, "top_p": 0.5},
}


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("shape", ["llm", "flat"])
def test_same_tokens_as_the_sampler(config: str, shape: str) -> None:
    gen = torch.Generator().manual_seed(len(config) * 7 + len(shape))
    b, vocab = 12, 1500
    if shape == "llm":
        logits = llm_like(b, vocab, gen)
    else:  # nearly uniform: the unfiltered winner is rarely kept, so the search runs
        logits = torch.randn(b, vocab, generator=gen) * 0.05
    seeds = torch.randint(0, 2**63 - 1, (b,), generator=gen).tolist()
    steps = torch.randint(0, 10**6, (b,), generator=gen).tolist()
    info = params(b, seeds=seeds, steps=steps, **CONFIGS[config])  # type: ignore[arg-type]
    assert torch.equal(draw(logits, info), reference(logits, info))


@pytest.mark.usefixtures("small_blocks")
def test_mixed_rows_in_one_batch_match_the_sampler() -> None:
    gen = torch.Generator().manual_seed(3)
    b, vocab = 16, 1000
    logits = llm_like(b, vocab, gen)
    logits[8:] = (logits[8:] * 2).round() / 2  # many equal logits (bf16 logits have them)
    temps = [0.0, 0.6, 1.0, 0.0, 0.3, 1e-30, 2.0, 0.7] * 2
    top_ks = [-1, -1, 40, 1, 0, -1, vocab + 3, 3] * 2
    top_ps = [1.0, 0.9, 1.0, 0.5, 0.2, 1.0, 0.95, 1e-7] * 2
    info = params(b, temps, top_ks, top_ps, seeds=list(range(100, 116)))
    assert torch.equal(draw(logits, info), reference(logits, info))


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("share", [2.0, 0.9, 0.0])
def test_rounds_or_search_passes_draw_the_same_tokens(
    share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the finish races a round or narrows by a search pass changes only how many
    passes it makes: at share 2 it never races (the search alone finds every set), at 0 it
    always does (rounds alone, each narrowing the bracket as it checks its winner); the
    default is in the tests above. Flat rows and equal logits make rounds fail and sets end
    inside a run of ties."""
    monkeypatch.setattr(triton_sampling, "ROUND_SHARE", share)
    gen = torch.Generator().manual_seed(17)
    b, vocab = 16, 1000
    logits = search_rows(8, vocab, gen, tied=slice(4, 8), fine=slice(12, None))
    temps = [0.6, 1.0, 1.3, 0.8] * 4
    top_ks = [-1, 5, 40, -1, 3, -1, 25, 200] * 2
    top_ps = [0.9, 1.0, 0.5, 0.3, 1.0, 0.95, 0.8, 1.0] * 2
    seeds = torch.randint(0, 2**63 - 1, (b,), generator=gen).tolist()
    info = params(b, temps, top_ks, top_ps, seeds=seeds, steps=list(range(b)))
    assert torch.equal(draw(logits, info), reference(logits, info))


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize(
    ("skip_blocks", "count_blocks", "race_sums", "race_ahead", "race_regs"),
    [
        (False, 1, False, False, None),
        (True, 1, False, False, None),
        (True, 2, False, False, None),
        (True, 1, True, False, None),
        (True, 2, True, True, 80),
        (False, 2, True, False, None),
        (False, 1, False, True, None),
    ],
)
def test_count_passes_that_skip_blocks_or_load_two_draw_the_same_tokens(
    skip_blocks: bool,
    count_blocks: int,
    race_sums: bool,
    race_ahead: bool,
    race_regs: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The finish's passes skip the blocks whose largest logit (kept by the race) lies below
    the bracket, load one or two blocks per trip, and (race_sums) take Z and the finite count
    from the parts' race so that the first pass reads only the blocks at or above the
    winner's logit; the parts' race loads its blocks a trip ahead (race_ahead), compiled under
    a register cap (race_regs, on a GPU): none may change a token. An odd block count (1100
    tokens: 9 blocks of 128) leaves the last pair half outside the row; the flat rows need
    search passes, the rounded ones end sets inside runs of ties, the strong candidates of the
    llm rows sit in a few blocks, so most blocks are skipped, and two rows have whole blocks
    and most tokens masked to -inf (their finite count is not the row's length)."""
    monkeypatch.setattr(triton_sampling, "SKIP_BLOCKS", skip_blocks)
    monkeypatch.setattr(triton_sampling, "COUNT_BLOCKS", count_blocks)
    monkeypatch.setattr(triton_sampling, "RACE_SUMS", race_sums)
    monkeypatch.setattr(triton_sampling, "RACE_AHEAD", race_ahead)
    monkeypatch.setattr(triton_sampling, "RACE_REGS", race_regs)
    monkeypatch.setattr(triton_sampling, "RACE_REGS_ABOVE", 0)  # the cap on this small grid too
    gen = torch.Generator().manual_seed(41)
    b, vocab = 48, 1100
    logits = search_rows(24, vocab, gen, tied=slice(6, 10), fine=slice(40, None))
    logits[3, 200:700] = -math.inf
    keep = torch.rand(vocab, generator=gen) < 0.04
    keep[0] = True
    logits[27] = torch.where(keep, logits[27], torch.full_like(logits[27], -math.inf))
    temps = [0.6, 1.0, 0.8, 1.3] * 12
    top_ks = [-1, 5, 40, 20, 300, -1, 3, 50] * 6
    top_ps = [0.9, 1.0, 0.5, 0.95, 0.8, 0.5, 1.0, 0.9, 0.5, 1.0, 0.3, 0.95, 0.8, 0.5, 0.7, 0.6] * 3
    seeds = torch.randint(0, 2**63 - 1, (b,), generator=gen).tolist()
    info = params(b, temps, top_ks, top_ps, seeds=seeds, steps=list(range(b)))
    assert torch.equal(draw(logits, info), reference(logits, info))


def test_the_register_cap_applies_only_to_a_race_grid_past_five_programs_an_sm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RACE_REGS caps the race launch only where its grid holds more than RACE_REGS_ABOVE
    programs per SM (a bs-256 draw on 132 SMs: 768 programs), where the cap keeps it one
    wave; a smaller grid fits one wave uncapped and the cap only cost it (session 44). Never
    under the interpreter, and RACE_REGS None caps nothing."""
    monkeypatch.setattr(triton_sampling, "interpreter_enabled", lambda: False)
    cap = triton_sampling._race_cap
    rows = {b: b * triton_sampling._parts(b, 151936, 1024, 132)[0] for b in (1, 32, 256)}
    assert rows == {1: 149, 32: 544, 256: 768}
    assert [cap(rows[b], 132) for b in (1, 32, 256)] == [{}, {}, {"maxnreg": 80}]
    assert cap(5 * 132, 132) == {} and cap(5 * 132 + 1, 132) == {"maxnreg": 80}
    monkeypatch.setattr(triton_sampling, "RACE_REGS_ABOVE", 0)
    assert cap(1, 132) == {"maxnreg": 80}
    monkeypatch.setattr(triton_sampling, "RACE_REGS", None)
    assert cap(768, 132) == {}
    monkeypatch.setattr(triton_sampling, "interpreter_enabled", lambda: True)
    monkeypatch.setattr(triton_sampling, "RACE_REGS", 80)
    assert cap(768, 132) == {}


@pytest.mark.usefixtures("small_blocks")
def test_masked_logits_draw_the_same_tokens_as_the_sampler() -> None:
    """min_p and min_tokens leave -inf logits (most of a row for a strict min_p, a whole block
    for a banned range): the fused draw must skip them as the sampler does."""
    gen = torch.Generator().manual_seed(29)
    b, vocab = 12, 1000
    logits = llm_like(b, vocab, gen)
    logits[:4, 300:700] = -math.inf  # whole blocks
    keep = torch.rand(b, vocab, generator=gen) < 0.05
    keep[:, 0] = True
    logits[4:] = torch.where(keep[4:], logits[4:], torch.full_like(logits[4:], -math.inf))
    # 1e6: SamplingParams' largest temperature, flat in fp32 yet never NaN on a masked logit
    temps = [0.0, 0.7, 1.0, 1.5, 1.0, 1e6] * 2
    top_ks = [-1, 5, -1, 40] * 3
    top_ps = [1.0, 0.9, 0.5, 1.0] * 3
    seeds = torch.randint(0, 2**63 - 1, (b,), generator=gen).tolist()
    info = params(b, temps, top_ks, top_ps, seeds=seeds, steps=list(range(b)))
    got = draw(logits, info)
    assert torch.equal(got, reference(logits, info))
    assert torch.isfinite(logits[torch.arange(b), got]).all()


def test_the_sampler_with_the_fused_draw_samples_requests_alike() -> None:
    """End to end through the seam: requests' seeds and output lengths become the keys."""
    gen = torch.Generator().manual_seed(4)
    reqs = []
    for i, p in enumerate(
        [
            SamplingParams(temperature=0.6),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.9, top_k=20, top_p=0.8),
            SamplingParams(temperature=1.0, top_p=0.5, seed=2**40 + 3),
        ]
    ):
        req = Req(i, [1, 2, 3], p, sampling_seed=1000 + i, output_ids=[7] * i)
        reqs.append(req)
    info = SamplingBatchInfo.from_reqs(reqs, DEVICE)
    logits = llm_like(4, 800, gen).to(DEVICE)
    fused = Sampler(sample_fn=sample_fn(DEVICE, "on"))
    assert fused.sample_fn is fused_sample
    assert torch.equal(fused(logits, info), Sampler()(logits, info))


def test_half_precision_logits_draw_as_their_fp32_values() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = llm_like(8, 2000, gen).half()
    info = params(8, [0.6, 0.6, 1.0, 0.0] * 2, [-1, 30, -1, -1] * 2, [1.0, 1.0, 0.8, 1.0] * 2)
    assert torch.equal(draw(logits, info), reference(logits.float(), info))


def test_the_noise_is_the_core_hash_bit_for_bit() -> None:
    """At a huge temperature the race is decided by the noise alone: the token is the one
    whose uniform draw is largest (lowest id among equal draws), for seeds over 32 bits too."""
    gen = torch.Generator().manual_seed(6)
    b, vocab = 24, 3000
    logits = torch.randn(b, vocab, generator=gen)
    seeds = [0, 1, 2**31, 2**32, 2**63 - 1] + torch.randint(0, 2**63 - 1, (19,)).tolist()
    steps = [0, 7, 2**31, 2**40, 2**63 - 1] + torch.randint(0, 2**40, (19,)).tolist()
    info = params(b, 1e30, seeds=seeds, steps=steps)
    u = uniform_noise(torch.tensor(seeds), torch.tensor(steps), vocab)  # [B, V]
    assert torch.equal(draw(logits, info), u.argmax(-1))


def test_the_cheap_noise_that_rules_blocks_out_stays_well_inside_its_margin() -> None:
    """The race computes a block's keys exactly only where a cheap key (``_fast_gumbel``)
    comes within ``FAST_G_MARGIN`` of the best: its G must stay far closer than that to the
    exact ``-ln(-ln u)``, over every kind of draw - u near 1 (the series, where the largest
    G and so the winners are), near its switch to the log, and the rest; on the GPU through
    the SFU's log2 as the race runs it."""
    import triton
    import triton.language as tl

    @triton.jit
    def cheap(h_ptr, out_ptr, n, FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        h = tl.load(h_ptr + i, mask=i < n, other=0).to(tl.uint32)
        tl.store(out_ptr + i, fast_gumbel(h, FAST_LOG), mask=i < n)

    top = 2**23
    w_switch = int(top * (1 - 0.03125))  # where u = 1 - 2**-5
    m = [0, 1, 2, 3, top // 2, w_switch - 2, w_switch - 1, w_switch, w_switch + 1, top - 2]
    m += [top - 1 - k for k in range(64)] + list(range(0, top, 4099))
    ms = torch.tensor(m, dtype=torch.int64)
    h = (ms << 9) | torch.randint(0, 512, ms.shape, generator=torch.Generator().manual_seed(3))
    out = torch.empty(len(m), dtype=torch.float32, device=DEVICE)
    n, block = len(m), 1024
    cheap[(triton.cdiv(n, block),)](
        h.to(torch.int32).to(DEVICE), out, n, FAST_LOG=not interpreter_enabled(), BLOCK=block
    )
    u = (ms.double() + 0.5) / top
    exact = -torch.log(-torch.log(u))
    err = (out.cpu().double() - exact).abs()
    assert float(err.max()) < triton_sampling.FAST_G_MARGIN.value / 20, (
        f"worst at m={m[int(err.argmax())]}: {float(err.max()):.2e}"
    )


# -- the rules ------------------------------------------------------------------------------------
def test_greedy_rows_take_the_lowest_id_among_equal_maxima() -> None:
    logits = torch.randn(6, 300)
    logits[:, [40, 17, 250]] = 9.0
    info = params(6, [0.0, 0.0, 0.5, 0.5, 2.0, 0.0], top_k=[-1, 1, 1, 1, 1, 5])
    assert draw(logits, info).tolist() == [17] * 6  # temperature 0, or top_k 1


@pytest.mark.parametrize("temperature", [1e-30, 1e-45])
@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 5}])
def test_tiny_temperature_races_only_the_top_logits(
    temperature: float, filters: dict[str, float]
) -> None:
    """1e-45 is subnormal: 1 / T is inf, which must not make 0 * inf a NaN for the top
    logit's mass (the filtered rows' finish works with 1 / T times log2(e))."""
    logits = torch.randn(1, 500).repeat(60, 1)
    logits[:, 3] = logits[:, 99] = 20.0
    info = params(60, temperature, seeds=list(range(60)), **filters)  # type: ignore[arg-type]
    tokens = draw(logits, info)
    assert set(tokens.tolist()) == {3, 99}  # equally likely: both appear in 60 draws
    assert torch.equal(tokens, reference(logits, info))


def test_top_p_below_the_top_probability_keeps_only_the_first_token() -> None:
    logits = torch.zeros(40, 200)
    logits[:, [30, 60]] = 3.0  # two equal top tokens: the first by id stays
    info = params(40, 1.0, top_p=[1e-7, 1e-30] * 20, seeds=list(range(40)))
    assert draw(logits, info).tolist() == [30] * 40


@pytest.mark.usefixtures("small_blocks")
def test_top_k_beyond_the_vocabulary_or_off_keeps_every_token() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(8, 700, generator=gen)
    seeds = list(range(50, 58))
    unfiltered = draw(logits, params(8, 1.0, top_k=-1, seeds=seeds))
    for k in (0, -5, 700, 701, 2**62):
        assert torch.equal(draw(logits, params(8, 1.0, top_k=k, seeds=seeds)), unfiltered)
    assert torch.equal(draw(logits, params(8, 1.0, top_p=1.0, seeds=seeds)), unfiltered)


def test_equal_probabilities_rank_by_token_id() -> None:
    # Ten equal logits: top_k 3 keeps ids 0-2; top_p 0.25 keeps the tokens whose mass before
    # (0, 0.1, 0.2, 0.3, ...) is below 0.25: ids 0-2 again.
    logits = torch.zeros(60, 10)
    for info in (params(60, 1.0, top_k=3), params(60, 1.0, top_p=0.25)):
        tokens = draw(logits, info)
        assert set(tokens.tolist()) == {0, 1, 2}
        assert torch.equal(tokens, reference(logits, info))


def test_a_row_draws_the_same_token_alone_or_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = llm_like(6, 900, gen)
    temps = [0.7, 0.0, 1.0, 0.6, 1.3, 0.9]
    top_ks = [-1, -1, 25, -1, 4, 60]
    top_ps = [1.0, 1.0, 0.9, 0.7, 1.0, 0.95]
    seeds, steps = [11, 12, 13, 14, 15, 16], [3, 1, 4, 1, 5, 9]

    def rows(order: list[int]) -> torch.Tensor:
        def pick(values: list[Any]) -> list[Any]:
            return [values[i] for i in order]

        info = params(len(order), pick(temps), pick(top_ks), pick(top_ps), pick(seeds), pick(steps))
        return draw(logits[order], info)

    batched = rows(list(range(6)))
    for row in range(6):
        assert rows([row]).item() == batched[row].item()
    order = [4, 2, 0, 5, 1, 3]
    assert torch.equal(rows(order), batched[order])


# -- distributions --------------------------------------------------------------------------------
def frequencies(logits: torch.Tensor, **kw: float | int) -> torch.Tensor:
    """Token frequencies over DRAWS seeds for one row of ``logits [V]``."""
    rows = logits[None, :].expand(DRAWS, -1)
    tokens = draw(rows, params(DRAWS, seeds=list(range(DRAWS)), **kw))  # type: ignore[arg-type]
    return torch.bincount(tokens, minlength=logits.shape[0]).double() / DRAWS


def assert_follows(freq: torch.Tensor, expected: torch.Tensor) -> None:
    """Each frequency within 4.5 binomial standard deviations (+1/n) of its probability, and
    nothing drawn where the probability is 0."""
    sd = torch.sqrt(expected * (1 - expected) / DRAWS)
    assert torch.all((freq - expected).abs() <= 4.5 * sd + 1.0 / DRAWS), (freq, expected)
    assert torch.all(freq[expected == 0] == 0)


PROBS = torch.tensor([0.05, 0.3, 0.02, 0.15, 0.08, 0.25, 0.1, 0.05], dtype=torch.float64)


def test_temperature_draws_follow_the_tempered_softmax() -> None:
    expected = torch.softmax(PROBS.log() / 0.7, dim=0)
    assert_follows(frequencies(PROBS.log().float(), temperature=0.7), expected)


def test_top_k_draws_follow_the_renormalised_top_k() -> None:
    expected = torch.where(PROBS >= 0.1, PROBS, 0)  # the 4 largest: 0.3, 0.25, 0.15, 0.1
    assert_follows(frequencies(PROBS.log().float(), top_k=4), expected / expected.sum())


def test_top_p_draws_follow_the_renormalised_nucleus() -> None:
    # Sorted: 0.3, 0.25, 0.15, 0.1, ...; mass before: 0, 0.3, 0.55, 0.7: top_p 0.6 keeps 3.
    expected = torch.where(PROBS >= 0.15, PROBS, 0)
    assert_follows(frequencies(PROBS.log().float(), top_p=0.6), expected / expected.sum())


def test_top_k_with_top_p_draws_follow_the_renormalised_top_k_nucleus() -> None:
    # top_k 3 keeps 0.3, 0.25, 0.15 (mass 0.7); top_p 0.7 of that is 0.49, which the mass
    # before 0.15 (0.55) exceeds: two tokens stay. Against the whole row (0.55 < 0.7) the
    # third would stay too.
    expected = torch.where(PROBS >= 0.25, PROBS, 0)
    freq = frequencies(PROBS.log().float(), top_k=3, top_p=0.7)
    assert_follows(freq, expected / expected.sum())


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("shape", ["llm", "flat", "ties"])
def test_top_k_with_top_p_draws_the_samplers_tokens(shape: str) -> None:
    """Both filters, where the top-k set's mass must be searched for: flat rows (the race's
    winner is rarely kept, and top_p cuts inside the top-k set), LLM rows, and sets that end
    inside a run of equal logits. On flat rows and ties the two rules' sets differ in many
    rows, so a kernel measuring top_p against the whole row fails (LLM rows, peaked, rarely
    tell them apart)."""
    gen = torch.Generator().manual_seed(31 + len(shape))
    b, vocab = 16, 1200
    if shape == "llm":
        logits = llm_like(b, vocab, gen)
    else:
        logits = torch.randn(b, vocab, generator=gen) * (0.05 if shape == "flat" else 1.0)
        if shape == "ties":
            logits = (logits * 3).round() / 3
    temps = [0.6, 1.0, 1.3, 0.8] * 4
    top_ks = [20, 200, 7, 600, 50, 3, 900, 120] * 2
    top_ps = [0.95, 0.9, 0.5, 0.8, 0.99, 0.6, 0.3, 0.97] * 2
    seeds = torch.randint(0, 2**63 - 1, (b,), generator=gen).tolist()
    info = params(b, temps, top_ks, top_ps, seeds=seeds, steps=list(range(b)))
    on = logits.to(DEVICE)
    off = torch.full((b,), -1, device=DEVICE)
    whole_row = Sampler.filtered_probs(on, replace(info, top_ks=off))
    renormalised = Sampler.filtered_probs(on, info)
    top_k_only = Sampler.filtered_probs(on, replace(info, top_ps=torch.ones(b, device=DEVICE)))
    old_rule = (whole_row > 0) & (top_k_only > 0)
    if shape != "llm":
        assert ((renormalised > 0) != old_rule).any(dim=-1).sum() >= 4  # the rules differ
    assert torch.equal(draw(logits, info), reference(logits, info))


@pytest.mark.usefixtures("small_blocks")
def test_top_k_with_top_p_over_rows_with_fewer_finite_tokens_than_top_k() -> None:
    """min_p leaves fewer finite tokens than top_k: the top-k set is every finite token, its
    mass the row's (the search for its threshold has nothing to cut)."""
    gen = torch.Generator().manual_seed(37)
    b, vocab = 12, 1000
    logits = torch.randn(b, vocab, generator=gen) * 0.05
    keep = torch.rand(b, vocab, generator=gen) < 0.04  # ~40 finite tokens a row
    keep[:, 0] = True
    logits = torch.where(keep, logits, torch.full_like(logits, -math.inf))
    top_ks = [100, 500, 41, 30] * 3  # beyond, far beyond, about and below the finite count
    top_ps = [0.9, 0.5, 0.95, 0.7] * 3
    seeds = torch.randint(0, 2**63 - 1, (b,), generator=gen).tolist()
    info = params(b, 1.0, top_ks, top_ps, seeds=seeds, steps=list(range(b)))
    got = draw(logits, info)
    assert torch.equal(got, reference(logits, info))
    assert torch.isfinite(logits[torch.arange(b), got]).all()


# -- parameters and capture -----------------------------------------------------------------------
def test_parameters_of_the_wrong_dtype_or_shape_are_refused() -> None:
    logits = torch.randn(3, 50, device=DEVICE)
    good = params(3)
    with pytest.raises(ValueError, match="sample: top_ks dtype torch.int32 unsupported"):
        fused_sample(logits, replace(good, top_ks=good.top_ks.int()))
    with pytest.raises(ValueError, match=r"sample: seeds \(2,\) must be \[B\]"):
        sample(logits, replace(good, seeds=good.seeds[:2]), use_triton=True)
    with pytest.raises(ValueError, match=r"sample: logits \(150,\) must be \[B, V\]"):
        fused_sample(logits.flatten(), good)


def test_an_empty_batch_samples_nothing() -> None:
    out = fused_sample(torch.empty(0, 100, device=DEVICE), params(0))
    assert out.shape == (0,) and out.dtype == torch.int64


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_matches_eager(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    b, vocab = 64, 151936
    logits = llm_like(b, vocab, gen).to("cuda", dtype)
    info = params(b, [0.0, 0.6, 1.0, 0.8] * 16, [-1, -1, 50, 20] * 16, [1.0, 1.0, 0.9, 0.5] * 16)
    fresh_info = params(
        b, [0.7, 0.0, 0.6, 1.1] * 16, [-1, 1, 30, 5] * 16, [0.9, 1.0, 1.0, 0.3] * 16
    )
    inputs = [logits, info.temperatures, info.top_ks, info.top_ps, info.seeds, info.steps]
    fresh = [
        llm_like(b, vocab, gen).to(dtype),
        fresh_info.temperatures,
        fresh_info.top_ks,
        fresh_info.top_ps,
        fresh_info.seeds + 17,
        fresh_info.steps + 5,
    ]
    replay_matches_eager(lambda: [fused_sample(logits, info)], inputs, fresh)


@needs_cuda
def test_large_vocabulary_batches_match_the_sampler_on_the_gpu() -> None:
    gen = torch.Generator().manual_seed(11)
    for b, vocab in ((1, 151936), (33, 151936), (8, 256000)):
        logits = llm_like(b, vocab, gen).cuda()
        temps = [0.6, 0.0, 1.0, 0.7] * math.ceil(b / 4)
        ks = [-1, -1, 50, 20] * math.ceil(b / 4)
        ps = [1.0, 1.0, 0.9, 0.95] * math.ceil(b / 4)
        info = params(b, temps[:b], ks[:b], ps[:b], seeds=list(range(b)))
        assert torch.equal(draw(logits, info), reference(logits, info))


@needs_cuda
def test_near_uniform_rows_of_a_large_vocabulary_match_the_sampler_on_the_gpu() -> None:
    # Near-uniform rows skip no block by their logits alone: every block is first raced with
    # the cheap keys, and the exact race must still find the reference's token in each row.
    gen = torch.Generator().manual_seed(12)
    b, vocab = 96, 151936
    logits = (torch.randn(b, vocab, generator=gen) * 0.05).cuda()
    temps = [0.6, 1.0, 0.3, 2.0] * (b // 4)
    info = params(b, temps, seeds=list(range(1000, 1000 + b)), steps=list(range(b)))
    assert torch.equal(draw(logits, info), reference(logits, info))
