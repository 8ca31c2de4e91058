"""RuntimeConfig: the frozen run configuration, built once from TOML file < env EXECRT_* < CLI."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from execrt.core import envs
from execrt.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DTYPES = ("auto", "float32", "float16", "bfloat16")
FUSED_KERNELS = ("auto", "on", "off")  # auto: the Triton kernels on CUDA, torch elsewhere
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # auto: the model's dtype
KV_CACHE_ROTATIONS = ("auto", "none", "hadamard")  # auto: hadamard for an fp8 cache
FLASHINFER_PREFILL = ("auto", "fa2", "fa3")  # auto: FA3 where it runs (sm90), else FA2
#: the triton backend's decode merge: a launch of its own, or inside stage 1 (last split)
TRITON_DECODE_MERGE = ("separate", "fused", "auto")
#: the order of the triton backend's decode work: longest split first, or request after request
TRITON_DECODE_ORDER = ("longest", "request")
#: the triton backend's decode q/k norm, RoPE and K/V store: inside the split launch, or not
TRITON_DECODE_PROLOGUE = ("off", "on")
#: the triton backend's decode split grid: a program per request at least, or one wave
TRITON_DECODE_PROGRAMS = ("request", "sm")
#: the triton backend's extend kernel: the tuned choice, or one kernel by name
TRITON_EXTEND_KERNELS = ("auto", "gather", "fresh", "ws")
#: the triton backend's fp8 decode kernel: the default (EXECRT_FP8_DECODE_KERNEL, else the
#: kernels'), the Triton split kernel, or the Gluon kernel that converts into mma registers
TRITON_DECODE_FP8_KERNELS = ("auto", "words", "mma")
#: the triton backend's decode splits past one wave of the fp8 mma kernel's programs: cut to
#: fit one wave where that is faster, or left to the split policy
TRITON_DECODE_WAVE = ("auto", "off")
#: The bound on one serving step where ``step_timeout_s`` is 0 (auto), by device type. A GPU
#: step takes milliseconds; five minutes leave room for a first step that compiles and tunes
#: kernels. No bound on CPU: one prefill chunk of a large model there may take minutes.
AUTO_STEP_TIMEOUT_S = {"cuda": 300.0}
# Field type (as written in the annotation) -> (accepted Python types, how errors name them).
# bool is an int subclass: it is accepted only where listed explicitly.
_ACCEPTED_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "str": ((str,), "str"),
    "str | None": ((str, type(None)), "str, a path or None"),
    "bool": ((bool,), "bool"),
    "int": ((int,), "int"),
    "float": ((float, int), "float or int"),
}
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything that decides how a model is executed. Immutable; validated on construction.

    Backend fields take a registered backend name or ``"auto"``; ``graph_backend`` and
    ``prefix_cache`` also take ``"none"`` (no graphs; no prefix cache, every prompt prefilled
    in full). ``prefix_cache_force_miss`` keeps the cache's code path but reports no match, to
    measure its overhead. ``kv_cache_dtype`` stores K/V in the model's dtype (``auto``) or in
    fp8 (``fp8_e4m3``, ``fp8_e5m2``: twice the tokens in the same memory);
    ``kv_cache_rotation`` ``hadamard`` rotates each head's q and k by one orthogonal matrix
    after RoPE (q.k unchanged, K's outlier channels spread before rounding: 40% less fp8
    error), ``auto`` does so for an fp8 cache only. ``strict`` turns
    any automatic fallback into an error. ``cuda_graph_sampling`` lets a decode graph run
    the sampler too when the model brings a capturable one (its ``sample_fn``): a replay then
    yields the token ids; without one, sampling runs after the replay either way.

    Sizes of 0 are "auto": chosen for the device by ``core.assembly`` (e.g. running requests
    and the KV pool from GPU memory, small fixed sizes on CPU). A key ``<backend>_<option>``
    (``flashinfer_prefill_backend``) reaches only that backend, as ``options[<option>]``.
    """

    model: str | None = None
    attention_backend: str = "auto"
    moe_dispatcher: str = "auto"
    graph_backend: str = "auto"
    prefix_cache: str = "radix"
    prefix_cache_force_miss: bool = False
    flashinfer_prefill_backend: str = "auto"
    triton_decode_merge: str = "auto"
    triton_decode_split_target: int = 0  # tokens per decode KV split; 0 = the kernel's default
    triton_decode_min_split: int = 0  # shortest decode KV split in tokens; 0 = the kernel's default
    triton_decode_order: str = "longest"
    triton_decode_prologue: str = "off"
    triton_decode_programs: str = "request"
    triton_extend_kernel: str = "auto"
    triton_decode_fp8_kernel: str = "auto"
    triton_decode_wave: str = "auto"
    strict: bool = False
    device: str = "auto"
    dtype: str = "auto"
    max_running_requests: int = 0
    kv_cache_tokens: int = 0
    kv_cache_memory_fraction: float = 0.0
    kv_cache_dtype: str = "auto"
    kv_cache_rotation: str = "auto"
    context_len: int = 0
    max_prefill_tokens: int = 0
    seed: int = 0
    cuda_graph_max_bs: int = 0
    cuda_graph_bs: str = ""
    cuda_graph_sampling: bool = True
    overlap_schedule: bool = True
    gc_freeze: bool = True
    fused_kernels: str = "auto"
    tp_size: int = 1  # tensor-parallel ranks: 1, or the world size under torchrun
    ep_size: int = 0  # expert-parallel ranks of a MoE model: 0 = tp_size, 1 = replicated
    step_timeout_s: float = 0.0  # a serving step past it fails /health; 0 = auto, inf = none

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("attention_backend", "moe_dispatcher", "graph_backend", "prefix_cache"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                keywords = (
                    "'auto' or 'none'" if name in ("graph_backend", "prefix_cache") else "'auto'"
                )
                raise ConfigError(
                    f"config: {name} must be a backend name, {keywords}, got {value!r}",
                    keys=[name],
                )
        if not _DEVICE_RE.match(self.device):
            raise ConfigError(
                f"config: device {self.device!r} unsupported (supported: auto, cpu, cuda, cuda:N)",
                keys=["device"],
            )
        if self.tp_size < 1:
            raise ConfigError(f"config: tp_size must be >= 1, got {self.tp_size}", keys=["tp_size"])
        auto_sizes = ("max_running_requests", "max_prefill_tokens", "kv_cache_tokens")
        for name in (
            *auto_sizes, "context_len", "cuda_graph_max_bs", "ep_size",
            "triton_decode_split_target", "triton_decode_min_split",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"config: {name} must be >= 0 (0 = auto), got {getattr(self, name)}",
                    keys=[name],
                )
        if self.context_len == 1:  # a request needs a prompt token and room for one more
            raise ConfigError(
                "config: context_len 1 leaves no room for a token after the prompt "
                "(accepted: 0 = the model's, or at least 2)",
                keys=["context_len"],
            )
        if not self.step_timeout_s >= 0:  # NaN too
            raise ConfigError(
                f"config: step_timeout_s must be >= 0 (seconds; 0 = auto: "
                f"{_auto_step_timeouts()}; inf = no bound), got {self.step_timeout_s}",
                keys=["step_timeout_s"],
            )
        if self.seed < 0:  # 0 is a seed like any other
            raise ConfigError(f"config: seed must be >= 0, got {self.seed}", keys=["seed"])
        if not 0.0 <= self.kv_cache_memory_fraction <= 0.95:
            raise ConfigError(
                "config: kv_cache_memory_fraction must be in [0, 0.95] (0 = auto), "
                f"got {self.kv_cache_memory_fraction}",
                keys=["kv_cache_memory_fraction"],
            )
        choices = {
            "dtype": DTYPES,
            "kv_cache_dtype": KV_CACHE_DTYPES,
            "kv_cache_rotation": KV_CACHE_ROTATIONS,
            "flashinfer_prefill_backend": FLASHINFER_PREFILL,
            "triton_decode_merge": TRITON_DECODE_MERGE,
            "triton_decode_order": TRITON_DECODE_ORDER,
            "triton_decode_prologue": TRITON_DECODE_PROLOGUE,
            "triton_decode_programs": TRITON_DECODE_PROGRAMS,
            "triton_extend_kernel": TRITON_EXTEND_KERNELS,
            "triton_decode_fp8_kernel": TRITON_DECODE_FP8_KERNELS,
            "triton_decode_wave": TRITON_DECODE_WAVE,
            "fused_kernels": FUSED_KERNELS,
        }
        for name, accepted in choices.items():
            if getattr(self, name) not in accepted:
                raise ConfigError(
                    f"config: {name} {getattr(self, name)!r} unsupported "
                    f"(supported: {', '.join(accepted)})",
                    keys=[name],
                )
        self.graph_batch_sizes()  # validates cuda_graph_bs

    def graph_batch_sizes(self) -> tuple[int, ...]:
        """``cuda_graph_bs`` ("1,2,4,8") as integers; empty means the default list."""
        try:
            sizes = tuple(int(p) for p in self.cuda_graph_bs.split(",") if p.strip())
        except (AttributeError, ValueError):
            sizes = (0,)
        if any(b < 1 for b in sizes):
            raise ConfigError(
                f"config: cuda_graph_bs {self.cuda_graph_bs!r} must be comma-separated "
                "integers >= 1, e.g. '1,2,4,8'",
                keys=["cuda_graph_bs"],
            )
        return sizes

    def step_timeout(self, device_type: str) -> float | None:
        """The bound in seconds on one serving step on a ``device_type`` device (``cuda``,
        ``cpu``), or None for none: ``step_timeout_s``, or where that is 0 (auto)
        ``AUTO_STEP_TIMEOUT_S``'s for the device (none on CPU); ``inf`` is none."""
        bound = self.step_timeout_s or AUTO_STEP_TIMEOUT_S.get(device_type, math.inf)
        return None if math.isinf(bound) else bound

    def _check_types(self) -> None:
        # Values from TOML, replace() and Engine(**kw) arrive as Python objects, unlike the
        # environment's strings: check them here so every source fails the same way.
        for f in fields(self):
            value: Any = getattr(self, f.name)
            if f.name == "model" and isinstance(value, os.PathLike):
                value = os.fspath(value)
                object.__setattr__(self, "model", value)
            accepted = _ACCEPTED_TYPES[str(f.type)]
            if not isinstance(value, accepted[0]) or (
                isinstance(value, bool) and bool not in accepted[0]
            ):
                raise ConfigError(
                    f"config: {f.name}={value!r} has type {type(value).__name__} "
                    f"(accepted: {accepted[1]})",
                    keys=[f.name],
                )
            if str(f.type) == "float":
                object.__setattr__(self, f.name, float(getattr(self, f.name)))

    def backend_options(self, name: str) -> dict[str, Any]:
        """The settings of backend ``name``: keys ``<name>_<option>`` as ``{option: value}``."""
        prefix = f"{name}_"
        return {
            f.name[len(prefix) :]: getattr(self, f.name)
            for f in fields(self)
            if f.name.startswith(prefix)
        }

    def replace(self, **changes: Any) -> RuntimeConfig:
        """A new config with ``changes`` applied (validated like any other)."""
        _check_keys(changes, "replace")
        return dataclasses.replace(self, **changes)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], source: str) -> None:
        """Raise ConfigError naming ``source`` (where the keys came from) for unknown keys."""
        _check_keys(values, source)

    @classmethod
    def load(
        cls,
        file: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        cli: Mapping[str, Any] | None = None,
    ) -> RuntimeConfig:
        """Merge the sources, later winning: TOML ``file`` < ``EXECRT_*`` env < ``cli``.

        ``cli`` entries whose value is None are ignored (flags the user did not give).
        Raises ConfigError for unknown keys, unparsable values and invalid settings.
        """
        merged: dict[str, Any] = {}
        if file is not None:
            merged.update(_read_toml(file))
        env = _coerce_environment(envs.config_overrides(environ))
        for key, value in env.items():  # each value named by its variable
            merged.update(_validated({key: value}, _env_source(key)))
        if cli:
            given = {k: v for k, v in cli.items() if v is not None}
            _check_keys(given, "command line")
            merged.update(given)
        return cls(**merged)


def _auto_step_timeouts() -> str:
    shown = [f"{seconds:g} s on {kind.upper()}" for kind, seconds in AUTO_STEP_TIMEOUT_S.items()]
    return ", ".join([*shown, "none elsewhere"])


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    known = set(RuntimeConfig.keys())
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"config ({source}): unknown key(s) {', '.join(unknown)} "
            f"(accepted: {', '.join(RuntimeConfig.keys())})"
        )


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        # Editors on Windows save UTF-8 with a byte-order mark, which TOML does not allow.
        data = tomllib.loads(raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config: file {os.fspath(path)!r} not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config: file {os.fspath(path)!r} is not valid TOML: {exc}") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ConfigError(
            f"config: file {os.fspath(path)!r} cannot be read: {exc.strerror or exc}"
        ) from None
    # Accept both a flat file and one whose settings sit under an [execrt] table.
    if isinstance(data.get("execrt"), dict):
        data = data["execrt"]
    source = f"file {os.fspath(path)}"
    _check_keys(data, source)
    return _validated(data, source)


def _validated(values: dict[str, Any], source: str) -> dict[str, Any]:
    """``values`` after checking them alone (each check is per key, the defaults pass), so a
    bad value is reported with the source it came from."""
    try:
        RuntimeConfig(**values)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("config: ", f"config ({source}): ", 1)) from None
    return values


def _env_source(key: str) -> str:
    return f"environment {envs.CONFIG_PREFIX}{key.upper()}"


def _coerce_environment(raw: Mapping[str, str]) -> dict[str, Any]:
    """``EXECRT_*`` strings as typed values; an error names the variable."""
    _check_keys(raw, "environment")
    types = {f.name: f.type for f in fields(RuntimeConfig)}
    return {
        key: _coerce(key, value, str(types[key]), _env_source(key)) for key, value in raw.items()
    }


def _coerce(key: str, value: str, type_name: str, source: str) -> Any:
    text = value.strip()
    try:
        if type_name == "bool":
            lowered = text.lower()
            if lowered in envs.TRUE_WORDS:
                return True
            if lowered in envs.FALSE_WORDS:
                return False
            raise ValueError
        if type_name == "int":
            return int(text)
        if type_name == "float":
            return float(text)
    except ValueError:
        raise ConfigError(
            f"config ({source}): {key}={value!r} is not a valid {type_name}"
        ) from None
    if type_name.startswith("str") and text.lower() in {"", "none"} and "None" in type_name:
        return None
    return text
