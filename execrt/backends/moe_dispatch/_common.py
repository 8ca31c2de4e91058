"""Input checks every MoE dispatcher shares (shapes and dtypes, no device synchronisation)."""

from __future__ import annotations

import torch

from execrt.core.interfaces import MoEDispatcherInit

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
