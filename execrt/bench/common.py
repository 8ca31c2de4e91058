"""Measuring helpers the benchmarks share: copy bandwidth, CUDA-event timing, the accuracy
check, ranking, the run's environment and saving results."""

from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import torch

from execrt.core.context import RuntimeContext
from execrt.core.errors import ExecrtError
from execrt.core.interfaces import (
    AttentionBackend,
    AttentionBackendInit,
    AttentionCapabilities,
    AttentionRequirements,
)
from execrt.core.memory import KVCache, ReqToTokenPool
from execrt.core.selection import ResolutionReport
from execrt.plugins.host import PluginHost

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

L2_BYTES = 60 << 20  # at least the L2 of the GPUs we measure (H100/H200: 50 MB)

#: ``||out - ref|| / ||ref||`` a benchmarked result may be off its fp32 (fp64) reference, per
#: dtype: the bar the conformance suites hold backends to on CUDA
#: (``ConformanceSuite.cuda_tolerances``). A result past it is wrong, not imprecise (bf16
#: kernels land near 2e-3; a wrong mask, scale or slot lands near 1).
TOLERANCES: Mapping[torch.dtype, float] = {
    torch.float32: 5e-3,  # TF32 dots where a kernel uses them
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}
#: ``Checked.check``'s values
PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"

R = TypeVar("R")
OptionsT = TypeVar("OptionsT", bound="DataclassInstance")


def copy_bandwidth_gbps(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = median_us(lambda: dst.copy_(src), 1, iters) / 1e6
    return 2 * nbytes / seconds / 1e9


def host_copy_gbps(nbytes: int = 64 << 20, iters: int = 5) -> float:
    """Host memory copy rate (read + write): the roofline's divisor on CPU runs."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(iters):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


class CopyRate(NamedTuple):
    """The device a run measures on and the copy rate its roofline divides by."""

    gpu: str  # the GPU's name, or the device type off CUDA
    gbps: float  # read + write


def measure_copy_rate(device: torch.device) -> CopyRate:
    """On CUDA the GPU's device-to-device copy rate, then its buffers freed (the allocator
    would keep the copy's 4 GiB and the next engine would size its KV pool smaller);
    elsewhere the host copy rate."""
    if device.type != "cuda":
        return CopyRate(device.type, host_copy_gbps())
    rate = CopyRate(torch.cuda.get_device_name(device), copy_bandwidth_gbps())
    release_memory()
    return rate


def median_us(launch: Callable[[], object], iters: int, reps: int) -> float:
    """Median over ``reps`` samples of the µs one ``launch()`` takes, each sample timing
    ``iters`` back-to-back launches between CUDA events."""
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            launch()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def graph_us(fn: Callable[[], object], replays: int, reps: int) -> float:
    """Median µs of one replay of a CUDA graph of ``fn`` (warmed up, compiled kernels and
    all, on a side stream before the capture): ``median_us`` of ``replays`` back-to-back
    replays, ``reps`` samples."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return median_us(graph.replay, replays, reps)


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def save_records(records: Sequence[Any], out_dir: str, stem: str) -> str:
    """Write dataclass records as a JSON list to ``out_dir/<stem>-<UTC stamp>.json`` (``-2``,
    ``-3``, ... after the stamp when a file of that second exists: never overwritten).
    ExecrtError naming ``--out`` when it cannot be written."""
    path = _claim(out_dir, stem)
    try:
        with open(path, "w") as fh:
            json.dump([asdict(r) for r in records], fh, indent=2)
    except OSError as exc:
        raise _not_saved(out_dir, f"the {stem} records", exc) from None
    return path


def _claim(out_dir: str, stem: str) -> str:
    """A new, empty ``out_dir/<stem>-<UTC stamp>[-n].json``, made here (never one that exists)."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    try:
        os.makedirs(out_dir, exist_ok=True)
        for n in range(1, 1000):
            path = os.path.join(out_dir, f"{stem}-{stamp}{'' if n == 1 else f'-{n}'}.json")
            try:
                with open(path, "x"):
                    return path
            except FileExistsError:
                continue
    except OSError as exc:
        raise _not_saved(out_dir, f"the {stem} records", exc) from None
    raise FileExistsError(f"{out_dir}: 999 {stem} records of {stamp} already")


class Checkpoint:
    """Where a run keeps its records so far: ``out_dir/<stem>-partial-<UTC stamp>.json``,
    rewritten whole (then renamed over the last copy) after each finished record, so that a
    run cut short (a time limit, a crash) keeps what it finished. ``report`` saves the final
    ``<stem>-<stamp>.json`` and removes it. Without ``out_dir`` nothing is written."""

    def __init__(self, out_dir: str | None, stem: str) -> None:
        self.out_dir, self.stem = out_dir, stem
        self.path: str | None = None  # made by the first save

    def save(self, records: Sequence[Any]) -> None:
        """Rewrite the partial file with ``records`` (every record so far, compared as the
        final file compares them); ExecrtError naming ``--out`` when it cannot be written."""
        if self.out_dir is None:
            return
        self.path = self.path or _claim(self.out_dir, f"{self.stem}-partial")
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as fh:
                json.dump([asdict(r) for r in records], fh, indent=2)
            os.replace(tmp, self.path)
        except OSError as exc:
            raise _not_saved(self.out_dir, f"the {self.stem} records so far", exc) from None

    def report(self, records: list[R], format_table: Callable[[Sequence[R]], str]) -> list[R]:
        """:func:`report` (print, save the final file), then the partial file removed."""
        report(records, format_table, self.out_dir, self.stem)
        if self.path is not None and os.path.exists(self.path):
            os.remove(self.path)  # the final file has every record
        return records


def prepare_out_dir(bench: str, out_dir: str | None) -> None:
    """Make ``out_dir`` and write (then remove) a file in it, before a run measures anything:
    a long run must not end without its records. ``out_dir_problem`` only looks at the path
    (root may write to /proc by its mode bits, yet /proc refuses a new entry); this tries it.
    ExecrtError naming ``--out`` and why; None saves nothing."""
    if out_dir is None:
        return
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise ExecrtError(
            f"bench {bench}: --out {out_dir!r}: cannot make it ({_why(exc, out_dir)})"
        ) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".execrt-probe-", dir=out_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ExecrtError(
            f"bench {bench}: --out {out_dir!r}: cannot write a file in it ({_why(exc, out_dir)})"
        ) from None


def _not_saved(out_dir: str, what: str, exc: OSError) -> ExecrtError:
    """A failed save said as the flag the user gave, not as a bare OSError (which the CLI would
    print without saying which option it is about); the table printed before has the numbers."""
    return ExecrtError(f"--out {out_dir!r}: {what} were not saved: {_why(exc, out_dir)}")


def _why(exc: OSError, out_dir: str) -> str:
    """Why ``out_dir`` could not be made or written in, in words (no errno, no class name)."""
    if isinstance(exc, FileExistsError) and exc.filename == out_dir:
        return "it exists and is not a directory"  # makedirs(exist_ok=True) of a file
    return (exc.strerror or str(exc)).lower()


def where_problems(device: str, out_dir: str | None) -> list[str]:
    """What is wrong with where a benchmark runs (``device``) and saves (``out_dir``)."""
    return [p for p in (device_problem(device), out_dir_problem(out_dir)) if p is not None]


def out_dir_problem(out_dir: str | None) -> str | None:
    """Why the results folder cannot be written, as far as its path tells (checked as the
    options are built, with no side effect; ``prepare_out_dir`` tries it before a run
    measures), or None (None: nothing is saved)."""
    if out_dir is None:
        return None
    existing = os.path.abspath(out_dir)
    while not os.path.exists(existing):  # not made yet (prepare_out_dir does): its ancestor
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"--out {out_dir!r}: cannot make it ({existing} is not a directory)"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write a file in it" if existing == os.path.abspath(out_dir) else "make it"
        return f"--out {out_dir!r}: cannot {what} ({existing} is not writable)"
    return None


def smoke_defaults(opts: OptionsT, smoke: Mapping[str, Any]) -> OptionsT:
    """``opts`` (a bench's frozen Options) for its ``--device cpu`` smoke run: every field of
    ``smoke`` that ``opts`` leaves at its default (the GPU run's) takes ``smoke``'s value; the
    fields set otherwise win. ``model`` and ``config`` are one choice, the shape: the smoke
    shape only where neither was set. Off CPU, ``opts`` itself. A field named in
    ``opts.typed`` (the CLI's flags that were typed) is kept even at its default: a value set
    to exactly its default cannot be told from one left out otherwise."""
    if getattr(opts, "device", None) != "cpu":
        return opts
    defaults = {f.name: f.default for f in dataclasses.fields(opts)}
    typed: frozenset[str] = getattr(opts, "typed", frozenset())
    unset = {k: v for k, v in smoke.items() if k not in typed and getattr(opts, k) == defaults[k]}
    if not {"model", "config"} <= unset.keys():  # a shape was chosen: keep it whole
        unset = {k: v for k, v in unset.items() if k not in ("model", "config")}
    return dataclasses.replace(opts, **unset)


def smoke_note(given: DataclassInstance, resolved: DataclassInstance) -> str:
    """The header line that says a run took smoke values (``smoke_defaults``), "" if none."""
    names = [f.name for f in dataclasses.fields(given)]
    changed = {n for n in names if getattr(given, n) != getattr(resolved, n)}
    if not changed:
        return ""
    shape = "config" in changed
    what = "shape" if changed == {"model", "config"} else "shape and sizes" if shape else "sizes"
    return (
        f"# the CPU smoke {what} where no flag set them: a check that the method runs, "
        "not a measurement"
    )


def require_cuda_unless_cpu(bench: str, device: torch.device) -> None:
    """Raise ExecrtError when ``device`` is CUDA and none is visible, pointing at the
    ``--device cpu`` smoke run the benchmarks that take ``--device`` offer."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExecrtError(f"bench {bench}: needs a CUDA device (none is visible; --device cpu?)")


def device_problem(device: str) -> str | None:
    """A device name a benchmark cannot run on, said as a sentence, or None."""
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda") or (kind == "cpu" and device != "cpu"):
        return f"device {device!r} unsupported (supported: cuda, cuda:N, cpu)"
    return None


class Checked(Protocol):
    """A record the accuracy check gates. ``check``: ``passed`` (within tolerance), ``failed``
    (a result past it: the note gives its error), ``error`` (the backend raised: the note gives
    the reason, the timing fields stay empty) or ``skipped`` (not run here: the note says why).
    Only ``passed`` records are ranked."""

    check: str
    note: str


CheckedT = TypeVar("CheckedT", bound=Checked)


def check_error(record: Checked, err: float, dtype: torch.dtype, label: str) -> bool:
    """Set ``record.check`` from ``err`` (norm-relative, against the reference) and ``dtype``'s
    tolerance (``TOLERANCES``; NaN and inf fail); a failure is added to the record's note with
    its error, and printed after ``label`` (the backend and shape). True when it passed."""
    tol = TOLERANCES[dtype]
    if err <= tol:  # False for NaN
        record.check = PASSED
        return True
    record.check = FAILED
    why = f"failed the check: rel err {err:.1e} > {tol:.0e} ({str(dtype).replace('torch.', '')})"
    record.note = f"{record.note}; {why}" if record.note else why
    print(f"  {label} {why}", flush=True)
    return False


class Refused(RuntimeError):
    """A backend that refuses what a benchmark asks of it (a KV dtype it does not declare, a
    package that is not installed): its reasons. Its record is skipped, not an error."""


def run_fields(
    gpu: str, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> dict[str, Any]:
    """The fields every record of an attention benchmark's run shares: the GPU, the date,
    the heads and dtype, and the run's environment (``environment.run_environment``)."""
    from execrt.bench.environment import run_environment

    return {
        "gpu": gpu,
        "date": utc_now(),
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": str(dtype).replace("torch.", ""),
        "env": run_environment(),
    }


def note_error(record: Checked, exc: BaseException, label: str) -> None:
    """A record whose backend raised: ``check`` error (skipped where it refused the problem,
    ``Refused``), the one-line reason as its note (its timing fields stay empty), and a line
    printed after ``label`` (the backend and shape)."""
    record.check = SKIPPED if isinstance(exc, Refused) else ERROR
    record.note = failure_note(exc)
    print(f"  {label} {record.check}: {record.note}", flush=True)


def passing(row: Iterable[CheckedT]) -> list[CheckedT]:
    """The records of ``row`` that passed the check: the only ones ranked."""
    return [r for r in row if r.check == PASSED]


def check_cell(record: Checked) -> str:
    """A table's check column: failures in capitals, so a wrong or broken peer stands out."""
    return record.check if record.check in (PASSED, SKIPPED) else record.check.upper()


def rank(
    row: Sequence[Any], metric: str, field: str = "vs_best_peer", against: float | None = None
) -> None:
    """Set each record's ``field`` to its ``metric`` over ``against`` (default: the best of
    the row, e.g. one shape's backends); 0 where there is nothing to compare with."""
    values = [getattr(r, metric) for r in row]
    base = max(values, default=0.0) if against is None else against
    for record, value in zip(row, values, strict=True):
        setattr(record, field, value / base if base else 0.0)


def release_memory() -> None:
    """Free what the last engine or buffer left: the objects, then the CUDA allocator's cache
    (which ``mem_get_info`` counts as used, so the next engine would size its KV pool smaller)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cell(value: float | None, width: int, fmt: str) -> str:
    """A table cell: ``value`` formatted and right-aligned, "-" when there is none."""
    return ("-" if value is None else format(value, fmt)).rjust(width)


def failure_note(exc: BaseException) -> str:
    """One line for a record that could not run: the exception's type and first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def chosen_backend(resolution: ResolutionReport, kind: str) -> str:
    """The name of the ``kind`` backend a run chose, "none" when it built none."""
    found = [r.chosen for r in resolution.resolutions if r.kind == kind]
    return (found[0] if found else None) or "none"


def report(
    records: list[R], format_table: Callable[[Sequence[R]], str], out_dir: str | None, stem: str
) -> list[R]:
    """The tail of every benchmark run: print the table, save the records as JSON in
    ``out_dir`` (when given; see :func:`save_records`), return them."""
    print(format_table(records))
    if out_dir:
        print(f"# saved {save_records(records, out_dir, stem)}")
    return records


def build_attention_backend(
    host: PluginHost,
    name: str,
    *,
    pool: ReqToTokenPool,
    kv_cache: KVCache,
    num_q_heads: int,
    max_batch_size: int,
    context: RuntimeContext,
    options: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """A registered attention backend over a benchmark's own pools (shapes from the cache),
    with its own ``options``; RuntimeError with the backend's reasons when it cannot serve
    them here. ``dtype`` is the model's (None: the cache's, which must then not be fp8)."""
    spec = host.registry.get("attention", name)
    d, hkv = kv_cache.head_dim, kv_cache.num_kv_heads
    dtype = dtype or kv_cache.dtype
    kv_dtype = None if kv_cache.dtype == dtype else kv_cache.dtype
    requirements = AttentionRequirements(
        kv_cache.device.type, dtype, d, num_q_heads, hkv, kv_dtype=kv_dtype
    )
    reasons = spec.refusals(requirements)
    if reasons:
        raise Refused("; ".join(reasons))
    init = AttentionBackendInit.over_cache(
        spec.narrowed(AttentionCapabilities).capabilities,
        kv_cache,
        pool,
        num_q_heads=num_q_heads,
        max_batch_size=max_batch_size,
        context=context,
        dtype=dtype,
        options=options,
    )
    backend: AttentionBackend = spec.create(init)
    return backend
