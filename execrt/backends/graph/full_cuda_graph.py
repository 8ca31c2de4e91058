"""full_cuda_graph graph backend: one torch.cuda.CUDAGraph per shape key, in one shared pool."""

from __future__ import annotations

import gc
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from execrt.backends.graph.resources import resource_owner
from execrt.core.interfaces import GraphBackend, GraphBackendInit, ShapeKey

logger = logging.getLogger(__name__)

NAME = "full_cuda_graph graph backend"
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_MIB = float(1 << 20)

#: One capture stream per device for the process, as torch.cuda.graph keeps one. cuBLAS keeps a
#: workspace per stream that is never freed, so a new stream per backend would leave another
#: workspace behind with every backend built.
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}
#: Graphs whose capture CUDA invalidated. Newer torch leaves a pinned-memory allocator filter
#: that points at the graph object after a failed capture_end; freeing the object would leave
#: that filter dangling, so the (small, never instantiated) objects are kept for good.
_INVALIDATED_CAPTURES: list[torch.cuda.CUDAGraph] = []


class FullCudaGraphBackend(GraphBackend):
    """Records the whole forward of each shape key as one CUDA graph; replay relaunches it.

    Lifecycle: ``with capture_session(): capture(key, fn)`` for every key, largest first;
    then ``replay(key)`` per step; ``cleanup()`` on close or before a recapture.

    - Every graph of a generation allocates from one private memory pool. The pool reuses the
      blocks a graph freed for the next capture, so capturing the largest key first lets all
      smaller graphs fit inside its footprint (graph memory ~ the largest graph, not the sum).
      A key larger than one already captured still works but costs extra memory; it is logged.
    - ``capture`` runs ``fn`` ``warmup_runs`` times eagerly on the capture stream (a side
      stream: the legacy default stream cannot be captured), synchronised, so lazy
      initialisation (cuBLAS workspaces, Triton compilation, communication handles) happens
      outside the graph; then records one more call. ``fn`` must not synchronise with the host
      while recording.
    - ``replay(key)`` launches the graph on the current stream and returns the very objects
      ``capture`` returned. Their tensors live in the pool and are overwritten by the next
      replay of *any* key: callers copy what they keep. Replay neither syncs nor allocates.
    - Garbage collection is frozen for the capture session (collections during many captures
      are slow, and a finaliser run mid-capture can unload a kernel module the graph uses),
      unfrozen with one full collection afterwards.
    - ``cleanup()`` synchronises, resets every graph, drops the outputs and the pool, then
      closes a dispatcher's graph resources. A new capture starts a new generation with a new
      pool: a pool whose graphs are gone cannot be reopened while tensors of it are alive.
    - An exception while capturing a key discards that key's partial graph, leaves the stream
      and the allocator usable and re-raises, naming the key; graphs captured before stay.
    """

    def __init__(
        self, init: GraphBackendInit, *, warmup_runs: int = 2, capture_error_mode: str = "global"
    ) -> None:
        super().__init__(init)
        if init.device.type != "cuda":
            raise ValueError(f"{NAME}: device {init.device} unsupported (supported: cuda)")
        if warmup_runs < 0:
            raise ValueError(f"{NAME}: warmup_runs {warmup_runs} unsupported (supported: >= 0)")
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"{NAME}: capture_error_mode {capture_error_mode!r} unsupported "
                f"(supported: {', '.join(CAPTURE_ERROR_MODES)})"
            )
        index = init.device.index
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        self.device = torch.device("cuda", index)
        self.index = index
        self.warmup_runs = warmup_runs
        self.capture_error_mode = capture_error_mode
        self.generation = 0  # bumped by cleanup(); a recapture starts a new one
        self._graphs: dict[ShapeKey, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[ShapeKey, Any] = {}
        self._pool: Any = None  # this generation's memory pool handle, made on first capture
        self._stream: torch.cuda.Stream | None = None  # the device's capture stream
        self._session: Any = None  # the progress bar while a capture session is open
        self._resources = resource_owner(init, NAME, self.cleanup)

    # -- capture --------------------------------------------------------------------------------
    @contextmanager
    def capture_session(self) -> Iterator[None]:
        """Open a capture session: gc frozen, capture stream ready, progress and memory logged."""
        if self._session is not None:
            raise RuntimeError(f"{NAME}: capture sessions do not nest")
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()  # hand cached blocks back so the graph pool can use them
        if self._stream is None:
            if self.index not in _CAPTURE_STREAMS:
                _CAPTURE_STREAMS[self.index] = torch.cuda.Stream(self.device)
            self._stream = _CAPTURE_STREAMS[self.index]
        before = len(self._graphs)
        reserved = torch.cuda.memory_reserved(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        started = time.perf_counter()
        self._session = _progress_bar()
        # gc.unfreeze() would thaw everything, an application's own frozen heap too: freeze
        # only from a clean state, and otherwise just keep the collector off for the session.
        freeze = gc.get_freeze_count() == 0
        collecting = gc.isenabled()
        if freeze:
            gc.freeze()
        else:
            gc.disable()
        try:
            yield
        finally:
            self._session.close()
            self._session = None
            if freeze:
                gc.unfreeze()
                gc.collect()
            elif collecting:
                gc.enable()
            captured = len(self._graphs) - before
            if captured > 0:
                logger.info(
                    "%s: captured %d graphs in %.2f s; graph memory +%.1f MiB reserved, "
                    "+%.1f MiB allocated (generation %d, %d graphs in all)",
                    NAME,
                    captured,
                    time.perf_counter() - started,
                    (torch.cuda.memory_reserved(self.device) - reserved) / _MIB,
                    (torch.cuda.memory_allocated(self.device) - allocated) / _MIB,
                    self.generation,
                    len(self._graphs),
                )

    def capture(self, key: ShapeKey, fn: Callable[[], Any]) -> Any:
        if self._session is None:
            raise RuntimeError(f"{NAME}: capture({key}) outside capture_session()")
        if key in self._graphs:
            raise ValueError(
                f"{NAME}: shape key {key} already captured in generation {self.generation}; "
                "cleanup() first (a recapture is a new generation)"
            )
        largest = max((k.batch_size for k in self._graphs), default=key.batch_size)
        if key.batch_size > largest:
            logger.warning(
                "%s: %s captured after a smaller key (largest so far %d): the shared pool "
                "cannot reuse smaller graphs' memory for it; capture the largest key first",
                NAME,
                key,
                largest,
            )
        started = time.perf_counter()
        try:
            if self._resources is not None:  # before the warm-up, whose forward may use them
                self._resources.ensure(key.batch_size)
            self._warm_up(fn)
            if self._resources is not None:
                self._resources.warm_up(key.batch_size)
            graph, output = self._record(fn)
        except Exception as exc:
            raise RuntimeError(f"{NAME}: capturing {key} failed: {exc}") from exc
        self._graphs[key] = graph
        self._outputs[key] = output
        self._session.update(1)
        logger.debug("%s: captured %s in %.3f s", NAME, key, time.perf_counter() - started)
        return output

    def _warm_up(self, fn: Callable[[], Any]) -> None:
        assert self._stream is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            for _ in range(self.warmup_runs):
                torch.cuda.synchronize()
                fn()
        torch.cuda.synchronize(self.device)

    def _record(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        assert self._stream is not None
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        pool = self._pool
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)  # nothing of the warm-ups may leak into the graph
        collecting = gc.isenabled()
        gc.disable()  # not even young objects are finalised while recording
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                graph.capture_begin(pool=pool, capture_error_mode=self.capture_error_mode)
                try:
                    output = fn()
                    graph.capture_end()
                except BaseException:
                    self._discard(graph, pool)
                    raise
        finally:
            if collecting:
                gc.enable()
        return graph, output

    def _discard(self, graph: torch.cuda.CUDAGraph, pool: Any) -> None:
        """Undo a failed recording so that the stream and the allocator work as before."""
        if torch.cuda.is_current_stream_capturing():
            try:
                graph.capture_end()  # a Python error left the capture valid: end it normally,
            except RuntimeError:
                pass  # (CUDA invalidated the capture, e.g. a host sync inside fn)
            else:
                graph.reset()  # then give its share of the pool back
                return
        # cudaStreamEndCapture failed, so torch skipped ending the allocator's routing of this
        # capture into the pool: end it here. torch's pinned-memory allocator keeps its own
        # routing to this pool id, so the pool is retired: later captures get a fresh one.
        try:
            torch._C._cuda_endAllocateToPool(self.index, pool)
        except RuntimeError:
            graph.reset()  # torch ended the routing itself (failure after it): reset balances
        else:
            torch._C._cuda_releasePool(self.index, pool)
            _INVALIDATED_CAPTURES.append(graph)
        self._pool = None
        self._end_generator_capture()
        logger.warning("%s: a capture was invalidated; its pool is retired", NAME)

    def _end_generator_capture(self) -> None:
        """A failed cudaStreamEndCapture skips torch's end of capture for the CUDA RNG, which
        then refuses every later random op ("Offset increment outside graph capture"). An
        empty capture, begun and ended normally, closes the RNG's capture state again."""
        empty = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA graph is empty"
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                empty.capture_begin()
                empty.capture_end()
        empty.reset()

    # -- replay and cleanup ---------------------------------------------------------------------
    def replay(self, key: ShapeKey) -> Any:
        graph = self._graphs.get(key)
        if graph is None:
            captured = ", ".join(str(k) for k in self._graphs) or "none"
            raise KeyError(f"{NAME}: shape key {key} not captured (captured: {captured})")
        graph.replay()
        return self._outputs[key]

    def has(self, key: ShapeKey) -> bool:
        return key in self._graphs

    def cleanup(self) -> None:
        if self._graphs or self._pool is not None:
            torch.cuda.synchronize(self.device)  # no replay may still run on a graph we drop
            for graph in self._graphs.values():
                graph.reset()
            self._graphs.clear()
            self._outputs.clear()
            self._pool = None
            self.generation += 1
        if self._resources is not None:
            self._resources.close()  # only now: the graphs that used them are gone


def _progress_bar() -> Any:
    """A tqdm bar for an interactive terminal at INFO verbosity; silent anywhere else."""
    from tqdm import tqdm

    show = sys.stderr.isatty() and logger.isEnabledFor(logging.INFO)
    return tqdm(desc=f"{NAME}: capturing", unit="graph", leave=False, disable=not show)
