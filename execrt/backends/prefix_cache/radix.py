"""radix prefix cache: a radix tree over token ids (page size 1) whose nodes hold KV slot ids."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from execrt.core.prefix_cache import PrefixCache, PrefixCacheInit, PrefixMatch

NAME = "radix prefix cache"


def first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
    """The first index where ``a`` and ``b`` (same length) differ, ``len(a)`` if none.

    One vectorised compare per tree node: matching never loops over tokens in Python.
    """
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else int(a.size)


class _Node:
    """One edge of the tree: a run of tokens, the KV slots of those tokens, lock counts:
    ``lock_ref`` counts the locks of every path through the node (it is protected while > 0),
    ``own_locks`` those of the node itself, which are all that ``unlock(node)`` may undo.

    ``tree`` is the generation the node belongs to (None once evicted), so a stale node handed
    back by a caller is recognised. ``queued`` is the access time of the node's live entry in
    the eviction heap (-1: none); entries with another time are stale and skipped.
    """

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "lock_ref",
        "own_locks",
        "last_access",
        "queued",
        "uid",
        "tree",
    )

    def __init__(
        self,
        parent: _Node | None,
        key: np.ndarray,  # [n] int64, host
        value: torch.Tensor,  # [n] int64, on the cache's device
        lock_ref: int,
        last_access: int,
        uid: int,
        tree: object,
    ) -> None:
        self.children: dict[int, _Node] = {}  # first token -> child
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = lock_ref
        self.own_locks = 0
        self.last_access = last_access
        self.queued = -1
        self.uid = uid
        self.tree: object | None = tree


class RadixCache(PrefixCache):
    """Token-id prefixes -> KV slots in a radix tree; LRU eviction of unlocked leaves.

    Each node holds a run of token ids (host int64), the slot ids of those tokens (int64 on
    ``init.device``), a lock count and a logical access time (a counter, not wall time).
    Children are keyed by their first token, so a walk costs one dict lookup and one
    vectorised compare per node: O(depth + len(key)), whatever the tree holds. A match or
    insert that ends inside a node splits it; the new parent takes the first part of the key
    and slots and the lock count, and only it is marked used. The root is always locked.

    Evictable leaves (unlocked, childless) sit in a heap by access time, with stale entries
    skipped lazily and compacted when they outnumber the nodes, so eviction costs O(log n) per
    freed node. ``force_miss``: match walks, splits and touches as usual but reports nothing.
    """

    def __init__(self, init: PrefixCacheInit) -> None:
        super().__init__(init)
        self._uids = itertools.count()
        self._clock = itertools.count(1)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.reset()

    # -- the contract ---------------------------------------------------------------------------
    def match(self, key: Sequence[int]) -> PrefixMatch:
        node, length = self._descend(_as_key(key, "match"), next(self._clock))
        self._queue_if_evictable(node)
        slots = self._path_slots(node)  # [length]; built under force_miss too (its cost counts)
        if self.init.force_miss or length == 0:
            return PrefixMatch(self._empty, self._root)
        return PrefixMatch(slots, node)

    def insert(self, key: Sequence[int], slots: torch.Tensor) -> int:
        return self._insert(_as_key(key, "insert"), slots)[0]

    def insert_and_match(self, key: Sequence[int], slots: torch.Tensor) -> tuple[int, PrefixMatch]:
        # One walk: after the insert, the node that ends the key is the match's.
        tokens = _as_key(key, "insert")
        n, node = self._insert(tokens, slots)
        slots_of_key = self._path_slots(node)  # [len(key)]; built under force_miss too
        if self.init.force_miss or node is self._root:
            return n, PrefixMatch(self._empty, self._root)
        return n, PrefixMatch(slots_of_key, node)

    def lock(self, node: Any) -> None:
        current = self._own(node, "lock")
        if current is not self._root:  # the empty match's node: locking it is a no-op
            current.own_locks += 1
        while current is not self._root:
            if current.lock_ref == 0:
                self._evictable -= current.key.size
                self._protected += current.key.size
            current.lock_ref += 1
            current = _parent(current)

    def unlock(self, node: Any) -> None:
        current = self._own(node, "unlock")
        if current is self._root:
            return
        if current.own_locks == 0:
            raise ValueError(
                f"{NAME}: unlock of a node that is not locked itself (one unlock per lock of "
                "the same node; a lock of a longer match does not count)"
            )
        current.own_locks -= 1
        while current is not self._root:
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self._protected -= current.key.size
                self._evictable += current.key.size
                self._queue_if_evictable(current)
            current = _parent(current)

    def evict(self, num_slots: int) -> int:
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_slots and self._heap:
            access, _, node = heapq.heappop(self._heap)
            if node.queued != access or node.tree is not self._tree:
                continue  # stale: touched again since, or already evicted
            node.queued = -1
            if node.lock_ref or node.children:
                continue  # queued again when it next becomes an unlocked leaf
            parent = node.parent
            assert parent is not None
            del parent.children[int(node.key[0])]
            node.tree = node.parent = None
            self._nodes -= 1
            self._evictable -= node.key.size
            count += node.key.size
            freed.append(node.value)
            self._queue_if_evictable(parent)
        if freed:
            self.init.free_slots(freed[0] if len(freed) == 1 else torch.cat(freed))
        return count

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def cached_slots(self) -> torch.Tensor:
        values, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            values.append(node.value)
            stack.extend(node.children.values())
        return torch.cat(values) if values else self._empty.clone()  # [evictable + protected]

    def reset(self) -> None:
        # A new generation: nodes of the old tree are refused by lock/unlock from now on.
        self._tree = object()
        self._nodes = 0  # not counting the root
        self._root = self._new_node(None, np.empty(0, np.int64), self._empty, 1, 0)
        self._evictable = 0
        self._protected = 0
        self._heap: list[tuple[int, int, _Node]] = []

    def close(self) -> None:
        self.reset()

    # -- the tree -------------------------------------------------------------------------------
    def _insert(self, tokens: np.ndarray, slots: torch.Tensor) -> tuple[int, _Node]:
        """Insert ``tokens``; returns how many were cached before and the node ending them."""
        if slots.dtype != torch.int64 or tuple(slots.shape) != (tokens.size,):
            raise ValueError(
                f"{NAME}: insert needs int64 slots of shape [{tokens.size}] (one per key token), "
                f"got {str(slots.dtype).replace('torch.', '')} {list(slots.shape)}"
            )
        if slots.device.type != self.device.type:
            raise ValueError(
                f"{NAME}: insert slots are on {slots.device}, the cache keeps them on {self.device}"
            )
        tick = next(self._clock)
        node, length = self._descend(tokens, tick)
        if length < tokens.size:
            # Copies: the caller's key and slot tensors (often a view of its row) stay its own.
            leaf = self._new_node(
                node, tokens[length:].copy(), slots[length:].clone(), lock_ref=0, last_access=tick
            )
            node.children[int(tokens[length])] = leaf
            self._evictable += leaf.key.size
            node = leaf
        self._queue_if_evictable(node)
        return length, node

    def _new_node(
        self,
        parent: _Node | None,
        key: np.ndarray,
        value: torch.Tensor,
        lock_ref: int,
        last_access: int,
    ) -> _Node:
        if parent is not None:
            self._nodes += 1
        return _Node(parent, key, value, lock_ref, last_access, next(self._uids), self._tree)

    def _descend(self, key: np.ndarray, tick: int) -> tuple[_Node, int]:
        """Walk down along ``key``, touching every node matched; split the node the match ends
        inside. Returns the node that ends the match and the matched length."""
        node, pos, end = self._root, 0, key.size
        while pos < end:
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            span = child.key.size
            take = min(span, end - pos)
            common = first_mismatch(child.key[:take], key[pos : pos + take])
            if common < span:
                # Only the matched part is used: the rest keeps its access time (and its
                # place in the eviction heap).
                head = self._split(child, common)
                head.last_access = tick
                return head, pos + common
            child.last_access = tick
            node, pos = child, pos + span
        return node, pos

    def _split(self, child: _Node, at: int) -> _Node:
        """Put a new node holding ``child``'s first ``at`` tokens between it and its parent."""
        parent = child.parent
        assert parent is not None and 0 < at < child.key.size
        # The new node copies its part; the child keeps views of what it already held. Both keep
        # the child's access time; the caller touches the part it matched.
        head = self._new_node(
            parent,
            child.key[:at].copy(),
            child.value[:at].clone(),
            child.lock_ref,  # every lock through child runs through head too
            child.last_access,
        )
        head.children[int(child.key[at])] = child
        parent.children[int(child.key[0])] = head
        child.parent = head
        child.key = child.key[at:]
        child.value = child.value[at:]
        return head

    def _path_slots(self, node: _Node) -> torch.Tensor:
        parts = []
        while node is not self._root:
            parts.append(node.value)
            node = _parent(node)
        if not parts:
            return self._empty
        parts.reverse()
        return torch.cat(parts)  # [length], a copy the caller may keep

    def _queue_if_evictable(self, node: _Node) -> None:
        """Put an unlocked leaf in the eviction heap at its current access time (once)."""
        if node.lock_ref or node.children or node is self._root:
            return
        if node.queued == node.last_access:
            return
        node.queued = node.last_access
        heapq.heappush(self._heap, (node.last_access, node.uid, node))
        if len(self._heap) > 2 * self._nodes + 64:
            # Stale entries (touched or evicted nodes) outnumber the nodes: drop them. Each
            # live node has at most one entry, so this runs at most once per ~n pushes.
            self._heap = [
                entry
                for entry in self._heap
                if entry[2].queued == entry[0] and entry[2].tree is self._tree
            ]
            heapq.heapify(self._heap)

    def _own(self, node: Any, op: str) -> _Node:
        if not isinstance(node, _Node) or node.tree is not self._tree:
            raise ValueError(
                f"{NAME}: {op} of a node that is not in this tree (evicted, from before "
                "reset(), or from another cache); pass the node of a match on this cache"
            )
        return node


def _parent(node: _Node) -> _Node:
    parent = node.parent
    assert parent is not None, "a live non-root node has a parent"
    return parent


def _as_key(key: Sequence[int] | np.ndarray | torch.Tensor, op: str) -> np.ndarray:
    """``key`` as a host int64 array [n] (no copy when it already is one)."""
    if isinstance(key, torch.Tensor):
        key = key.detach().cpu().numpy()
    arr = np.asarray(key)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(
            f"{NAME}: {op} key must be a 1-D sequence of integer token ids, "
            f"got {arr.ndim}-D {arr.dtype}"
        )
    return arr.astype(np.int64, copy=False)
