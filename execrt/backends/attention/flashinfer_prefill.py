"""Which of FlashInfer's prefill kernel families (FA2, FA3) runs here, and where its JIT cache is.

FlashInfer compiles its kernels on first use (JIT) into
``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<arch>/cached_ops`` (the base defaults
to the home directory), and loads them from there on every later start: the cache persists
across processes by itself. FA3, the Hopper kernels its own ``auto`` picks on sm90, takes
minutes to compile on a first start; the backend builds them while it starts (a progress line
says so) instead of in the first request.
"""

from __future__ import annotations

import torch

from execrt.core.errors import BackendUnavailableError

PREFILL_VARIANTS = ("auto", "fa2", "fa3")
FA3_MIN_CUDA = (12, 3)  # FlashInfer's own condition for its sm90a kernels


def fa3_refusals(
    capability: tuple[int, int],
    cuda_version: str | None,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> list[str]:
    """Why FlashInfer's FA3 prefill cannot run here (empty: it can). ``capability`` is the
    GPU's (major, minor); ``cuda_version`` torch's CUDA version ("12.8"), None without CUDA."""
    out = []
    major, minor = capability
    if major != 9:
        out.append(f"FA3 needs an sm90 GPU (this one is sm{major}{minor})")
    if cuda_version is None or _version(cuda_version) < FA3_MIN_CUDA:
        out.append(f"FA3 needs CUDA >= 12.3 (torch was built with {cuda_version})")
    if kv_dtype != q_dtype:
        # Its Hopper GEMMs take Q and K of one type: a bf16 query cannot meet an fp8 cache.
        q, kv = (str(t).removeprefix("torch.") for t in (q_dtype, kv_dtype))
        out.append(f"FA3 cannot read a {kv} KV cache with {q} queries")
    return out


def prefill_variant(
    requested: str,
    capability: tuple[int, int],
    cuda_version: str | None,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> str:
    """The prefill family to build: ``requested`` ("fa2" or "fa3"), or for "auto" FA3 where it
    runs (FlashInfer's own auto: sm90), else FA2. Raises BackendUnavailableError for "fa3"
    where it cannot run, ValueError for an unknown name."""
    if requested not in PREFILL_VARIANTS:
        raise ValueError(
            f"flashinfer attention: prefill_backend {requested!r} unsupported "
            f"(supported: {', '.join(PREFILL_VARIANTS)})"
        )
    problems = fa3_refusals(capability, cuda_version, q_dtype, kv_dtype)
    if requested == "auto":
        return "fa2" if problems else "fa3"
    if requested == "fa3" and problems:
        reasons = [f"flashinfer_prefill_backend 'fa3': {p}" for p in problems]
        raise BackendUnavailableError("attention", "flashinfer", reasons + ["use 'fa2' or 'auto'"])
    return requested


def device_prefill_variant(
    requested: str, device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype
) -> str:
    """:func:`prefill_variant` for the GPU ``device``."""
    capability = torch.cuda.get_device_capability(device)
    return prefill_variant(requested, capability, torch.version.cuda, q_dtype, kv_dtype)


def jit_cache_dir() -> str:
    """Where FlashInfer keeps the kernels it compiled (for this version and GPU arch)."""
    try:
        from flashinfer.jit import env

        return str(env.FLASHINFER_JIT_DIR)
    except (ImportError, AttributeError):  # another FlashInfer layout: say what sets it
        return "FlashInfer's JIT cache ($FLASHINFER_WORKSPACE_BASE/.cache/flashinfer)"


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(".")[:2])
    except ValueError:
        return (0,)
