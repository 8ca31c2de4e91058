"""AttentionBackendSuite: an attention backend against a float64 oracle over gathered K/V."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import pytest
import torch

from execrt.core.interfaces import (
    FP8_DTYPES,
    MODEL_DTYPES,
    AttentionCapabilities,
    AttentionRequirements,
)
from execrt.testing.attention_cases import draw_step
from execrt.testing.attention_harness import (
    TAIL,
    AttentionHarness,
    Geometry,
    Outcome,
    Step,
    matches_eager,
    moved_buffers,
    tensor_fields,
)
from execrt.testing.attention_kv_dtype import kv_dtype_cases, run_kv_dtype_case
from execrt.testing.attention_prologue import prologue_cases, run_prologue_case
from execrt.testing.attention_scenarios import (
    CPU_PROFILE,
    CUDA_PROFILE,
    MULTI_STEPS,
    SCENARIOS,
    Profile,
    continuing_steps,
)
from execrt.testing.suite import (
    STANDARD_DTYPES,
    Case,
    ConformanceSuite,
    cases,
    dtype_name,
    not_declared,
)

Record = Callable[[str, object], None]

HEAD_DIMS = (64, 80, 96, 128, 256)
# 3 and 7: groups padded to a power of two (SmolLM2: 9 q / 3 kv heads, Qwen2.5: 14 / 2); 16: a
# group that fills a 16-row tile (Llama-3.1-405B: 128 / 8)
GQA_RATIOS = (1, 2, 3, 4, 7, 8, 16)
MODES = ("decode", "extend")


def _seed(case: Case, salt: str = "") -> int:
    return zlib.crc32(f"{case.id}{salt}".encode())


def _scaled(step: Step, factor: int) -> Step:
    return dataclasses.replace(
        step,
        prefix_lens=tuple(p * factor for p in step.prefix_lens),
        extend_lens=tuple(n if step.mode == "decode" else n * factor for n in step.extend_lens),
    )


_SIXTEEN_BIT_TOLERANCES = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


class AttentionBackendSuite(ConformanceSuite):
    """Conformance of an attention backend. Set ``backend`` (or ``factory`` + ``capabilities``).

    Every test is parametrised over devices, dtypes, head dims and GQA ratios; values the
    backend does not declare skip with the capability as the reason, and configurations it
    refuses here skip with its own reason.
    """

    kind: ClassVar[str] = "attention"
    cpu_profile: ClassVar[Profile] = CPU_PROFILE
    cuda_profile: ClassVar[Profile] = CUDA_PROFILE
    #: ``||out - ref||_F / ||ref||_F`` per dtype against the float64 oracle. 16-bit outputs
    #: round at 2**-11 (fp16) and 2**-8 (bf16) relative; the built-in backends and FlashInfer
    #: stay within 3.8e-4 (fp16) and 3.0e-3 (bf16) on an H200 and 2.2e-4 / 1.9e-3 on CPU, so
    #: these leave 5-8x room for another kernel's accumulation order, and no more: an error
    #: of a few percent is a bug, not rounding.
    #: (fp32 as every suite's.)
    tolerances: ClassVar[Mapping[torch.dtype, float]] = {
        **ConformanceSuite.tolerances,
        **_SIXTEEN_BIT_TOLERANCES,
    }
    cuda_tolerances: ClassVar[Mapping[torch.dtype, float]] = {
        **ConformanceSuite.cuda_tolerances,
        **_SIXTEEN_BIT_TOLERANCES,
    }
    #: The backend's own settings (``AttentionBackendInit.options``), e.g. a kernel variant.
    options: ClassVar[Mapping[str, Any]] = {}
    #: An fp8 cache, against the float64 oracle over the same (dequantized) cache: the
    #: dtype's tolerance, at most this.
    kv_dtype_tolerance: ClassVar[float] = 1e-2
    #: An fp8 cache, against the oracle over the unquantized K/V: what the format may cost.
    kv_dtype_budgets: ClassVar[Mapping[torch.dtype, float]] = {
        torch.float8_e4m3fn: 0.06,
        torch.float8_e5m2: 0.10,
    }
    #: Settings under which the backend fuses a decode step's q/k prologue
    #: (``fuses_qk_prologue``), added to ``options`` for the prologue cases only; those
    #: cases skip where the backend does not fuse it.
    prologue_options: ClassVar[Mapping[str, Any]] = {}

    # -- cases ----------------------------------------------------------------------------------
    @classmethod
    def caps(cls) -> AttentionCapabilities:
        caps = cls.collection_spec().capabilities
        assert isinstance(caps, AttentionCapabilities)
        return caps

    @classmethod
    def dtype_axis(cls) -> list[torch.dtype]:
        return list(dict.fromkeys([*STANDARD_DTYPES, *sorted(cls.caps().dtypes, key=str)]))

    @classmethod
    def value_axis(cls, standard: tuple[int, ...], declared: frozenset[int] | None) -> list[int]:
        return sorted(set(standard) | set(declared or ()))

    @classmethod
    def kv_dtype_axis(cls) -> list[torch.dtype]:
        """The fp8 cache dtypes (every backend lists them, declared or skipped), and any
        other non-model dtype the backend declares."""
        return sorted(FP8_DTYPES | (cls.caps().kv_dtypes - MODEL_DTYPES), key=str)

    @classmethod
    def make_case(
        cls,
        case_id: str,
        device: str,
        dtype: torch.dtype,
        head_dim: int,
        gqa_ratio: int,
        *,
        mode: str | None = None,
        graph: bool = False,
        kv_dtype: torch.dtype | None = None,
        **options: Any,
    ) -> Case:
        spec, caps = cls.collection_spec(), cls.caps()
        declared = (
            not_declared("devices", device, caps.devices)
            or not_declared("dtypes", dtype, caps.dtypes)
            or (None if kv_dtype is None else not_declared("kv_dtypes", kv_dtype, caps.kv_dtypes))
            or not_declared("head_dims", head_dim, caps.head_dims)
            or not_declared("gqa_ratios", gqa_ratio, caps.gqa_ratios)
            or (f"capability {mode} is False" if mode and not getattr(caps, mode) else None)
            or ("capability graph is False" if graph and not caps.graph else None)
        )
        hkv = cls.profile(device).num_kv_heads
        req = AttentionRequirements(
            device, dtype, head_dim, hkv * gqa_ratio, hkv, graph=graph, kv_dtype=kv_dtype,
            decode=mode == "decode", extend=mode == "extend",
        )  # fmt: skip
        skip, error = cls.runnable(spec, device, req, declared)
        opts = {"head_dim": head_dim, "gqa_ratio": gqa_ratio, "mode": mode, "graph": graph}
        opts |= {"kv_dtype": kv_dtype} | options
        return Case(case_id, device, dtype, opts, skip, error)

    @classmethod
    def primary(cls, device: str) -> tuple[torch.dtype, int, int]:
        """The dtype, head dim and GQA ratio most tests use on ``device``: declared, runnable."""
        caps, prof = cls.caps(), cls.profile(device)
        head_dim = prof.head_dim
        if caps.head_dims is not None and head_dim not in caps.head_dims:
            head_dim = min(caps.head_dims)
        ratio = prof.gqa_ratio
        if caps.gqa_ratios is not None and ratio not in caps.gqa_ratios:
            ratio = min(caps.gqa_ratios)
        dtypes = [d for d in prof.dtypes if d in caps.dtypes] + sorted(
            caps.dtypes - set(prof.dtypes), key=str
        )
        for dtype in dtypes:
            if cls.make_case("probe", device, dtype, head_dim, ratio).skip is None:
                return dtype, head_dim, ratio
        return (dtypes or list(prof.dtypes))[0], head_dim, ratio

    @classmethod
    def scenario_cases(cls) -> list[Case]:
        out = []
        for device in cls.device_axis(cls.caps().devices):
            _, head_dim, ratio = cls.primary(device)
            for dtype in cls.dtype_axis():
                for name, steps in SCENARIOS.items():
                    mode = name.split("-")[0]
                    step = steps[1] if device.startswith("cuda") else steps[0]
                    case_id = f"{device}-{dtype_name(dtype)}-{name}"
                    out.append(
                        cls.make_case(case_id, device, dtype, head_dim, ratio, mode=mode, step=step)
                    )
        return out

    @classmethod
    def head_dim_cases(cls) -> list[Case]:
        out = []
        for device in cls.device_axis(cls.caps().devices):
            dtype, _, ratio = cls.primary(device)
            for mode in MODES:
                for hd in cls.value_axis(HEAD_DIMS, cls.caps().head_dims):
                    case_id = f"{device}-{dtype_name(dtype)}-{mode}-d{hd}"
                    out.append(cls.make_case(case_id, device, dtype, hd, ratio, mode=mode))
        return out

    @classmethod
    def gqa_cases(cls) -> list[Case]:
        """Every ratio in the primary dtype; the groups that are no power of two (3, 7) in the
        other dtypes too, whose kernels may be paths of their own (a 16-bit path that mapped
        q heads to kv heads by ``h % Hkv`` passed when only the primary dtype ran them)."""
        out = []
        for device in cls.device_axis(cls.caps().devices):
            primary, head_dim, _ = cls.primary(device)
            for dtype in (primary, *(d for d in cls.dtype_axis() if d != primary)):
                for mode in MODES:
                    for ratio in cls.value_axis(GQA_RATIOS, cls.caps().gqa_ratios):
                        if dtype != primary and ratio not in (3, 7):
                            continue
                        case_id = f"{device}-{dtype_name(dtype)}-{mode}-gqa{ratio}"
                        out.append(
                            cls.make_case(case_id, device, dtype, head_dim, ratio, mode=mode)
                        )
        return out

    @classmethod
    def generated_cases(cls) -> list[Case]:
        out = []
        for device in cls.device_axis(cls.caps().devices):
            _, head_dim, ratio = cls.primary(device)
            for dtype in cls.dtype_axis():
                for mode in MODES:
                    case_id = f"{device}-{dtype_name(dtype)}-{mode}"
                    out.append(cls.make_case(case_id, device, dtype, head_dim, ratio, mode=mode))
        return out

    @classmethod
    def kv_dtype_cases(cls) -> list[Case]:
        return kv_dtype_cases(cls)

    @classmethod
    def prologue_cases(cls) -> list[Case]:
        return prologue_cases(cls)

    @classmethod
    def primary_cases(cls, *, graph: bool = False) -> list[Case]:
        out = []
        for device in cls.device_axis(cls.caps().devices):
            dtype, head_dim, ratio = cls.primary(device)
            case_id = f"{device}-{dtype_name(dtype)}"
            mode = "decode" if graph else None
            out.append(
                cls.make_case(case_id, device, dtype, head_dim, ratio, mode=mode, graph=graph)
            )
        return out

    @classmethod
    def graph_cases(cls) -> list[Case]:
        return cls.primary_cases(graph=True)

    @classmethod
    def kv_writer_cases(cls) -> list[Case]:
        """The primary cases, named by who writes this step's K/V (``stores_kv``)."""
        writer = "backend_stores" if cls.caps().stores_kv else "model_stores"
        return [dataclasses.replace(case, id=f"{case.id}-{writer}") for case in cls.primary_cases()]

    @classmethod
    def cuda_graph_cases(cls) -> list[Case]:
        return cls.cuda_capture_only(cls.primary_cases(graph=True))

    @classmethod
    def device_cases(cls) -> list[Case]:
        return [Case(device, device) for device in cls.device_axis(cls.caps().devices)]

    # -- helpers --------------------------------------------------------------------------------
    def geometry(self, case: Case, num_layers: int = 1) -> Geometry:
        hkv = type(self).profile(case.device).num_kv_heads
        return Geometry(hkv, case["gqa_ratio"], case["head_dim"], num_layers)

    def harness(
        self,
        case: Case,
        geometry: Geometry,
        steps: list[Step],
        seed: int,
        graph_max_bs: int = 0,
        options: Mapping[str, Any] | None = None,
        **kv: Any,  # kv_dtype, scales: see AttentionHarness
    ) -> AttentionHarness:
        spec = type(self).backend_spec()  # a fresh PluginHost for every test
        return AttentionHarness(
            spec,
            case.device,
            case.dtype or torch.float32,
            geometry,
            max_reqs=max(s.batch_size for s in steps) + 4,
            max_context_len=max(s.max_context for s in steps) + TAIL + 8,
            cache_slots=sum(s.num_slots for s in steps) + 64,
            seed=seed,
            graph_max_bs=graph_max_bs,
            options=type(self).options if options is None else options,
            **kv,
        )

    def run_steps(self, case: Case, geometry: Geometry, steps: list[Step], seed: int) -> Outcome:
        """Run ``steps`` one after the other on one backend; every step checked."""
        tol = type(self).tolerance(case.device, case.dtype or torch.float32)
        harness = self.harness(case, geometry, steps, seed)
        total = Outcome()
        try:
            for i, step in enumerate(steps):
                prepared = harness.prepare(step)
                label = case.id if len(steps) == 1 else f"{case.id} step {i} ({step.mode})"
                total.add(harness.check(prepared, harness.run(prepared), tol, label))
        finally:
            harness.close()
        return total

    def record(self, case: Case, outcome: Outcome, record_property: Record) -> None:
        """Put the case's worst error and its tolerance in the report."""
        record_property("max_error", outcome.max_error)
        record_property("tolerance", type(self).tolerance(case.device, case.dtype or torch.float32))

    def finish(self, case: Case, outcome: Outcome, record_property: Record) -> None:
        self.record(case, outcome, record_property)
        if outcome.problems:
            pytest.fail("\n".join(outcome.problems), pytrace=False)

    # -- tests ----------------------------------------------------------------------------------
    @cases("scenario_cases")
    def test_scenario(self, case: Case, record_property: Record) -> None:
        """A named scenario (ids say which), against the oracle and the cache mirror."""
        self.begin(case)
        outcome = self.run_steps(case, self.geometry(case), [case["step"]], _seed(case))
        self.finish(case, outcome, record_property)

    @cases("head_dim_cases")
    def test_head_dim(self, case: Case, record_property: Record) -> None:
        self.begin(case)
        step = SCENARIOS[f"{case['mode']}-ragged"][1 if case.device.startswith("cuda") else 0]
        outcome = self.run_steps(case, self.geometry(case), [step], _seed(case))
        self.finish(case, outcome, record_property)

    @cases("gqa_cases")
    def test_gqa_ratio(self, case: Case, record_property: Record) -> None:
        self.begin(case)
        name = "decode-ragged" if case["mode"] == "decode" else "extend-prefix"
        step = SCENARIOS[name][1 if case.device.startswith("cuda") else 0]
        outcome = self.run_steps(case, self.geometry(case), [step], _seed(case))
        self.finish(case, outcome, record_property)

    @cases("generated_cases")
    def test_generated(self, case: Case, record_property: Record) -> None:
        """Hypothesis-drawn batches within the device profile (derandomized, few examples)."""
        self.begin(case)
        hypothesis = pytest.importorskip("hypothesis")
        prof = type(self).profile(case.device)
        worst = Outcome()

        @type(self).hypothesis_settings(case)
        @hypothesis.given(data=hypothesis.strategies.data())
        def run(data: Any) -> None:
            step = draw_step(data, prof, case["mode"])
            outcome = self.run_steps(case, self.geometry(case), [step], _seed(case, repr(step)))
            worst.max_error = max(worst.max_error, outcome.max_error)
            if outcome.problems:  # the problem first: a report's one-line reason shows it
                raise AssertionError("\n".join(outcome.problems) + f"\nin {step}")

        try:
            run()
        finally:  # the worst error of every drawn example, the failing one too
            self.record(case, worst, record_property)

    @cases("primary_cases")
    def test_multi_layer_multi_step(self, case: Case, record_property: Record) -> None:
        """One plan serves every layer; a later, different batch is not stale, nor is a batch
        of the same requests one token further on (``continuing_steps``)."""
        self.begin(case)
        caps = type(self).caps()
        steps = [s for s in MULTI_STEPS if getattr(caps, s.mode)]
        if not steps:
            pytest.skip("capabilities decode and extend are both False")
        cuda = case.device.startswith("cuda")
        if cuda:
            steps = [_scaled(s, 20) for s in steps]
        chain = list(continuing_steps(20 if cuda else 1))
        if not caps.extend:  # from the first decode step on, that one laid out afresh
            chain = [dataclasses.replace(chain[1], continues=False), *chain[2:4]]
        elif not caps.decode:
            chain = []
        steps += chain
        outcome = self.run_steps(case, self.geometry(case, num_layers=3), steps, _seed(case))
        self.finish(case, outcome, record_property)

    @cases("kv_dtype_cases")
    def test_kv_dtype(self, case: Case, record_property: Record) -> None:
        """An fp8 cache stored by the one store, two layers with scales (1, 1) and (0.25, 4):
        against the float64 oracle over that cache read times its scales
        (torch_native's reading) within ``kv_dtype_tolerance``, and against the unquantized
        K/V within the format's budget. Graph cases plan through ``plan_graph``."""
        self.begin(case)
        run_kv_dtype_case(self, case, record_property)

    @cases("prologue_cases")
    def test_qk_prologue(self, case: Case, record_property: Record) -> None:
        """A backend that ``fuses_qk_prologue`` (under ``prologue_options``): handed raw
        q/k/v and a ``QKPrologue`` per layer (norm or none, Hadamard or not, graph plans, fp8
        caches with scales (0.25, 4)), its output against the float64 oracle over the float64
        rotation, and the K/V it stored against the mirror within the dtype's tolerance (the
        fp8 budget for an fp8 cache); nothing else in the cache written. Skips where the
        backend does not fuse it."""
        self.begin(case)
        run_prologue_case(self, case, record_property)

    @cases("kv_writer_cases")
    def test_attend_twice_with_one_plan(self, case: Case, record_property: Record) -> None:
        """``attend`` twice per layer on one plan (as a graph's warm-up and capture do): the
        cache still holds exactly this step's K/V (a ``stores_kv`` backend stores the same
        values again at the same slots, any other backend writes nothing) and both outputs
        equal the oracle."""
        self.begin(case)
        caps = type(self).caps()
        steps = [s for s in MULTI_STEPS if getattr(caps, s.mode)]
        tol = type(self).tolerance(case.device, case.dtype or torch.float32)
        harness = self.harness(case, self.geometry(case, num_layers=2), steps, _seed(case))
        total = Outcome()
        try:
            for i, step in enumerate(steps):
                prepared = harness.prepare(step)
                plan = harness.plan(prepared)
                for call in ("first", "second"):
                    outs = harness.attend_layers(prepared, plan)
                    label = f"{case.id} step {i} ({step.mode}), {call} attend"
                    total.add(harness.check(prepared, outs, tol, label))
        finally:
            harness.close()
        self.finish(case, total, record_property)

    @cases("graph_cases")
    def test_graph_metadata(self, case: Case, record_property: Record) -> None:
        """The graph metadata path: equal to eager and the oracle, buffers at fixed addresses."""
        self.begin(case)
        steps = list(type(self).profile(case.device).graph_steps)
        bucket = max(s.batch_size + s.padded_rows for s in steps)
        tol = type(self).tolerance(case.device, case.dtype or torch.float32)
        harness = self.harness(case, self.geometry(case, 2), steps, _seed(case), bucket)
        total = Outcome()
        seen: dict[int, tuple[Any, dict[str, Any]]] = {}
        try:
            for i, step in enumerate(steps):
                label = f"{case.id} graph step {i} (bucket {step.batch_size + step.padded_rows})"
                prepared = harness.prepare(step, graph=True)
                size = prepared.fb.batch_size
                plan, problems = harness.plan_graph_checked(
                    prepared, label, seen_bucket=size in seen
                )
                total.problems += problems
                outs = harness.attend_layers(prepared, plan)
                leaves = tensor_fields(plan.meta)
                if size in seen:
                    total.problems += moved_buffers(label, seen[size][1], leaves)
                else:
                    seen[size] = (plan.meta, leaves)  # kept alive on purpose
                total.add(harness.check(prepared, outs, tol, label))
                total.problems += matches_eager(harness, prepared, outs, tol, label)
        finally:
            harness.close()
        self.finish(case, total, record_property)

    @cases("cuda_graph_cases")
    def test_cuda_graph_replay(self, case: Case, record_property: Record) -> None:
        """Capture a decode forward with torch.cuda.CUDAGraph, replay it on a new batch."""
        self.begin(case)
        first, second = type(self).profile(case.device).graph_steps[:2]
        bucket = first.batch_size + first.padded_rows
        assert bucket == second.batch_size + second.padded_rows
        tol = type(self).tolerance(case.device, case.dtype or torch.float32)
        harness = self.harness(case, self.geometry(case, 2), [first, second], _seed(case), bucket)
        total = Outcome()
        try:
            a = harness.prepare(first, graph=True)
            plan = harness.plan(a)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                harness.attend_layers(a, plan)  # warm-up outside capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = harness.attend_layers(a, plan)
            for prepared, label in ((a, "replay of the captured batch"), (None, "new batch")):
                if prepared is None:
                    prepared = harness.prepare(second, graph=True, reuse=a)
                    # re-planned into the captured buffers, as before each replay
                    total.problems += harness.plan_graph_checked(
                        prepared, f"{case.id} {label}", seen_bucket=True
                    )[1]
                graph.replay()
                torch.cuda.synchronize()
                total.add(harness.check(prepared, outs, tol, f"{case.id} {label}"))
        finally:
            harness.close()
        self.finish(case, total, record_property)

    @cases("device_cases")
    def test_refusals_explain_themselves(self, case: Case) -> None:
        """Every refusal has a reason, and nothing outside the declared capabilities is accepted."""
        spec, caps = type(self).backend_spec(), type(self).caps()
        hkv = type(self).profile(case.device).num_kv_heads
        problems = []
        for dtype in type(self).dtype_axis():
            for hd in type(self).value_axis(HEAD_DIMS, caps.head_dims):
                for ratio in type(self).value_axis(GQA_RATIOS, caps.gqa_ratios):
                    for graph in (False, True):
                        req = AttentionRequirements(case.device, dtype, hd, hkv * ratio, hkv, graph)
                        reasons = spec.refusals(req)
                        if not all(isinstance(r, str) and r.strip() for r in reasons):
                            problems.append(f"{req}: refusal without a reason {reasons!r}")
                        undeclared = (
                            not_declared("devices", case.device, caps.devices)
                            or not_declared("dtypes", dtype, caps.dtypes)
                            or not_declared("head_dims", hd, caps.head_dims)
                            or not_declared("gqa_ratios", ratio, caps.gqa_ratios)
                            or (graph and not caps.graph)
                        )
                        if undeclared and not reasons:
                            problems.append(f"{req}: accepted although not declared")
        dtype, hd, ratio = type(self).primary(case.device)
        for kv in type(self).kv_dtype_axis():
            req = AttentionRequirements(case.device, dtype, hd, hkv * ratio, hkv, kv_dtype=kv)
            if not_declared("kv_dtypes", kv, caps.kv_dtypes) and not spec.refusals(req):
                problems.append(f"{req}: KV cache dtype accepted although not declared")
        assert not problems, "\n".join(problems[:10])
