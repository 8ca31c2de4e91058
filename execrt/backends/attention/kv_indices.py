"""Per-step CSR index build shared by the attention backends: ``kv_indptr`` / ``kv_indices``.

Every request's context slots, gathered from ``req_to_token`` into one flat list. A Triton
kernel does it on CUDA (and under the Triton interpreter); elsewhere a capturable torch path
does. Importing this module imports no kernel library.
"""

from __future__ import annotations

import os
from typing import NoReturn

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
COMPONENT = "kv indices"


def fail(message: str, component: str = COMPONENT) -> NoReturn:
    raise ValueError(f"{component}: {message}")


def check_index(
    name: str,
    t: torch.Tensor,
    min_len: int,
    dtypes: tuple[torch.dtype, ...],
    component: str = COMPONENT,
) -> None:
    """A 1-D, contiguous index tensor of an accepted dtype with at least ``min_len`` entries."""
    if t.dim() != 1:
        fail(f"{name} must be 1-D, got shape {tuple(t.shape)}", component)
    if t.dtype not in dtypes:
        accepted = ", ".join(map(str, dtypes))
        fail(f"{name} dtype {t.dtype} unsupported (supported: {accepted})", component)
    if t.shape[0] < min_len:
        fail(f"{name} has {t.shape[0]} entries, need at least {min_len}", component)
    if t.shape[0] > 0 and t.stride(0) != 1:
        fail(f"{name} must be contiguous, got stride {t.stride(0)}", component)


def check_devices(ref: torch.Tensor, component: str = COMPONENT, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != ref.device:
            fail(
                f"{name} is on {t.device} but the first input is on {ref.device} "
                "(all inputs on one device)",
                component,
            )


def host_indptr(lens: list[int]) -> torch.Tensor:
    """``[0, cumsum(lens)]`` as an int32 CPU tensor (offsets known on the host, no sync)."""
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def use_triton(device: torch.device) -> bool:
    """The Triton kernel serves CUDA tensors, and CPU ones under the Triton interpreter."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    impl: str = "auto",
) -> None:
    """Gather each request's context slot ids into the flat ``kv_indices`` buffer.

    For every request b, copies ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` into
    ``kv_indices[kv_indptr[b] : kv_indptr[b] + seq_lens[b]]``. No host synchronisation and no
    allocation of outputs, so the call can be captured in a CUDA graph. Entries of
    ``kv_indices`` past ``kv_indptr[B]`` are left untouched.

    Args:
        req_to_token: int32/int64 ``[R, max_ctx]`` slot table, last dim contiguous.
        req_pool_indices: int32/int64 ``[B]`` row of ``req_to_token`` for each request.
        seq_lens: int32/int64 ``[B]`` context length of each request (``<= max_ctx``).
        kv_indptr: int32/int64 ``[>= B+1]`` prefix sum of ``seq_lens``, filled by the caller.
        kv_indices: int32/int64 ``[>= sum(seq_lens)]`` output (written in place).
        impl: "auto" (Triton where ``use_triton``), "triton" or "torch".

    Raises:
        ValueError: on wrong ranks, dtypes, lengths, devices or ``impl``.
    """
    if req_to_token.dim() != 2:
        fail(f"req_to_token must be 2-D [R, max_ctx], got shape {tuple(req_to_token.shape)}")
    if req_to_token.dtype not in INDEX_DTYPES:
        fail(f"req_to_token dtype {req_to_token.dtype} unsupported (supported: int32, int64)")
    batch = req_pool_indices.shape[0] if req_pool_indices.dim() == 1 else -1
    check_index("req_pool_indices", req_pool_indices, 0, INDEX_DTYPES)
    check_index("seq_lens", seq_lens, batch, INDEX_DTYPES)
    if seq_lens.shape[0] != batch:
        fail(f"seq_lens has {seq_lens.shape[0]} entries but req_pool_indices has {batch}")
    check_index("kv_indptr", kv_indptr, batch + 1, INDEX_DTYPES)
    check_index("kv_indices", kv_indices, 0, INDEX_DTYPES)
    check_devices(
        req_to_token,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
    )
    if req_to_token.shape[1] > 1 and req_to_token.stride(1) != 1:
        fail(f"req_to_token must be contiguous in its last dim, got {tuple(req_to_token.stride())}")
    if impl not in ("auto", "triton", "torch"):
        fail(f"impl {impl!r} unsupported (supported: auto, triton, torch)")
    if batch == 0:
        return
    if impl == "triton" or (impl == "auto" and use_triton(req_to_token.device)):
        from execrt.backends.attention.triton_kernels.indices import launch_build_kv_indices

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


def fill_kv_index(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    impl: str = "auto",
) -> None:
    """The whole per-step index build on the device: ``kv_indptr[: B+1] = [0, cumsum(seq_lens)]``
    then :func:`build_kv_indices`. Writes into the given (possibly static, longer) buffers;
    no host synchronisation, so graph metadata can use it as is."""
    batch = seq_lens.shape[0]
    kv_indptr[:1].zero_()
    torch.cumsum(seq_lens, 0, dtype=kv_indptr.dtype, out=kv_indptr[1 : batch + 1])
    build_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, impl=impl)
