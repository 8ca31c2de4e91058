"""ParallelState: this rank's place in the process group (gloo on CPU, NCCL on GPU), its tensor-
and expert-parallel groups, and the one place where heads and rows are split across TP ranks."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from execrt.core.errors import ConfigError, ExecrtError


@dataclass(frozen=True)
class CommGroup:
    """A communicator this rank belongs to: its size, this rank's index in it and the
    torch.distributed group (None: the default group). At size 1 no collective runs."""

    size: int = 1
    rank: int = 0
    handle: Any = None


@dataclass(frozen=True)
class ParallelState:
    """World size, rank, and how the world is split into tensor- and expert-parallel groups.

    ``tp_size`` ranks share each layer's attention heads and dense MLP rows; ``ep_size`` ranks
    share the experts. Each is 1 or the whole world (no data parallelism yet), so each group is
    either this rank alone or the world group. ``ep_size`` 0 means the world (experts over every
    rank, attention replicated: what ``ParallelState(world, rank, backend)`` builds). At world
    size 1 every collective is a no-op.
    """

    world_size: int = 1
    rank: int = 0
    backend: str = "none"  # "none" (single process), "gloo" or "nccl"
    group: Any = None  # torch.distributed ProcessGroup of the world; None = default group
    tp_size: int = 1
    ep_size: int = 0  # 0: the world size

    def __post_init__(self) -> None:
        if self.ep_size == 0:
            object.__setattr__(self, "ep_size", self.world_size)
        for name in ("tp_size", "ep_size"):
            size = getattr(self, name)
            if size not in (1, self.world_size):
                raise ConfigError(
                    f"parallel: {name} {size} unsupported in a world of {self.world_size} "
                    f"(supported: 1 or {self.world_size})",
                    keys=[name],
                )

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    @property
    def ep_rank(self) -> int:
        return self.ep_group.rank

    @property
    def world(self) -> CommGroup:
        return CommGroup(self.world_size, self.rank, self.group)

    @property
    def tp_group(self) -> CommGroup:
        return self.world if self.tp_size > 1 else CommGroup()

    @property
    def ep_group(self) -> CommGroup:
        return self.world if self.ep_size > 1 else CommGroup()

    def with_layout(self, tp_size: int, ep_size: int, *, is_moe: bool) -> ParallelState:
        """This world split as the run configuration asks (``ep_size`` 0: same as ``tp_size``).

        Every rank must do some share of the work: a world of N runs tp_size N, or (MoE models)
        tp_size 1 with ep_size N. Raises ConfigError, one line, when the flags and the world
        size disagree.
        """
        ep = ep_size or tp_size
        world = self.world_size
        # Too few processes for tp_size (or, for experts over the world, for ep_size).
        name, size = ("tp_size", tp_size) if tp_size > 1 else ("ep_size", ep)
        if size > world:
            raise ConfigError(
                f"parallel: {name} {size} needs {size} processes, this world has {world} "
                f"(launch {size} processes with torchrun --nproc-per-node {size})",
                keys=[name],
            )
        if tp_size not in (1, world) or ep not in (1, world):
            raise ConfigError(
                f"parallel: tp_size {tp_size} / ep_size {ep} unsupported in a world of {world} "
                f"(supported: tp_size {world} with ep_size 1 or {world}, or tp_size 1 with "
                f"ep_size {world} for a MoE model)",
                keys=["tp_size", "ep_size"],
            )
        if world > 1 and tp_size == 1 and (ep == 1 or not is_moe):
            wanted = f"tp_size {world}" + (f" or ep_size {world}" if is_moe else "")
            raise ConfigError(
                f"parallel: a world of {world} processes but tp_size 1"
                + (f" and ep_size {ep}" if is_moe else "")
                + f": every rank would repeat the same work (supported: {wanted})",
                keys=["tp_size", "ep_size"] if is_moe else ["tp_size"],
            )
        return replace(self, tp_size=tp_size, ep_size=ep if is_moe else 1)

    def all_reduce(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """Sum ``tensor`` over ``group`` (``tp_group`` or ``ep_group``), in place; returns it."""
        if group.size > 1:
            dist.all_reduce(tensor, group=group.handle)
        return tensor

    def broadcast(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """``tensor`` of the group's first rank, copied in place on every rank; returns it."""
        if group.size > 1:
            src = dist.get_global_rank(group.handle, 0) if group.handle is not None else 0
            dist.broadcast(tensor, src=src, group=group.handle)
        return tensor

    def all_gather_counts(self, count: int, device: torch.device, group: CommGroup) -> list[int]:
        """Every rank's ``count`` in ``group``, in rank order."""
        if group.size == 1:
            return [count]
        local = torch.tensor([count], dtype=torch.int64, device=device)
        out = [torch.zeros_like(local) for _ in range(group.size)]
        dist.all_gather(out, local, group=group.handle)
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


@dataclass(frozen=True)
class HeadShard:
    """One TP rank's attention heads: q heads ``[q_start, q_start + num_q)`` and kv heads
    ``[kv_start, kv_start + num_kv)`` of the checkpoint."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def shard_heads(num_q_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """Split query heads evenly; kv heads too, or, when there are fewer kv heads than ranks,
    give each rank the one kv head its query heads read (rank r: kv head r * Hkv // tp)."""
    if num_q_heads % tp_size:
        raise ConfigError(
            f"tensor parallel: num_q_heads {num_q_heads} not divisible by tp_size {tp_size} "
            "(supported: a tp_size dividing the query heads)",
            keys=["tp_size"],
        )
    num_q = num_q_heads // tp_size
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ConfigError(
                f"tensor parallel: num_kv_heads {num_kv_heads} not divisible by tp_size "
                f"{tp_size} (supported: a tp_size dividing, or a multiple of, the kv heads)",
                keys=["tp_size"],
            )
        num_kv = num_kv_heads // tp_size
        return HeadShard(tp_rank * num_q, num_q, tp_rank * num_kv, num_kv)
    if tp_size % num_kv_heads:
        raise ConfigError(
            f"tensor parallel: tp_size {tp_size} not a multiple of num_kv_heads {num_kv_heads} "
            "(supported: a tp_size dividing, or a multiple of, the kv heads)",
            keys=["tp_size"],
        )
    # Each kv head is replicated on tp / Hkv ranks; rank r's query heads all read kv head
    # r * Hkv // tp because the query groups are contiguous.
    return HeadShard(tp_rank * num_q, num_q, tp_rank * num_kv_heads // tp_size, 1)


def shard_rows(size: int, tp_size: int, tp_rank: int, what: str) -> slice:
    """This rank's contiguous block of ``size`` rows (an MLP's intermediate size, say)."""
    if size % tp_size:
        raise ConfigError(
            f"tensor parallel: {what} {size} not divisible by tp_size {tp_size} "
            f"(supported: a tp_size dividing the {what})",
            keys=["tp_size"],
        )
    block = size // tp_size
    return slice(tp_rank * block, (tp_rank + 1) * block)


def launch_rank() -> int:
    """This process's rank as torchrun set it (0 outside torchrun), before any group exists."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def init_parallel(device: torch.device) -> ParallelState:
    """Join the process group ``torchrun`` described in the environment, if any.

    Uses NCCL for CUDA devices (each rank on ``cuda:LOCAL_RANK``) and gloo otherwise. A single
    process needs no group. May be called again once the group is destroyed (the next Engine
    in the same torchrun processes). The returned state is the world; ModelRunner lays TP and
    EP over it.
    """
    if dist.is_available() and dist.is_initialized():
        return ParallelState.from_process_group()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or not dist.is_available():
        return ParallelState.single()
    if device.type == "cuda":
        # NCCL binds a communicator to the current device: one GPU per local rank.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store, rank, world = next(dist.rendezvous("env://"))
    # torchrun's store outlives a destroyed group, keys and all, and torch names each new
    # default group as it named the first: a second group (the next Engine's) would read the
    # first one's stale addresses and fail to connect. So each join of this rank gets keys of
    # its own; every rank joins in the same order, so the ranks agree on the prefix.
    joins = store.add(f"execrt/joins/rank{rank}", 1)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(f"execrt/join{joins}/", store),
        rank=rank,
        world_size=world,
    )
    return ParallelState.from_process_group()


class RankLostError(ExecrtError):
    """A collective failed because another rank went away (killed, crashed) or stopped
    answering: this rank cannot go on. Its message is one line for the user; the collective's
    own error is its ``__cause__`` (for a debug log). ``lost`` says which rank and what
    happened without the collective's words (``rank 1 of 2 is gone``), for a client of the
    server, which gets no detail of its host (addresses, source paths)."""

    def __init__(self, rank: int, world_size: int, reason: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.reason = reason
        # In a world of two the other rank is the one gone; a larger world's error names an
        # address, not a rank.
        peer = f"rank {1 - rank} of 2" if world_size == 2 else f"another rank (of {world_size})"
        what = "stopped answering" if _TIMED_OUT.search(reason) else "is gone"
        self.lost = f"{peer} {what}"
        super().__init__(f"{self.lost} (a collective failed: {reason}); stopping")


#: What gloo and NCCL say when a collective fails for want of a peer.
_COLLECTIVE = re.compile(
    r"gloo|nccl|connection (closed|reset) by peer|broken pipe|timed out", re.IGNORECASE
)
_TIMED_OUT = re.compile(r"timed? ?out", re.IGNORECASE)
#: Where gloo's messages begin: ``[/path/to/gloo/transport/tcp/pair.cc:553] ``.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*")
#: The longest reason quoted from a collective's error.
REASON_CHARS = 200


def rank_lost(exc: BaseException, world: ParallelState) -> RankLostError | None:
    """``exc`` as a RankLostError when it, or an exception it was raised from, is a failed
    collective of a multi-rank ``world`` (a ``torch.distributed.DistError``, or gloo's plain
    RuntimeError); else None. The reason is the error's first sentence, without gloo's source
    location."""
    if world.world_size < 2:
        return None
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, RankLostError):
            return cause
        text = str(cause)
        distributed = isinstance(cause, getattr(dist, "DistError", ()))
        if distributed or (isinstance(cause, RuntimeError) and _COLLECTIVE.search(text)):
            return RankLostError(world.rank, world.world_size, _reason(text))
        cause = cause.__cause__ or cause.__context__
    return None


def _reason(text: str) -> str:
    line = _SOURCE_PREFIX.sub("", (text.strip().splitlines() or [""])[0])
    first = line.split(". ", 1)[0].rstrip(".")  # gloo goes on with advice of its own
    if len(first) > REASON_CHARS:
        first = first[: REASON_CHARS - 3] + "..."
    return first or "no message"
