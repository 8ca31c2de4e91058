"""reexec graph backend: "replay" re-runs the function into the captured outputs (CPU testing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from execrt.backends.graph.resources import resource_owner
from execrt.core.interfaces import GraphBackend, GraphBackendInit, ShapeKey

OWNER = "reexec graph backend"


class ReexecGraphBackend(GraphBackend):
    """Keeps each captured function and the output objects of its first run.

    ``replay(key)`` runs the function again and copies the new results into those same output
    tensors, so callers see exactly what a real graph gives them: the same objects, overwritten.
    It records nothing and saves nothing; it exists so the graph runner's bucket, pad and trim
    logic runs on any device, including CPU in CI. A dispatcher's graph resources follow the
    same lifecycle as under real graphs (``GraphResourceOwner``), so it can be tested on CPU;
    before each replay they are warmed up for the key again, outside any capture, so that the
    re-run forward uses the graph state of that key as the recorded kernels would.
    """

    def __init__(self, init: GraphBackendInit) -> None:
        super().__init__(init)
        self._fns: dict[ShapeKey, Callable[[], Any]] = {}
        self._outputs: dict[ShapeKey, Any] = {}
        self.generation = 0  # bumped by cleanup(); a recapture starts a new one
        self._resources = resource_owner(init, OWNER, self.cleanup)

    def capture(self, key: ShapeKey, fn: Callable[[], Any]) -> Any:
        if key in self._fns:
            raise ValueError(
                f"reexec graph backend: shape key {key} already captured; cleanup() first"
            )
        if self._resources is not None:
            self._resources.ensure(key.batch_size)
            self._resources.warm_up(key.batch_size)
        output = fn()
        self._fns[key] = fn
        self._outputs[key] = output
        return output

    def replay(self, key: ShapeKey) -> Any:
        try:
            fn = self._fns[key]
        except KeyError:
            captured = ", ".join(str(k) for k in self._fns) or "none"
            raise KeyError(
                f"reexec graph backend: shape key {key} not captured (captured: {captured})"
            ) from None
        output = self._outputs[key]
        if self._resources is not None:
            # A real replay relaunches kernels recorded on this key's bucket; a re-run forward
            # sees the dispatcher's graph state only once the resources are back on it.
            self._resources.before_replay(key.batch_size)
        _copy_into(output, fn(), f"replay({key})")
        return output

    def has(self, key: ShapeKey) -> bool:
        return key in self._fns

    def cleanup(self) -> None:
        if self._fns or self._outputs:
            self.generation += 1
        self._fns.clear()
        self._outputs.clear()
        if self._resources is not None:
            self._resources.close()  # after the "graphs", as a real backend must


def _copy_into(dst: Any, src: Any, where: str) -> None:
    """Copy ``src`` into the tensors of ``dst``, a structure of the same shape."""
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
            got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
            raise ValueError(
                f"reexec graph backend: {where} produced {got}, captured {tuple(dst.shape)}; "
                "a captured function must return the same shapes every time"
            )
        dst.copy_(src)
    elif dataclasses.is_dataclass(dst) and not isinstance(dst, type):
        for f in dataclasses.fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name), f"{where}.{f.name}")
    elif isinstance(dst, dict):
        for name, value in dst.items():
            _copy_into(value, src[name], f"{where}[{name!r}]")
    elif isinstance(dst, (list, tuple)):
        if len(dst) != len(src):
            raise ValueError(f"reexec graph backend: {where} changed length")
        for i, (d, s) in enumerate(zip(dst, src, strict=True)):
            _copy_into(d, s, f"{where}[{i}]")
    elif dst != src:
        # Host values cannot be updated in place: a real graph would replay the captured one.
        raise ValueError(
            f"reexec graph backend: {where} returned host value {src!r}, captured {dst!r}"
        )
