"""Per-step CSR index build shared by the attention backends: ``kv_indptr`` / ``kv_indices``.

Every request's context slots, gathered from ``req_to_token`` into one flat list. A Triton
kernel (``execrt.kernels.attention.indices``) does it where ``use_triton`` says so; elsewhere a
capturable torch path does. Importing this module imports no kernel library.
"""

from __future__ import annotations

import torch

from execrt.kernels._triton import KernelMode, check_index_build, use_triton

COMPONENT = "kv indices"


def host_indptr(lens: list[int]) -> torch.Tensor:
    """``[0, cumsum(lens)]`` as an int32 CPU tensor (offsets known on the host, no sync)."""
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def fill_kv_index(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    mode: KernelMode | str = "auto",
    fill_indptr: bool = True,
) -> None:
    """The per-step index build on the device: ``kv_indptr[: B+1] = [0, cumsum(seq_lens)]``
    (unless ``fill_indptr`` is False: the caller filled it), then each request's context slot
    ids gathered into the flat ``kv_indices`` buffer.

    For every request b, copies ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` into
    ``kv_indices[kv_indptr[b] : kv_indptr[b] + seq_lens[b]]``. Writes into the given (possibly
    static, longer) buffers: no host synchronisation and no allocation of outputs, so graph
    metadata can use it as is. Entries past ``B + 1`` (``kv_indptr``) and ``kv_indptr[B]``
    (``kv_indices``) are left untouched.

    Args:
        req_to_token: int32/int64 ``[R, max_ctx]`` slot table, last dim contiguous.
        req_pool_indices: int32/int64 ``[B]`` row of ``req_to_token`` for each request.
        seq_lens: int32/int64 ``[B]`` context length of each request (``<= max_ctx``).
        kv_indptr: int32/int64 ``[>= B+1]`` prefix sum of ``seq_lens`` (written here unless
            ``fill_indptr`` is False).
        kv_indices: int32/int64 ``[>= sum(seq_lens)]`` output (written in place).
        mode: the kernels switch (``execrt.kernels.use_triton``): "auto" (the Triton kernel on
            CUDA when triton imports), "on" (the Triton kernel; CPU needs the interpreter) or
            "off" (the torch path).
        fill_indptr: write ``kv_indptr`` first (False: it holds the prefix sum already).

    Raises:
        ValueError: on wrong ranks, dtypes, lengths, devices or ``mode``.
    """
    batch = check_index_build(
        COMPONENT, req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices
    )
    triton = use_triton(req_to_token.device, mode)
    if fill_indptr:
        kv_indptr[:1].zero_()
        torch.cumsum(seq_lens, 0, dtype=kv_indptr.dtype, out=kv_indptr[1 : batch + 1])
    if batch == 0:
        return
    if triton:
        from execrt.kernels.attention.indices import launch_build_kv_indices

        launch_build_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices)
    else:
        _build_kv_indices_torch(req_to_token, req_pool_indices, kv_indptr, kv_indices)


def _build_kv_indices_torch(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    # Static shapes only (capturable): every entry of kv_indices finds its request by a search
    # in the prefix sum; entries past the total keep their old value.
    batch = req_pool_indices.shape[0]
    ends = kv_indptr[1 : batch + 1].to(torch.int64)  # [B]
    pos = torch.arange(kv_indices.shape[0], device=kv_indices.device)  # [N]
    owner = torch.searchsorted(ends, pos, right=True).clamp_(max=batch - 1)  # [N]
    offset = pos - kv_indptr[owner].to(torch.int64)  # [N]
    rows = req_pool_indices.to(torch.int64)[owner]  # [N]
    slots = req_to_token[rows, offset.clamp(0, req_to_token.shape[1] - 1)]  # [N]
    inside = pos < ends[-1]
    kv_indices.copy_(torch.where(inside, slots.to(kv_indices.dtype), kv_indices))
