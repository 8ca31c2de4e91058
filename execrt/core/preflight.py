"""Settings checked against this machine before any weight loads: the memory the pools need.

A KV cache of 99999999999 tokens or 100000000 running requests used to surface after the model
had loaded, as an allocator RuntimeError. ``check_before_load`` turns it into one ConfigError
naming the key, the bytes it needs and the memory there is. (``fused_kernels = "on"`` where
Triton cannot run is the kernels' one switch to refuse, ``execrt.kernels._triton.use_triton``,
which the loader asks before it reads any weight.)
"""

from __future__ import annotations

import os

import torch

from execrt.core.config import RuntimeConfig
from execrt.core.errors import ConfigError
from execrt.core.memory import KVCache
from execrt.core.model_spec import ModelSpec
from execrt.core.runners import InputBuffers


def check_before_load(
    config: RuntimeConfig,
    local: ModelSpec,
    device: torch.device,
    kv_dtype: torch.dtype,
    context_len: int,
) -> None:
    """Raise ConfigError for settings this machine cannot run. ``local`` is this rank's share
    of the model; ``device``, ``kv_dtype`` (the KV cache's storage dtype) and ``context_len``
    are the resolved values."""
    needs = pool_bytes(config, local, kv_dtype, context_len)
    total = sum(n for _, _, n in needs)
    available = available_memory(device)
    if available is None or total <= available:
        return
    # Name the keys that matter (a 1 MiB table beside a 3 TiB cache does not), largest first.
    named = [(k, what, n) for k, what, n in sorted(needs, key=lambda x: -x[2]) if n * 100 >= total]
    said = " and ".join(
        f"{k}={getattr(config, k)} needs {format_bytes(n)} for the {what}" for k, what, n in named
    )
    raise ConfigError(
        f"config: {said}, before the model's weights, but {device} has "
        f"{format_bytes(available)} available; {_LOWER[named[0][0]]}",
        keys=[k for k, _, _ in named],
    )


_LOWER = {
    "kv_cache_tokens": "lower kv_cache_tokens (0 sizes the KV cache to fit)",
    "max_running_requests": "lower max_running_requests (or context_len)",
    "max_prefill_tokens": "lower max_prefill_tokens (longer prompts are prefilled in chunks)",
}


#: The most an automatic CPU KV cache grows past its floor to fit one full-context request
CPU_KV_CEILING_BYTES = 1 << 30


def cpu_kv_budget(floor: int, per_token: int, context_len: int, available: int | None) -> int:
    """Bytes of an automatic KV cache on CPU: ``floor``, raised to fit one request at full
    context when that takes at most ``CPU_KV_CEILING_BYTES`` and a quarter of the memory
    ``available`` (SmolLM2's 8,192 tokens need 360 MiB in fp32; 256 MiB held 5,825)."""
    full = per_token * context_len
    room = CPU_KV_CEILING_BYTES if available is None else min(CPU_KV_CEILING_BYTES, available // 4)
    return full if floor < full <= room else floor


def max_step_tokens(config: RuntimeConfig) -> int:
    """Tokens of the largest step (a prefill, or a decode of every running request): what the
    static input buffers hold. ``config``'s sizes resolved (not 0)."""
    return max(config.max_prefill_tokens, config.max_running_requests)


def pool_bytes(
    config: RuntimeConfig, local: ModelSpec, kv_dtype: torch.dtype, context_len: int
) -> list[tuple[str, str, int]]:
    """``(key, what it sizes, bytes)`` for each pool a key sizes. An automatic KV cache
    (``kv_cache_tokens`` 0) is sized to fit later, so it is not counted."""
    rows = config.max_running_requests + 1  # row 0 is the padding row
    table = f"request-to-token table ({rows} rows x {context_len} tokens, int32)"
    out = [("max_running_requests", table, rows * context_len * 4)]
    step = max_step_tokens(config)
    buffers = f"step input buffers ({step} tokens x 3, int64)"
    out.append(
        ("max_prefill_tokens", buffers, InputBuffers.bytes_for(config.max_running_requests, step))
    )
    tokens = config.kv_cache_tokens
    if tokens:
        per_token = KVCache.bytes_per_token_for(
            local.num_layers, local.num_kv_heads, local.head_dim, kv_dtype
        )
        # K and V of every layer, slot 0 included, and the allocator's int64 free list.
        what = f"KV cache ({format_bytes(per_token)} per token)"
        out.append(("kv_cache_tokens", what, (tokens + 1) * per_token + tokens * 8))
    return out


def available_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now (CUDA: free device memory; CPU: MemAvailable), None
    when this platform does not say."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: int) -> str:
    """``3.0 TiB``, ``256.0 MiB``, ``512 B``: the size in the largest unit below it."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
