"""Attention shapes per device and the named scenarios the attention suite runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from execrt.testing.attention_harness import Step


@dataclass(frozen=True)
class Profile:
    """Shapes per device: small on CPU (the Triton interpreter is slow), realistic on CUDA."""

    num_kv_heads: int
    gqa_ratio: int
    head_dim: int
    dtypes: tuple[torch.dtype, ...]  # preference order for the primary dtype
    max_generated_batch: int
    max_generated_context: int
    max_generated_extend: int
    max_examples: int
    graph_steps: tuple[Step, ...]  # same bucket twice, then a smaller bucket


CPU_PROFILE = Profile(
    num_kv_heads=2,
    gqa_ratio=2,
    head_dim=64,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    max_generated_batch=4,
    max_generated_context=48,
    max_generated_extend=12,
    max_examples=10,
    graph_steps=(
        Step.decode([7, 19, 3], padded_rows=1),
        Step.decode([30, 2], padded_rows=2),
        Step.decode([11], padded_rows=1),
    ),
)
CUDA_PROFILE = Profile(
    num_kv_heads=8,
    gqa_ratio=4,
    head_dim=128,
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    max_generated_batch=16,
    max_generated_context=4096,
    max_generated_extend=512,
    max_examples=25,
    graph_steps=(
        Step.decode([700, 1900, 5, 3000, 64], padded_rows=3),
        Step.decode([2, 4100, 333], padded_rows=5),
        Step.decode([1500, 9], padded_rows=2),
    ),
)

#: Named scenarios: (CPU step, CUDA step). Decode steps give context lengths incl. the new token.
SCENARIOS: dict[str, tuple[Step, Step]] = {
    "decode-single": (Step.decode([37]), Step.decode([1537])),
    "decode-ragged": (
        Step.decode([5, 17, 40, 2, 23]),
        Step.decode([129, 1700, 3001, 2, 513, 64, 2048, 9]),
    ),
    "decode-context1": (Step.decode([1, 1, 1]), Step.decode([1] * 8)),
    # Long enough that Triton splits the context several ways on either device (4 splits for
    # one 2100-token request under the CPU interpreter's 4 "SMs", 17 for 12000 on an H200).
    # The second CPU request passes 4096 tokens (a 4k buffer or index width would cut it).
    "decode-long": (Step.decode([2100, 4200]), Step.decode([12000, 100])),
    "decode-permuted": (
        Step.decode([5, 17, 40, 2, 23], permuted=True),
        Step.decode([129, 1700, 3001, 2, 513], permuted=True),
    ),
    "decode-padded": (
        Step.decode([7, 19], padded_rows=2),
        Step.decode([700, 1900, 5], padded_rows=5),
    ),
    "extend-single": (Step.extend([0], [13]), Step.extend([0], [700])),
    "extend-ragged": (
        Step.extend([0, 0, 0], [5, 1, 30]),
        Step.extend([0, 0, 0, 0], [129, 1, 1000, 64]),
    ),
    "extend-context1": (Step.extend([0, 0, 0], [1, 1, 1]), Step.extend([0] * 8, [1] * 8)),
    "extend-prefix": (
        Step.extend([0, 20, 7, 64], [9, 4, 1, 16]),
        Step.extend([0, 2000, 7, 640], [90, 400, 1, 160]),
    ),
    "extend-long": (Step.extend([2100, 0, 4100], [7, 3, 5]), Step.extend([8000, 0], [64, 900])),
    "extend-permuted": (
        Step.extend([11, 0, 30], [6, 3, 10], permuted=True),
        Step.extend([1100, 0, 300], [60, 300, 10], permuted=True),
    ),
    # A batch past a 16-request grid or tile (CPU), and past 128 new tokens in one request
    # (a second q tile): real decode batches run 64-256 requests.
    "decode-wide": (
        Step.decode([(7 * i) % 29 + 1 for i in range(40)]),
        Step.decode([(37 * i) % 1500 + 1 for i in range(256)]),
    ),
    "extend-wide": (
        Step.extend([0, 5, 0], [70, 130, 3]),
        Step.extend([0, 300, 0] * 3, [700, 1300, 3] * 3),
    ),
    # Logits past 100: a softmax without its row maximum overflows (Step.q_scale).
    "decode-large-logits": (
        Step.decode([5, 40, 23, 90], q_scale=50.0),
        Step.decode([129, 1700, 3001], q_scale=50.0),
    ),
    "extend-large-logits": (
        Step.extend([0, 20], [9, 30], q_scale=50.0),
        Step.extend([0, 2000], [700, 160], q_scale=50.0),
    ),
}
#: The steps of the multi-layer, multi-step test (CPU; CUDA scales lengths by 20). The two
#: decode steps of four requests share every shape (as an engine's steady decode steps do)
#: and differ in lengths and slots: a plan kept by shape from the first step is stale.
MULTI_STEPS = (
    Step.extend([0, 12, 3], [9, 4, 6]),
    Step.decode([33, 5, 18, 1]),
    Step.decode([34, 6, 19, 2]),
    Step.decode([70]),
    Step.extend([40], [2]),
)


def continuing_steps(factor: int = 1) -> tuple[Step, ...]:
    """Requests that go on from step to step in their rows, as in a running engine: a prefill,
    two decode steps (each request's next token in the slot after its last), a third in which
    a new request has taken over the second request's row, then a chunk of prefill for every
    request. The batch's rows are the same every step: a plan kept per set of requests (their
    ``req_to_token`` rows read once) misses every new slot. ``factor`` scales the lengths."""
    first = Step.extend([0, 5 * factor, 0], [6 * factor, 3 * factor, 9 * factor])
    held = [6 * factor, 8 * factor, 9 * factor]
    steps = [first]
    for _ in range(2):
        held = [n + 1 for n in held]
        steps.append(Step.decode(held, continues=True))
    held = [held[0] + 1, 3 * factor + 1, held[2] + 1]
    steps.append(Step.decode(held, continues=True, fresh=(1,)))
    steps.append(Step.extend(held, [3, 2, 1], continues=True))
    return tuple(steps)
