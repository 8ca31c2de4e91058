"""Graph metadata refuses what it cannot serve, with the component named (shared base check)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from execrt.core.batch import ForwardBatch, ForwardMode
from execrt.core.context import RuntimeContext
from execrt.core.interfaces import AttentionBackendInit
from execrt.core.memory import KVCache, ReqToTokenPool
from execrt.plugins.builtin import TRITON_ATTENTION


def _batch(bs: int, mode: ForwardMode, pool: ReqToTokenPool, cache: KVCache) -> ForwardBatch:
    seq = torch.ones(bs, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=mode, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
        positions=seq - 1, req_pool_indices=torch.zeros(bs, dtype=torch.int64), seq_lens=seq,
        out_cache_loc=torch.zeros(bs, dtype=torch.int64), seq_lens_cpu=[1] * bs,
        extend_prefix_lens_cpu=[0] * bs, extend_seq_lens_cpu=[1] * bs, req_to_token_pool=pool,
        kv_cache=cache,
    )  # fmt: skip


def test_triton_graph_metadata_preconditions() -> None:
    from execrt.backends.attention.triton import TritonAttnBackend

    pool = ReqToTokenPool(4, 16, "cpu")
    cache = KVCache(32, 1, 2, 64, torch.float32, "cpu")
    backend = TritonAttnBackend(AttentionBackendInit(
        TRITON_ATTENTION, 4, 2, 64, 64, 1, torch.float32, torch.device("cpu"), pool, cache, 4, 16,
        RuntimeContext(),
    ))  # fmt: skip
    decode = _batch(2, ForwardMode.DECODE, pool, cache)
    with pytest.raises(RuntimeError, match="triton attention: init_graph_state"):
        backend.init_forward_metadata_graph(decode)
    backend.init_graph_state(2, 2)
    with pytest.raises(
        ValueError, match="triton attention: graphs capture decode only, got EXTEND"
    ):
        backend.init_forward_metadata_graph(
            dataclasses.replace(decode, forward_mode=ForwardMode.EXTEND)
        )
    with pytest.raises(ValueError, match="triton attention: batch 3 exceeds graph max_bs 2"):
        backend.init_forward_metadata_graph(_batch(3, ForwardMode.DECODE, pool, cache))
    backend.init_forward_metadata_graph(decode)
    assert decode.attn_metadata.kv_indptr.tolist() == [0, 1, 2]
