"""The one torch/Triton switch of every kernel (model and attention): the interpreter check,
device and index checks, ``fail``, launch sizing and the PDL decision (lazy triton)."""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Literal, NoReturn

import torch

from execrt.core import envs
from execrt.core.errors import ConfigError

KernelMode = Literal["auto", "on", "off"]
KERNEL_MODES: tuple[KernelMode, ...] = ("auto", "on", "off")

# Triton's own switch for its CPU interpreter (not an execrt setting, hence not in core/envs).
# triton.jit reads it when a kernel is *defined*, so it must be set before a kernel module that
# imports triton is first imported; tests/conftest.py does that on machines without CUDA.
TRITON_INTERPRET = "TRITON_INTERPRET"

# What turns the interpreter on, as triton reads TRITON_INTERPRET: any case of these with
# triton >= 3.4 (``triton.knobs``, checked on 3.4, 3.6 and 3.9), exactly "1" before.
INTERPRETER_VALUES = ("1", "true", "on", "yes", "y")
INTERPRETER_HINT = (
    f"the Triton interpreter: set {TRITON_INTERPRET}=1 (triton >= 3.4 also reads "
    f"{', '.join(INTERPRETER_VALUES[1:])}, any case)"
)

# The interpreter runs programs one after another, so on CPU the launch heuristics should ask for
# as few (large) programs as they can: pretend there is one SM.
INTERPRETER_SM_COUNT = 1

#: Dtypes of the index tensors (slot ids, offsets, lengths) the kernels accept.
INDEX_DTYPES = (torch.int32, torch.int64)

_INSTALL_HINT = "pip install triton (it ships with the CUDA builds of torch)"


def fail(component: str, message: str) -> NoReturn:
    """Raise the ValueError every kernel uses for a bad argument: ``"<component>: <message>"``."""
    raise ValueError(f"{component}: {message}")


@functools.cache
def interpreter_enabled() -> bool:
    """Whether Triton kernels run under the CPU interpreter: ``TRITON_INTERPRET`` as the
    installed triton itself reads it (``triton.knobs``; before 3.4, ``== "1"``), and False
    without triton.

    Read once per process: triton.jit fixes the choice when a kernel module is imported, so
    a later change of the variable could not reach those kernels anyway. Every place that
    asks (the kernels switch, the device checks, PDL, the attention backend's registry
    check) asks here, so they all give one answer.
    """
    value = os.environ.get(TRITON_INTERPRET)
    if value is None or not triton_importable():
        return False
    try:
        from triton import knobs
    except ImportError:  # triton 3.2, 3.3: ``os.getenv("TRITON_INTERPRET", "0") == "1"``
        return value == "1"
    return bool(knobs.runtime.interpret)


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: CUDA, or CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())


def use_triton(device: torch.device | str, mode: KernelMode | str) -> bool:
    """Whether the fused ops should run their Triton kernels on ``device``.

    ``off``: never (torch references). ``auto``: on CUDA devices when triton imports, else
    torch (never the interpreter). ``on``: always; on a CPU device that needs the Triton
    interpreter (``interpreter_enabled``), elsewhere it raises. The answer is passed to each op
    explicitly (``rmsnorm(..., use_triton=...)``); nothing here is remembered.
    """
    if mode not in KERNEL_MODES:
        fail("kernels", f"mode {mode!r} unsupported (supported: {', '.join(KERNEL_MODES)})")
    dev = torch.device(device)
    if mode == "off":
        return False
    if mode == "auto":
        return dev.type == "cuda" and triton_importable()
    if not triton_importable():
        raise ImportError(
            f"kernels: mode 'on' needs triton, which is not installed ({_INSTALL_HINT})"
        )
    if runs_on(dev):
        return True
    # A setting this machine cannot run (fused_kernels = "on"): a ConfigError, raised before
    # the model's weights load (the loader asks this first).
    if dev.type == "cpu":
        raise ConfigError(
            f"kernels: mode 'on' on a CPU device needs {INTERPRETER_HINT}", keys=["fused_kernels"]
        )
    raise ConfigError(
        f"kernels: mode 'on' unsupported on device {dev} (supported: cuda, cpu with interpreter)",
        keys=["fused_kernels"],
    )


def import_triton() -> ModuleType:
    """``triton``, or an ImportError with the install hint (called by the triton_* modules)."""
    try:
        import triton
    except ImportError as exc:
        raise ImportError(f"kernels: the Triton kernels need triton ({_INSTALL_HINT})") from exc
    return triton


def next_power_of_2(n: int) -> int:
    """The host's ``triton.next_power_of_2``. Host code uses these two rather than Triton's:
    those are constexpr functions, ~3-5 µs a call on the host, and an eager prefill computes
    grids and tiles a dozen times per layer."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """The host's ``triton.cdiv`` (see ``next_power_of_2``): ``ceil(a / b)`` for ints."""
    return -(-a // b)


def pow2_at_least(n: int, minimum: int = 16) -> int:
    """A block size: the power of two covering ``n``, at least ``minimum`` (tl.dot's 16)."""
    return max(minimum, next_power_of_2(n))


def num_warps_for(block: int, elem_per_thread: int = 8) -> int:
    """Warps for a program streaming ``block`` elements: ~``elem_per_thread`` per thread.

    Eight 16-bit elements are one 16-byte vector load per thread. At most 8 warps (more only
    adds reduction traffic) unless a row would then need over 64 fp32 registers per thread.
    """
    cap = 8 if block <= 8 * 32 * 64 else 16
    return max(1, min(cap, block // (32 * elem_per_thread)))


# Kernel scratch per name, device and stream (split-K partials and counters, the mma decode's
# work queue). Launches on one stream never overlap (PDL waits for the grid ahead before any
# load or store; only prefetches come first), so one buffer serves every call on it; kernels
# on two streams may run at once, so each stream has its own. Zeroed buffers stay zero
# between launches (each launch resets what it counts). A buffer that grows is kept alive,
# not freed: CUDA graphs captured earlier still read it.
_SCRATCH: dict[tuple[str, torch.device, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def stream_scratch(
    name: str, device: torch.device, numel: int, dtype: torch.dtype, *, zeroed: bool, least: int
) -> torch.Tensor:
    """Scratch ``name`` of ``device``'s current stream: at least ``numel`` (and ``least``)
    elements of ``dtype``, zeros when first made if ``zeroed``."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (name, device, stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _OUTGROWN.append(buf)
        make = torch.zeros if zeroed else torch.empty
        buf = make(max(numel, least), dtype=dtype, device=device)
        _SCRATCH[key] = buf
    return buf


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (``INTERPRETER_SM_COUNT`` elsewhere)."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@functools.cache
def _triton_has_pdl() -> bool:
    """Whether this triton can launch with PDL (``launch_pdl``) and has the GDC builtins."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except Exception:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


#: Registers of an SM (sm70 onwards) and the shared memory each resident block reserves
#: beside its own (sm80 onwards).
REGS_PER_SM = 65536
SMEM_RESERVED = 1024


def programs_per_sm(
    registers: int,
    warps: int,
    shared: int,
    *,
    shared_per_sm: int,
    threads_per_sm: int,
    blocks_per_sm: int,
) -> int:
    """Programs of ``warps`` warps an SM holds at once at ``registers`` a thread (allocated
    per warp in units of 256) and ``shared`` bytes each: the least of what its registers,
    shared memory, threads and blocks allow (0 when one does not fit)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_smem = shared_per_sm // (shared + SMEM_RESERVED)
    return min(by_regs, by_smem, threads_per_sm // (32 * warps), blocks_per_sm)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device (cached per device index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index)


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for kernels on ``device``: CUDA sm90+, a triton that has
    it, not the interpreter, not disabled by ``EXECRT_DISABLE_PDL``.

    A PDL launch may start before the kernel ahead of it in the stream has finished, so its
    grid is resident when that one ends instead of being launched then (about a microsecond per
    kernel boundary: a decode step is a few hundred small kernels). Every kernel launched this
    way first waits for the grid ahead (``triton_pdl.pdl_prologue``), so no read or write moves
    before the dependency; CUDA graphs keep the programmatic edges.
    """
    if device.type != "cuda" or interpreter_enabled() or envs.flag(envs.DISABLE_PDL):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (9, 0) and _triton_has_pdl()


#: The kernels that prefetch ahead of their PDL wait (``pdl_prefetch``).
PREFETCHING_KERNELS = ("linear", "decode")


def pdl_prefetch(device: torch.device, kernel: str, rows: int | None = None) -> bool:
    """Whether ``kernel`` (one of ``PREFETCHING_KERNELS``) asks L2 for memory that the grid
    ahead does not write (weights; older K/V) before it waits for that grid
    (``triton_pdl.prefetch_l2``): with PDL, when ``EXECRT_PDL_PREFETCH`` is truthy (every
    kernel) or lists the kernel by name (comma-separated), and the launch has no more than
    ``EXECRT_PDL_PREFETCH_ROWS`` rows where that is set (``rows``: the GEMM's M, the decode
    batch). Off by default: on the H200 it saved 5% of the 0.6B step at bs 1 and cost 2-4%
    at bs 8-128 (docs/kernels.md)."""
    if kernel not in PREFETCHING_KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {PREFETCHING_KERNELS}")
    if not use_pdl(device):
        return False
    names = _prefetch_names()
    if not (names & envs.TRUE_WORDS or kernel in names):
        return False
    limit = prefetch_rows_limit()
    return limit is None or rows is None or rows <= limit


#: Where ``EXECRT_PDL_PRELOAD`` is unset, the skinny GEMM preloads its first weight tile
#: ahead of its PDL wait in launches of at most this many rows (``pdl_preload``). One H100,
#: 0.6B step, two A/B pairs: -1% at bs 1, +1.5% at bs 8 (docs/kernels.md).
PDL_PRELOAD_DEFAULT_ROWS = 1


def pdl_preload(device: torch.device, rows: int) -> bool:
    """Whether the skinny GEMM of ``rows`` rows loads its first weight tile into registers
    before it waits for the grid ahead (with PDL only): ``EXECRT_PDL_PRELOAD`` 1 or 0 for
    every launch, else up to ``PDL_PRELOAD_DEFAULT_ROWS`` rows. No kernel writes a weight, so
    the load may overlap the grid ahead; the first K step then runs from those registers, the
    arithmetic unchanged."""
    if not use_pdl(device):
        return False
    if not os.environ.get(envs.PDL_PRELOAD, "").strip():
        return rows <= PDL_PRELOAD_DEFAULT_ROWS
    return envs.flag(envs.PDL_PRELOAD)


def _prefetch_names() -> set[str]:
    """``EXECRT_PDL_PREFETCH`` as a set of lower-case words, checked."""
    value = os.environ.get(envs.PDL_PREFETCH, "")
    names = {n.strip().lower() for n in value.split(",") if n.strip()}
    unknown = names - set(PREFETCHING_KERNELS) - envs.TRUE_WORDS - envs.FALSE_WORDS
    if unknown:
        raise ConfigError(
            f"{envs.PDL_PREFETCH}={value!r}: {sorted(unknown)} unknown; accepted: 1 or 0, or "
            f"a comma-separated list of {', '.join(PREFETCHING_KERNELS)}"
        )
    return names


def check_kernel_switches() -> None:
    """ConfigError for the first ``envs.KERNEL_SWITCHES`` variable set to a value its kernel
    would refuse: checked when an engine starts, on any device, so that a typo is not
    silently ignored on a CPU machine and found only on a GPU (each is read again at launch)."""
    envs.flag(envs.DISABLE_PDL)
    _prefetch_names()
    prefetch_rows_limit()
    envs.flag(envs.PDL_PRELOAD)
    fp8_words_opaque()
    fp8_decode_kernel()
    merge_chunk(1)


def prefetch_rows_limit() -> int | None:
    """``EXECRT_PDL_PREFETCH_ROWS`` as a whole number >= 1, or None where it is unset."""
    value = os.environ.get(envs.PDL_PREFETCH_ROWS, "").strip()
    if not value:
        return None
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ConfigError(
            f"{envs.PDL_PREFETCH_ROWS}={value!r} unsupported; accepted: a whole number >= 1 "
            "(the most rows a prefetching launch may have), or unset (any)"
        )
    return limit


def fp8_words_opaque() -> bool:
    """Whether the fp8-words decode loop hides its joined K/V tiles from Triton's operand-width
    search (decode.py, ``_opaque``): only when ``EXECRT_FP8_WORDS_OPAQUE`` is truthy. Off by
    default: fewer instructions, but slower on the H200 (8B, 128 x 512: 8.205 against 8.038
    ms per step; docs/kernels.md). Read at each launch."""
    value = os.environ.get(envs.FP8_WORDS_OPAQUE, "").strip().lower()
    if value and value not in envs.TRUE_WORDS | envs.FALSE_WORDS:
        raise ConfigError(
            f"{envs.FP8_WORDS_OPAQUE}={value!r} unsupported; accepted: 1 or 0 (true/false, "
            "yes/no, on/off)"
        )
    return value in envs.TRUE_WORDS


#: How a decode merge takes the splits (``decode._merge_group``) unless
#: ``EXECRT_DECODE_MERGE_CHUNK`` says otherwise: 0, two passes (every split's log-sum-exp and
#: their maximum first); N >= 1, one pass with a running maximum, loading N splits at a time.
#: 8 since session 27: Qwen3-0.6B bs 1 x 512, graphs, 0.807-0.917 against 0.826-0.944 ms a
#: step on an H200 and an H100, bs 8 unchanged (docs/kernels.md).
DEFAULT_MERGE_CHUNK = 8
MERGE_CHUNKS = (0, 1, 2, 4, 8, 16)
_MERGE_CHUNK_VALUES = frozenset(map(str, MERGE_CHUNKS))


def merge_chunk(max_splits: int) -> int:
    """The decode merge's ``CHUNK`` for launches of up to ``max_splits`` splits:
    ``EXECRT_DECODE_MERGE_CHUNK`` (0, 1, 2, 4, 8 or 16), else ``DEFAULT_MERGE_CHUNK``; a
    one-pass chunk is cut to the splits there can be. Read at each launch."""
    value = os.environ.get(envs.DECODE_MERGE_CHUNK, "").strip()
    if value and value not in _MERGE_CHUNK_VALUES:
        raise ConfigError(
            f"{envs.DECODE_MERGE_CHUNK}={value!r} unsupported; accepted: "
            f"{', '.join(map(str, MERGE_CHUNKS))}, or unset ({DEFAULT_MERGE_CHUNK})"
        )
    chunk = int(value) if value else DEFAULT_MERGE_CHUNK
    return min(chunk, next_power_of_2(max(1, max_splits)))


#: The kernels that can read an fp8 cache at decode (``decode_attention(fp8_kernel=...)``),
#: and ``auto``: the mma kernel from ``decode_mma.MMA_MIN_BATCH`` requests where it can run,
#: else the words kernel.
FP8_DECODE_KERNELS = ("auto", "words", "mma")
#: What runs when neither the call nor ``EXECRT_FP8_DECODE_KERNEL`` names one.
DEFAULT_FP8_DECODE_KERNEL = "auto"


def fp8_decode_kernel() -> str:
    """The fp8 decode kernel ``EXECRT_FP8_DECODE_KERNEL`` names, or the default. Read at each
    launch."""
    value = os.environ.get(envs.FP8_DECODE_KERNEL, "").strip().lower()
    if not value:
        return DEFAULT_FP8_DECODE_KERNEL
    if value not in FP8_DECODE_KERNELS:
        raise ConfigError(
            f"{envs.FP8_DECODE_KERNEL}={value!r} unsupported; accepted: "
            + ", ".join(FP8_DECODE_KERNELS)
        )
    return value


def pdl_kwargs(device: torch.device) -> dict[str, bool]:
    """Launch keywords of a kernel with a ``PDL: tl.constexpr`` parameter (see ``use_pdl``)."""
    return {"PDL": True, "launch_pdl": True} if use_pdl(device) else {"PDL": False}


#: How tuned tables name a dtype in their file names.
DTYPE_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",  # the decode tile tables are keyed by the KV dtype
    torch.float8_e5m2: "float8_e5m2",
}


def tuned_table_name(device_name: str, dtype: torch.dtype, keys: str = "") -> str:
    """File name of a per-GPU tuned table, vLLM's scheme:
    ``[keys,]device_name=NVIDIA_H200,dtype=bfloat16.json`` (e.g. keys ``E=128,N=768``)."""
    dev = device_name.replace(" ", "_")
    name = f"device_name={dev},dtype={DTYPE_NAMES.get(dtype, dtype)}.json"
    return f"{keys},{name}" if keys else name


def check_float(component: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        fail(component, f"{name} dtype {t.dtype} unsupported (supported: fp16, bf16, fp32)")


def check_device(component: str, name: str, t: torch.Tensor) -> None:
    """The kernels run on CUDA tensors, and on CPU ones only under the Triton interpreter
    (elsewhere Triton fails with an error about its drivers that names neither)."""
    if runs_on(t.device):
        return
    fail(
        component,
        f"{name} is on {t.device}, unsupported by the Triton kernels (supported: cuda, or cpu "
        f"with {INTERPRETER_HINT}; use_triton() picks)",
    )


def check_same_device(component: str, ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            fail(component, f"{name} is on {t.device}, expected {ref.device} (one device for all)")


def check_last_dim_contiguous(component: str, **tensors: torch.Tensor | None) -> None:
    # Kernels vectorise along the last dim; every other stride is passed to them (tensors may
    # be slices of a larger static buffer).
    for name, t in tensors.items():
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            fail(
                component, f"{name} must be contiguous in its last dim, strides {tuple(t.stride())}"
            )


def check_index(
    component: str,
    name: str,
    t: torch.Tensor,
    min_len: int,
    dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES,
) -> None:
    """A 1-D, contiguous index tensor of an accepted dtype with at least ``min_len`` entries."""
    if t.dim() != 1:
        fail(component, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        accepted = ", ".join(map(str, dtypes))
        fail(component, f"{name} dtype {t.dtype} unsupported (supported: {accepted})")
    if t.shape[0] < min_len:
        fail(component, f"{name} has {t.shape[0]} entries, need at least {min_len}")
    if t.shape[0] > 0 and t.stride(0) != 1:
        fail(component, f"{name} must be contiguous, got stride {t.stride(0)}")


def check_index_build(
    component: str,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    **others: torch.Tensor,
) -> int:
    """The inputs of a per-step ``kv_indptr`` / ``kv_indices`` build, all on ``req_to_token``'s
    device (``others`` too); returns the batch size."""
    if req_to_token.dim() != 2 or req_to_token.dtype not in INDEX_DTYPES:
        shape = tuple(req_to_token.shape)
        fail(
            component,
            f"req_to_token must be a 2-D int32/int64 table, got {req_to_token.dtype} {shape}",
        )
    check_last_dim_contiguous(component, req_to_token=req_to_token)
    batch = req_pool_indices.shape[0] if req_pool_indices.dim() == 1 else -1
    check_index(component, "req_pool_indices", req_pool_indices, 0)
    check_index(component, "seq_lens", seq_lens, batch)
    if seq_lens.shape[0] != batch:
        fail(
            component, f"seq_lens has {seq_lens.shape[0]} entries but req_pool_indices has {batch}"
        )
    check_index(component, "kv_indptr", kv_indptr, batch + 1)
    check_index(component, "kv_indices", kv_indices, 0)
    check_same_device(
        component,
        req_to_token,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        **others,
    )
    return batch
