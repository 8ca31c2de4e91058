"""The base of every conformance suite: backend lookup, capability-driven cases, strict xfails."""

from __future__ import annotations

import dataclasses
import inspect
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import pytest
import torch

from execrt.core.interfaces import Capabilities
from execrt.core.plugins import BackendSpec
from execrt.plugins.host import PluginHost

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=Capabilities)

#: dtypes every suite knows how to test; a backend's declared ones are added to these.
STANDARD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: devices every suite lists, so a missing one shows up as a skip with its reason.
STANDARD_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Case:
    """One parametrisation of a suite test: id, parameters, and why it cannot run here."""

    id: str
    device: str
    dtype: torch.dtype | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    skip: str | None = None  # set: the test is skipped with this reason
    error: str | None = None  # set: the test fails at once with this message

    def __getitem__(self, key: str) -> Any:
        return self.options[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.options.get(key, default)


def cases(generator: str) -> Callable[[F], F]:
    """Mark a suite test as parametrised by the classmethod ``generator`` (-> list of Case)."""

    def mark(fn: F) -> F:
        fn._execrt_cases = generator  # type: ignore[attr-defined]
        return fn

    return mark


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def device_available(device: str) -> bool:
    if device == "cpu":
        return True
    module = getattr(torch, device, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def not_declared(field_name: str, value: Any, declared: Iterable[Any] | None) -> str | None:
    """The skip reason for a value outside a declared capability set (None: declared)."""
    if declared is None or value in declared:
        return None
    shown = dtype_name(value) if isinstance(value, torch.dtype) else value
    return f"capability {field_name} does not include {shown}"


def generated_settings(max_examples: int, *, shrink: bool = True, **overrides: Any) -> Any:
    """The Hypothesis settings of a suite's generated test: derandomized (a run is repeatable),
    no example database, no deadline, no health checks; ``shrink`` False reports a failing
    example as drawn (shrinking one can take minutes); ``overrides`` add to them."""
    hypothesis = pytest.importorskip("hypothesis")
    if not shrink:
        overrides.setdefault(
            "phases", [p for p in hypothesis.Phase if p != hypothesis.Phase.shrink]
        )
    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        **overrides,
    )


_COLLECTION_SPECS: weakref.WeakKeyDictionary[type, BackendSpec] = weakref.WeakKeyDictionary()


class ConformanceSuite:
    """Subclass one of the kind suites, then set either ``backend`` or ``factory``+``capabilities``.

    ``backend``: a registered name, looked up through a fresh PluginHost (entry points included).
    ``factory``: ``"module:attr"`` or a callable taking the kind's init record, with
    ``capabilities`` (and optionally ``refusal_check(requirements) -> list[str]``) for a
    backend that is not registered. ``devices`` restricts the devices tested.
    ``expected_failures`` maps a test-id substring (``test_name[case-id]`` or a part of it) to
    a reason with an issue URL; matching tests run as strict xfail.
    """

    kind: ClassVar[str] = ""
    backend: ClassVar[str | None] = None
    factory: ClassVar[str | Callable[[Any], Any] | None] = None
    capabilities: ClassVar[Capabilities | None] = None
    refusal_check: ClassVar[Callable[[Any], list[str]] | None] = None
    devices: ClassVar[tuple[str, ...] | None] = None
    expected_failures: ClassVar[Mapping[str, str]] = {}
    #: ``||out - ref|| / ||ref||`` allowed per dtype, on CPU and on CUDA.
    tolerances: ClassVar[Mapping[torch.dtype, float]] = {
        torch.float32: 1e-4,
        torch.float16: 5e-3,
        torch.bfloat16: 3e-2,
    }
    cuda_tolerances: ClassVar[Mapping[torch.dtype, float]] = {
        torch.float32: 5e-3,  # TF32 dots
        torch.float16: 1e-2,
        torch.bfloat16: 3e-2,
    }
    #: Problem sizes per device (each kind suite sets its own profile type).
    cpu_profile: ClassVar[Any] = None
    cuda_profile: ClassVar[Any] = None
    #: Hypothesis examples per generated test (None: the device profile's).
    max_examples: ClassVar[int | None] = None
    #: False: report a failing generated example as drawn, without shrinking it (faster; a
    #: shrunk example is smaller to read). ``execrt conformance --no-shrink`` sets it.
    shrink_failures: ClassVar[bool] = True

    @classmethod
    def profile(cls, device: str) -> Any:
        return cls.cuda_profile if device.startswith("cuda") else cls.cpu_profile

    @classmethod
    def hypothesis_settings(cls, case: Case, **overrides: Any) -> Callable[[F], F]:
        """``generated_settings`` for a generated test's ``case``: ``max_examples`` examples
        (None: the device profile's), drawn from a seed of the case id, so a report reproduces
        and the examples stay the same when the test's code changes (``derandomize`` alone
        hashes the test's source)."""
        hypothesis = pytest.importorskip("hypothesis")
        max_examples = cls.max_examples or cls.profile(case.device).max_examples
        settings = generated_settings(max_examples, shrink=cls.shrink_failures, **overrides)
        seed = hypothesis.seed(zlib.crc32(case.id.encode()))

        def apply(fn: F) -> F:
            applied: F = seed(settings(fn))
            return applied

        return apply

    @staticmethod
    def cuda_capture_only(cases: list[Case]) -> list[Case]:
        """``cases`` with every non-CUDA one skipped: CUDA-graph capture needs a CUDA device."""
        out = []
        for case in cases:
            if not case.device.startswith("cuda") and case.skip is None:
                skip = f"torch.cuda.CUDAGraph capture needs a CUDA device, not {case.device}"
                case = dataclasses.replace(case, skip=skip)
            out.append(case)
        return out

    # -- the backend under test ---------------------------------------------------------------
    @classmethod
    def backend_spec(cls, host: PluginHost | None = None) -> BackendSpec:
        """The spec under test; a registered name is looked up in ``host`` (default: a new one)."""
        if cls.backend is not None:
            if cls.factory is not None:
                raise TypeError(f"{cls.__name__}: set `backend` or `factory`, not both")
            return (host or PluginHost()).registry.get(cls.kind, cls.backend)
        if cls.factory is None or cls.capabilities is None:
            raise TypeError(
                f"{cls.__name__}: set `backend = '<registered name>'`, or both `factory` and "
                "`capabilities`"
            )
        # Read through the class: a plain function stored on it stays a plain function.
        check = cls.refusal_check
        return BackendSpec(
            kind=cls.kind,
            name=cls.backend_label(),
            factory=cls.factory,
            capabilities=cls.capabilities,
            plugin="<suite>",
            version="",
            check=check,
        )

    @classmethod
    def backend_label(cls) -> str:
        if cls.backend is not None:
            return cls.backend
        factory = cls.factory
        return factory if isinstance(factory, str) else getattr(factory, "__name__", "factory")

    @classmethod
    def declared(cls, kind: type[C]) -> C:
        """The capabilities of the backend under test (as collected), as the kind's record."""
        caps = cls.collection_spec().capabilities
        if not isinstance(caps, kind):
            raise TypeError(
                f"{cls.__name__}: capabilities {type(caps).__name__} are not {kind.__name__}"
            )
        return caps

    @classmethod
    def collection_spec(cls) -> BackendSpec:
        """The spec used to build the cases; looked up once per class at collection."""
        if cls not in _COLLECTION_SPECS:
            _COLLECTION_SPECS[cls] = cls.backend_spec()
        return _COLLECTION_SPECS[cls]

    @classmethod
    def tolerance(cls, device: str, dtype: torch.dtype) -> float:
        table = cls.cuda_tolerances if device.startswith("cuda") else cls.tolerances
        if dtype not in table:
            raise KeyError(f"{cls.__name__}: no tolerance for {dtype_name(dtype)} on {device}")
        return float(table[dtype])

    @classmethod
    def device_axis(cls, declared: Iterable[str]) -> list[str]:
        if cls.devices is not None:
            return list(cls.devices)
        return list(dict.fromkeys([*STANDARD_DEVICES, *sorted(declared)]))

    @classmethod
    def runnable(
        cls, spec: BackendSpec, device: str, requirements: Any, declared: str | None
    ) -> tuple[str | None, str | None]:
        """(skip reason, error) for one case: undeclared, device absent, or refused here.

        A refusal must explain itself: an empty reason is a capability-honesty failure.
        """
        if declared:
            return declared, None
        if not device_available(device):
            return "; ".join([f"no {device} device here", *spec.unusable_here()]), None
        reasons, broken = spec.assess(requirements)
        if broken:
            return (
                None,
                f"{spec.name}: {broken} (a check returns the reasons it refuses, [] where "
                "it serves)",
            )
        if reasons and not all(isinstance(r, str) and r.strip() for r in reasons):
            return None, f"{spec.name} refused {requirements} without a reason: {reasons!r}"
        return ("refused here: " + "; ".join(reasons) if reasons else None), None

    # -- parametrisation ----------------------------------------------------------------------
    @classmethod
    def suite_tests(cls) -> dict[str, Callable[..., Any]]:
        """Every case-parametrised test of this suite, by name."""
        out: dict[str, Callable[..., Any]] = {}
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("test") and hasattr(fn, "_execrt_cases"):
                out[name] = fn
        return out

    @classmethod
    def keep_case(cls, test_name: str, case: Case) -> bool:
        """Whether ``case`` of test ``test_name`` runs in this class (all do by default). A
        class for one variant of a backend overrides it to drop what the variant cannot
        change, which its base class already runs."""
        return True

    @classmethod
    def _cases_of(cls, test_name: str, generator: str) -> list[Case]:
        return [case for case in getattr(cls, generator)() if cls.keep_case(test_name, case)]

    @classmethod
    def collect_cases(cls) -> dict[str, list[Case]]:
        """Test name -> its cases, as pytest will parametrise them (no pytest needed)."""
        return {
            name: cls._cases_of(name, fn._execrt_cases)  # type: ignore[attr-defined]
            for name, fn in cls.suite_tests().items()
        }

    @classmethod
    def expected_failure(cls, test_id: str) -> str | None:
        """The reason of the first ``expected_failures`` key contained in ``test_id``."""
        for key, reason in cls.expected_failures.items():
            if key in test_id:
                return reason
        return None

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        generator = getattr(metafunc.function, "_execrt_cases", None)
        if generator is None or "case" not in metafunc.fixturenames:
            return
        cls = metafunc.cls
        assert cls is not None
        params = []
        for case in cls._cases_of(metafunc.function.__name__, generator):
            marks: list[Any] = []
            if case.skip:
                marks.append(pytest.mark.skip(reason=case.skip))
            else:
                reason = cls.expected_failure(f"{metafunc.function.__name__}[{case.id}]")
                if reason is not None:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
            params.append(pytest.param(case, id=case.id, marks=marks))
        metafunc.parametrize("case", params)

    # -- tests every suite has ----------------------------------------------------------------
    def test_expected_failures_name_real_tests(self) -> None:
        """Every ``expected_failures`` key matches some test id and gives a reason."""
        ids = [f"{name}[{c.id}]" for name, cs in type(self).collect_cases().items() for c in cs]
        problems = []
        for key, reason in type(self).expected_failures.items():
            if not isinstance(reason, str) or not reason.strip():
                problems.append(f"{key!r}: give a reason (and an issue URL)")
            if not any(key in test_id for test_id in ids):
                problems.append(f"{key!r} matches no test id (e.g. {ids[0] if ids else 'none'})")
        assert not problems, "expected_failures: " + "; ".join(problems)

    @staticmethod
    def begin(case: Case) -> None:
        """First line of every case-parametrised test: fail a case that carries an error."""
        if case.error:
            pytest.fail(case.error, pytrace=False)
