"""The one seam to NCCL EP (``nccl.ep`` + ``nccl.core``, or a test double) and its validated calls.

NCCL EP checks its arguments with C asserts, which abort the process: every call made here
checks shapes, dtypes, devices and contiguity in Python first and raises ``ValueError``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from execrt.backends.moe_dispatch import nccl_ep_probe as probe
from execrt.core.errors import BackendUnavailableError, ResourceError
from execrt.core.parallel import ParallelState

COMPONENT = "nccl_ep dispatcher"


def _cuda_capturing() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@dataclass(frozen=True)
class NcclApi:
    """What the dispatcher reaches NCCL EP through: ``ep`` (the ``nccl.ep`` module),
    ``core`` (``nccl.core``), ``is_capturing`` (is a CUDA-graph capture active?) and
    ``comm_from_group`` (a fresh communicator over a torch process group, the fallback when
    torch does not expose its own). Tests hand in ``tests.doubles.nccl_ep``'s."""

    ep: Any
    core: Any
    is_capturing: Callable[[], bool] = _cuda_capturing
    comm_from_group: Callable[[Any], Any] | None = None


def load_nccl_api() -> NcclApi:
    """Import the real modules, after checking that the NCCL in this process can load them.

    Raises BackendUnavailableError naming the NCCL versions found (torch's, nccl.core's)
    instead of letting libnccl_ep.so fail to load on missing symbols.
    """
    problems = probe.environment_problems(probe.probe_environment())
    if problems:
        raise BackendUnavailableError("moe_dispatch", "nccl_ep", problems)
    try:
        ep = importlib.import_module("nccl.ep")
        core = importlib.import_module("nccl.core")
        interop = importlib.import_module("nccl.ep.interop.torch")
    except ImportError as exc:  # the probe imports nccl.ep too; this is the last line
        raise BackendUnavailableError(
            "moe_dispatch",
            "nccl_ep",
            [f"nccl.ep cannot be imported ({type(exc).__name__}: {exc}; {probe.INSTALL_HINT})"],
        ) from exc
    return NcclApi(ep, core, _cuda_capturing, interop.get_nccl_comm_from_group)


@dataclass
class Communicator:
    """The NCCL communicator EP groups are built on; ``owned``: we made it and destroy it."""

    comm: Any
    owned: bool

    def close(self) -> None:
        if self.owned and self.comm is not None:
            self.comm.destroy()
        self.comm = None


def open_communicator(api: NcclApi, parallel: ParallelState, device: torch.device) -> Communicator:
    """The EP group's existing NCCL communicator (torch's ProcessGroupNCCL), or, when the EP
    group is this rank alone (no process group, or experts replicated over TP ranks), a
    one-rank communicator of our own."""
    if api.is_capturing():
        raise ResourceError(f"{COMPONENT}: cannot open a communicator inside CUDA-graph capture")
    if parallel.backend == "none" or parallel.ep_size == 1 < parallel.world_size:
        if parallel.ep_size != 1:
            raise ValueError(f"{COMPONENT}: EP size {parallel.ep_size} needs NCCL")
        comm = api.core.Communicator.init(1, 0, api.core.get_unique_id())
        return _checked(Communicator(comm, owned=True))
    if parallel.backend != "nccl":
        raise ValueError(
            f"{COMPONENT}: process group backend {parallel.backend!r} unsupported "
            "(supported: nccl, or none at world size 1)"
        )
    ptr = _torch_comm_ptr(parallel, device)
    if ptr:
        return _checked(Communicator(api.core.Communicator(ptr), owned=False))
    if api.comm_from_group is None:
        raise BackendUnavailableError(
            "moe_dispatch", "nccl_ep", ["torch does not expose its NCCL communicator"]
        )
    return _checked(Communicator(api.comm_from_group(parallel.ep_group.handle), owned=True))


def _torch_comm_ptr(parallel: ParallelState, device: torch.device) -> int:
    handle = parallel.ep_group.handle
    group = handle if handle is not None else dist.group.WORLD
    backend = group._get_backend(device)  # type: ignore[union-attr]
    getter = getattr(backend, "_comm_ptr", None)
    if not callable(getter):
        return 0
    ptr = int(getter())
    if ptr == 0:  # ProcessGroupNCCL creates its communicator at the first collective
        dist.all_reduce(torch.zeros(1, device=device), group=handle)
        ptr = int(getter())
    return ptr


def _checked(communicator: Communicator) -> Communicator:
    if not getattr(communicator.comm, "device_api_support", True):
        communicator.close()
        raise BackendUnavailableError(
            "moe_dispatch", "nccl_ep", ["this NCCL communicator has no Device API support"]
        )
    return communicator


def create_group(
    api: NcclApi, comm: Any, *, num_experts: int, max_tokens: int, hidden: int, top_k: int
) -> Any:
    """A low-latency EP group. The staging buffer is sized by the library (AUTO) at the first
    handle; every handle of the group has one layout and one top-k, so it never regrows."""
    if api.is_capturing():
        raise ResourceError(f"{COMPONENT}: cannot create an EP group inside CUDA-graph capture")
    config = api.ep.GroupConfig(
        algorithm=api.ep.Algorithm.LOW_LATENCY,
        num_experts=num_experts,
        max_dispatch_tokens_per_rank=max_tokens,
        max_token_bytes=hidden * 2,  # bf16 rows
        num_topk=top_k,
    )
    return api.ep.Group.create(comm, config)


def create_handle(api: NcclApi, group: Any, routing: Any, stream: int) -> Any:
    """A handle over ``routing`` (an ``ep.Tensor`` of ``topk_ids [T, K]`` int64; the caller
    keeps it alive as long as the handle)."""
    if api.is_capturing():
        raise ResourceError(f"{COMPONENT}: cannot create an EP handle inside CUDA-graph capture")
    return group.create_handle(api.ep.Layout.EXPERT_MAJOR, routing, layout_info=None, stream=stream)


def update_handle(api: NcclApi, handle: Any, routing: Any, stream: int) -> None:
    """Rebind the handle's routing (host-only in LL mode); never inside capture."""
    if api.is_capturing():
        raise ResourceError(f"{COMPONENT}: cannot update an EP handle inside CUDA-graph capture")
    handle.update(routing, layout_info=None, stream=stream)


def stream_of(device: torch.device) -> int:
    """The raw CUDA stream NCCL EP launches on: the current one (0 off CUDA)."""
    return int(torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else 0


# ---------------------------------------------------------------------------------------------
# Validated dispatch / combine (LL expert-major, staged: send_only, then complete)
# ---------------------------------------------------------------------------------------------
def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Raise ValueError unless ``t`` has exactly this shape, dtype and device and is dense."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{COMPONENT}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{COMPONENT}: {name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype != dtype:
        raise ValueError(
            f"{COMPONENT}: {name} dtype {_short(t.dtype)} unsupported (supported: {_short(dtype)})"
        )
    if t.device != device:
        raise ValueError(f"{COMPONENT}: {name} on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(
            f"{COMPONENT}: {name} must be contiguous (strides {tuple(t.stride())}); "
            "NCCL EP reads it as a dense buffer"
        )


def check_expert_ids(ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError unless every id of ``ids [T, K]`` is in [-1, num_experts): NCCL EP's
    kernel sends to rank ``id // E_local`` unchecked, and -1 is the one "routed nowhere".
    Reads the range back to the host."""
    low, high = torch.stack(torch.aminmax(ids)).tolist()  # one sync for both
    if low >= -1 and high < num_experts:
        return
    bad = ids[(ids < -1) | (ids >= num_experts)]
    raise ValueError(
        f"{COMPONENT}: expert id {int(bad[0])} in topk_ids unsupported (supported: -1, routed "
        f"nowhere, or 0..{num_experts - 1}; {bad.numel()} ids out of range)"
    )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dispatch(
    api: NcclApi,
    handle: Any,
    tokens: torch.Tensor,
    recv: torch.Tensor,
    counters: torch.Tensor,
    *,
    num_tokens: int,
    stream: int,
) -> None:
    """``tokens [T, H]`` -> ``recv [E_local, P*C, H]`` + ``counters [E_local]`` int32.

    ``num_tokens`` is the T the handle's routing was bound with; rows must match it exactly.
    """
    e_local, rows, hidden = recv.shape
    device = recv.device
    check_tensor("dispatch input", tokens, (num_tokens, hidden), torch.bfloat16, device)
    check_tensor("dispatch output", recv, (e_local, rows, hidden), torch.bfloat16, device)
    check_tensor("expert_counters", counters, (e_local,), torch.int32, device)
    ep = api.ep
    inputs = ep.DispatchInputs(tokens=ep.Tensor(tokens))
    outputs = ep.DispatchOutputs(tokens=ep.Tensor(recv))
    layout = ep.LayoutInfo(expert_counters=ep.Tensor(counters))
    counters.zero_()
    handle.dispatch(
        inputs, outputs, layout_info=layout, config=ep.DispatchConfig(send_only=1), stream=stream
    )
    # The descriptors above stay referenced until complete() returns, as NCCL EP requires.
    handle.complete(stream=stream)


def combine(
    api: NcclApi,
    handle: Any,
    expert_output: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    recv_shape: tuple[int, int, int],
    num_tokens: int,
    top_k: int,
    stream: int,
) -> None:
    """``expert_output [E_local, P*C, H]`` (unweighted) -> ``out [T, H]``; NCCL EP applies
    ``topk_weights [T, K]`` itself, so the expert outputs must not be pre-multiplied."""
    hidden = recv_shape[2]
    device = out.device
    check_tensor("expert output", expert_output, recv_shape, torch.bfloat16, device)
    check_tensor("combine output", out, (num_tokens, hidden), torch.bfloat16, device)
    check_tensor("topk_weights", topk_weights, (num_tokens, top_k), torch.float32, device)
    ep = api.ep
    inputs = ep.CombineInputs(tokens=ep.Tensor(expert_output))
    outputs = ep.CombineOutputs(tokens=ep.Tensor(out), topk_weights=ep.Tensor(topk_weights))
    handle.combine(inputs, outputs, config=ep.CombineConfig(send_only=1), stream=stream)
    handle.complete(stream=stream)
