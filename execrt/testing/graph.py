"""GraphBackendSuite: capture/replay of a function over static tensors, against eager calls."""

from __future__ import annotations

import dataclasses
import gc
import re
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from execrt.core.context import RuntimeContext
from execrt.core.interfaces import (
    GraphBackend,
    GraphBackendInit,
    GraphCapabilities,
    GraphRequirements,
    ShapeKey,
)
from execrt.testing.oracles import compare
from execrt.testing.suite import Case, ConformanceSuite, cases, not_declared

Record = Callable[[str, object], None]

#: Captured largest first, as a graph runner does; two keys share a batch size.
KEYS = (ShapeKey(8), ShapeKey(4), ShapeKey(4, "variant"), ShapeKey(2), ShapeKey(1))
HIDDEN = 32


@dataclass
class StepOutput:
    """What the captured function returns: a structure of tensors, as a model forward does
    (the engine's holds float logits, integer token ids sampled in the graph and absent fields)."""

    hidden: torch.Tensor  # [bs, H]
    logits: torch.Tensor  # [bs, 2H]
    positive: torch.Tensor  # [bs] int64: how many inputs of the row are > 0
    absent: torch.Tensor | None = None


class Workload:
    """Per key, a static input buffer and a function reading it; eager calls give the oracle.

    ``calls`` counts the runs of each key's function; ``observe`` (when set) is called with the
    key at every run, so a test can see what a run found around it."""

    def __init__(self, device: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.device = torch.device(device)
        self.w1 = torch.randn(HIDDEN, HIDDEN, generator=gen).to(self.device)
        self.w2 = torch.randn(HIDDEN, 2 * HIDDEN, generator=gen).to(self.device)
        self.inputs = {k: torch.zeros(k.batch_size, HIDDEN, device=self.device) for k in KEYS}
        self.calls: Counter[ShapeKey] = Counter()
        self.observe: Callable[[ShapeKey], None] | None = None
        self.refill()

    def refill(self) -> None:
        """New input values, written in place (the buffers' addresses never change)."""
        for key, buf in self.inputs.items():
            buf.copy_(torch.randn(key.batch_size, HIDDEN, generator=self.gen))

    def fn(self, key: ShapeKey) -> Callable[[], StepOutput]:
        x = self.inputs[key]
        scale = 0.5 if key.variant else 1.0  # variants must not be confused with each other

        def step() -> StepOutput:
            self.calls[key] += 1
            if self.observe is not None:
                self.observe(key)
            h = torch.tanh(x @ self.w1) * scale  # [bs, H]
            return StepOutput(h, h @ self.w2, (x > 0).sum(-1))

        return step


class CaptureFailed(Exception):
    """What the suite's failing function raises inside a capture."""


class GraphBackendSuite(ConformanceSuite):
    """Conformance of a graph backend at the backend level: capture, replay, has, cleanup.

    Runner-level behaviour (padding rows, bucket choice) is the graph runner's, tested there.
    """

    kind: ClassVar[str] = "graph"
    tolerances: ClassVar[dict[torch.dtype, float]] = {torch.float32: 1e-6}
    cuda_tolerances: ClassVar[dict[torch.dtype, float]] = {torch.float32: 1e-5}

    # -- cases ----------------------------------------------------------------------------------
    @classmethod
    def caps(cls) -> GraphCapabilities:
        return cls.declared(GraphCapabilities)

    @classmethod
    def make_case(cls, device: str, *, needs: tuple[str, ...] = ()) -> Case:
        spec, caps = cls.collection_spec(), cls.caps()
        declared = not_declared("devices", device, caps.devices)
        for name in needs:
            if not declared and name == "cuda" and not device.startswith("cuda"):
                declared = f"real CUDA graph checks need a CUDA device, not {device}"
            elif not declared and name != "cuda" and not getattr(caps, name):
                declared = f"capability {name} is False"
        skip, error = cls.runnable(spec, device, GraphRequirements(device), declared)
        return Case(device, device, torch.float32, {}, skip, error)

    @classmethod
    def device_cases(cls) -> list[Case]:
        return [cls.make_case(d) for d in cls.device_axis(cls.caps().devices)]

    @classmethod
    def real_capture_cases(cls) -> list[Case]:
        return [
            cls.make_case(d, needs=("real_capture", "cuda"))
            for d in cls.device_axis(cls.caps().devices)
        ]

    @classmethod
    def shared_pool_cases(cls) -> list[Case]:
        return [
            cls.make_case(d, needs=("real_capture", "shared_memory_pool", "cuda"))
            for d in cls.device_axis(cls.caps().devices)
        ]

    @classmethod
    def resource_cases(cls) -> list[Case]:
        return [
            cls.make_case(d, needs=("graph_resources",))
            for d in cls.device_axis(cls.caps().devices)
        ]

    @classmethod
    def refusal_cases(cls) -> list[Case]:
        return [Case(d, d) for d in cls.device_axis(cls.caps().devices)]

    # -- helpers --------------------------------------------------------------------------------
    @contextmanager
    def open_backend(self, case: Case, provider: Any = None) -> Iterator[tuple[GraphBackend, Any]]:
        spec = type(self).backend_spec()  # a fresh PluginHost for every test
        context = RuntimeContext()
        init = GraphBackendInit(
            capabilities=spec.capabilities,
            device=torch.device(case.device),
            context=context,
            resource_provider=provider,
        )
        backend = spec.create(init)
        try:
            yield backend, context
        finally:
            backend.cleanup()
            context.close()

    def capture_all(
        self, backend: GraphBackend, work: Workload, keys: tuple[ShapeKey, ...] = KEYS
    ) -> dict[ShapeKey, Any]:
        with backend.capture_session():
            return {key: backend.capture(key, work.fn(key)) for key in keys}

    def check_replays(self, case: Case, backend: GraphBackend, work: Workload, keys: Any) -> float:
        """Replay every key on new inputs; each must equal a fresh eager call of its function,
        every field of it, and run nothing but its own recording."""
        tol = type(self).tolerance(case.device, torch.float32)
        relaunches = type(self).caps().real_capture
        worst = 0.0
        for round_ in range(2):
            work.refill()
            for key in keys:
                before = Counter(work.calls)
                out = backend.replay(key)
                ran = dict(work.calls - before)
                got = (out.hidden.clone(), out.logits.clone())
                want = work.fn(key)()
                where = f"{case.id}: replay {round_} of {key}"
                for name, have, ref in zip(
                    ("hidden", "logits"), got, (want.hidden, want.logits), strict=True
                ):
                    cmp = compare(have, ref.double())
                    worst = max(worst, cmp.rel_error)
                    assert cmp.ok(tol), (
                        f"{where}: {name} differs from eager by "
                        f"{cmp.rel_error:.3g} (tolerance {tol:.3g}); a replay must run the "
                        "graph captured for this very key (keys of one batch size differ by "
                        "variant) on the current contents of the static inputs"
                    )
                assert out.positive.dtype == torch.int64 and torch.equal(
                    out.positive, want.positive
                ), (
                    f"{where}: the int64 output 'positive' is {out.positive.tolist()}, eager "
                    f"{want.positive.tolist()}: every tensor of the output is overwritten by a "
                    "replay, integer ones too (the engine samples token ids in the graph)"
                )
                assert out.absent is None, f"{where}: the None field 'absent' became {out.absent!r}"
                expected = {} if relaunches else {key: 1}
                assert ran == expected, f"{where} ran the captured functions {ran or 'never'}; " + (
                    "a backend declaring real_capture relaunches what it recorded and calls "
                    "no Python function (declare real_capture=False if replay re-runs it)"
                    if relaunches
                    else "a re-running replay (real_capture=False) runs the function of "
                    "this key once, and no other"
                )
        return worst

    # -- tests ----------------------------------------------------------------------------------
    @cases("device_cases")
    def test_replay_matches_eager(self, case: Case, record_property: Record) -> None:
        """For every captured key, replay after new inputs equals a fresh eager call."""
        self.begin(case)
        work = Workload(case.device, seed=1)
        with self.open_backend(case) as (backend, _):
            self.capture_all(backend, work)
            record_property("max_error", self.check_replays(case, backend, work, KEYS))

    @cases("device_cases")
    def test_replay_returns_captured_objects(self, case: Case) -> None:
        """replay returns the very objects capture returned, overwritten in place."""
        self.begin(case)
        work = Workload(case.device, seed=2)
        with self.open_backend(case) as (backend, _):
            captured = self.capture_all(backend, work)
            for key, out in captured.items():
                ptr = out.hidden.data_ptr()
                for _ in range(2):
                    again = backend.replay(key)
                    assert again is out, f"{case.id}: replay({key}) returned a new object"
                    assert again.hidden is out.hidden and again.hidden.data_ptr() == ptr, (
                        f"{case.id}: replay({key}) returned different output tensors"
                    )

    @cases("device_cases")
    def test_has_and_duplicate_capture(self, case: Case) -> None:
        """has() reports captured keys only; replaying another raises KeyError; capturing a
        key twice raises."""
        self.begin(case)
        work = Workload(case.device, seed=3)
        key, other = KEYS[1], KEYS[2]  # same batch size, different variant
        with self.open_backend(case) as (backend, _):
            assert not backend.has(key), f"{case.id}: has({key}) before any capture"
            self.capture_all(backend, work, (key,))
            assert backend.has(key), f"{case.id}: has({key}) False after capture"
            assert not backend.has(other), f"{case.id}: has({other}) True, only {key} captured"
            for missing in (other, KEYS[3]):  # a variant of the captured size, another size
                try:
                    backend.replay(missing)
                except KeyError as exc:  # the contract: a caller tells a missing key by it
                    message = str(exc)
                    assert missing is other or re.search(rf"\b{key.batch_size}\b", message), (
                        f"{case.id}: replay({missing}) raised KeyError({message}), which does "
                        f"not name the captured key {key}"
                    )
                except Exception as exc:
                    pytest.fail(
                        f"{case.id}: replay({missing}) of a key never captured raised "
                        f"{type(exc).__name__}, not KeyError (naming the captured keys)"
                    )
                else:
                    pytest.fail(
                        f"{case.id}: replay({missing}) of a key never captured did not raise"
                    )
            try:
                with backend.capture_session():
                    backend.capture(key, work.fn(key))
            except Exception:  # the type is the backend's choice
                pass
            else:
                pytest.fail(
                    f"{case.id}: capture({key}) a second time did not raise; a captured key "
                    "must be refused until cleanup(), not silently re-recorded"
                )

    @cases("device_cases")
    def test_cleanup_is_idempotent_and_allows_recapture(
        self, case: Case, record_property: Record
    ) -> None:
        """cleanup() twice leaves no key and nothing of the recordings alive; a recapture
        replays correctly."""
        self.begin(case)
        work = Workload(case.device, seed=4)
        with self.open_backend(case) as (backend, _):
            alive = self.capture_weakly(backend, work)
            backend.cleanup()
            backend.cleanup()
            left = [k for k in KEYS if backend.has(k)]
            assert not left, f"{case.id}: keys {left} still captured after cleanup()"
            gc.collect()
            kept = [what for what, ref in alive if ref() is not None]
            assert not kept, (
                f"{case.id}: after cleanup() the backend still holds {', '.join(kept)}: "
                "cleanup() drops every recording, or each recapture keeps the last "
                "generation's static tensors alive"
            )
            self.capture_all(backend, work, KEYS[:2])
            record_property("max_error", self.check_replays(case, backend, work, KEYS[:2]))

    def capture_weakly(self, backend: GraphBackend, work: Workload) -> list[tuple[str, Any]]:
        """Capture every key, keeping only weak references to the functions and outputs."""
        fns = {key: work.fn(key) for key in KEYS}
        with backend.capture_session():
            outputs = {key: backend.capture(key, fn) for key, fn in fns.items()}
        return [(f"the function of {k}", weakref.ref(fn)) for k, fn in fns.items()] + [
            (f"the outputs of {k}", weakref.ref(out.hidden)) for k, out in outputs.items()
        ]

    @cases("device_cases")
    def test_a_failed_capture_leaves_the_key_uncaptured(self, case: Case) -> None:
        """A function raising inside capture: the error reaches the caller (chained when
        wrapped), the key stays uncaptured and can be captured again, earlier keys replay."""
        self.begin(case)
        work = Workload(case.device, seed=8)
        first, failing = KEYS[0], KEYS[1]

        def broken() -> StepOutput:
            raise CaptureFailed(f"the conformance suite's function for {failing} failed")

        with self.open_backend(case) as (backend, _):
            self.capture_all(backend, work, (first,))
            try:
                with backend.capture_session():
                    backend.capture(failing, broken)
            except Exception as exc:
                chain: list[BaseException] = []
                seen: BaseException | None = exc
                while seen is not None and len(chain) < 20:
                    chain.append(seen)
                    seen = seen.__cause__ or seen.__context__
                assert any(isinstance(e, CaptureFailed) for e in chain), (
                    f"{case.id}: capture({failing}) of a raising function raised "
                    f"{type(exc).__name__}({exc}) without the function's own error in its chain"
                )
            else:
                pytest.fail(f"{case.id}: capture({failing}) of a raising function did not raise")
            assert not backend.has(failing), (
                f"{case.id}: has({failing}) is True after its capture failed"
            )
            with pytest.raises(KeyError):
                backend.replay(failing)
            try:
                self.capture_all(backend, work, (failing,))
            except Exception as exc:
                pytest.fail(
                    f"{case.id}: capturing {failing} again after a failed capture raised "
                    f"{type(exc).__name__}: {exc}"
                )
            self.check_replays(case, backend, work, (first, failing))

    @cases("real_capture_cases")
    def test_replay_without_sync_or_allocation(self, case: Case) -> None:
        """A real replay neither synchronises with the host nor allocates device memory."""
        self.begin(case)
        work = Workload(case.device, seed=5)
        with self.open_backend(case) as (backend, _):
            self.capture_all(backend, work)
            for key in KEYS:
                backend.replay(key)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for key in KEYS:
                    backend.replay(key)
            except RuntimeError as exc:
                pytest.fail(f"{case.id}: replay synchronised with the host: {exc}")
            finally:
                torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.synchronize()
            grown = torch.cuda.memory_allocated() - before
            assert grown == 0, f"{case.id}: replays allocated {grown} bytes of device memory"

    @cases("shared_pool_cases")
    def test_shared_memory_pool(self, case: Case) -> None:
        """Graphs share one pool: capturing every key reserves less than one pool per key."""
        self.begin(case)
        work = Workload(case.device, seed=6)
        for key in KEYS:  # warm the regular allocator so only graph pools count below
            work.fn(key)()
        torch.cuda.synchronize()

        def reserved_by(keys: tuple[ShapeKey, ...]) -> int:
            # Start from an empty cache: a backend that empties it (torch.cuda.graph does, per
            # capture) must not have earlier tests' cached blocks counted against its graphs.
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved()
            with self.open_backend(case) as (backend, _):
                self.capture_all(backend, work, keys)
                torch.cuda.synchronize()
                grown = torch.cuda.memory_reserved() - before
            torch.cuda.empty_cache()
            return grown

        one = reserved_by(KEYS[:1])
        every = reserved_by(KEYS)
        assert every < len(KEYS) * max(one, 1), (
            f"{case.id}: {len(KEYS)} graphs reserved {every} bytes, one graph {one}: the "
            "memory pool does not look shared (capability shared_memory_pool)"
        )

    @cases("resource_cases")
    def test_graph_resources(self, case: Case) -> None:
        """A dispatcher's graph resources: created once per generation, registered, warmed per
        key (and again before a re-running replay), closed after the graphs are gone."""
        self.begin(case)
        provider = RecordingProvider()
        work = Workload(case.device, seed=7)
        with self.open_backend(case, provider) as (backend, context):
            provider.backend = backend
            self.capture_all(backend, work, KEYS[:3])
            assert len(provider.created) == 1, (
                f"{case.id}: create_graph_resources called {len(provider.created)} times for "
                "one generation of captures, expected once (by the first, largest key)"
            )
            resources = provider.created[0]
            assert context.has(provider.resource_name), (
                f"{case.id}: resources not registered as {provider.resource_name!r}"
            )
            assert context.get(provider.resource_name) is resources, (
                f"{case.id}: the context holds a different object than the one created"
            )
            warmed = {n for _, n in provider.warmed}
            missing = {k.batch_size for k in KEYS[:3]} - warmed
            assert not missing, f"{case.id}: no warm-up for batch sizes {sorted(missing)}"
            # A re-running replay must find the provider on its own key's bucket, as the
            # kernels a real graph recorded for that key carry it.
            seen: list[tuple[ShapeKey, int | None]] = []
            work.observe = lambda key: seen.append((key, provider.current))
            for key in (KEYS[2], KEYS[0], KEYS[1], KEYS[0]):
                backend.replay(key)
            work.observe = None
            stale = [(k, n) for k, n in seen if n != k.batch_size]
            assert not stale, (
                f"{case.id}: replays ran the function with the resources warmed for another "
                f"bucket ({', '.join(f'{k} on {n}' for k, n in stale)}): a replay that re-runs "
                "the function warms the resources up for its key first"
            )
            backend.cleanup()
            backend.cleanup()
            assert provider.closed == [resources], (
                f"{case.id}: close_graph_resources calls {provider.closed}, expected one"
            )
            assert provider.captured_at_close == [[]], (
                f"{case.id}: the resources were closed while keys {provider.captured_at_close} "
                "were still captured: cleanup() drops the graphs first, then closes them"
            )
            assert not context.has(provider.resource_name), (
                f"{case.id}: {provider.resource_name!r} still registered after cleanup()"
            )
            # A new generation creates and registers new resources, and closes them too.
            self.capture_all(backend, work, KEYS[:1])
            assert len(provider.created) == 2, (
                f"{case.id}: a capture after cleanup() created no new graph resources "
                "(the first generation's were closed)"
            )
            assert context.has(provider.resource_name) and (
                context.get(provider.resource_name) is provider.created[1]
            ), f"{case.id}: the new generation's resources are not the ones registered"
            backend.cleanup()
            assert provider.closed == provider.created, (
                f"{case.id}: close_graph_resources calls {provider.closed} after two "
                f"generations, expected {provider.created}"
            )

    @cases("refusal_cases")
    def test_refusals_explain_themselves(self, case: Case) -> None:
        spec, caps = type(self).backend_spec(), type(self).caps()
        reasons = spec.refusals(GraphRequirements(case.device))
        assert all(isinstance(r, str) and r.strip() for r in reasons), reasons
        if case.device not in caps.devices:
            assert reasons, f"{case.device} accepted although not declared"


@dataclass
class RecordingProvider:
    """A GraphResourceProvider that records what the graph backend asks of it."""

    resource_name: str = "conformance_graph_resources"
    created: list[Any] = dataclasses.field(default_factory=list)
    warmed: list[tuple[Any, int]] = dataclasses.field(default_factory=list)
    closed: list[Any] = dataclasses.field(default_factory=list)
    current: int | None = None  # the bucket of the last warm-up
    backend: GraphBackend | None = None  # set by the test: close records what it still holds
    captured_at_close: list[list[ShapeKey]] = dataclasses.field(default_factory=list)

    def create_graph_resources(self, capacity: int, context: RuntimeContext) -> Any:
        resources = {"capacity": capacity, "id": len(self.created)}
        self.created.append(resources)
        return resources

    def warm_up_graph_resources(self, resources: Any, num_tokens: int) -> None:
        self.warmed.append((resources, num_tokens))
        self.current = num_tokens

    def close_graph_resources(self, resources: Any) -> None:
        self.closed.append(resources)
        self.current = None
        if self.backend is not None:
            self.captured_at_close.append([k for k in KEYS if self.backend.has(k)])
