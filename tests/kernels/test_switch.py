"""The torch/Triton switch: one interpreter check asked everywhere, and that importing the
public kernel modules never imports triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from execrt.kernels import _triton, use_triton
from execrt.kernels._triton import TRITON_INTERPRET, triton_importable


def interpreter(monkeypatch: pytest.MonkeyPatch, enabled: bool) -> None:
    """The interpreter flag as the kernels see it (read once per process, so patched here)."""
    monkeypatch.setattr(_triton, "interpreter_enabled", lambda: enabled)


def test_off_is_always_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreter(monkeypatch, True)
    assert use_triton("cpu", "off") is False
    assert use_triton("cuda", "off") is False


def test_auto_uses_triton_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreter(monkeypatch, True)  # the interpreter is for "on", never chosen by "auto"
    assert use_triton(torch.device("cpu"), "auto") is False
    assert use_triton("cuda:0", "auto") is triton_importable()


@pytest.mark.skipif(not triton_importable(), reason="needs triton")
def test_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreter(monkeypatch, True)
    assert use_triton("cpu", "on") is True
    interpreter(monkeypatch, False)
    with pytest.raises(
        ValueError,
        match=f"kernels: mode 'on' on a CPU device needs the Triton interpreter: set "
        f"{TRITON_INTERPRET}=1 \\(triton >= 3.4 also reads true, on, yes, y, any case\\)",
    ):
        use_triton("cpu", "on")


# Asked in a fresh interpreter per value: the builtin plugin's registry check, the kernels
# switch, the attention kernels' device check, and triton itself (how it defined the kernels).
AGREEMENT_PROBE = r"""
import json, types
import torch
from execrt.kernels import use_triton
from execrt.plugins.builtin import _triton_check

answers = {}
request = types.SimpleNamespace(device="cpu", dtype=torch.float32)
answers["registry check"] = not _triton_check(request)
try:
    answers["kernels switch"] = use_triton("cpu", "on")
except ValueError:
    answers["kernels switch"] = False
from execrt.kernels.attention import common, decode
q = torch.zeros(1, 2, 16)
try:
    common.check_qkvo(q, q, q, q)
    answers["attention device check"] = True
except ValueError as exc:
    assert "q is on cpu" in str(exc), exc
    answers["attention device check"] = False
from triton.runtime.interpreter import InterpretedFunction
answers["triton"] = isinstance(decode._decode_split_kernel, InterpretedFunction)
print(json.dumps(answers))
"""


@pytest.mark.skipif(not triton_importable(), reason="needs triton")
@pytest.mark.parametrize(
    ("value", "enabled"),
    [("1", True), ("true", True), (None, False), ("0", False), ("TRUE", True), ("yes", True)],
    ids=["1", "true", "unset", "0", "TRUE", "yes"],
)
def test_every_place_gives_the_interpreter_flag_the_same_answer(
    value: str | None, enabled: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if k != TRITON_INTERPRET}
    if value is not None:
        env[TRITON_INTERPRET] = value
    done = subprocess.run(
        [sys.executable, "-c", AGREEMENT_PROBE], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.splitlines()[-1])
    if value in ("TRUE", "yes") and not answers["triton"]:  # a triton before 3.4 reads only "1"
        enabled = False
    assert answers == dict.fromkeys(answers, enabled), answers
    assert len(answers) == 4


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="kernels: mode 'fast' unsupported .*auto, on, off"):
        use_triton("cpu", "fast")


def test_public_modules_do_not_import_triton() -> None:
    code = (
        "import sys\n"
        "import execrt.kernels, execrt.kernels.norm, execrt.kernels.rotary\n"
        "import execrt.kernels.activation\n"
        "execrt.kernels.use_triton('cpu', 'auto')\n"
        "print('triton' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not triton_importable(), reason="needs triton")
def test_kernels_refuse_a_device_triton_cannot_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # Called with use_triton=True on CPU tensors without the interpreter, Triton itself failed
    # with "0 active drivers ([]). There should only be one.", naming neither tensor nor fix.
    from execrt.core.interfaces import StandardDispatchOutput
    from execrt.kernels import (  # noqa: F401 - loaded while the interpreter flag is set
        triton_activation,
        triton_linear,
        triton_norm,
        triton_rotary,
        triton_router,
    )
    from execrt.kernels.activation import silu_and_mul
    from execrt.kernels.attention import decode_attention
    from execrt.kernels.fused_moe import fused_experts, moe_align
    from execrt.kernels.linear import linear
    from execrt.kernels.norm import fused_add_rmsnorm, rmsnorm
    from execrt.kernels.rotary import qk_norm_rope
    from execrt.kernels.router import topk_softmax

    interpreter(monkeypatch, False)  # the kernel modules are loaded above, interpreted
    x, w, q = torch.randn(2, 8), torch.randn(8), torch.randn(2, 2, 8)
    pos, table, ids = torch.zeros(2, dtype=torch.int64), torch.randn(4, 8), torch.zeros(2, 1)
    i32, part_o, part_lse = (
        torch.zeros(3, dtype=torch.int32),
        torch.empty(2, 2, 1, 8),
        torch.empty(2, 2, 1),
    )
    calls = {
        "rmsnorm: x": lambda: rmsnorm(x, w, 1e-6, use_triton=True),
        "fused_add_rmsnorm: x": lambda: fused_add_rmsnorm(x, x, w, 1e-6, use_triton=True),
        "silu_and_mul: x": lambda: silu_and_mul(x, use_triton=True),
        "topk_softmax: logits": lambda: topk_softmax(x, 2, True, use_triton=True),
        "qk_norm_rope: q": lambda: qk_norm_rope(
            q, q, pos, table, table, None, None, 1e-6, use_triton=True
        ),
        "linear: x": lambda: linear(x[:1], torch.randn(4, 8), use_triton=True),
        "fused_moe: hidden": lambda: fused_experts(
            StandardDispatchOutput(x, ids.long(), ids), torch.randn(2, 8, 8), torch.randn(2, 8, 4)
        ),
        "fused_moe: topk_ids": lambda: moe_align(ids.long(), 2, 16),
        "triton attention: q": lambda: decode_attention(
            q, q, q, torch.empty_like(q), i32, i32, i32[:2], part_o, part_lse, 1.0, 1
        ),
    }
    for prefix, call in calls.items():
        with pytest.raises(
            ValueError, match=f"^{prefix} is on cpu, unsupported .*cuda.*{TRITON_INTERPRET}=1"
        ):
            call()
