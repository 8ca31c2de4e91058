"""The nccl.ep double against the real nccl-extensions 0.1.0 / nccl4py 0.6.0 it stands in for.

The real package imports on a CPU-only machine (libnccl_ep.so loads at the first native call,
none of which happens here), so CI compares the two: names, enum values, dataclass fields,
member kinds and signatures, and the Tensor descriptor's behaviour over the same torch tensors.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from enum import IntEnum
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.doubles.nccl_ep import DOUBLE_ONLY, FakeNccl

#: What execrt's nccl_ep backend uses of nccl.core.Communicator; both must have it.
COMMUNICATOR_USED = ("__init__", "init", "destroy", "ptr", "nranks", "rank", "device_api_support")


@dataclass(frozen=True)
class Real:
    ep: ModuleType
    core: ModuleType
    interop: ModuleType  # nccl.ep.interop.torch


@pytest.fixture(scope="module")
def real() -> Real:
    try:  # needs nccl-extensions, nccl4py and cuda-bindings (the test extra installs them)
        modules = [importlib.import_module(f"nccl.{m}") for m in ("ep", "core", "ep.interop.torch")]
    except Exception as exc:  # any import failure: not comparable here, say why
        pytest.skip(f"the real nccl.ep is not importable here ({type(exc).__name__}: {exc})")
    return Real(*modules)


@pytest.fixture
def fake() -> FakeNccl:
    return FakeNccl()


def params(fn: Any) -> list[tuple[str, Any, Any]]:
    """Names, kinds and defaults of a signature (annotations differ: the double's say Any)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def public_members(cls: type) -> set[str]:
    """Public names a class and its bases define (``__init__`` included), object's excepted."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is not object:
            names |= {n for n in vars(klass) if not n.startswith("_") or n == "__init__"}
    return names


def kind(cls: type, name: str) -> str:
    """function, property, classmethod or staticmethod."""
    return type(inspect.getattr_static(cls, name)).__name__


def module_names(mod: ModuleType) -> set[str]:
    return {n for n in vars(mod) if not n.startswith("_")}


def compare_members(name: str, double: type, real: type, members: set[str]) -> list[str]:
    problems = []
    for member in sorted(members):
        if not hasattr(real, member):
            problems.append(f"{name}.{member}: the real class has no such member")
            continue
        if not hasattr(double, member):
            problems.append(f"{name}.{member}: the double lacks it")
            continue
        if kind(double, member) != kind(real, member):
            problems.append(
                f"{name}.{member} is a {kind(double, member)} in the double, "
                f"a {kind(real, member)} in the real class"
            )
        elif kind(real, member) != "property":
            got, want = params(getattr(double, member)), params(getattr(real, member))
            if got != want:
                problems.append(f"{name}.{member}{got} != real {want}")
    return problems


# ---------------------------------------------------------------------------------------------
# nccl.ep
# ---------------------------------------------------------------------------------------------
def test_the_double_exports_exactly_the_real_public_names(real: Real, fake: FakeNccl) -> None:
    assert module_names(fake.ep) == set(real.ep.__all__)
    assert module_names(fake.interop) == set(real.interop.__all__)
    assert module_names(fake.core) <= set(real.core.__all__), "the double invents nccl.core names"


def test_enum_members_and_values_agree(real: Real, fake: FakeNccl) -> None:
    pairs = [(getattr(fake.ep, n), getattr(real.ep, n)) for n in real.ep.__all__]
    pairs.append((fake.core.NcclDataType, real.core.NcclDataType))
    enums = [(d, r) for d, r in pairs if isinstance(r, type) and issubclass(r, IntEnum)]
    assert len(enums) == 9
    for double, real_enum in enums:
        assert issubclass(double, IntEnum), double
        got = [(m.name, int(m)) for m in double]
        assert got == [(m.name, int(m)) for m in real_enum], real_enum.__name__


def _field_table(cls: type) -> list[tuple[Any, ...]]:
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
            if isinstance(default, IntEnum):
                default = (type(default).__name__, int(default))
        else:
            default = ("factory", type(f.default_factory()).__name__)  # type: ignore[misc]
        out.append((f.name, f.kw_only, str(f.type), default))
    return out


def test_dataclasses_agree_field_for_field_keyword_only_included(
    real: Real, fake: FakeNccl
) -> None:
    names = [n for n in real.ep.__all__ if dataclasses.is_dataclass(getattr(real.ep, n))]
    assert len(names) == 10
    for name in names:
        double, real_cls = getattr(fake.ep, name), getattr(real.ep, name)
        assert dataclasses.is_dataclass(double), name
        assert _field_table(double) == _field_table(real_cls), name
        assert repr(double.__dataclass_params__) == repr(real_cls.__dataclass_params__), name
        assert params(double) == params(real_cls), name


@pytest.mark.parametrize("name", ["Group", "Handle", "Tensor"])
def test_classes_have_the_real_members_and_only_listed_extras(
    real: Real, fake: FakeNccl, name: str
) -> None:
    double, real_cls = getattr(fake.ep, name), getattr(real.ep, name)
    extras = DOUBLE_ONLY.get(name, frozenset())
    assert not extras & public_members(real_cls), "a listed extra exists in the real class"
    assert extras <= public_members(double), "DOUBLE_ONLY lists a member the double lacks"
    assert public_members(double) - extras == public_members(real_cls)
    problems = compare_members(name, double, real_cls, public_members(real_cls))
    assert not problems, "\n".join(problems)


def test_live_objects_carry_no_public_attributes_beyond_the_real_ones(
    real: Real, fake: FakeNccl
) -> None:
    ep, core = fake.ep, fake.core
    comm = core.Communicator.init(1, 0, core.get_unique_id())
    config = ep.GroupConfig(num_experts=4, max_dispatch_tokens_per_rank=2, max_token_bytes=64)
    group = ep.Group.create(comm, config)
    ids = torch.zeros(2, 1, dtype=torch.int64)
    handle = group.create_handle(ep.Layout.EXPERT_MAJOR, ep.Tensor(ids), stream=0)
    for obj, name in ((group, "Group"), (handle, "Handle"), (ep.Tensor(ids), "Tensor")):
        attrs = {a for a in vars(obj) if not a.startswith("_")}
        allowed = public_members(getattr(real.ep, name)) | DOUBLE_ONLY.get(name, frozenset())
        assert attrs <= allowed, f"{name} instances have {attrs - allowed}"
    handle.destroy()
    group.destroy()


def _dtypes() -> list[torch.dtype]:
    out = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.int32, torch.uint8]
    out += [torch.int8, torch.float64, torch.bool]
    return out + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_tensor_descriptors_of_one_torch_tensor_agree(
    real: Real, fake: FakeNccl, dtype: torch.dtype
) -> None:
    buffer = torch.zeros(3, 4, dtype=torch.float32).to(dtype)
    got, want = fake.ep.Tensor(buffer), real.ep.Tensor(buffer)
    assert (got.sizes, got.ndim, got.data) == (want.sizes, want.ndim, want.data)
    assert got.buffer is buffer and want.buffer is buffer
    for value in (got.datatype, want.datatype):
        assert isinstance(value, IntEnum) and type(value).__name__ == "NcclDataType", value
    assert (got.datatype.name, int(got.datatype)) == (want.datatype.name, int(want.datatype))
    assert isinstance(got.ptr, int) and isinstance(want.ptr, int)


def test_tensor_refusals_agree(real: Real, fake: FakeNccl) -> None:
    for make in (fake.ep.Tensor, real.ep.Tensor):
        with pytest.raises(ValueError, match="at least one dimension"):
            make(torch.tensor(1.0))
        with pytest.raises(ValueError, match="only valid with a raw integer pointer"):
            make(torch.zeros(2), dtype=9)


def test_ctypes_prototypes_and_library_functions_agree(real: Real, fake: FakeNccl) -> None:
    for name in ("AllocFn", "FreeFn"):
        double, real_fn = getattr(fake.ep, name), getattr(real.ep, name)
        assert double._restype_ is real_fn._restype_, name
        assert double._argtypes_ == real_fn._argtypes_, name
    for name in ("get_lib_path", "get_lib_version"):
        assert params(getattr(fake.ep, name)) == params(getattr(real.ep, name)), name


def test_interop_comm_from_group_agrees(real: Real, fake: FakeNccl) -> None:
    got = params(fake.interop.get_nccl_comm_from_group)
    assert got == params(real.interop.get_nccl_comm_from_group)


# ---------------------------------------------------------------------------------------------
# nccl.core: what the backend and the double's interop use
# ---------------------------------------------------------------------------------------------
def test_communicator_surface(real: Real, fake: FakeNccl) -> None:
    double, real_cls = fake.core.Communicator, real.core.Communicator
    members = public_members(double) | set(COMMUNICATOR_USED)
    problems = compare_members("Communicator", double, real_cls, members)
    assert not problems, "\n".join(problems)


def test_unique_id_surface_and_size(real: Real, fake: FakeNccl) -> None:
    double, real_cls = fake.core.UniqueId, real.core.UniqueId
    problems = compare_members("UniqueId", double, real_cls, public_members(double))
    assert not problems, "\n".join(problems)
    assert {"from_bytes", "as_bytes"} <= public_members(double)
    for core in (fake.core, real.core):
        empty = core.get_unique_id(empty=True)
        assert empty.as_bytes == bytes(128)
        again = core.UniqueId.from_bytes(bytearray(empty.as_bytes))
        assert bytes(again) == empty.as_bytes


def test_core_functions_and_version_records(real: Real, fake: FakeNccl) -> None:
    for name in ("get_unique_id", "get_version"):
        assert params(getattr(fake.core, name)) == params(getattr(real.core, name)), name
    info = fake.core.get_version()
    assert [f.name for f in dataclasses.fields(info)] == [
        f.name for f in dataclasses.fields(real.core.VersionInfo)
    ]
    assert [f.name for f in dataclasses.fields(info.libnccl)] == [
        f.name for f in dataclasses.fields(real.core.LibraryInfo)
    ]
