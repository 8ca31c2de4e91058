"""What the MoE dispatchers share: input checks (shapes, dtypes; no device sync) and exchanges."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

from execrt.core.interfaces import ExpertMajorDispatchOutput, MoEDispatcherInit
from execrt.core.parallel import ParallelState

S = TypeVar("S")

_ID_DTYPES = (torch.int32, torch.int64)


def check_routing(
    component: str,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    init: MoEDispatcherInit,
) -> None:
    """Raise ValueError unless ``hidden [T, H]``, ``topk_ids [T, K]`` (int32/int64) and
    ``topk_weights [T, K]`` (floating) agree with each other and with ``init``.

    Reads only shapes and dtypes, so it never waits for the device and is safe under capture;
    the values of ``topk_ids`` are the dispatcher's to check where it reads them anyway.
    """
    if hidden.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"{component}: expected hidden [T, H], topk_ids and topk_weights [T, K]; got "
            f"{tuple(hidden.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"{component}: {topk_ids.shape[0]} routing rows for {hidden.shape[0]} tokens"
        )
    if hidden.shape[1] != init.hidden_size:
        raise ValueError(
            f"{component}: hidden size {hidden.shape[1]} unsupported "
            f"(supported: {init.hidden_size}, as built)"
        )
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(
            f"{component}: topk_ids dtype {str(topk_ids.dtype).replace('torch.', '')} "
            "unsupported (supported: int32, int64)"
        )
    if not topk_weights.is_floating_point():
        raise ValueError(
            f"{component}: topk_weights dtype {str(topk_weights.dtype).replace('torch.', '')} "
            "unsupported (supported: floating point)"
        )


def check_sharding(component: str, init: MoEDispatcherInit) -> None:
    """Experts split into equal contiguous blocks, at least one per rank."""
    world = init.parallel.ep_size
    if init.num_experts < world or init.num_experts % world:
        raise ValueError(
            f"{component}: num_experts {init.num_experts} unsupported (supported: a positive "
            f"multiple of the EP size {world})"
        )


def check_expert_output(
    component: str, expert_output: torch.Tensor, dispatched: Any, state_type: type[S]
) -> S:
    """The routing state of ``dispatched`` if it is this dispatcher's expert-major output and
    ``expert_output`` has its shape; TypeError or ValueError otherwise."""
    if not isinstance(dispatched, ExpertMajorDispatchOutput) or not isinstance(
        dispatched.state, state_type
    ):
        raise TypeError(f"{component}: combine needs the ExpertMajorDispatchOutput it made")
    if expert_output.shape != dispatched.hidden_states.shape:
        raise ValueError(
            f"{component}: expert output {tuple(expert_output.shape)} unsupported "
            f"(supported: the dispatched shape {tuple(dispatched.hidden_states.shape)})"
        )
    return dispatched.state


def exchange(
    parallel: ParallelState,
    rows: torch.Tensor,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 of ``rows``: ``in_splits[r]`` rows go to rank r and
    ``out_splits[r]`` arrive from it, in rank order. Without splits every rank gets an equal
    share (static shapes: capturable under NCCL). At world size 1 the rows stay put."""
    if parallel.ep_size == 1:
        return rows
    num_out = rows.shape[0] if out_splits is None else sum(out_splits)
    out = rows.new_empty(num_out, *rows.shape[1:])
    group = parallel.ep_group.handle
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out
