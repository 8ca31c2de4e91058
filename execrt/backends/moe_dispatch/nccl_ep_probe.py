"""Can NCCL EP run here? The nccl_ep availability probe; it never loads libnccl_ep.so."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

INSTALL_HINT = "pip install execrt[nccl-ep]"
MIN_NCCL = (2, 29)  # first NCCL with the Device API symbols libnccl_ep.so links against
MIN_COMPUTE_CAPABILITY = (9, 0)
MAX_TOP_K = 32  # MAX_NUM_TOPK of NCCL EP 0.2
MAX_LOCAL_EXPERTS = 1024  # NUM_MAX_LOCAL_EXPERTS of NCCL EP 0.2 (nccl_ep/common.hpp)
ROW_ALIGN_BYTES = 16  # NCCL EP moves token rows in 16-byte units
NCCL_SWAP_HINT = (
    "LD_PRELOAD a newer libnccl.so.2, or install nvidia-nccl-cu13>=2.29 over torch's pin"
)


@dataclass(frozen=True)
class NcclEpEnvironment:
    """What the probe found; every field is read without loading libnccl_ep.so."""

    ep_installed: bool
    cuda_available: bool
    compute_capability: tuple[int, int] | None
    torch_nccl: tuple[int, ...] | None  # the NCCL torch loaded (None: built without NCCL)
    core_nccl: tuple[int, ...] | None = None  # nccl.core.get_version(), when importable
    core_error: str | None = None  # why nccl.core could not report its NCCL
    ep_error: str | None = None  # why nccl.ep, present, failed to import


def probe_environment() -> NcclEpEnvironment:
    """Look at this process: modules present, CUDA device, and the NCCL versions loaded.

    nccl.core is asked for its NCCL only when torch's is new enough: both must be one library.
    nccl.ep is imported only once both agree (importing it loads no native library yet), so
    that a broken install (e.g. no cuda-bindings) is a reason here, not a crash later. The
    Device API is a property of a communicator: it is checked when the dispatcher opens one.
    """
    cuda = torch.cuda.is_available()
    torch_nccl = torch_nccl_version()
    ep_installed = _importable("nccl.ep")
    core_nccl, core_error, ep_error = None, None, None
    if torch_nccl is not None and torch_nccl[:2] >= MIN_NCCL:
        core_nccl, core_error = _core_nccl_version()
        if ep_installed and core_nccl is not None and core_nccl[:3] == torch_nccl[:3]:
            ep_error = _import_error("nccl.ep")
    return NcclEpEnvironment(
        ep_installed=ep_installed,
        cuda_available=cuda,
        compute_capability=tuple(torch.cuda.get_device_capability()) if cuda else None,  # type: ignore[arg-type]
        torch_nccl=torch_nccl,
        core_nccl=core_nccl,
        core_error=core_error,
        ep_error=ep_error,
    )


def environment_problems(env: NcclEpEnvironment) -> list[str]:
    """Why NCCL EP cannot run in ``env`` (empty: it can), each reason naming what it found."""
    out = []
    if not env.ep_installed:
        out.append(f"module 'nccl.ep' not installed ({INSTALL_HINT})")
    elif env.ep_error is not None:
        out.append(f"module 'nccl.ep' cannot be imported: {env.ep_error} ({INSTALL_HINT})")
    if not env.cuda_available:
        out.append("no CUDA device visible")
    elif env.compute_capability is not None and env.compute_capability < MIN_COMPUTE_CAPABILITY:
        major, minor = env.compute_capability
        out.append(f"compute capability {major}.{minor} unsupported (supported: >= 9.0)")
    if env.torch_nccl is None:
        out.append("torch was built without NCCL; NCCL EP needs >= 2.29")
    elif env.torch_nccl[:2] < MIN_NCCL:
        out.append(
            f"NCCL {_dotted(env.torch_nccl)} loaded by torch; NCCL EP needs >= 2.29 "
            f"({NCCL_SWAP_HINT})"
        )
    elif env.core_error is not None or env.core_nccl is None:
        why = env.core_error or "no version reported"
        out.append(f"nccl.core cannot report its NCCL: {why}")
    elif env.core_nccl[:3] != env.torch_nccl[:3]:
        out.append(
            f"NCCL {_dotted(env.torch_nccl)} loaded by torch but {_dotted(env.core_nccl)} by "
            "nccl.core; NCCL EP needs one NCCL in the process "
            "(LD_PRELOAD the newer libnccl.so.2)"
        )
    return out


def requirement_problems(hidden_size: int, top_k: int) -> list[str]:
    """Shape limits of NCCL EP's low-latency bf16 path."""
    out = []
    if hidden_size < 1 or (hidden_size * 2) % ROW_ALIGN_BYTES:
        out.append(
            f"hidden size {hidden_size} unsupported (supported: multiples of 8, so that a bf16 "
            f"row is a multiple of {ROW_ALIGN_BYTES} bytes)"
        )
    if not 1 <= top_k <= MAX_TOP_K:
        out.append(f"top_k {top_k} unsupported (supported: 1..{MAX_TOP_K})")
    return out


def availability_problems(req: Any) -> list[str]:
    """The registry's check for nccl_ep: ``req`` is a MoERequirements."""
    return requirement_problems(req.hidden_size, req.top_k) + environment_problems(
        probe_environment()
    )


def torch_nccl_version() -> tuple[int, ...] | None:
    """The NCCL version torch reports at run time (None: torch has no NCCL)."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a CPU build has no torch._C._nccl_version
        return None
    return tuple(int(v) for v in version[:3])


def _core_nccl_version() -> tuple[tuple[int, ...] | None, str | None]:
    """(nccl.core's libnccl version, None) or (None, why it has none)."""
    if not _importable("nccl.core"):
        return None, f"module 'nccl.core' not installed ({INSTALL_HINT})"
    try:
        core = importlib.import_module("nccl.core")
        info = core.get_version().libnccl
    except Exception as exc:  # any failure is a reason to report
        return None, f"{type(exc).__name__}: {exc}"
    if info is None:
        return None, "no libnccl loaded"
    return tuple(int(v) for v in info.version.release[:3]), None


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # e.g. ImportError: cannot import name 'bindings' from 'cuda'
        return f"{type(exc).__name__}: {exc}"
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)
