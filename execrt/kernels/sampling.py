"""Token sampling (greedy, temperature, top-k, top-p, seeded): reference and the switch to Triton.

The draw is the core ``Sampler``'s (see its docstring): per row, greedy when the temperature
is 0 or top_k is 1, else the exponential race ``argmax p / E`` over the tokens top-k and top-p
keep, ``E`` a counter-based Exp(1) draw from (seed, step, token id). The Triton path does it
without sorting the vocabulary and without a host sync (see ``triton_sampling``), so it can run
inside a CUDA graph.
"""

from __future__ import annotations

import torch

from execrt.core.sampler import SampleFn, Sampler, SamplingBatchInfo
from execrt.kernels._triton import KernelMode, import_triton, use_triton


def sample_torch(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The reference: the core Sampler's torch draw (a full sort of each sampled row)."""
    return Sampler.sample_torch(logits, info)


def sample(
    logits: torch.Tensor, info: SamplingBatchInfo, *, use_triton: bool = False
) -> torch.Tensor:
    """Token ids ``[B]`` int64 from ``logits [B, V]`` (fp32, fp16 or bf16) and the per-row
    parameters in ``info`` (``[B]`` each): temperatures fp32 (0 = greedy), top_ks int64
    (<= 0 = off), top_ps fp32 (>= 1 = off), seeds and steps int64 (the noise key).
    ``info.all_greedy`` is not read: greedy rows need their temperature 0 in the tensors.

    ``use_triton`` (see ``execrt.kernels.use_triton``) picks the two-launch Triton kernels, which
    sync nothing with the host and allocate only ``[B]``-sized buffers: capturable in a CUDA
    graph. They give the reference's tokens for the same seeds, except where two candidates'
    race keys, or a token's mass before it and top_p, are equal within fp32 rounding (the
    kernel compares ``s + T * G`` where the reference compares ``softmax(s / T) / E``, and sums
    the masses in another order). A row's token never depends on the other rows.
    """
    if not use_triton:
        return sample_torch(logits, info)
    import_triton()
    from execrt.kernels.triton_sampling import sample_triton

    return sample_triton(logits, info)


def fused_sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """``sample(..., use_triton=True)``: the ``core.sampler.SampleFn`` of the Triton draw."""
    return sample(logits, info, use_triton=True)


def sample_fn(device: torch.device | str, mode: KernelMode | str) -> SampleFn | None:
    """What to give ``Sampler(sample_fn=...)`` on ``device``: ``fused_sample`` when
    ``use_triton(device, mode)``, else None (the Sampler's torch draw)."""
    return fused_sample if use_triton(device, mode) else None
