"""triton attention: split-KV paged decode and causal extend kernels, graph-ready metadata."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from execrt.core import envs
from execrt.core.batch import ForwardBatch
from execrt.core.config import TRITON_DECODE_FP8_KERNELS as DECODE_FP8_KERNELS
from execrt.core.config import TRITON_DECODE_MERGE as DECODE_MERGE
from execrt.core.config import TRITON_DECODE_ORDER as DECODE_ORDER
from execrt.core.config import TRITON_DECODE_PROGRAMS as DECODE_PROGRAMS
from execrt.core.config import TRITON_DECODE_PROLOGUE as DECODE_PROLOGUE
from execrt.core.config import TRITON_DECODE_WAVE as DECODE_WAVE
from execrt.core.config import TRITON_EXTEND_KERNELS as EXTEND_KERNELS
from execrt.core.errors import ConfigError
from execrt.core.interfaces import (
    KV,
    AttentionBackend,
    AttentionBackendInit,
    AttentionLayer,
    AttentionStep,
    QKPrologue,
)
from execrt.kernels.kv_indices import fill_kv_index, host_indptr

if TYPE_CHECKING:  # the kernels import triton: the backend imports them when built
    from execrt.kernels.attention import DecodePrologue, DecodeTiles, SplitPolicy


@dataclass
class TritonMetadata:
    """Per-step index data shared by every layer (device tensors unless noted)."""

    kv_indptr: torch.Tensor  # [B+1] int32, prefix sum of seq_lens
    kv_indices: torch.Tensor  # [>= sum(seq_lens)] int32 slot ids, request after request
    # decode
    num_splits: torch.Tensor | None = None  # [B] int32
    max_splits: int = 1  # host int: the most splits per request (partials' split dim)
    tiles: DecodeTiles | None = None  # stage-1 launch shape (host), from the tuned table
    partial_o: torch.Tensor | None = None  # [B, Hq, max_splits, Dv] fp32 scratch
    partial_lse: torch.Tensor | None = None  # [B, Hq, max_splits] fp32 scratch
    work: torch.Tensor | None = None  # [1 + B * max_splits] int32: (request, split) items
    arrivals: torch.Tensor | None = None  # [B * Hkv] int32 zeros: the merge inside stage 1
    # extend
    qo_indptr: torch.Tensor | None = None  # [B+1] int32 offsets of each request's new tokens
    prefix_lens: torch.Tensor | None = None  # [B] int32
    max_extend_len: int = 0  # host int
    max_kv_len: int = 0  # host int: longest context, sizes the extend schedule's L2 chunks


class TritonAttnBackend(AttentionBackend):
    """Paged attention in Triton over the slot cache (page size 1).

    Metadata is built on the device once per step: ``kv_indptr`` by a prefix sum of
    ``seq_lens`` and ``kv_indices`` by a kernel that copies ``req_to_token`` rows, so no K/V
    moves and no host loop runs. Decode splits each context adaptively (more splits for
    fewer, longer requests); extend attends causally over prefix plus new tokens, reading the
    new tokens' K/V from the step's own rows when ``attend`` is handed them. An fp8
    cache is read through the layer's scale row on the device (graph replays see it).

    Option ``decode_merge`` (config ``triton_decode_merge``): ``separate`` merges the splits
    in a launch of its own; ``fused`` merges them in the last stage-1 program of each request
    to finish (one launch per layer, and a one-split request writes its output directly);
    ``auto`` (the default) runs the merge the batch size's tuned tile entry names
    (``DecodeTiles.merge``), and otherwise fuses exactly the batches whose requests the split
    policy gives one split each unless they are longer than a split (``min_splits`` 1:
    enough requests to fill the GPU), where the H200 measured fused 5-9% faster, and keeps
    the separate merge below, where it measured fused 5-8% slower (docs/kernels.md); end to
    end on the H200 it was never slower than ``separate`` and 4-15% faster at bs 64-128.

    Option ``decode_split_target`` (config ``triton_decode_split_target``): the tokens per
    decode KV split (0: the kernels' ``SplitPolicy`` default; a batch too small to fill the
    GPU is still cut finer); shorter splits balance ragged batches, longer ones write fewer
    partials.

    Option ``decode_min_split`` (config ``triton_decode_min_split``): the shortest split in
    tokens (0: the batch size's tuned tile entry's ``min_split_len`` where it has one, else the
    policy's default, 128; at most the split target). A batch too small to fill
    the GPU is cut no finer than this: one split per request of up to this many tokens, so a
    one-split request under the ``fused`` merge needs no merge at all.

    Option ``decode_order`` (config ``triton_decode_order``): ``longest`` (the default) hands
    decode's programs the work list longest split first, so the shortest splits fill the end
    of a ragged batch; ``request`` keeps request order.

    Option ``decode_prologue`` (config ``triton_decode_prologue``): ``on`` runs a decode
    step's q/k norm, RoPE and K/V store inside the split launch (``fuses_qk_prologue``: one
    launch fewer per layer, the same values as the separate rotation kernel); ``off`` (the
    default: the H200 ran it slower) leaves them to the model. Needs ``Dv == D``.

    Option ``decode_programs`` (config ``triton_decode_programs``): ``request`` (the default)
    launches at least a program per request; ``sm`` launches one wave (two per SM over the kv
    heads), each program taking an equal share of the work list with its look-ahead (slower on
    the H200 at bs 1-128 of the 0.6B shape, so not the default).

    Option ``extend_kernel`` (config ``triton_extend_kernel``): ``auto`` (the default) runs
    the kernel this GPU's tuned table chose (:func:`execrt.kernels.attention.choose_kernel`);
    ``gather``, ``fresh`` or ``ws`` name one. A named kernel that cannot run with this
    device, cache and head dims is refused when the backend is built; ``fresh`` runs
    ``gather`` for a step whose K/V are not handed to ``attend``.

    Option ``decode_fp8_kernel`` (config ``triton_decode_fp8_kernel``), for an fp8 cache:
    ``auto`` (the default) runs ``EXECRT_FP8_DECODE_KERNEL``'s kernel, else the kernels'
    default (the mma kernel from 8 requests where it can run, else words); ``words`` the
    Triton split kernel; ``mma`` the Gluon kernel that converts K/V
    straight into the mma registers (:mod:`execrt.kernels.attention.decode_mma`), refused
    when the backend is built where it cannot run (it also leaves the decode prologue to
    the model: the prologue runs in the Triton kernel only).

    Option ``decode_wave`` (config ``triton_decode_wave``): ``auto`` (the default) cuts a
    decode batch's splits where its items come to a little more than one wave of the mma
    kernel's resident programs and one wave of fewer, longer splits is faster
    (``kernels.decode_wave``; e.g. 32 requests of 8k+ tokens on an H200: 5 splits -> 4);
    ``off`` leaves the split counts to the policy. Outputs agree to rounding (the splits
    differ, not the math).
    """

    def __init__(self, init: AttentionBackendInit) -> None:
        super().__init__(init)
        from execrt.kernels import attention as kernels

        self.kernels = kernels
        self.num_sms = (
            torch.cuda.get_device_properties(init.device).multi_processor_count
            if init.device.type == "cuda"
            else 4
        )
        self.split_policy = _split_policy(
            kernels,
            init.options.get("decode_split_target", 0),
            init.options.get("decode_min_split", 0),
        )
        self.min_split_set = bool(init.options.get("decode_min_split", 0))
        self._tiles_by_bs: dict[int, DecodeTiles] = {}
        self.max_context_len = init.max_context_len
        self.decode_merge = _choice(init.options, "decode_merge", "auto", DECODE_MERGE)
        self.decode_order = _choice(init.options, "decode_order", "longest", DECODE_ORDER)
        self.decode_prologue = (
            _choice(init.options, "decode_prologue", "off", DECODE_PROLOGUE) == "on"
            and init.head_dim == init.v_head_dim  # (the rotated q passes through the output)
        )
        self.decode_programs = _choice(init.options, "decode_programs", "request", DECODE_PROGRAMS)
        self.extend_kernel = _choice(init.options, "extend_kernel", "auto", EXTEND_KERNELS)
        if self.extend_kernel != "auto" and init.kv_cache.k_buffers:
            probe = torch.empty(0, 1, init.head_dim, dtype=init.dtype, device=init.device)
            why = kernels.extend_kernel_refusal(
                self.extend_kernel, probe, init.kv_cache.k_buffers[0],
                init.kv_cache.v_buffers[0], init.head_dim, init.v_head_dim,
            )  # fmt: skip
            if why is not None:
                raise ConfigError(
                    f"triton attention: extend_kernel {self.extend_kernel!r} cannot run here: "
                    f"{why}",
                    keys=[_key("extend_kernel")],
                )
        self.decode_fp8_kernel = _choice(
            init.options, "decode_fp8_kernel", "auto", DECODE_FP8_KERNELS
        )
        if self.decode_fp8_kernel == "mma" and init.kv_cache.k_buffers:
            from execrt.kernels.attention.decode_mma import mma_unsupported

            probe = torch.empty(0, init.num_q_heads, init.head_dim, dtype=init.dtype,
                                device=init.device)  # fmt: skip
            why = mma_unsupported(probe, init.kv_cache.k_buffers[0], init.kv_cache.v_buffers[0])
            if why is not None:
                raise ConfigError(
                    f"triton attention: decode_fp8_kernel 'mma' cannot run here: {why}",
                    keys=[_key("decode_fp8_kernel")],
                )
            self.decode_prologue = False
        self.decode_wave = _choice(init.options, "decode_wave", "auto", DECODE_WAVE)
        # q's shape for decode_wave (expanded to each batch: no allocation per step).
        self._q_probe = torch.empty(
            1, init.num_q_heads, init.head_dim, dtype=init.dtype, device=init.device
        )
        self._waves: dict[tuple[int, str | None], int] = {}
        self._graph: dict[str, torch.Tensor] | None = None

    # -- planning -------------------------------------------------------------------------------
    def plan(self, fb: ForwardBatch) -> TritonMetadata:
        b = fb.batch_size
        kv_indptr = torch.empty(b + 1, dtype=torch.int32, device=self.device)
        kv_indices = torch.empty(fb.seq_lens_sum, dtype=torch.int32, device=self.device)
        if fb.mode.is_decode():
            max_splits = self._max_splits(b, fb.max_seq_len)
            num_splits = torch.empty(b, dtype=torch.int32, device=self.device)
            work = torch.empty(
                self.kernels.work_size(b, max_splits), dtype=torch.int32, device=self.device
            )
            self._decode_metadata(fb, kv_indptr, kv_indices, num_splits, max_splits, work)
            return TritonMetadata(
                kv_indptr, kv_indices, num_splits, max_splits, self._tiles(b),
                *self._partials(b, max_splits), work=work, arrivals=self._arrivals(b),
            )  # fmt: skip
        fill_kv_index(
            self.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr,
            kv_indices,
        )  # fmt: skip
        qo = host_indptr(fb.extend_lens_cpu)
        return TritonMetadata(
            kv_indptr,
            kv_indices,
            qo_indptr=qo.to(self.device, non_blocking=True),
            prefix_lens=torch.tensor(fb.prefix_lens_cpu, dtype=torch.int32).to(
                self.device, non_blocking=True
            ),
            max_extend_len=fb.max_extend_len,
            max_kv_len=fb.max_seq_len,
        )

    def _max_splits(self, batch_size: int, max_seq_len: int) -> int:
        return self.split_policy.max_splits(
            batch_size, max_seq_len, self.num_kv_heads, self.num_sms
        )

    def _tiles(self, batch_size: int) -> DecodeTiles:
        """Stage-1 tiles for this cache dtype and batch size (a graph bucket captures them)."""
        tiles = self._tiles_by_bs.get(batch_size)
        if tiles is None:
            tiles = self._tiles_by_bs[batch_size] = self.kernels.decode_tiles(
                self.kv_cache.dtype, self.kv_cache.head_dim, batch_size, self.device
            )
        return tiles

    def _policy(self, batch_size: int) -> SplitPolicy:
        """The split policy of a ``batch_size`` decode batch: the backend's, with the shortest
        split its tuned tiles name (unless ``decode_min_split`` set one; never past the split
        target). Splits only get fewer than the backend's policy gives (``_max_splits``, which
        sizes the scratch, stays a bound)."""
        tuned = self._tiles(batch_size).min_split_len
        policy = self.split_policy
        if not tuned or self.min_split_set:
            return policy
        shortest = max(policy.min_split_len, min(tuned, policy.target_split_len))
        return replace(policy, min_split_len=shortest)

    def _decode_metadata(
        self,
        fb: ForwardBatch,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        num_splits: torch.Tensor,
        max_splits: int,
        work: torch.Tensor,
    ) -> None:
        """kv_indptr, kv_indices, the split counts and the work list in one launch."""
        fill = self._fill(fb.batch_size)
        self.kernels.decode_metadata(
            self.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr,
            kv_indices, num_splits, max_splits, self._policy(fb.batch_size), fill, work,
            longest_first=self.decode_order == "longest", wave=self._wave(fb.batch_size),
        )  # fmt: skip

    def _wave(self, batch_size: int) -> int:
        """``decode_metadata``'s wave for a decode batch (``kernels.decode_wave``: non-zero
        where the batch runs on the fp8 mma kernel, whose items past one wave of resident
        programs are cut into fewer splits when that is faster)."""
        if self.decode_wave == "off" or batch_size == 0 or not self.kv_cache.k_buffers:
            return 0
        # Once per batch size (plan_graph runs every step), and again if the variable that
        # names the fp8 kernel changes.
        key = (batch_size, os.environ.get(envs.FP8_DECODE_KERNEL))
        wave = self._waves.get(key)
        if wave is None:
            wave = self._waves[key] = self.kernels.decode_wave(
                self._q_probe.expand(batch_size, -1, -1),
                self.kv_cache.k_buffers[0],
                self.kv_cache.v_buffers[0],
                fp8_kernel=self._fp8_kernel_arg(),
                prologue=self.decode_prologue,
            )
        return wave

    def _fp8_kernel_arg(self) -> str | None:
        """``decode_attention``'s ``fp8_kernel`` for this backend (None: the kernels' choice)."""
        return None if self.decode_fp8_kernel == "auto" else self.decode_fp8_kernel

    def _partials(self, b: int, max_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (b, self.num_q_heads, max_splits)
        return (
            torch.empty((*shape, self.v_head_dim), dtype=torch.float32, device=self.device),
            torch.empty(shape, dtype=torch.float32, device=self.device),
        )

    def _fill(self, batch_size: int) -> int:
        """Splits every request of a ``batch_size`` decode batch gets to fill the GPU."""
        return self.split_policy.min_splits(batch_size, self.num_kv_heads, self.num_sms)

    def fuses_merge(self, batch_size: int) -> bool:
        """Whether decode steps of ``batch_size`` requests merge inside the split launch
        (``auto``: as the batch size's tuned tiles say, else where the batch needs no more
        splits than a request each to fill the GPU)."""
        if self.decode_merge == "auto":
            tuned = self._tiles(batch_size).merge
            return tuned == "fused" if tuned else self._fill(batch_size) == 1
        return self.decode_merge == "fused"

    def _arrivals(self, b: int) -> torch.Tensor | None:
        """Zeroed arrival counters for the fused merge (None: the separate merge). Every
        layer's launch leaves them zero again, so one set serves the whole step."""
        if not self.fuses_merge(b):
            return None
        return torch.zeros(b * self.num_kv_heads, dtype=torch.int32, device=self.device)

    # -- attending ------------------------------------------------------------------------------
    def fuses_qk_prologue(self, step: AttentionStep) -> bool:
        return self.decode_prologue and step.mode.is_decode()

    def attend_with_prologue(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: AttentionLayer,
        step: AttentionStep,
        prologue: QKPrologue,
    ) -> Tensor:
        if not self.fuses_qk_prologue(step):
            return super().attend_with_prologue(q, k, v, layer, step, prologue)
        p = prologue
        fused = self.kernels.DecodePrologue(
            k, v, p.positions, p.cos, p.sin, p.q_norm_weight, p.k_norm_weight, p.eps,
            step.out_cache_loc, p.hadamard,
        )  # fmt: skip
        return self._decode(q, layer, step, fused)

    def attend(
        self, q: Tensor, layer: AttentionLayer, step: AttentionStep, kv: KV = None
    ) -> Tensor:
        if step.mode.is_decode():
            return self._decode(q, layer, step)
        meta: TritonMetadata = step.meta
        k_buf, v_buf, scales, o = self._operands(q, layer)
        assert meta.qo_indptr is not None and meta.prefix_lens is not None
        # This step's K/V, when handed, feed the new tokens' part of the extend kernel from
        # their own consecutive rows (TMA on sm90) instead of gathers through the cache; the
        # kernel falls back to the cache where it cannot (fp8 cache, older GPU).
        fresh = kv is not None and kv[0].shape[0] == q.shape[0] and kv[0].dtype == q.dtype
        k_new, v_new = kv if fresh and kv is not None else (None, None)
        kernel = None if self.extend_kernel == "auto" else self.extend_kernel
        if kernel == "fresh" and k_new is None:
            kernel = "gather"
        self.kernels.extend_attention(
            q, k_buf, v_buf, o, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
            meta.prefix_lens, meta.max_extend_len, layer.scaling, kv_scales=scales,
            max_kv_len=meta.max_kv_len, k_new=k_new, v_new=v_new, kernel=kernel,
        )  # fmt: skip
        return o

    def _operands(
        self, q: Tensor, layer: AttentionLayer
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """The layer's K and V buffers, its scale row (an fp8 cache; k, v first) and a new
        output ``[T, Hq, Dv]``."""
        cache = self.kv_cache
        k_buf, v_buf = cache.k_buffers[layer.layer_id], cache.v_buffers[layer.layer_id]
        scales = cache.layer_scales[layer.layer_id] if cache.is_fp8 else None
        return k_buf, v_buf, scales, q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))

    def _decode(
        self,
        q: Tensor,
        layer: AttentionLayer,
        step: AttentionStep,
        prologue: DecodePrologue | None = None,
    ) -> Tensor:
        meta: TritonMetadata = step.meta
        assert meta.num_splits is not None and meta.partial_o is not None
        assert meta.partial_lse is not None and meta.tiles is not None
        assert meta.work is not None
        k_buf, v_buf, scales, o = self._operands(q, layer)
        t = meta.tiles
        self.kernels.decode_attention(
            q, k_buf, v_buf, o, meta.kv_indptr, meta.kv_indices, meta.num_splits,
            meta.partial_o, meta.partial_lse, layer.scaling, meta.max_splits,
            kv_scales=scales, block_n=t.block_n, num_warps=t.num_warps,
            num_stages=t.num_stages, work=meta.work, arrivals=meta.arrivals, prologue=prologue,
            programs=self.decode_programs,
            fp8_kernel=self._fp8_kernel_arg(),
        )  # fmt: skip
        return o

    # -- graphs ---------------------------------------------------------------------------------
    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static buffers for every decode bucket up to ``max_bs`` (fixed addresses)."""
        splits = self._max_splits(1, self.max_context_len)  # the most any bucket uses
        dev = self.device
        self._graph = {
            "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "kv_indices": torch.zeros(max_bs * self.max_context_len, dtype=torch.int32, device=dev),
            "num_splits": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "work": torch.zeros(
                self.kernels.work_size(max_bs, splits), dtype=torch.int32, device=dev
            ),
            "partial_o": torch.empty(
                (max_bs, self.num_q_heads, splits, self.v_head_dim), dtype=torch.float32, device=dev
            ),
            "partial_lse": torch.empty(
                (max_bs, self.num_q_heads, splits), dtype=torch.float32, device=dev
            ),
        }
        # Counters for the largest bucket wherever a bucket may fuse (under auto a tuned
        # entry can fuse a small bucket while the largest does not); a few KB.
        if self.decode_merge != "separate":
            self._graph["arrivals"] = torch.zeros(
                max_bs * self.num_kv_heads, dtype=torch.int32, device=dev
            )

    def plan_graph(self, fb: ForwardBatch) -> TritonMetadata:
        """Decode plan written into the static buffers: no allocation of them, no sync.

        The split counts' bound and stage 1's grid depend only on the bucket size and the
        static context limit, so what a bucket captured is what every replay of it uses.
        """
        g, b = self._graph, fb.batch_size
        max_bs = None if g is None else g["kv_indptr"].shape[0] - 1
        self.check_graph_batch("triton attention", max_bs, fb)
        assert g is not None
        kv_indptr = g["kv_indptr"][: b + 1]
        max_splits = min(self._max_splits(b, self.max_context_len), g["partial_lse"].shape[2])
        work = g["work"][: self.kernels.work_size(b, max_splits)]
        self._decode_metadata(fb, kv_indptr, g["kv_indices"], g["num_splits"], max_splits, work)
        return TritonMetadata(
            kv_indptr,
            g["kv_indices"],
            g["num_splits"][:b],
            max_splits,
            self._tiles(b),
            g["partial_o"][:b],
            g["partial_lse"][:b],
            work=work,
            arrivals=g["arrivals"][: b * self.num_kv_heads] if self.fuses_merge(b) else None,
        )

    def close(self) -> None:
        self._graph = None


def _choice(options: Mapping[str, object], name: str, default: str, accepted: Sequence[str]) -> str:
    """Option ``name`` (``default`` when absent), refused unless one of ``accepted``."""
    value = str(options.get(name, default))
    if value not in accepted:
        raise ConfigError(
            f"triton attention: {name} {value!r} unsupported (supported: {', '.join(accepted)})",
            keys=[_key(name)],
        )
    return value


def _key(option: str) -> str:
    """The RuntimeConfig key of this backend's ``option`` (``RuntimeConfig.backend_options``)."""
    return f"triton_{option}"


def _split_policy(kernels: ModuleType, target: object, min_split: object = 0) -> SplitPolicy:
    """The decode split policy with ``target`` tokens per split and splits of at least
    ``min_split`` tokens (0: the default policy's)."""
    for name, value in (("decode_split_target", target), ("decode_min_split", min_split)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(
                f"triton attention: {name} {value!r} unsupported "
                "(a token count >= 1, or 0 for the default)",
                keys=[_key(name)],
            )
    policy = kernels.SplitPolicy.with_target(target) if target else kernels.SplitPolicy()
    if not min_split:
        return policy
    if min_split > policy.target_split_len:
        raise ConfigError(
            f"triton attention: decode_min_split {min_split} unsupported (at most the split "
            f"target, {policy.target_split_len} tokens)",
            keys=[_key("decode_min_split")],
        )
    return replace(policy, min_split_len=min_split)
