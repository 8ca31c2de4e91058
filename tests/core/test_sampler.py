"""Sampler: greedy, temperature, top-k, top-p and seeds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from execrt.core.sampler import Sampler, SamplingBatchInfo, adjust_logits, uniform_noise
from execrt.core.schedule import Req, SamplingParams
from execrt.core.staging import HostToDevice

CPU = torch.device("cpu")


def info(
    b: int,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=torch.full((b,), temperature),
        top_ks=torch.full((b,), top_k, dtype=torch.int64),
        top_ps=torch.full((b,), top_p),
        seeds=torch.tensor(seeds if seeds is not None else list(range(b)), dtype=torch.int64),
        steps=torch.tensor(steps if steps is not None else [0] * b, dtype=torch.int64),
        all_greedy=temperature == 0.0,
    )


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50)
    assert torch.equal(Sampler()(logits, info(5, temperature=0.0)), logits.argmax(-1))


def test_top_k_1_is_greedy_even_with_temperature() -> None:
    logits = torch.randn(4, 30)
    assert torch.equal(Sampler()(logits, info(4, top_k=1)), logits.argmax(-1))


def test_seeded_samples_ignore_batch_makeup() -> None:
    logits = torch.randn(1, 100).repeat(3, 1)
    alone = Sampler()(logits[:1], info(1, seeds=[42], steps=[7]))
    batched = Sampler()(logits, info(3, seeds=[42, 1, 2], steps=[7, 7, 7]))
    assert alone.item() == batched[0].item()
    draws = {Sampler()(logits[:1], info(1, seeds=[42], steps=[s])).item() for s in range(40)}
    assert len(draws) > 5  # different steps draw differently


def test_top_k_and_top_p_stay_inside_their_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 64)
    order = logits[0].argsort(descending=True)
    probs = logits[0].softmax(-1)[order]
    nucleus = int((probs.cumsum(0) - probs < 0.6).sum())  # tokens top_p=0.6 keeps
    for seed in range(300):
        tok_k = Sampler()(logits, info(1, top_k=5, seeds=[seed])).item()
        assert tok_k in order[:5].tolist()
        tok_p = Sampler()(logits, info(1, top_p=0.6, seeds=[seed])).item()
        assert tok_p in order[:nucleus].tolist()


def test_sample_frequencies_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 4000
    counts = torch.zeros(4)
    for seed in range(n):
        counts[Sampler()(logits, info(1, seeds=[seed])).item()] += 1
    freq = counts / n
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # 4 standard deviations of a binomial proportion at n=4000 is at most 0.032.
    assert torch.all((freq - expected).abs() < 0.032), freq


def test_temperature_sharpens() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    cold = sum(
        Sampler()(logits, info(1, temperature=0.1, seeds=[s])).item() == 0 for s in range(500)
    )
    warm = sum(
        Sampler()(logits, info(1, temperature=1.0, seeds=[s])).item() == 0 for s in range(500)
    )
    # p(token 0) is 0.983 at T=0.1 (expect ~492 of 500) and 0.6 at T=1 (expect ~300, sd 11).
    assert cold > 470 and 250 < warm < 350


def test_uniform_noise_is_open_interval_and_deterministic() -> None:
    u = uniform_noise(torch.tensor([3, 3]), torch.tensor([1, 1]), 10000)
    assert torch.equal(u[0], u[1])
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01


# -- SamplingBatchInfo.from_reqs ------------------------------------------------------------------
def req(params: SamplingParams, seed: int = 0, outputs: int = 0, pending: int = 0) -> Req:
    r = Req(0, [1, 2], params, sampling_seed=seed, output_ids=[5] * outputs)
    r.num_pending = pending
    return r


def test_an_all_greedy_batch_needs_no_tensors() -> None:
    reqs = [req(SamplingParams(temperature=0.0)), req(SamplingParams(temperature=0.8, top_k=1))]
    got = SamplingBatchInfo.from_reqs(reqs, CPU)
    assert got.all_greedy
    for t in (got.temperatures, got.top_ks, got.top_ps, got.seeds, got.steps):
        assert t.numel() == 0
    logits = torch.randn(2, 16)
    assert torch.equal(Sampler()(logits, got), logits.argmax(-1))


def test_a_mixed_batch_carries_every_parameter_per_row() -> None:
    reqs = [
        req(SamplingParams(temperature=0.5, top_k=5, top_p=0.75), 2**40 + 1, 3, pending=2),
        req(SamplingParams(temperature=0.0), seed=7),
        req(SamplingParams(temperature=2, top_p=1), seed=0, outputs=1),
    ]
    got = SamplingBatchInfo.from_reqs(reqs, CPU)
    assert not got.all_greedy
    assert got.temperatures.dtype == got.top_ps.dtype == torch.float32
    assert got.top_ks.dtype == got.seeds.dtype == got.steps.dtype == torch.int64
    assert got.temperatures.tolist() == [0.5, 0.0, 2.0]
    assert got.top_ks.tolist() == [5, -1, -1]
    assert got.top_ps.tolist() == [0.75, 1.0, 1.0]
    assert got.seeds.tolist() == [2**40 + 1, 7, 0]
    assert got.steps.tolist() == [5, 0, 1]  # outputs on the host + tokens still in flight


class CountingStager(HostToDevice):
    def __init__(self) -> None:
        super().__init__(CPU)
        self.calls: list[str] = []

    def __call__(self, values: Sequence[int]) -> torch.Tensor:
        self.calls.append("ints")
        return super().__call__(values)

    def floats(self, values: Sequence[float]) -> torch.Tensor:
        self.calls.append("floats")
        return super().floats(values)


def test_from_reqs_stages_ints_and_floats_in_one_copy_each() -> None:
    reqs = [req(SamplingParams(top_k=3), seed=1, outputs=2), req(SamplingParams(top_p=0.5))]
    stager = CountingStager()
    got = SamplingBatchInfo.from_reqs(reqs, CPU, stager)
    assert sorted(stager.calls) == ["floats", "ints"]
    assert got.top_ks.tolist() == [3, -1] and got.seeds.tolist() == [1, 0]
    assert got.steps.tolist() == [2, 0] and got.top_ps.tolist() == [1.0, 0.5]
    assert SamplingBatchInfo.from_reqs([req(SamplingParams(temperature=0))], CPU, stager).all_greedy
    assert len(stager.calls) == 2  # a greedy batch stages nothing


@pytest.mark.parametrize("b", range(1, 10))
def test_staged_rows_start_16_byte_aligned_at_every_batch_size(b: int) -> None:
    # Triton compiles a variant per pointer alignment: rows at offsets b and 2b of one staged
    # buffer (seeds of an odd batch, top_ps of a batch of 2 mod 4) compiled mid-run.
    reqs = [req(SamplingParams(temperature=0.6, top_p=0.9), seed=i, outputs=i) for i in range(b)]
    got = SamplingBatchInfo.from_reqs(reqs, CPU, CountingStager())
    for t in (got.temperatures, got.top_ks, got.top_ps, got.seeds, got.steps):
        assert t.shape == (b,) and t.is_contiguous() and t.data_ptr() % 16 == 0
    assert got.seeds.tolist() == got.steps.tolist() == list(range(b))
    assert got.top_ps.tolist() == pytest.approx([0.9] * b) and got.top_ks.tolist() == [-1] * b


def test_advanced_is_the_same_rows_one_step_later() -> None:
    reqs = [req(SamplingParams(temperature=0.6), seed=5, outputs=2, pending=1)]
    reqs.append(req(SamplingParams(temperature=0.0), seed=9, outputs=4))
    now = SamplingBatchInfo.from_reqs(reqs, CPU, CountingStager())
    for r in reqs:  # what one more decode of every row does to the requests
        r.output_ids.append(1)
    later = now.advanced()
    again = SamplingBatchInfo.from_reqs(reqs, CPU)
    for name in ("temperatures", "top_ks", "top_ps", "seeds", "steps"):
        assert getattr(later, name).tolist() == getattr(again, name).tolist(), name
    assert now.steps.tolist() == [3, 4]  # untouched: a new tensor
    greedy = SamplingBatchInfo.from_reqs([req(SamplingParams(temperature=0.0))], CPU)
    assert greedy.advanced() is greedy  # no tensors to advance


def test_a_greedy_row_stays_argmax_inside_a_sampled_batch() -> None:
    reqs = [req(SamplingParams(temperature=0.0)), req(SamplingParams(temperature=1.0))]
    logits = torch.tensor([[0.0, 0.1, 0.2], [0.2, 0.1, 0.0]])
    for seed in range(10):
        reqs[0].sampling_seed = reqs[1].sampling_seed = seed
        ids = Sampler()(logits, SamplingBatchInfo.from_reqs(reqs, CPU))
        assert ids[0].item() == 2


# -- filtered_probs against hand-computed values --------------------------------------------------
# p = [0.2, 0.4, 0.1, 0.3] in deliberately unsorted positions: sorted 0.4 (id 1), 0.3 (id 3),
# 0.2 (id 0), 0.1 (id 2); mass before each in that order: 0, 0.4, 0.7, 0.9.
P = torch.tensor([[0.2, 0.4, 0.1, 0.3]], dtype=torch.float64)


def filtered(temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> list[float]:
    params = info(1, temperature=temperature, top_k=top_k, top_p=top_p)
    probs = Sampler.filtered_probs(torch.log(P).float(), params)
    return [round(x, 5) for x in probs[0].tolist()]


def test_filtered_probs_without_filters_are_the_softmax() -> None:
    assert filtered() == [0.2, 0.4, 0.1, 0.3]
    assert filtered(top_k=0) == filtered(top_k=-1) == filtered(top_k=10) == [0.2, 0.4, 0.1, 0.3]


def test_top_k_zeroes_all_but_the_k_largest_without_renormalising() -> None:
    assert filtered(top_k=2) == [0.0, 0.4, 0.0, 0.3]
    assert filtered(top_k=3) == [0.2, 0.4, 0.0, 0.3]


def test_top_p_keeps_tokens_while_the_mass_before_them_is_below_p() -> None:
    assert filtered(top_p=0.5) == [0.0, 0.4, 0.0, 0.3]  # 0.4 < 0.5 still admits id 3
    assert filtered(top_p=0.35) == [0.0, 0.4, 0.0, 0.0]
    assert filtered(top_p=1e-6) == [0.0, 0.4, 0.0, 0.0]  # the top token always stays
    assert filtered(top_p=0.8) == [0.2, 0.4, 0.0, 0.3]


def test_top_k_and_top_p_combine_as_the_smaller_set() -> None:
    assert filtered(top_k=1, top_p=0.95) == [0.0, 0.4, 0.0, 0.0]
    assert filtered(top_k=3, top_p=0.5) == [0.0, 0.4, 0.0, 0.3]


def test_top_p_applies_to_the_top_k_set_renormalised() -> None:
    # As vLLM, SGLang and transformers: top_k 2 keeps 0.4 and 0.3 (mass 0.7); renormalised
    # they are 0.571 and 0.429, so top_p 0.55 keeps only the first (mass before the second:
    # 0.571). Measured against the whole row, 0.4 < 0.55 would have kept both.
    assert filtered(top_k=2, top_p=0.55) == [0.0, 0.4, 0.0, 0.0]
    assert filtered(top_k=2, top_p=0.58) == [0.0, 0.4, 0.0, 0.3]
    # top_k 3 (mass 0.9): the third's mass before, 0.7, is 0.778 of the set.
    assert filtered(top_k=3, top_p=0.77) == [0.0, 0.4, 0.0, 0.3]
    assert filtered(top_k=3, top_p=0.79) == [0.2, 0.4, 0.0, 0.3]
    # top_k beyond the vocabulary or off: the row's own mass, as top_p alone.
    assert filtered(top_k=4, top_p=0.65) == filtered(top_k=-1, top_p=0.65) == [0.0, 0.4, 0.0, 0.3]


def test_the_kept_set_is_transformers_temperature_top_k_top_p_warpers() -> None:
    """An independent oracle: transformers' warpers (temperature, then top-k, then top-p over
    what top-k left, renormalised) keep the same tokens with the same probabilities, over
    random rows, vocabularies and parameters."""
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        vocab = int(torch.randint(50, 3000, (1,), generator=gen))
        logits = torch.randn(1, vocab, generator=gen) * float(
            torch.rand(1, generator=gen) * 5 + 0.1
        )
        k = int(torch.randint(2, vocab, (1,), generator=gen))
        p = float(torch.rand(1, generator=gen) * 0.98 + 0.01)
        t = float(torch.rand(1, generator=gen) * 1.5 + 0.2)
        warped = logits_process.TemperatureLogitsWarper(t)(None, logits.clone())
        warped = logits_process.TopKLogitsWarper(k)(None, warped)
        want = torch.softmax(logits_process.TopPLogitsWarper(p)(None, warped), dim=-1)
        got = Sampler.filtered_probs(logits, info(1, temperature=t, top_k=k, top_p=p))
        assert torch.equal(got > 0, want > 0), (vocab, k, p, t)
        assert torch.allclose(got / got.sum(), want, atol=1e-6), (vocab, k, p, t)


def test_temperature_scales_the_logits_before_filtering() -> None:
    # T = 0.5 squares the probabilities: [0.04, 0.16, 0.01, 0.09] / 0.30.
    assert filtered(temperature=0.5) == [round(x / 0.3, 5) for x in (0.04, 0.16, 0.01, 0.09)]
    # Sharpened, top_p=0.5 keeps one token: 0.16 / 0.3 = 0.533 of the mass sits before id 3.
    assert filtered(temperature=0.5, top_p=0.5) == [0.0, round(0.16 / 0.3, 5), 0.0, 0.0]
    assert filtered(temperature=0.0) == filtered()  # greedy rows use T = 1 here (no 0 division)


def test_filtered_probs_treat_each_row_with_its_own_parameters() -> None:
    logits = torch.log(P).float().repeat(2, 1)
    two = SamplingBatchInfo(
        temperatures=torch.tensor([1.0, 1.0]),
        top_ks=torch.tensor([1, -1]),
        top_ps=torch.tensor([1.0, 0.5]),
        seeds=torch.zeros(2, dtype=torch.int64),
        steps=torch.zeros(2, dtype=torch.int64),
        all_greedy=False,
    )
    probs = Sampler.filtered_probs(logits, two)
    assert probs.dtype == torch.float32
    assert torch.allclose(probs, torch.tensor([[0.0, 0.4, 0.0, 0.0], [0.0, 0.4, 0.0, 0.3]]))


def test_filtered_probs_accept_half_precision_logits() -> None:
    logits = torch.log(P).to(torch.bfloat16)
    probs = Sampler.filtered_probs(logits, info(1, top_k=2))
    assert probs.dtype == torch.float32
    assert (probs[0] > 0).tolist() == [False, True, False, True]


def test_equal_probabilities_are_kept_lowest_id_first() -> None:
    logits = torch.zeros(1, 6)  # six tokens of 1/6: ranked by id
    kept = Sampler.filtered_probs(logits, info(1, top_k=2))[0] > 0
    assert kept.tolist() == [True, True, False, False, False, False]
    # Mass before ids 0, 1, 2: 0, 1/6, 1/3; top_p 0.3 keeps the first two.
    kept = Sampler.filtered_probs(logits, info(1, top_p=0.3))[0] > 0
    assert kept.tolist() == [True, True, False, False, False, False]


def test_top_p_1_keeps_the_tokens_after_the_cumsum_reaches_1() -> None:
    # fp32: p = [1.0, 9e-14, 9e-14], the mass before the last is 1.0 once rounded; top_p 1 is
    # "off" and keeps it, top_p 0.999 does not.
    logits = torch.tensor([[0.0, -30.0, -30.0]])
    assert (Sampler.filtered_probs(logits, info(1, top_p=1.0))[0] > 0).all()
    kept = Sampler.filtered_probs(logits, info(1, top_p=0.999))[0] > 0
    assert kept.tolist() == [True, False, False]


# -- the fused-draw seam --------------------------------------------------------------------------
class RecordingDraw:
    """A stand-in fused draw: records its calls, answers token 1 for every row."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits: torch.Tensor, batch: SamplingBatchInfo) -> torch.Tensor:
        self.calls += 1
        return torch.ones(logits.shape[0], dtype=torch.int64)


def test_a_given_sample_fn_replaces_the_torch_draw_except_for_all_greedy_batches() -> None:
    fn = RecordingDraw()
    sampler = Sampler(sample_fn=fn)
    logits = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    assert sampler(logits, info(2, temperature=0.7)).tolist() == [1, 1]
    assert fn.calls == 1
    # An all-greedy batch has no parameter tensors: argmax on the host flag, no fused call.
    assert sampler(logits, info(2, temperature=0.0)).tolist() == [0, 0]
    assert fn.calls == 1
    # sample() is the capturable path: it never reads the host flag.
    assert sampler.sample(logits, info(2, temperature=0.0)).tolist() == [1, 1]
    assert fn.calls == 2


def test_sample_without_a_fused_draw_is_the_torch_draw_for_mixed_rows() -> None:
    logits = torch.randn(4, 40)
    mixed = info(4, temperature=0.9, seeds=[1, 2, 3, 4])
    mixed.temperatures[1] = 0.0
    mixed.all_greedy = True  # ignored by sample(): the tensors decide
    got = Sampler().sample(logits, mixed)
    assert got[1] == logits[1].argmax()
    assert torch.equal(got, Sampler.sample_torch(logits, mixed))


# -- uniform_noise --------------------------------------------------------------------------------
def noise(seeds: list[int], steps: list[int], vocab: int) -> torch.Tensor:
    return uniform_noise(torch.tensor(seeds), torch.tensor(steps), vocab)


def test_uniform_noise_sits_on_a_23_bit_grid_strictly_inside_0_1() -> None:
    seeds = [0, 1, 2**31, 2**32, 2**63 - 1, 12345]
    u = noise(seeds, [0, 7, 2**31, 2**40, 2**63 - 1, 3], 4096)
    assert u.dtype == torch.float32 and u.shape == (6, 4096)
    grid = u.double() * 2**23 - 0.5  # (h + 0.5) / 2**23 with an integer h in [0, 2**23)
    assert torch.equal(grid, grid.round()) and grid.min() >= 0 and grid.max() <= 2**23 - 1
    assert u.min() > 0 and u.max() < 1


def test_uniform_noise_depends_on_the_token_id_not_the_vocab_size() -> None:
    assert torch.equal(noise([9], [4], 1000)[:, :300], noise([9], [4], 300))


def test_uniform_noise_rows_follow_their_seed_and_step_not_their_position() -> None:
    pairs = [(1, 0), (2, 5), (3, 9), (1, 1)]
    rows = noise([s for s, _ in pairs], [t for _, t in pairs], 64)
    order = [2, 0, 3, 1]
    swapped = noise([pairs[i][0] for i in order], [pairs[i][1] for i in order], 64)
    assert torch.equal(swapped, rows[order])
    alone = [noise([s], [t], 64)[0] for s, t in pairs]
    assert all(torch.equal(a, r) for a, r in zip(alone, rows, strict=True))


def test_uniform_noise_changes_with_every_part_of_the_key() -> None:
    base = noise([5], [3], 256)
    for seeds, steps in (([6], [3]), ([5], [4]), ([5 + 2**32], [3])):  # high seed bits count
        other = noise(seeds, steps, 256)
        # Independent draws agree on a token only by chance (about 256 / 2**23 expected).
        assert (other == base).sum() <= 2, (seeds, steps)
    ids = base[0]
    assert len(set(ids.tolist())) > 250  # distinct per token id too


def test_logit_bias_is_added_before_the_draw_and_each_row_keeps_its_own() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 40, dtype=torch.bfloat16)
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100}),  # forces token 7
        SamplingParams(temperature=0.8, seed=5, logit_bias=[(int(logits[1].argmax()), -100)]),
        SamplingParams(temperature=0),  # no bias: its own argmax
    ]
    reqs = [Req(i, [1], p, sampling_seed=p.seed or 0) for i, p in enumerate(params)]
    for stager in (None, HostToDevice(CPU)):
        batch = SamplingBatchInfo.from_reqs(reqs, CPU, stager)
        assert batch.logit_adds is not None
        ids = Sampler()(logits, batch)
        assert ids[0] == 7 and ids[1] != logits[1].argmax() and ids[2] == logits[2].argmax()
        # The oracle: the biases written into fp32 logits by hand, then the unbiased draw.
        biased = logits.float().clone()
        biased[0, 7] += 100
        biased[1, int(logits[1].argmax())] -= 100
        plain = SamplingBatchInfo.from_reqs(
            [Req(i, [1], SamplingParams(temperature=p.temperature, seed=p.seed),
                 sampling_seed=p.seed or 0) for i, p in enumerate(params)],
            CPU,
        )  # fmt: skip
        assert plain.logit_adds is None
        assert torch.equal(ids, Sampler()(biased, plain))
    assert torch.equal(logits, logits.clone())  # the logits themselves untouched


@pytest.mark.parametrize(
    ("bias", "needle"),
    [
        ({3: 101}, "unsupported (token ids >= 0, biases in [-100, 100])"),
        ({-1: 1}, "unsupported"),
        ({3: float("nan")}, "unsupported"),
        ([(3, 1.0), (3, 2.0)], "names a token id twice"),
        ({"3": 1}, "accepted: a dict of int -> float"),
        ([(3,)], "accepted: a dict of int -> float"),
    ],
)
def test_bad_logit_bias_is_named(bias: object, needle: str) -> None:
    problems = SamplingParams(logit_bias=bias).problems()  # type: ignore[arg-type]
    assert any(needle in p for p in problems), problems


def test_logit_bias_is_stored_as_sorted_pairs() -> None:
    sp = SamplingParams(logit_bias={9: -1, 2: 3.5})
    assert sp.logit_bias == ((2, 3.5), (9, -1)) and not sp.problems()
    assert SamplingParams(logit_bias=[[9, -1], [2, 3.5]]) == sp
    hash(sp)  # still hashable


def test_min_tokens_bans_count_the_token_in_flight_and_need_the_stop_tokens() -> None:
    sp = SamplingParams(temperature=0, min_tokens=3)
    req = Req(0, [1], sp, output_ids=[4])

    def stops(r: Req) -> tuple[int, ...]:
        return (2, 9)

    req.num_pending = 1  # the second token is in flight: this step samples the third
    info = SamplingBatchInfo.from_reqs([req], CPU, None, stops)
    assert info.adjusted and info.logit_adds is not None
    rows, ids, values = info.logit_adds
    assert ids.tolist() == [2, 9] and torch.isinf(values).all() and (values < 0).all()
    req.output_ids.append(5)  # the fourth token: min_tokens reached, nothing banned
    assert not SamplingBatchInfo.from_reqs([req], CPU, None, stops).adjusted
    logits = torch.zeros(1, 12)
    logits[0, 9] = 5.0
    assert int(Sampler()(logits, info)[0]) != 9


def test_min_p_drops_what_is_less_likely_than_min_p_times_the_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.11, 0.09]]))
    sp = SamplingParams(temperature=1.0, min_p=0.2, seed=1)  # keeps p >= 0.1
    info = SamplingBatchInfo.from_reqs([Req(0, [1], sp)], CPU)
    assert info.min_ps is not None
    adjusted = adjust_logits(logits, info)
    assert torch.isinf(adjusted[0, 3]) and torch.isfinite(adjusted[0, :3]).all()

    def draw(seed: int) -> int:
        info = SamplingBatchInfo.from_reqs([Req(0, [1], sp, sampling_seed=seed)], CPU)
        return int(Sampler()(logits, info)[0])

    drawn = {draw(seed) for seed in range(200)}
    assert drawn == {0, 1, 2}
    hot = replace(sp, temperature=4.0)  # flatter: 0.09 is now within 0.2 of the top
    info = SamplingBatchInfo.from_reqs([Req(0, [1], hot)], CPU)
    assert torch.isfinite(adjust_logits(logits, info)).all()


class _Only:
    """A constraint that allows a fixed set of tokens (what ``response_format`` installs)."""

    def __init__(self, ids: list[int], vocab: int) -> None:
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[ids] = True
        self.seen: list[int] = []

    def allowed(self, device: torch.device | None = None) -> torch.Tensor:
        return self.mask if device is None else self.mask.to(device)

    def advance(self, token: int) -> None:
        self.seen.append(token)


def test_a_constrained_row_draws_only_allowed_tokens_and_the_others_are_untouched() -> None:
    vocab = 16
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 3
    fmt = SamplingParams(temperature=1.0, response_format="json_object")
    greedy_fmt = replace(fmt, temperature=0.0)
    plain = SamplingParams(temperature=1.0)
    for params in ([fmt, plain, greedy_fmt], [greedy_fmt, replace(plain, temperature=0.0)] * 2):
        reqs = [Req(i, [1], p, sampling_seed=i) for i, p in enumerate(params[:3])]
        for r in reqs:
            if r.sampling_params.response_format != "text":
                r.constraint = _Only([3, 7], vocab)
        info = SamplingBatchInfo.from_reqs(reqs, CPU)
        assert info.adjusted and info.allowed is not None
        rows, masks = info.allowed
        constrained = [i for i, r in enumerate(reqs) if r.constraint is not None]
        assert rows.tolist() == constrained and masks.shape == (len(constrained), vocab)
        adjusted = adjust_logits(logits, info)
        unconstrained = [i for i in range(3) if i not in constrained]
        assert torch.equal(adjusted[unconstrained], logits[unconstrained].float())
        for seed in range(20):
            drawn = Sampler()(logits, replace(info, seeds=info.seeds + seed))
            assert all(int(drawn[i]) in (3, 7) for i in constrained)


def test_output_counts_are_tallied_as_tokens_arrive() -> None:
    req = Req(0, [7, 7, 8], SamplingParams())
    assert dict(req.output_counts) == {} and req.seen_tokens == {7, 8}
    req.output_ids += [3, 3, 7]
    assert dict(req.output_counts) == {3: 2, 7: 1}
    req.output_ids.append(3)
    assert dict(req.output_counts) == {3: 3, 7: 1} and req.seen_tokens == {3, 7, 8}
