"""KV memory: request->token map, slot allocator, its debug holder map, per-layer K/V storage."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from execrt.core import envs
from execrt.core.errors import KVOwnershipError
from execrt.core.kv_quant import K_INV_SCALE, V_INV_SCALE, KVScales, is_fp8, store


class ReqToTokenPool:
    """Maps a request row to the KV slot of each of its tokens.

    ``req_to_token`` is int32 ``[max_reqs + 1, max_context_len]``; row 0 is the padding row that
    padded graph rows point at, so real rows are ``1..max_reqs``. Rows are handed out and taken
    back on the host; the table itself lives on ``device``.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str) -> None:
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError(
                f"ReqToTokenPool: max_reqs {max_reqs} and max_context_len {max_context_len} "
                "must be >= 1"
            )
        self.size = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (max_reqs + 1, max_context_len), dtype=torch.int32, device=self.device
        )  # [R+1, C]
        self._free: list[int] = list(range(max_reqs, 0, -1))  # pop() hands out low rows first

    def available_size(self) -> int:
        return len(self._free)

    def free_rows(self) -> list[int]:
        """The rows not handed out (a copy)."""
        return list(self._free)

    def alloc(self) -> int | None:
        """One free row, or None when every row is in use."""
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if not 1 <= row <= self.size:
            raise ValueError(f"ReqToTokenPool: row {row} out of range (1..{self.size})")
        if row in self._free:
            raise ValueError(f"ReqToTokenPool: row {row} freed twice")
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record ``slots`` as the KV slots of tokens ``start..start+len(slots)`` of ``row``."""
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(
                f"ReqToTokenPool: token {end - 1} beyond max_context_len {self.max_context_len}"
            )
        self.req_to_token[row, start:end] = slots.to(torch.int32)

    def write_tokens(
        self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """``req_to_token[rows[i], positions[i]] = slots[i]`` for every i, in one device op.

        ``rows`` / ``positions`` / ``slots`` are ``[T]`` int64 on the pool's device; no host
        sync (positions are not range-checked here: the scheduler sizes them)."""
        if slots.numel():
            self.req_to_token.index_put_((rows, positions), slots.to(torch.int32))


#: Queued frees the allocator appends to its free list at once, at the latest.
MERGE_EVERY = 64


class TokenToKVPoolAllocator:
    """Hands out KV slots ``1..size``; slot 0 is reserved for the writes of padded tokens.

    ``alloc(n)`` is all-or-nothing: it returns ``n`` slot ids or None, never a partial list.
    The free list lives on the device so allocation needs no host->device copy, and neither
    call makes the host wait for the device: sizes are host counts, freed slots are queued
    (the allocator keeps the caller's tensor: do not write it afterwards) and appended to the
    free list, in the order they came back, only when an allocation needs them.

    ``free`` checks that the ids are in ``1..size``. That reads them on the host, so on a GPU
    it is done only with ``check_ids`` (default: the ``EXECRT_DEBUG_KV_OWNERSHIP`` switch,
    which the tests turn on): a read per free would stall the scheduler that overlaps
    building the next step with the device running this one.
    """

    def __init__(
        self, size: int, device: torch.device | str, *, check_ids: bool | None = None
    ) -> None:
        if size < 1:
            raise ValueError(f"TokenToKVPoolAllocator: size {size} must be >= 1")
        self.size = size
        self.device = torch.device(device)
        if check_ids is None:
            check_ids = self.device.type == "cpu" or envs.flag(envs.DEBUG_KV_OWNERSHIP)
        self.check_ids = check_ids
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=self.device)
        self._returned: list[torch.Tensor] = []  # freed since the last merge, in order
        self._returned_count = 0

    def available_size(self) -> int:
        return int(self._free.numel()) + self._returned_count

    def free_slot_ids(self) -> torch.Tensor:
        """The slots not handed out, int64 ``[available_size()]`` on the device (read only)."""
        self._merge()
        return self._free

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free slot ids as int64 ``[n]`` on the device, or None if fewer are free."""
        if n < 0:
            raise ValueError(f"TokenToKVPoolAllocator: cannot allocate {n} slots")
        if n > self.available_size():
            return None
        if n > self._free.numel():
            self._merge()
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return ``slots`` to the pool. Slot 0 and out-of-range ids are rejected (see the
        class docstring for when they are checked)."""
        if slots.numel() == 0:
            return
        # Ids the host holds are read without a wait: a GPU allocator checks those too.
        host_ids = slots.device.type == "cpu" and self.device.type != "cpu"
        slots = slots.to(device=self.device, dtype=torch.int64).flatten()
        if self.check_ids or host_ids:
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 1 or hi > self.size:
                raise ValueError(f"TokenToKVPoolAllocator: slot ids must be in 1..{self.size}")
        self._returned.append(slots)
        self._returned_count += int(slots.numel())
        if len(self._returned) >= MERGE_EVERY:
            self._merge()  # bounds the queue: one copy per MERGE_EVERY frees

    def _merge(self) -> None:
        """Append the queued frees to the free list (one device copy for all of them)."""
        if self._returned:
            self._free = torch.cat([self._free, *self._returned])
            self._returned, self._returned_count = [], 0


class SlotHolders:
    """The debug map (``EXECRT_DEBUG_KV_OWNERSHIP=1``): the holder of every handed-out slot.

    Each call checks all its slots before it changes anything, and raises KVOwnershipError on
    a slot handed to a second holder, on freeing slot 0 (the padding slot, never handed out),
    on freeing a free slot (a double free) and on freeing another holder's slot.
    """

    def __init__(self) -> None:
        self._holder: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._holder)

    def claim(self, slots: Sequence[int], holders: Sequence[str]) -> None:
        """``holders[i]`` takes ``slots[i]``."""
        seen: dict[int, str] = {}
        for slot, holder in zip(slots, holders, strict=True):
            held = self._holder.get(slot) or seen.get(slot)
            if slot == 0 or held is not None:
                by = "the padding slot" if slot == 0 else f"held by {held}"
                raise KVOwnershipError(f"KV ownership: slot {slot} handed to {holder}, {by}")
            seen[slot] = holder
        self._holder.update(seen)

    def drop(self, slots: Sequence[int], holder: str) -> None:
        """``holder`` frees ``slots``."""
        seen: set[int] = set()
        for slot in slots:
            held = None if slot in seen else self._holder.get(slot)
            if slot == 0:
                raise KVOwnershipError(f"KV ownership: {holder} frees slot 0, the padding slot")
            if held != holder:
                state = "already free (a double free)" if held is None else f"held by {held}"
                raise KVOwnershipError(f"KV ownership: {holder} frees slot {slot}, {state}")
            seen.add(slot)
        for slot in slots:
            del self._holder[slot]

    def move(self, slots: Sequence[int], holder: str, to: str) -> None:
        """``holder`` hands ``slots`` to ``to`` (e.g. a request's KV to the prefix cache)."""
        for slot in slots:
            held = self._holder.get(slot)
            if held != holder:
                state = "free" if held is None else f"held by {held}"
                raise KVOwnershipError(
                    f"KV ownership: {holder} hands slot {slot} to {to}, but it is {state}"
                )
        for slot in slots:
            self._holder[slot] = to

    def forget(self, slots: Iterable[int]) -> None:
        """Undo a ``claim`` whose reservation failed."""
        for slot in slots:
            self._holder.pop(slot, None)

    def reset(self, holders: dict[int, str]) -> None:
        self._holder = dict(holders)


class KVCache:
    """Per-layer K and V storage ``[size + 1, n_kv_heads, head_dim]``; row 0 is the padding slot.

    ``set_kv`` is the torch writer (``kv_quant.store``; the fused rotary kernel is its Triton
    twin). Backends read ``k_buffers[layer]`` / ``v_buffers[layer]`` directly (a list of
    tensors, one per layer, so each layer's buffer is contiguous). ``dtype`` is the storage
    dtype: the model's, or fp8 (``kv_cache_dtype``), which stores ``real / scale`` with the
    layer's scales in ``layer_scales[layer]``, fp32 ``[4]`` on the device (k, v, 1/k, 1/v;
    see ``kv_quant``), and their host copy ``scales``.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        v_head_dim: int | None = None,
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape_k = (size + 1, num_kv_heads, head_dim)
        shape_v = (size + 1, num_kv_heads, self.v_head_dim)
        self.k_buffers = [
            torch.zeros(shape_k, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_buffers = [
            torch.zeros(shape_v, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.scales = KVScales.ones(num_layers)
        # One tensor per layer (fixed addresses: captured graphs read them at every replay).
        self.layer_scales = [
            torch.tensor(self.scales.row(i), dtype=torch.float32, device=self.device)
            for i in range(num_layers)
        ]

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    def release(self) -> None:
        """Free the storage (the owner is closing): the lists are emptied in place, so a
        holder of ``k_buffers`` sees no layer rather than keeping the memory alive."""
        self.k_buffers.clear()
        self.v_buffers.clear()
        self.layer_scales.clear()

    def set_scales(self, scales: KVScales) -> None:
        """Use a checkpoint's per-layer scales (an fp8 cache only; before the first store)."""
        if not self.is_fp8:
            raise ValueError(f"KVCache: scales apply to an fp8 cache, not {self.dtype}")
        if len(scales.k) != self.num_layers:
            raise ValueError(f"KVCache: {len(scales.k)} layer scales for {self.num_layers} layers")
        self.scales = scales
        for i, row in enumerate(self.layer_scales):
            row.copy_(torch.tensor(scales.row(i), dtype=torch.float32))  # in place

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's ``k [T, n_kv, D]`` and ``v [T, n_kv, Dv]`` at slots ``loc [T]``."""
        inv = self.layer_scales[layer_id] if self.is_fp8 else None
        store(self.k_buffers[layer_id], loc, k, None if inv is None else inv[K_INV_SCALE])
        store(self.v_buffers[layer_id], loc, v, None if inv is None else inv[V_INV_SCALE])

    def bytes_per_token(self) -> int:
        return self.bytes_per_token_for(
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.v_head_dim
        )

    @staticmethod
    def bytes_per_token_for(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        v_head_dim: int | None = None,
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * num_kv_heads * (head_dim + (v_head_dim or head_dim)) * elem
