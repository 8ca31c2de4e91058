"""Tile configs of the fused-MoE GEMMs: shipped JSON tables keyed by token count, defaults."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from execrt.kernels._triton import tuned_table_name

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


@dataclass(frozen=True)
class GemmTile:
    """Tiles and launch knobs of one grouped GEMM. For gate/up, ``block_n`` counts intermediate
    columns: each program streams the matching gate *and* up rows (2 x block_n weight rows)."""

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"fused_moe: {name} {value} unsupported (power of two >= 16)")
        if self.group_m < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"fused_moe: bad tile {self} (group_m >= 1, num_warps 1..16, ...)")


@dataclass(frozen=True)
class MoEConfig:
    """One config per token count: ``block_m`` is shared (it shapes the alignment), the two
    GEMMs (``up`` = gate/up with SiLU*mul in the epilogue, ``down``) have their own tiles."""

    block_m: int
    up: GemmTile
    down: GemmTile

    def __post_init__(self) -> None:
        if self.block_m < 16 or self.block_m & (self.block_m - 1) or self.block_m > 256:
            raise ValueError(f"fused_moe: block_m {self.block_m} unsupported (16, 32, .., 256)")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MoEConfig:
        return cls(d["block_m"], GemmTile(**d["up"]), GemmTile(**d["down"]))


def config_file_name(num_experts: int, n: int, device_name: str, dtype: torch.dtype) -> str:
    """``E=128,N=768,device_name=NVIDIA_H200,dtype=bfloat16.json``; ``n`` = intermediate size."""
    return tuned_table_name(device_name, dtype, f"E={num_experts},N={n}")


@functools.lru_cache(maxsize=64)
def load_config_table(path: str) -> dict[int, MoEConfig] | None:
    """``{num_tokens: MoEConfig}`` from a config file, or None when there is none."""
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        data = json.load(fh)
    return {int(m): MoEConfig.from_json(c) for m, c in data["configs"].items()}


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoEConfig:
    """Batch-aware fallback for untuned shapes, from the rows each expert gets on average.

    Decode (a few rows per expert) is weight streaming: small block_m, narrow N tiles so the
    grid still fills the GPU with only top_k experts hit, deep K tiles for wide loads. With
    more rows per expert the tiles grow towards a compute-bound GEMM.
    """
    rows = num_tokens * top_k / max(num_experts, 1)
    if rows <= 16:
        return MoEConfig(16, GemmTile(32, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 4))
    if rows <= 48:
        return MoEConfig(32, GemmTile(64, 128, 8, 4, 3), GemmTile(64, 128, 8, 4, 3))
    if rows <= 160:
        return MoEConfig(64, GemmTile(64, 64, 8, 4, 4), GemmTile(128, 64, 8, 4, 4))
    return MoEConfig(128, GemmTile(64, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3))


def get_config(
    num_experts: int,
    intermediate_size: int,
    num_tokens: int,
    top_k: int,
    dtype: torch.dtype,
    device_name: str | None = None,
) -> MoEConfig:
    """The shipped config of the nearest token count for this (E, N, device, dtype), else
    ``default_config``. ``device_name`` defaults to the current CUDA device's."""
    if device_name is None:
        device_name = _current_device_name()
    table = None
    if device_name:
        name = config_file_name(num_experts, intermediate_size, device_name, dtype)
        table = load_config_table(os.path.join(CONFIG_DIR, name))
    if not table:
        return default_config(num_tokens, num_experts, top_k)
    nearest = min(table, key=lambda m: (abs(m - num_tokens), m))
    return table[nearest]


@functools.lru_cache(maxsize=1)
def _current_device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""
