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

pytest.importorskip("triton")
# On CUDA machines the kernels run on the GPU; elsewhere under the interpreter (conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _batch(bs: int, mode: ForwardMode) -> ForwardBatch:
    seq = torch.ones(bs, dtype=torch.int64, device=DEVICE)
    zeros = torch.zeros(bs, dtype=torch.int64, device=DEVICE)
    return ForwardBatch(
        mode=mode,
        input_ids=zeros,
        positions=seq - 1,
        req_pool_indices=zeros,
        seq_lens=seq,
        out_cache_loc=zeros,
        seq_lens_cpu=[1] * bs,
        prefix_lens_cpu=[0] * bs,
        extend_lens_cpu=[1] * bs,
    )


def test_triton_graph_metadata_preconditions() -> None:
    from execrt.backends.attention.triton import TritonAttnBackend

    pool = ReqToTokenPool(4, 16, DEVICE)
    cache = KVCache(32, 1, 2, 64, torch.float32, DEVICE)
    backend = TritonAttnBackend(
        AttentionBackendInit(
            capabilities=TRITON_ATTENTION,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=64,
            v_head_dim=64,
            num_layers=1,
            dtype=torch.float32,
            device=DEVICE,
            req_to_token_pool=pool,
            kv_cache=cache,
            max_batch_size=4,
            max_context_len=16,
            context=RuntimeContext(),
        )
    )
    decode = _batch(2, ForwardMode.DECODE)
    with pytest.raises(RuntimeError, match="triton attention: init_graph_state"):
        backend.plan_graph(decode)
    backend.init_graph_state(2, 2)
    with pytest.raises(
        ValueError, match="triton attention: graphs capture decode only, got EXTEND"
    ):
        backend.plan_graph(dataclasses.replace(decode, mode=ForwardMode.EXTEND))
    with pytest.raises(ValueError, match="triton attention: batch 3 exceeds graph max_bs 2"):
        backend.plan_graph(_batch(3, ForwardMode.DECODE))
    assert backend.plan_graph(decode).kv_indptr.tolist() == [0, 1, 2]
