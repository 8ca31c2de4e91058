"""flashinfer attention: FlashInfer's paged decode and prefill wrappers over the slot cache."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from execrt.backends.attention.flashinfer_prefill import device_prefill_variant, jit_cache_dir
from execrt.core.batch import ForwardBatch, ForwardMode
from execrt.core.interfaces import (
    KV,
    AttentionBackend,
    AttentionBackendInit,
    AttentionLayer,
    AttentionStep,
)
from execrt.kernels.kv_indices import fill_kv_index, host_indptr

WORKSPACE = "flashinfer_workspace"
# FlashInfer plans its split-KV scratch into this buffer; 128 MiB overflowed on the H200 for
# a 32-query-head prefill at batch 1 ("batch_prefill_tmp_s ... Increase the workspace").
WORKSPACE_BYTES = 512 << 20
OWNER = "flashinfer_attention"
SLOW_WARM_UP_S = 5.0  # a warm-up this long (a JIT compile) reports its time
progress = logging.getLogger("execrt.progress")


@dataclass
class FlashInferMetadata:
    """Which planned wrapper this step runs; the plan itself lives inside the wrapper."""

    # A planned BatchDecode... or BatchPrefillWithPagedKVCacheWrapper. In graph mode it was
    # built on our static buffers and re-plans into them; host fields that change per plan
    # (max_kv_len) feed only FlashInfer's trtllm/cudnn paths, never the fa2 kernels we use.
    wrapper: Any = field(metadata={"graph_opaque": "FlashInfer wrapper, re-planned in place"})
    kv_indices: torch.Tensor | None = None  # int32 slot ids (kept alive for the wrapper)


class FlashInferAttnBackend(AttentionBackend):
    """Decode through ``BatchDecodeWithPagedKVCacheWrapper``, extend through the paged prefill
    wrapper (causal), both over page size 1: a KV "page" is one slot of our cache.

    ``plan()`` runs once per step with host-side index pointers built from ``seq_lens_cpu``
    (so planning never waits for the GPU); the slot list is built on the device from
    ``req_to_token``. One 512 MiB workspace per process is shared through the RuntimeContext.
    An fp8 cache is planned with its dtype; FlashInfer takes the layer's scales as host
    floats (``kv_cache.scales``, fixed once the checkpoint is loaded, before any capture).

    Prefill runs FlashInfer's FA3 kernels where they run (sm90), else FA2; the option
    ``prefill_backend`` (config ``flashinfer_prefill_backend``) picks one. The constructor
    plans and runs one tiny prefill and decode, so FlashInfer's JIT compiles (first start) or
    loads (later starts) its kernels then, not in the first request.
    """

    #: Tensor-core decode (FlashInfer's prefill kernels with q_len 1) pays off for wide GQA.
    tensor_core_min_group = 4

    def __init__(self, init: AttentionBackendInit) -> None:
        super().__init__(init)
        import flashinfer

        self.flashinfer = flashinfer
        self.context = init.context
        self.sm_scale = init.head_dim**-0.5
        kv_dtype = init.kv_cache.k_buffers[0].dtype
        requested = str(init.options.get("prefill_backend", "auto"))
        #: "fa3" or "fa2": the prefill kernels this backend runs (refused before any allocation)
        self.prefill_variant = device_prefill_variant(requested, self.device, self.dtype, kv_dtype)
        self.workspace = self.context.get_or_create(
            WORKSPACE,
            lambda: torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device),
            owner=OWNER,
        )
        group = init.num_q_heads // init.num_kv_heads
        self.use_tensor_cores = group >= self.tensor_core_min_group
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=self.prefill_variant
        )
        self._graph: dict[str, Any] | None = None
        try:
            self.warm_up_s = self._warm_up()
        except BaseException:  # e.g. a failed JIT compile: release the workspace, then raise
            self.close()
            raise

    # -- planning -------------------------------------------------------------------------------
    def _fill_index(
        self, fb: ForwardBatch, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
    ) -> None:
        fill_kv_index(
            self.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr,
            kv_indices,
        )  # fmt: skip

    def _plan_decode(self, wrapper: Any, fb: ForwardBatch, kv_indices: torch.Tensor) -> None:
        wrapper.plan(
            host_indptr(fb.seq_lens_cpu),
            kv_indices,
            torch.ones(fb.batch_size, dtype=torch.int32),
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            q_data_type=self.dtype,
            kv_data_type=self.kv_cache.dtype,
            sm_scale=self.sm_scale,
        )

    def plan(self, fb: ForwardBatch) -> FlashInferMetadata:
        b = fb.batch_size
        kv_indptr = torch.empty(b + 1, dtype=torch.int32, device=self.device)
        kv_indices = torch.empty(fb.seq_lens_sum, dtype=torch.int32, device=self.device)
        self._fill_index(fb, kv_indptr, kv_indices)
        if fb.mode.is_decode():
            self._plan_decode(self.decode_wrapper, fb, kv_indices)
            return FlashInferMetadata(self.decode_wrapper, kv_indices)
        self.prefill_wrapper.plan(
            host_indptr(fb.extend_lens_cpu),
            host_indptr(fb.seq_lens_cpu),
            kv_indices,
            torch.ones(b, dtype=torch.int32),
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            causal=True,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_cache.dtype,
        )
        return FlashInferMetadata(self.prefill_wrapper, kv_indices)

    def _warm_up(self) -> float:
        """Plan and run a one-token prefill and decode over the padding row (slot 0, which
        only padding reads): FlashInfer builds or loads its kernels here. Returns seconds."""
        progress.info(
            "flashinfer: preparing the %s prefill and decode kernels (JIT cache %s; a first "
            "start compiles them: ~1 min for fa3, ~15 s for fa2 on a 16-core H200 host)",
            self.prefill_variant,
            jit_cache_dir(),
        )
        start = time.perf_counter()
        dev, hq, d = self.device, self.num_q_heads, self.head_dim
        q = torch.zeros(1, hq, d, dtype=self.dtype, device=dev)  # [T, Hq, D]
        first = AttentionLayer(0, hq, self.num_kv_heads, d, self.v_head_dim, self.sm_scale)
        for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            one = [1]
            fb = ForwardBatch(
                mode=mode,
                input_ids=torch.zeros(1, dtype=torch.int64, device=dev),
                positions=torch.zeros(1, dtype=torch.int64, device=dev),
                req_pool_indices=torch.zeros(1, dtype=torch.int64, device=dev),  # row 0
                seq_lens=torch.ones(1, dtype=torch.int64, device=dev),
                out_cache_loc=torch.zeros(1, dtype=torch.int64, device=dev),
                seq_lens_cpu=one,
                prefix_lens_cpu=[0],
                extend_lens_cpu=one,
            )
            step = AttentionStep(self, self.plan(fb), fb.out_cache_loc, mode)
            self.attend(q, first, step)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - start
        if elapsed >= SLOW_WARM_UP_S:
            progress.info("flashinfer: kernels ready after %.0f s", elapsed)
        return elapsed

    # -- attending ------------------------------------------------------------------------------
    def attend(
        self, q: Tensor, layer: AttentionLayer, step: AttentionStep, kv: KV = None
    ) -> Tensor:
        cache = (
            self.kv_cache.k_buffers[layer.layer_id].unsqueeze(1),  # [S, 1, Hkv, D]: page size 1
            self.kv_cache.v_buffers[layer.layer_id].unsqueeze(1),
        )
        meta: FlashInferMetadata = step.meta
        # One plan serves every layer; a layer with its own softmax scale rescales through
        # k_scale, which FlashInfer multiplies into the planned scale at run time, as it does
        # an fp8 cache's k_scale (stored = K / k_scale); v_scale multiplies the output.
        scales = self.kv_cache.scales
        k_scale = layer.scaling / self.sm_scale
        v_scale = 1.0
        if self.kv_cache.is_fp8:
            k_scale *= scales.k[layer.layer_id]
            v_scale = scales.v[layer.layer_id]
        return meta.wrapper.run(
            q.contiguous(),
            cache,
            k_scale=None if k_scale == 1.0 else k_scale,
            v_scale=None if v_scale == 1.0 else v_scale,  # 1.0 costs no extra kernel
        )

    # -- graphs ---------------------------------------------------------------------------------
    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static index buffers; a graph-mode decode wrapper per batch size binds to them."""
        max_tokens = max_bs * self.init.max_context_len
        dev = self.device
        self._graph = {
            "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "kv_indices": torch.zeros(max_tokens, dtype=torch.int32, device=dev),
            "wrapper_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "wrapper_indices": torch.zeros(max_tokens, dtype=torch.int32, device=dev),
            "last_page_len": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "wrappers": {},
        }

    def plan_graph(self, fb: ForwardBatch) -> FlashInferMetadata:
        """Re-plan the bucket's wrapper into its static buffers (host-side, no device sync)."""
        g, b = self._graph, fb.batch_size
        max_bs = None if g is None else g["kv_indptr"].shape[0] - 1
        self.check_graph_batch("flashinfer attention", max_bs, fb)
        assert g is not None
        wrapper = g["wrappers"].get(b)
        if wrapper is None:
            wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=g["wrapper_indptr"][: b + 1],
                paged_kv_indices_buffer=g["wrapper_indices"],
                paged_kv_last_page_len_buffer=g["last_page_len"][:b],
            )
            g["wrappers"][b] = wrapper
        self._fill_index(fb, g["kv_indptr"], g["kv_indices"])
        self._plan_decode(wrapper, fb, g["kv_indices"][: fb.seq_lens_sum])
        return FlashInferMetadata(wrapper, g["kv_indices"])

    def close(self) -> None:
        self._graph = None
        if self.context.has(WORKSPACE) and self.context.owner_of(WORKSPACE) == OWNER:
            self.context.unregister(WORKSPACE, owner=OWNER)
