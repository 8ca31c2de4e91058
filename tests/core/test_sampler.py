"""Sampler: greedy, temperature, top-k, top-p and seeds."""

from __future__ import annotations

import torch

from execrt.core.sampler import Sampler, SamplingBatchInfo, uniform_noise


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
