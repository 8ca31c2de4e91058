"""MoEDispatcherSuite: combine(run_experts(dispatch(x))) against a naive single-process MoE."""

from __future__ import annotations

import dataclasses
import pickle
import zlib
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from execrt.core.interfaces import (
    ExpertMajorDispatchOutput,
    MoEDispatcherCapabilities,
    MoERequirements,
    StandardDispatchOutput,
)
from execrt.core.parallel import ParallelState
from execrt.testing.moe_cases import (
    CPU_PROFILE,
    CUDA_PROFILE,
    ROUTINGS,
    MoEProfile,
    generated_draws,
    routing,
)
from execrt.testing.moe_harness import (
    FORMAT_TYPES,
    MoEJob,
    RankResult,
    expert_weights,
    open_dispatcher,
    run_multiprocess,
    run_rank,
)
from execrt.testing.oracles import compare, moe_oracle
from execrt.testing.suite import (
    STANDARD_DTYPES,
    Case,
    ConformanceSuite,
    cases,
    device_available,
    dtype_name,
    not_declared,
)

Record = Callable[[str, object], None]

TOP_KS = (1, 2, 4, 8)
WORLD_SIZES = (1, 2, 3)  # 3: no power of two, no 'the other rank'


class MoEDispatcherSuite(ConformanceSuite):
    """Conformance of a MoE dispatcher, at world size 1 in-process and above in spawned ranks.

    Each rank holds its contiguous block of experts; with ``capabilities.replicated_tokens``
    every rank brings the same tokens, otherwise each brings its own (uneven) tokens.
    """

    kind: ClassVar[str] = "moe_dispatch"
    cpu_profile: ClassVar[MoEProfile] = CPU_PROFILE
    cuda_profile: ClassVar[MoEProfile] = CUDA_PROFILE
    #: Largest world size run as gloo processes on CPU; larger declared sizes skip.
    max_cpu_world_size: ClassVar[int] = 3
    multiprocess_timeout_s: ClassVar[float] = 120.0

    # -- cases ----------------------------------------------------------------------------------
    @classmethod
    def caps(cls) -> MoEDispatcherCapabilities:
        return cls.declared(MoEDispatcherCapabilities)

    @staticmethod
    def group_backend(device: str, world: int) -> str:
        return "none" if world == 1 else ("nccl" if device.startswith("cuda") else "gloo")

    @classmethod
    def max_world(cls, device: str) -> tuple[int, str]:
        if device.startswith("cuda"):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            return count, f"{count} CUDA device(s) here"
        return cls.max_cpu_world_size, f"max_cpu_world_size is {cls.max_cpu_world_size}"

    @classmethod
    def make_case(
        cls,
        case_id: str,
        device: str,
        dtype: torch.dtype,
        *,
        world: int = 1,
        top_k: int | None = None,
        hidden: int | None = None,
        graph: bool = False,
        **options: Any,
    ) -> Case:
        spec, caps, prof = cls.collection_spec(), cls.caps(), cls.profile(device)
        top_k = top_k if top_k is not None else cls.primary(device)[1]
        hidden = hidden if hidden is not None else cls.primary(device)[2]
        group = cls.group_backend(device, world)
        too_big = caps.max_top_k is not None and top_k > caps.max_top_k
        declared = (
            not_declared("devices", device, caps.devices)
            or not_declared("dtypes", dtype, caps.dtypes)
            or not_declared("world_sizes", world, caps.world_sizes)
            or not_declared("process_group_backends", group, caps.process_group_backends)
            or not_declared("hidden_sizes", hidden, caps.hidden_sizes)
            or (f"capability max_top_k is {caps.max_top_k} (< {top_k})" if too_big else None)
            or ("capability graph is False" if graph and not caps.graph else None)
        )
        if not declared and device_available(device) and world > cls.max_world(device)[0]:
            declared = f"world size {world} needs {world} processes; {cls.max_world(device)[1]}"
        num_experts = cls.num_experts(prof, world, top_k, options.get("experts"))
        req = MoERequirements(device, dtype, world, group, num_experts, top_k, hidden, graph)
        skip, error = cls.runnable(spec, device, req, declared)
        opts = {"world": world, "top_k": top_k, "hidden": hidden} | options
        return Case(case_id, device, dtype, opts, skip, error)

    @staticmethod
    def num_experts(prof: MoEProfile, world: int, top_k: int, experts: int | None) -> int:
        """A case's expert count: ``experts`` (the expert-count axis) or the profile's, raised
        to the top-k and the world size, in whole blocks per rank."""
        wanted = max(experts or prof.num_experts, world, top_k)
        return -(-wanted // world) * world

    @classmethod
    def primary(cls, device: str) -> tuple[torch.dtype, int, int]:
        """(dtype, top_k, hidden size) most tests use on ``device``."""
        caps, prof = cls.caps(), cls.profile(device)
        top_k = min(prof.top_k, caps.max_top_k or prof.top_k)
        hidden = prof.hidden_size
        if caps.hidden_sizes is not None and hidden not in caps.hidden_sizes:
            hidden = min(caps.hidden_sizes)
        dtypes = [d for d in prof.dtypes if d in caps.dtypes] + sorted(
            caps.dtypes - set(prof.dtypes), key=str
        )
        for dtype in dtypes:
            probe = cls.make_case("probe", device, dtype, top_k=top_k, hidden=hidden)
            if probe.skip is None:
                return dtype, top_k, hidden
        return (dtypes or list(prof.dtypes))[0], top_k, hidden

    @classmethod
    def devices_here(cls) -> list[str]:
        return cls.device_axis(cls.caps().devices)

    @classmethod
    def routing_cases(cls) -> list[Case]:
        dtypes = list(dict.fromkeys([*STANDARD_DTYPES, *sorted(cls.caps().dtypes, key=str)]))
        return [
            cls.make_case(f"{dev}-{dtype_name(dt)}-w1-{name}", dev, dt, routing=name)
            for dev in cls.devices_here()
            for dt in dtypes
            for name in ROUTINGS
        ]

    @classmethod
    def world_cases(cls) -> list[Case]:
        token_mode = "replicated" if cls.caps().replicated_tokens else "per_rank"
        worlds = sorted(set(WORLD_SIZES) | set(cls.caps().world_sizes or ()))
        out = []
        for dev in cls.devices_here():
            dtype = cls.primary(dev)[0]
            for world in worlds:
                if world > 1:
                    case_id = f"{dev}-{dtype_name(dtype)}-w{world}-{token_mode}"
                    out.append(cls.make_case(case_id, dev, dtype, world=world))
        return out

    @classmethod
    def top_k_cases(cls) -> list[Case]:
        caps = cls.caps()
        ks = sorted(set(TOP_KS) | ({caps.max_top_k} if caps.max_top_k else set()))
        out = []
        for dev in cls.devices_here():
            dtype = cls.primary(dev)[0]
            for k in ks:
                case_id = f"{dev}-{dtype_name(dtype)}-w1-k{k}"
                out.append(cls.make_case(case_id, dev, dtype, top_k=k))
        return out

    @classmethod
    def hidden_cases(cls) -> list[Case]:
        out = []
        for dev in cls.devices_here():
            dtype = cls.primary(dev)[0]
            sizes = sorted(set(cls.profile(dev).hidden_sizes) | set(cls.caps().hidden_sizes or ()))
            for h in sizes:
                out.append(
                    cls.make_case(f"{dev}-{dtype_name(dtype)}-w1-h{h}", dev, dtype, hidden=h)
                )
        return out

    @classmethod
    def expert_cases(cls) -> list[Case]:
        out = []
        for dev in cls.devices_here():
            dtype = cls.primary(dev)[0]
            for e in cls.profile(dev).expert_counts:
                case_id = f"{dev}-{dtype_name(dtype)}-w1-e{e}"
                out.append(cls.make_case(case_id, dev, dtype, experts=e))
        return out

    @classmethod
    def primary_cases(cls, *, graph: bool = False, suffix: str = "") -> list[Case]:
        out = []
        for dev in cls.devices_here():
            dtype = cls.primary(dev)[0]
            case_id = f"{dev}-{dtype_name(dtype)}-w1{suffix}"
            out.append(cls.make_case(case_id, dev, dtype, graph=graph))
        return out

    @classmethod
    def format_cases(cls) -> list[Case]:
        return cls.primary_cases(suffix=f"-{cls.caps().output_format.value}")

    @classmethod
    def graph_cases(cls) -> list[Case]:
        return cls.cuda_capture_only(cls.primary_cases(graph=True))

    @classmethod
    def device_cases(cls) -> list[Case]:
        return [Case(dev, dev) for dev in cls.devices_here()]

    # -- helpers --------------------------------------------------------------------------------
    def job(self, case: Case, routings: tuple[str, ...], num_tokens: int | None = None) -> MoEJob:
        cls = type(self)
        spec, prof = cls.backend_spec(), cls.profile(case.device)
        world = case["world"]
        dtype = case.dtype or torch.float32
        return MoEJob(
            kind=cls.kind,
            backend=cls.backend,
            factory=cls.factory,
            capabilities=spec.capabilities,
            check=spec.check,
            device=case.device,
            dtype=dtype,
            # Enough experts for the case's top-k (a declared max_top_k may pass the profile's),
            # in whole blocks per rank.
            num_experts=cls.num_experts(prof, world, case["top_k"], case.get("experts")),
            top_k=case["top_k"],
            hidden_size=case["hidden"],
            intermediate_size=prof.intermediate_size,
            num_tokens=prof.num_tokens if num_tokens is None else num_tokens,
            routings=routings,
            seed=zlib.crc32(case.id.encode()),
            tolerance=cls.tolerance(case.device, dtype),
            world_size=world,
            process_group_backend=self.group_backend(case.device, world),
            many_tokens=prof.many_tokens,
        )

    def record(self, case: Case, results: list[RankResult], record: Record) -> None:
        """Put the worst error of ``results`` and the case's tolerance in the report."""
        record("max_error", max((r.max_error for r in results), default=0.0))
        record("tolerance", type(self).tolerance(case.device, case.dtype or torch.float32))

    def finish(self, case: Case, results: list[RankResult], record: Record, extra=()) -> None:
        self.record(case, results, record)
        problems = [
            f"{case.id} rank {r.rank} routing {r.routing} ({r.num_tokens} tokens): {p}"
            for r in results
            for p in r.problems
        ] + list(extra)
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)

    # -- tests ----------------------------------------------------------------------------------
    @cases("routing_cases")
    def test_routing(self, case: Case, record_property: Record) -> None:
        """One routing scenario at world size 1 (hot expert, empty rank, all masked, T=0 ...)."""
        self.begin(case)
        results = run_rank(self.job(case, (case["routing"],)), ParallelState.single())
        self.finish(case, results, record_property)

    @cases("primary_cases")
    def test_reused_dispatcher(self, case: Case, record_property: Record) -> None:
        """One dispatcher serves every routing scenario in turn (buffers reused, no stale state)."""
        self.begin(case)
        results = run_rank(self.job(case, ROUTINGS * 2), ParallelState.single())
        self.finish(case, results, record_property)

    @cases("world_cases")
    def test_world_size(self, case: Case, record_property: Record) -> None:
        """Every routing scenario on ``world`` spawned ranks (gloo on CPU, NCCL on CUDA)."""
        self.begin(case)
        job = self.job(case, ROUTINGS)
        try:
            pickle.dumps(job)
        except Exception as exc:
            pytest.fail(
                f"{case.id}: the backend cannot be sent to spawned ranks ({exc!r}); register it, "
                "or set `factory` to a 'module:attr' string",
                pytrace=False,
            )
        results, errors = run_multiprocess(job, type(self).multiprocess_timeout_s)
        self.finish(case, results, record_property, [f"{case.id}: {e}" for e in errors])

    @cases("top_k_cases")
    def test_top_k(self, case: Case, record_property: Record) -> None:
        self.begin(case)
        results = run_rank(self.job(case, ("random", "some_masked")), ParallelState.single())
        self.finish(case, results, record_property)

    @cases("hidden_cases")
    def test_hidden_size(self, case: Case, record_property: Record) -> None:
        self.begin(case)
        results = run_rank(self.job(case, ("random",)), ParallelState.single())
        self.finish(case, results, record_property)

    @cases("expert_cases")
    def test_expert_count(self, case: Case, record_property: Record) -> None:
        """Expert counts other than the profile's: not powers of two, and as many as real
        models have (nothing may assume the profile's 8)."""
        self.begin(case)
        job = self.job(case, ("random", "hot_expert", "some_masked"))
        self.finish(case, run_rank(job, ParallelState.single()), record_property)

    @cases("format_cases")
    def test_output_format(self, case: Case) -> None:
        """dispatch returns the declared format's dataclass, with that format's shapes."""
        self.begin(case)
        job = self.job(case, ())
        caps = job.capabilities
        gen = torch.Generator().manual_seed(job.seed)
        x = torch.randn(job.num_tokens, job.hidden_size, generator=gen).to(job.dtype)
        ids, weights = routing("some_masked", job.num_tokens, job.num_experts, job.top_k, 1, gen)
        with open_dispatcher(job, ParallelState.single(), job.num_tokens) as (dispatcher, _):
            d = dispatcher.dispatch(x.to(case.device), ids.to(case.device), weights.to(case.device))
        want = FORMAT_TYPES[caps.output_format]
        assert isinstance(d, want), (
            f"{case.id}: dispatch returned {type(d).__name__}, declared {want.__name__}"
        )
        assert d.format == caps.output_format
        routed = int((ids >= 0).sum())
        if isinstance(d, StandardDispatchOutput):
            assert tuple(d.topk_ids.shape) == tuple(ids.shape), f"{case.id}: topk_ids shape"
            assert tuple(d.hidden_states.shape) == tuple(x.shape), f"{case.id}: hidden shape"
            assert int((d.topk_ids >= 0).sum()) == routed, f"{case.id}: local ids != routed"
        else:
            assert isinstance(d, ExpertMajorDispatchOutput)
            e_local = job.num_experts
            assert d.hidden_states.dim() == 3 and d.hidden_states.shape[0] == e_local
            assert tuple(d.expert_counts.shape) == (e_local,), f"{case.id}: expert_counts shape"
            assert int(d.expert_counts.sum()) == routed, (
                f"{case.id}: expert_counts sum {int(d.expert_counts.sum())} != {routed} routed"
            )
            assert d.num_tokens == job.num_tokens

    @cases("primary_cases")
    def test_generated(self, case: Case, record_property: Record) -> None:
        """Hypothesis-drawn token counts, top-k and masking (derandomized, few examples)."""
        self.begin(case)
        hypothesis = pytest.importorskip("hypothesis")
        prof, caps = type(self).profile(case.device), type(self).caps()
        worst: list[RankResult] = []

        @type(self).hypothesis_settings(case)
        @hypothesis.given(**generated_draws(hypothesis.strategies, prof, caps.max_top_k))
        def run(num_tokens: int, top_k: int, scenario: str) -> None:
            drawn = dataclasses.replace(case, options={**case.options, "top_k": top_k})
            job = self.job(drawn, (scenario,), num_tokens=num_tokens)
            results = run_rank(job, ParallelState.single())
            worst.extend(results)
            problems = [p for r in results for p in r.problems]
            # The problem first: a report's one-line reason shows it.
            assert not problems, "; ".join(problems) + f" (T={num_tokens} top_k={top_k} {scenario})"

        try:
            run()
        finally:  # the worst error of every drawn example, the failing one too
            self.record(case, worst, record_property)

    @cases("graph_cases")
    def test_cuda_graph_capture(self, case: Case, record_property: Record) -> None:
        """dispatch -> experts -> combine captured in a CUDA graph equals the oracle on replay."""
        self.begin(case)
        from execrt.core.experts import run_experts

        job = self.job(case, ())
        dev = torch.device(case.device)
        w13, w2 = expert_weights(
            job.num_experts, job.hidden_size, job.intermediate_size, job.dtype, job.seed
        )
        w13, w2 = w13.to(dev), w2.to(dev)
        gen = torch.Generator().manual_seed(job.seed)
        inputs = []
        for _ in range(2):
            x = torch.randn(job.num_tokens, job.hidden_size, generator=gen).to(job.dtype)
            inputs.append(
                (x, *routing("some_masked", job.num_tokens, job.num_experts, job.top_k, 1, gen))
            )
        static = [t.to(dev) for t in inputs[0]]
        with open_dispatcher(job, ParallelState.single(), job.num_tokens) as (dispatcher, _):

            def step() -> torch.Tensor:
                d = dispatcher.dispatch(*static)
                return dispatcher.combine(run_experts(d, w13, w2), d)

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            errors = []
            for x, ids, weights in inputs[::-1]:
                for s, t in zip(static, (x, ids, weights), strict=True):
                    s.copy_(t)
                graph.replay()
                torch.cuda.synchronize()
                cmp = compare(out, moe_oracle(x, ids, weights, w13.cpu(), w2.cpu()).to(dev))
                errors.append(cmp.rel_error if cmp.num_nonfinite == 0 else float("inf"))
        tol = type(self).tolerance(case.device, job.dtype)
        record_property("max_error", max(errors))
        assert max(errors) <= tol, (
            f"{case.id}: replay error {max(errors):.3g} > tolerance {tol:.3g}"
        )

    @cases("device_cases")
    def test_refusals_explain_themselves(self, case: Case) -> None:
        """Every refusal has a reason; nothing outside the declared capabilities is accepted."""
        cls = type(self)
        spec, caps, prof = cls.backend_spec(), cls.caps(), cls.profile(case.device)
        problems = []
        worlds = sorted(set(WORLD_SIZES) | set(caps.world_sizes or ()) | {3})
        for dtype in STANDARD_DTYPES:
            for world in worlds:
                for group in ("none", "gloo", "nccl"):
                    for k in TOP_KS:
                        req = MoERequirements(
                            case.device, dtype, world, group, 8 * world, k, prof.hidden_size
                        )
                        reasons = spec.refusals(req)
                        if not all(isinstance(r, str) and r.strip() for r in reasons):
                            problems.append(f"{req}: refusal without a reason {reasons!r}")
                        undeclared = (
                            not_declared("devices", case.device, caps.devices)
                            or not_declared("dtypes", dtype, caps.dtypes)
                            or not_declared("world_sizes", world, caps.world_sizes)
                            or not_declared(
                                "process_group_backends", group, caps.process_group_backends
                            )
                            or (caps.max_top_k is not None and k > caps.max_top_k)
                        )
                        if undeclared and not reasons:
                            problems.append(f"{req}: accepted although not declared")
        assert not problems, "\n".join(problems[:10])
