"""Host <-> device transfers of one step's small integers: pinned buffers, non-blocking copies.

A pageable host->device copy waits for the stream to drain, which would serialise the host's
preparation of step N+1 with the GPU's work on step N. Pinned slots make both directions
asynchronous; each slot is reused only after the copy that used it has completed.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Each segment of a packed copy (``stage_ints`` / ``stage_floats``) starts at a multiple of this
#: many bytes. Triton specialises a kernel on whether each pointer argument is 16-byte aligned,
#: so views at arbitrary offsets of one staged buffer (the seeds of a batch of 3 start 24 bytes
#: in) compile another variant of every kernel that reads them, in the middle of a run, each
#: time a batch size of another residue first shows up.
ALIGN_BYTES = 16


class _Slot:
    def __init__(self, capacity: int, dtype: torch.dtype, pinned: bool) -> None:
        self.host = torch.empty(capacity, dtype=dtype, pin_memory=pinned)
        self.event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class _Ring:
    def __init__(self, device: torch.device, dtype: torch.dtype, slots: int) -> None:
        self.device = device
        self.dtype = dtype
        self.pinned = device.type == "cuda"
        self.slots = [_Slot(1024, dtype, self.pinned) for _ in range(slots)]
        self.next = 0

    def take(self, n: int) -> _Slot:
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        slot.wait()  # the previous copy through this slot has finished with it
        if n > slot.host.numel():
            slot.host = torch.empty(
                max(n, 2 * slot.host.numel()), dtype=self.dtype, pin_memory=True
            )
        return slot


class HostToDevice:
    """Copies host lists to the device through alternating pinned slots, one copy per call:
    ``stager(ints)`` gives int64, ``stager.floats(values)`` float32."""

    def __init__(self, device: torch.device, slots: int = 3) -> None:
        self.device = device
        self._ints = _Ring(device, torch.int64, slots)
        self._floats = _Ring(device, torch.float32, slots)

    def __call__(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as a new int64 ``[n]`` tensor on the device (the copy may be in flight)."""
        return self._copy(self._ints, values)

    def floats(self, values: Sequence[float]) -> torch.Tensor:
        return self._copy(self._floats, values)

    def _copy(self, ring: _Ring, values: Sequence[int] | Sequence[float]) -> torch.Tensor:
        if not ring.pinned:
            return _host_tensor(values, ring.dtype).to(self.device)
        n = len(values)
        slot = ring.take(n)
        slot.host[:n] = _host_tensor(values, ring.dtype)
        out = torch.empty(n, dtype=ring.dtype, device=self.device)
        out.copy_(slot.host[:n], non_blocking=True)
        slot.event = _event()
        slot.event.record()
        return out


class DeviceToHost:
    """Starts a non-blocking copy of a small device tensor into a pinned slot; ``result``
    waits for that copy only (not for the whole stream) and returns the values as a list."""

    def __init__(self, device: torch.device, dtype: torch.dtype, slots: int = 3) -> None:
        self._ring = _Ring(device, dtype, slots)

    def start(self, tensor: torch.Tensor) -> HostCopy:
        """Slots are reused round-robin: read a copy before ``slots`` more have started."""
        if not self._ring.pinned:  # a snapshot, flat and in the ring's dtype, as the pinned copy
            return HostCopy(tensor.detach().flatten().to(self._ring.dtype, copy=True), None)
        n = tensor.numel()
        slot = self._ring.take(n)
        host = slot.host[:n]
        host.copy_(tensor.flatten(), non_blocking=True)
        slot.event = _event()
        slot.event.record()
        return HostCopy(host, slot.event)


class HostCopy:
    """One in-flight device->host copy."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self._host = host
        self._event = event

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return list(self._host.tolist())


#: ``array`` type codes of the staged dtypes.
_TYPECODES = {torch.int64: "q", torch.float32: "f"}


def _host_tensor(values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a CPU tensor of ``dtype`` (int64 or float32). Through ``array``: about
    3x faster than ``torch.tensor(list)``, which checks each element's type, and an extend's
    16k token ids are then ~1 ms of the host's step instead of ~3."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)


def copy_to_host(tensor: torch.Tensor) -> HostCopy:
    """A non-blocking copy of ``tensor`` (flattened) into a host buffer of its own, pinned on
    CUDA: for values read later than a ``DeviceToHost`` ring's turn allows."""
    flat = tensor.detach().flatten()
    if flat.device.type != "cuda":
        return HostCopy(flat.to("cpu", copy=True), None)
    host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = _event()
    event.record()
    return HostCopy(host, event)


def _event() -> torch.cuda.Event:
    """A CUDA event recorded where the copy was queued (torch's constructor is untyped)."""
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def stage_ints(stager: HostToDevice, segments: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """``segments`` as int64 device tensors through one ``stager`` copy, each starting
    ``ALIGN_BYTES``-aligned in the staged buffer (see ALIGN_BYTES)."""
    return _stage(stager.__call__, segments, torch.int64)


def stage_floats(stager: HostToDevice, segments: Sequence[Sequence[float]]) -> list[torch.Tensor]:
    """``segments`` as float32 device tensors through one ``stager.floats`` copy, each
    aligned as ``stage_ints``'s are."""
    return _stage(stager.floats, segments, torch.float32)


def _stage(
    copy: Callable[[list[Any]], torch.Tensor],
    segments: Sequence[Sequence[Any]],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    unit = ALIGN_BYTES // dtype.itemsize
    flat: list[Any] = []
    starts = []
    for seg in segments:
        starts.append(len(flat))
        flat += seg
        flat += [0] * (-len(flat) % unit)  # the next segment starts aligned
    dev = copy(flat)  # one host->device copy
    return [dev[s : s + len(seg)] for s, seg in zip(starts, segments, strict=True)]
