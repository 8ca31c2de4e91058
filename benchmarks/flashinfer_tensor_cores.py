"""Measure FlashInfer decode with and without tensor cores at the benchmark shapes (GQA 4).

Decides FlashInferAttnBackend.tensor_core_min_group; writes one JSON per setting under argv[1].
"""

from __future__ import annotations

import sys

from execrt.backends.attention.flashinfer import FlashInferAttnBackend
from execrt.bench import attention

out = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"
for min_group, label in ((1, "tensor cores"), (1 << 30, "CUDA cores")):
    FlashInferAttnBackend.tensor_core_min_group = min_group
    print(f"## flashinfer decode, {label}")
    attention.run(["flashinfer"], iters=10, reps=3, out_dir=out)
