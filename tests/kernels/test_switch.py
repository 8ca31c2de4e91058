"""The torch/Triton switch, and that importing the public kernel modules never imports triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from execrt.kernels import use_triton
from execrt.kernels._triton import TRITON_INTERPRET, triton_importable


def test_off_is_always_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRITON_INTERPRET, "1")
    assert use_triton("cpu", "off") is False
    assert use_triton("cuda", "off") is False


def test_auto_uses_triton_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRITON_INTERPRET, "1")  # the interpreter is for "on", never chosen by "auto"
    assert use_triton(torch.device("cpu"), "auto") is False
    assert use_triton("cuda:0", "auto") is triton_importable()


@pytest.mark.skipif(not triton_importable(), reason="needs triton")
def test_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRITON_INTERPRET, "1")
    assert use_triton("cpu", "on") is True
    monkeypatch.delenv(TRITON_INTERPRET)
    with pytest.raises(ValueError, match="kernels: mode 'on' on a CPU device needs"):
        use_triton("cpu", "on")


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
