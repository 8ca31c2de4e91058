"""ParallelState: this rank's place in the process group (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    """World size, rank and the expert-parallel group of this process.

    Attention and dense layers are replicated; experts are sharded over the EP group, which is
    the whole world for now. At world size 1 every collective is a no-op.
    """

    world_size: int = 1
    rank: int = 0
    backend: str = "none"  # "none" (single process), "gloo" or "nccl"
    group: Any = None  # torch.distributed ProcessGroup of the EP group; None = default group

    @property
    def ep_size(self) -> int:
        return self.world_size

    @property
    def ep_rank(self) -> int:
        return self.rank

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the EP group, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_counts(self, count: int, device: torch.device) -> list[int]:
        """Every rank's ``count``, in rank order."""
        if self.world_size == 1:
            return [count]
        local = torch.tensor([count], dtype=torch.int64, device=device)
        out = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local, group=self.group)
        return [int(t.item()) for t in out]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    @classmethod
    def single(cls) -> ParallelState:
        return cls()

    @classmethod
    def from_process_group(cls, group: Any = None) -> ParallelState:
        """Wrap an initialised torch.distributed default (or given) group."""
        return cls(
            world_size=dist.get_world_size(group),
            rank=dist.get_rank(group),
            backend=str(dist.get_backend(group)),
            group=group,
        )


def init_parallel(device: torch.device) -> ParallelState:
    """Join the process group ``torchrun`` described in the environment, if any.

    Uses NCCL for CUDA devices and gloo otherwise. A single process needs no group.
    """
    if dist.is_available() and dist.is_initialized():
        return ParallelState.from_process_group()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or not dist.is_available():
        return ParallelState.single()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    return ParallelState.from_process_group()
