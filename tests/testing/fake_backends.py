"""Backends for testing the suites themselves: correct variants and deliberately broken ones."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from execrt.backends.attention.torch_native import TorchNativeAttnBackend
from execrt.backends.graph.reexec import ReexecGraphBackend
from execrt.backends.moe_dispatch.all_to_all import AllToAllDispatcher
from execrt.backends.moe_dispatch.allreduce import AllReduceDispatcher
from execrt.backends.prefix_cache.radix import RadixCache, _as_key
from execrt.core.batch import ForwardBatch, PaddedContext
from execrt.core.interfaces import (
    AttentionCapabilities,
    AttentionLayer,
    DispatchFormat,
    DispatchOutput,
    ExpertMajorDispatchOutput,
    GraphCapabilities,
    MoEDispatcher,
    MoEDispatcherCapabilities,
    MoEDispatcherInit,
    ShapeKey,
    StandardDispatchOutput,
)
from execrt.core.prefix_cache import PrefixCacheCapabilities, PrefixCacheInit, PrefixMatch

F32 = frozenset({torch.float32})
CPU = frozenset({"cpu"})

# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
NATIVE_CAPS = AttentionCapabilities(devices=CPU, dtypes=F32)
GRAPH_CAPS = AttentionCapabilities(devices=CPU, dtypes=F32, graph=True)
CUDA_GRAPH_CAPS = AttentionCapabilities(
    devices=frozenset({"cuda"}), dtypes=frozenset({torch.float32}), graph=True
)
STORES_CAPS = AttentionCapabilities(devices=CPU, dtypes=F32, stores_kv=True)
HALF_CAPS = AttentionCapabilities(devices=CPU, dtypes=frozenset({torch.float32, torch.float16}))
HALF_FP8_CAPS = dataclasses.replace(
    HALF_CAPS,
    kv_dtypes=frozenset({torch.float32, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2}),
)


class WrongScaleAttention(TorchNativeAttnBackend):
    """Broken: uses head_dim ** -0.5 instead of the layer's scaling."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        own = dataclasses.replace(layer, scaling=layer.head_dim**-0.5)
        return super().attend(q, own, step, kv)


class PowerOfTwoGroupsAttention(TorchNativeAttnBackend):
    """Broken: query head h reads kv head ``h >> log2(G)``, right only where the GQA group G
    is a power of two (SmolLM2's 9 q / 3 kv heads read the wrong heads)."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        self._num_q_heads = layer.num_q_heads
        return super().attend(q, layer, step, kv)

    def _gather(self, layer_id, slots):  # type: ignore[no-untyped-def]
        k, v = super()._gather(layer_id, slots)
        hkv = k.shape[-2]
        shift = (self._num_q_heads // hkv).bit_length() - 1
        heads = (torch.arange(self._num_q_heads, device=k.device) >> shift).clamp(max=hkv - 1)
        return k.index_select(-2, heads), v.index_select(-2, heads)  # one kv head per q head


class HalfModuloGroupsAttention(PowerOfTwoGroupsAttention):
    """Broken: its 16-bit path maps query head h to kv head ``h % Hkv`` (right at a group
    of 1 only; its fp32 path, the primary dtype on CPU, is right)."""

    def _gather(self, layer_id, slots):  # type: ignore[no-untyped-def]
        cache = self.kv_cache
        if cache.k_buffers[layer_id].dtype == torch.float32:
            return TorchNativeAttnBackend._gather(self, layer_id, slots)
        k, v = TorchNativeAttnBackend._gather(self, layer_id, slots)
        hkv = k.shape[-2]
        heads = torch.arange(self._num_q_heads, device=k.device) % hkv
        return k.index_select(-2, heads), v.index_select(-2, heads)


class HalfNoVScaleAttention(TorchNativeAttnBackend):
    """Broken: under a 16-bit model its fp8 read leaves out ``v_scale`` (its fp32 path, the
    primary dtype on CPU, is right)."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        self._half = q.dtype != torch.float32
        return super().attend(q, layer, step, kv)

    def _gather(self, layer_id, slots):  # type: ignore[no-untyped-def]
        k, v = super()._gather(layer_id, slots)
        cache = self.kv_cache
        if cache.is_fp8 and self._half:  # V as stored: without its scale
            v = cache.v_buffers[layer_id][slots].float()
        return k, v


class BatchWritingAttention(TorchNativeAttnBackend):
    """Broken: clamps the batch's positions in place while planning (the model's RoPE and
    the runner read them after)."""

    def plan(self, fb):  # type: ignore[no-untyped-def]
        fb.positions.clamp_(max=3)
        return super().plan(fb)


class StoringAttention(TorchNativeAttnBackend):
    """Correct: declares ``stores_kv`` and stores the K/V it is handed before reading."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        assert kv is not None, "a stores_kv backend is always handed this step's K/V"
        self.kv_cache.set_kv(layer.layer_id, step.out_cache_loc, *kv)
        return super().attend(q, layer, step)


class ForgetfulStoringAttention(TorchNativeAttnBackend):
    """Broken: declares ``stores_kv`` but never stores what it is handed."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        return super().attend(q, layer, step)


def _attend_without_max(q, k, v, scale, mask):  # type: ignore[no-untyped-def]
    """torch_native's ``attend`` with the softmax's row maximum left out (exp of the raw
    logits): right while logits stay within a few units, inf / NaN past ~88 in fp32."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(b, n, hkv, hq // hkv, d)
    scores = torch.einsum("bnhgd,blhd->bnhgl", qg, k.float()) * scale
    scores = scores.reshape(b, n, hq, -1).masked_fill(~mask, float("-inf"))
    e = scores.exp()
    probs = (e / e.sum(-1, keepdim=True)).nan_to_num_(0.0, posinf=float("inf"))
    probs = probs.view(b, n, hkv, hq // hkv, -1)
    out = torch.einsum("bnhgl,blhd->bnhgd", probs, v.float())
    return out.reshape(b, n, hq, -1).to(q.dtype)


class NoMaxSoftmaxAttention(TorchNativeAttnBackend):
    """Broken: a softmax without its row maximum (``_attend_without_max``)."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        from unittest import mock

        from execrt.backends.attention import torch_native

        with mock.patch.object(torch_native, "attend", _attend_without_max):
            return super().attend(q, layer, step, kv)


class SixteenRowsAttention(TorchNativeAttnBackend):
    """Broken: its decode grid covers 16 requests; later rows get row 0's output."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        out = super().attend(q, layer, step, kv)
        if step.mode.is_decode():
            out[16:] = out[:1]
        return out


class Slot0NaNStoringAttention(StoringAttention):
    """Broken: its padded rows leave NaN at slot 0 (padding's). Its own reads skip slot 0, so
    its outputs are right; a gathering backend's masked read of slot 0 would give NaN."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        out = super().attend(q, layer, step, kv)
        if bool((step.out_cache_loc == 0).any()):
            self.kv_cache.k_buffers[layer.layer_id][0] = float("nan")
        return out

    def _gather(self, layer_id, slots):  # type: ignore[no-untyped-def]
        k, v = super()._gather(layer_id, slots)
        at_zero = (slots == 0)[..., None, None]
        return k.masked_fill(at_zero, 0.0), v.masked_fill(at_zero, 0.0)


class StaticGraphAttention(TorchNativeAttnBackend):
    """Correct: torch_native with graph metadata written into buffers of fixed address."""

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        width = self.req_to_token_pool.max_context_len
        dev = self.req_to_token_pool.device
        self.slots = torch.zeros(max_bs, width, dtype=torch.int64, device=dev)  # [B, C]
        self.valid = torch.zeros(max_bs, width, dtype=torch.bool, device=dev)  # [B, C]
        self.positions = torch.arange(width, device=dev)

    def plan_graph(self, fb: ForwardBatch) -> PaddedContext:
        b = fb.batch_size
        rows = self.req_to_token_pool.req_to_token[fb.req_pool_indices]  # [b, C]
        torch.lt(self.positions[None, :], fb.seq_lens[:, None], out=self.valid[:b])
        self.slots[:b].copy_(torch.where(self.valid[:b], rows.long(), 0))
        return PaddedContext(self.slots[:b], self.valid[:b], [], [])


class FreshBuffersGraphAttention(StaticGraphAttention):
    """Broken: claims graphs, but its graph plan is freshly allocated on every call."""

    def plan_graph(self, fb: ForwardBatch) -> PaddedContext:
        return self.plan(fb)


class SyncingGraphAttention(StaticGraphAttention):
    """Broken on CUDA: its graph plan reads the batch's longest context from the device (a
    host sync before every replayed step) instead of the host mirror; its outputs are right."""

    def plan_graph(self, fb: ForwardBatch) -> PaddedContext:
        self.longest = int(fb.seq_lens.max())
        return super().plan_graph(fb)


class HoardingGraphAttention(StaticGraphAttention):
    """Broken on CUDA: its graph plan keeps a device copy of every batch's lengths (memory
    that grows with every replayed step); its outputs are right."""

    def plan_graph(self, fb: ForwardBatch) -> PaddedContext:
        self.__dict__.setdefault("history", []).append(fb.seq_lens.clone())
        return super().plan_graph(fb)


class LazyBucketGraphAttention(StaticGraphAttention):
    """Correct: allocates a buffer per batch size at its first graph plan of that size and
    reuses it after (as the flashinfer backend creates a wrapper, with its own workspace, per
    bucket): memory kept by a first plan is allowed, by a repeated one not."""

    def plan_graph(self, fb: ForwardBatch) -> PaddedContext:
        per_bucket: dict[int, torch.Tensor] = self.__dict__.setdefault("per_bucket", {})
        if fb.batch_size not in per_bucket:
            per_bucket[fb.batch_size] = torch.zeros(1 << 20, device=fb.seq_lens.device)
        return super().plan_graph(fb)


class StaleSeqLensGraphAttention(StaticGraphAttention):
    """Broken: computes the context mask once per bucket and ignores later seq_lens."""

    def plan_graph(self, fb: ForwardBatch) -> PaddedContext:
        seen: set[int] = self.__dict__.setdefault("_seen", set())
        b = fb.batch_size
        if b not in seen:
            seen.add(b)
            return super().plan_graph(fb)
        rows = self.req_to_token_pool.req_to_token[fb.req_pool_indices]
        self.slots[:b].copy_(torch.where(self.valid[:b], rows.long(), 0))
        return PaddedContext(self.slots[:b], self.valid[:b], [], [])


class RowsKeptAttention(TorchNativeAttnBackend):
    """Broken: reads a batch's ``req_to_token`` rows once per set of requests and keeps
    them, so a request's next token (in a slot written to its row after that read) is never
    seen: every scenario passes, a running engine's greedy tokens change."""

    def plan(self, fb: ForwardBatch) -> PaddedContext:
        kept: dict[tuple[int, ...], torch.Tensor] = self.__dict__.setdefault("_kept", {})
        requests = tuple(fb.req_pool_indices.tolist())
        if requests not in kept:
            kept[requests] = self.req_to_token_pool.req_to_token[fb.req_pool_indices].clone()
        rows = kept[requests][:, : fb.max_seq_len]
        valid = torch.arange(fb.max_seq_len, device=rows.device)[None, :] < fb.seq_lens[:, None]
        slots = torch.where(valid, rows.long(), 0)
        return PaddedContext(slots, valid, list(fb.prefix_lens_cpu), list(fb.extend_lens_cpu))


class FourKContextAttention(TorchNativeAttnBackend):
    """Broken: reads at most the first 4096 positions of a request's context (as a backend
    with a 4k context buffer would); every shorter context is exact."""

    def plan(self, fb: ForwardBatch) -> PaddedContext:
        context = super().plan(fb)
        context.valid[:, 4096:] = False
        return context


class NaNPaddingGraphAttention(StaticGraphAttention):
    """Broken: padded graph rows come out NaN (as a softmax over no key does); every real
    row is exact. In a model that NaN reaches slot 0 through the padded row's K/V, and every
    gathering backend reads slot 0 under a mask: 0 x NaN is NaN."""

    def plan_graph(self, fb: ForwardBatch) -> PaddedContext:
        self.real_rows = fb.num_token_non_padded
        return super().plan_graph(fb)

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        out = super().attend(q, layer, step, kv)
        out[getattr(self, "real_rows", out.shape[0]) :] = float("nan")
        return out


class StrideBlindStoringAttention(StoringAttention):
    """Broken: stores K/V as a kernel handed a bare pointer would, reading rows as if
    contiguous; the model hands ``v`` as a strided view of the q/k/v projection."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        assert kv is not None
        k, v = (torch.as_strided(x, x.shape, torch.empty(x.shape).stride()) for x in kv)
        return super().attend(q, layer, step, (k, v))


class ShapeMemoAttention(TorchNativeAttnBackend):
    """Broken: reuses its plan for a later step of the same shape (batch size, mode and
    tokens), as if every such step were a graph bucket; an engine's decode steps all are."""

    def plan(self, fb):  # type: ignore[no-untyped-def]
        memo: dict[Any, Any] = self.__dict__.setdefault("_memo", {})
        key = (fb.batch_size, fb.mode, fb.num_tokens)
        if key not in memo:
            memo[key] = super().plan(fb)
        return memo[key]


class QScalingAttention(TorchNativeAttnBackend):
    """Broken: folds the softmax scale into the caller's q in place (its output is right)."""

    def attend(self, q, layer: AttentionLayer, step, kv=None):  # type: ignore[no-untyped-def]
        q.mul_(layer.scaling)
        own = dataclasses.replace(layer, scaling=1.0)
        return super().attend(q, own, step, kv)


# ---------------------------------------------------------------------------------------------
# MoE dispatch
# ---------------------------------------------------------------------------------------------
SMALL_MOE = {"devices": CPU, "dtypes": F32}


ALLREDUCE_LIKE_CAPS = MoEDispatcherCapabilities(**SMALL_MOE)


class DropLastTokenDispatcher(AllReduceDispatcher):
    """Broken: the last token of every batch never reaches its experts."""

    def dispatch(self, hidden_states, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        ids = topk_ids.clone()
        ids[-1:] = -1
        return super().dispatch(hidden_states, ids, topk_weights)


class RankOneRaisesDispatcher(AllReduceDispatcher):
    """Broken: rank 1 raises in dispatch, leaving rank 0 alone in the all-reduce."""

    def dispatch(self, hidden_states, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        if self.init.parallel.rank == 1:
            raise RuntimeError("rank 1 dispatch exploded")
        return super().dispatch(hidden_states, topk_ids, topk_weights)


class AllGatherDispatcher(MoEDispatcher):
    """Correct, per-rank tokens: gather every rank's tokens, run local experts, reduce back."""

    def __init__(self, init: MoEDispatcherInit) -> None:
        super().__init__(init)
        self.first, self.num_local = init.first_local_expert, init.num_local_experts

    def dispatch(self, hidden_states, topk_ids, topk_weights) -> DispatchOutput:  # type: ignore[no-untyped-def]
        par = self.init.parallel
        counts = par.all_gather_counts(hidden_states.shape[0], hidden_states.device, par.ep_group)
        cap = max(counts)
        parts = [_gather(t, counts, cap, par) for t in (hidden_states, topk_ids, topk_weights)]
        local = parts[1] - self.first
        mine = (parts[1] >= 0) & (local >= 0) & (local < self.num_local)
        ids = torch.where(mine, local, torch.full_like(local, -1))
        out = StandardDispatchOutput(parts[0], ids, parts[2])
        out.counts = counts  # type: ignore[attr-defined]
        return out

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        par = self.init.parallel
        counts: list[int] = dispatch_output.counts  # type: ignore[union-attr]
        total = par.all_reduce(expert_output.clone(), par.ep_group)
        start = sum(counts[: par.rank])
        return total[start : start + counts[par.rank]]


def _gather(t: torch.Tensor, counts: list[int], cap: int, par: Any) -> torch.Tensor:
    if par.world_size == 1:
        return t
    padded = t.new_zeros((cap, *t.shape[1:]))
    padded[: t.shape[0]] = t
    chunks = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(chunks, padded)
    return torch.cat([c[:n] for c, n in zip(chunks, counts, strict=True)])


ALLGATHER_CAPS = MoEDispatcherCapabilities(
    replicated_tokens=False, world_sizes=frozenset({1, 2}), **SMALL_MOE
)


class ExpertMajorDispatcher(MoEDispatcher):
    """Correct, world size 1: tokens grouped per expert in ``[E, T*K, H]`` rows."""

    def dispatch(self, hidden_states, topk_ids, topk_weights) -> DispatchOutput:  # type: ignore[no-untyped-def]
        e, t = self.init.num_experts, hidden_states.shape[0]
        rows = max(t * topk_ids.shape[1], 1)
        grouped = hidden_states.new_zeros((e, rows, hidden_states.shape[1]))
        counts = torch.zeros(e, dtype=torch.int32)
        where = []
        for token in range(t):
            for k in range(topk_ids.shape[1]):
                expert = int(topk_ids[token, k])
                if expert < 0:
                    continue
                grouped[expert, int(counts[expert])] = hidden_states[token]
                where.append((token, k, expert, int(counts[expert])))
                counts[expert] += 1
        return ExpertMajorDispatchOutput(grouped, counts, t, (where, topk_weights))

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        assert isinstance(dispatch_output, ExpertMajorDispatchOutput)
        where, weights = dispatch_output.state
        out = expert_output.new_zeros((dispatch_output.num_tokens, expert_output.shape[2]))
        for token, k, expert, row in where:
            out[token] += float(weights[token, k]) * expert_output[expert, row]
        return out


EXPERT_MAJOR_CAPS = MoEDispatcherCapabilities(
    output_format=DispatchFormat.EXPERT_MAJOR, world_sizes=frozenset({1}), **SMALL_MOE
)


class RenormalisingDispatcher(AllReduceDispatcher):
    """Broken: renormalises each token's routing weights to sum to 1 (wrong for a model with
    norm_topk_prob false)."""

    def dispatch(self, hidden_states, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        w = topk_weights * (topk_ids >= 0)
        return super().dispatch(hidden_states, topk_ids, w / w.sum(-1, keepdim=True).clamp(1e-9))


class MaskedToExpertZeroDispatcher(AllReduceDispatcher):
    """Broken: routes a masked (-1) pair to expert 0 instead of to no expert."""

    def dispatch(self, hidden_states, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        return super().dispatch(hidden_states, topk_ids.clamp(min=0), topk_weights)


class InputWritingDispatcher(AllReduceDispatcher):
    """Broken: zeroes the caller's hidden states of tokens routed nowhere (its output is right,
    but the model reads those states again)."""

    def dispatch(self, hidden_states, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        hidden_states.masked_fill_((topk_ids < 0).all(-1)[:, None], 0)
        return super().dispatch(hidden_states, topk_ids, topk_weights)


class BoundExclusiveDispatcher(AllReduceDispatcher):
    """Broken: drops the token at index max_tokens_per_rank - 1 (an exclusive bound)."""

    def dispatch(self, hidden_states, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        last = self.init.max_tokens_per_rank - 1
        if hidden_states.shape[0] > last:
            topk_ids = topk_ids.clone()
            topk_ids[last:] = -1
        return super().dispatch(hidden_states, topk_ids, topk_weights)


class CountsFlippingDispatcher(ExpertMajorDispatcher):
    """Broken: reports the experts' row counts in reverse order (their sum is right); correct
    only where every row is computed."""

    def dispatch(self, hidden_states, topk_ids, topk_weights) -> DispatchOutput:  # type: ignore[no-untyped-def]
        d = super().dispatch(hidden_states, topk_ids, topk_weights)
        assert isinstance(d, ExpertMajorDispatchOutput)
        d.expert_counts = d.expert_counts.flip(0)
        return d


# The dispatchers below escaped the suite in a black-box plugin audit (session 38), each a
# plausible bug of a real dispatcher; the suite now fails each, saying what.
PER_RANK_CAPS = MoEDispatcherCapabilities(
    output_format=DispatchFormat.EXPERT_MAJOR, replicated_tokens=False, **SMALL_MOE
)


class Int8CountsDispatcher(AllToAllDispatcher):
    """Broken: keeps its per-expert row counts in int8 ('to save bandwidth'): an expert that
    gets more than 127 rows wraps."""

    def _exchange_counts(self, bucket):  # type: ignore[no-untyped-def]
        counts = super()._exchange_counts(bucket)
        per_source = counts.per_source.to(torch.int8).long()
        capacity = max(int(per_source.sum(0).max()), 1)
        return dataclasses.replace(counts, per_source=per_source, capacity=capacity)


class EightExpertsDispatcher(AllReduceDispatcher):
    """Broken: written against an 8-expert model, drops every pair routed past expert 7."""

    def dispatch(self, hidden_states, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        return super().dispatch(
            hidden_states, topk_ids.masked_fill(topk_ids >= 8, -1), topk_weights
        )


class TwoRanksDispatcher(AllReduceDispatcher):
    """Broken: written for two ranks, combine sums the shares of ranks 0 and 1 only."""

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        par = self.init.parallel
        if par.ep_size == 1:
            return expert_output
        shares = [torch.empty_like(expert_output) for _ in range(par.ep_size)]
        dist.all_gather(shares, expert_output.contiguous())
        return shares[0] + shares[1]


class BlockScaledDispatcher(AllReduceDispatcher):
    """Broken: rounds the tokens through a per-32-column block scale (as an fp8 payload would),
    assuming the hidden size is a multiple of 32."""

    def dispatch(self, hidden_states, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        blocks = hidden_states.reshape(hidden_states.shape[0], -1, 32)
        scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        scaled = ((blocks / scale) * scale).reshape(hidden_states.shape)
        return super().dispatch(scaled, topk_ids, topk_weights)


class HoardingDispatcher(AllReduceDispatcher):
    """Broken: keeps every call's dispatch output 'for debugging': memory grows per call."""

    def __init__(self, init: MoEDispatcherInit) -> None:
        super().__init__(init)
        self.history: list[DispatchOutput] = []

    def dispatch(self, hidden_states, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        d = super().dispatch(hidden_states, topk_ids, topk_weights)
        self.history.append(d)
        return d


class TransposedOutputDispatcher(AllReduceDispatcher):
    """Broken: combine hands out a transposed view (a kernel that writes ``[H, T]``)."""

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        return super().combine(expert_output, dispatch_output).t().contiguous().t()


class ReusedOutputDispatcher(AllReduceDispatcher):
    """Broken: combine writes into one persistent buffer and returns a view of it, which the
    next call overwrites."""

    def __init__(self, init: MoEDispatcherInit) -> None:
        super().__init__(init)
        self.out = torch.empty(init.max_tokens_per_rank, init.hidden_size, dtype=init.dtype)

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        out = self.out[: expert_output.shape[0]]
        out.copy_(super().combine(expert_output, dispatch_output))
        return out


# ---------------------------------------------------------------------------------------------
# Graph
# ---------------------------------------------------------------------------------------------
REEXEC_CAPS = GraphCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    real_capture=False,
    shared_memory_pool=False,
    graph_resources=True,
)


class StaleReplayGraph(ReexecGraphBackend):
    """Broken: replay hands back the captured outputs without running anything."""

    def replay(self, key: ShapeKey) -> Any:
        return self._outputs[key]


class RecapturingGraph(ReexecGraphBackend):
    """Broken: capturing a key that is already captured silently records it again."""

    def capture(self, key: ShapeKey, fn: Callable[[], Any]) -> Any:
        self._fns.pop(key, None)
        return super().capture(key, fn)


class FloatOnlyCopyGraph(ReexecGraphBackend):
    """Broken: replay copies the floating-point outputs only; integer ones (token ids sampled
    in the graph) keep their captured values."""

    def replay(self, key: ShapeKey) -> Any:
        out = self._outputs[key]
        fresh = self._fns[key]()
        for f in dataclasses.fields(out):
            kept = getattr(out, f.name)
            if isinstance(kept, torch.Tensor) and kept.is_floating_point():
                kept.copy_(getattr(fresh, f.name))
        return out


class HoardingGraph(ReexecGraphBackend):
    """Broken: keeps every capture's function and outputs past cleanup() (a leak per recapture)."""

    def capture(self, key: ShapeKey, fn: Callable[[], Any]) -> Any:
        out = super().capture(key, fn)
        self.__dict__.setdefault("history", []).append((fn, out))
        return out


class ClosedResourcesGraph(ReexecGraphBackend):
    """Broken: cleanup() closes the graph resources but keeps them, so the next generation's
    captures reuse closed resources (no new create, nothing registered)."""

    def cleanup(self) -> None:
        owner = self._resources
        self._fns.clear()
        self._outputs.clear()
        if owner is not None and owner.resources is not None and not getattr(self, "shut", 0):
            if owner.context.has(owner.name):
                owner.context.unregister(owner.name, owner=owner.owner)
            owner.provider.close_graph_resources(owner.resources)
            self.shut = 1


class ResourcesFirstGraph(ReexecGraphBackend):
    """Broken: cleanup() closes the graph resources while its graphs still hold them."""

    def cleanup(self) -> None:
        if self._resources is not None:
            self._resources.close()
        super().cleanup()


class UnboundReplayGraph(ReexecGraphBackend):
    """Broken: a re-running replay never warms the resources up for its key again, so the
    forward runs on whichever bucket was warmed last."""

    def replay(self, key: ShapeKey) -> Any:
        out = self._outputs[key]
        fresh = self._fns[key]()
        for f in dataclasses.fields(out):
            kept = getattr(out, f.name)
            if isinstance(kept, torch.Tensor):
                kept.copy_(getattr(fresh, f.name))
        return out


class EagerKeyGraph(ReexecGraphBackend):
    """Broken: records the key before its function has run, so a failed capture leaves it
    captured (with no outputs) until cleanup()."""

    def capture(self, key: ShapeKey, fn: Callable[[], Any]) -> Any:
        if key in self._fns:
            raise ValueError(f"{key} already captured")
        self._fns[key] = fn
        if self._resources is not None:
            self._resources.ensure(key.batch_size)
            self._resources.warm_up(key.batch_size)
        self._outputs[key] = fn()
        return self._outputs[key]


class TwiceRunGraph(ReexecGraphBackend):
    """Broken: replay runs the function once more "to warm it up" (side effects run twice)."""

    def replay(self, key: ShapeKey) -> Any:
        self._fns[key]()
        return super().replay(key)


class EveryKeyGraph(ReexecGraphBackend):
    """Broken: a replay re-runs every captured key ("refresh all graphs")."""

    def replay(self, key: ShapeKey) -> Any:
        for other in self._fns:
            if other != key:
                super().replay(other)
        return super().replay(key)


class ResourceReexecGraph(ReexecGraphBackend):
    """Correct: reexec, which owns a dispatcher's graph resources itself (for the resource test)."""


RESOURCE_CAPS = dataclasses.replace(REEXEC_CAPS, graph_resources=True)


# ---------------------------------------------------------------------------------------------
# Prefix caches
# ---------------------------------------------------------------------------------------------
RADIX_CAPS = PrefixCacheCapabilities(devices=CPU)


class LockBlindRadix(RadixCache):
    """Broken: lock and unlock do nothing, so locked paths are evictable."""

    def lock(self, node: Any) -> None:
        pass

    def unlock(self, node: Any) -> None:
        pass


class EvictsLockedRadix(RadixCache):
    """Broken: lock counts the path as protected but leaves its nodes evictable."""

    def lock(self, node: Any) -> None:
        super().lock(node)
        self._shift(node, -1)

    def unlock(self, node: Any) -> None:
        self._shift(node, +1)
        super().unlock(node)

    def _shift(self, node: Any, delta: int) -> None:
        while node is not self._root:
            node.lock_ref += delta
            node = node.parent


class AliasingRadix(RadixCache):
    """Broken: keeps the caller's slot tensor (a view of its row) instead of a copy."""

    def insert(self, key: Any, slots: torch.Tensor) -> int:
        n = super().insert(key, slots)
        tokens = _as_key(key, "insert")
        leaf, end = self._descend(tokens, next(self._clock))
        if end == tokens.size and leaf is not self._root:
            leaf.value = slots[end - leaf.key.size : end]
        return n


class MostRecentFirstRadix(RadixCache):
    """Broken: evicts the most recently used leaf first."""

    def _queue_if_evictable(self, node: Any) -> None:
        if node.lock_ref or node.children or node is self._root:
            return
        node.queued = -node.last_access
        heapq.heappush(self._heap, (node.queued, node.uid, node))


class ShortMatchRadix(RadixCache):
    """Broken: a match reports one token less than is cached."""

    def match(self, key: Any) -> PrefixMatch:
        m = super().match(key)
        return PrefixMatch(m.slots[:-1], m.node) if m.length > 1 else m


class ForceMissIgnoredRadix(RadixCache):
    """Broken: matches even when built with force_miss."""

    def __init__(self, init: PrefixCacheInit) -> None:
        super().__init__(dataclasses.replace(init, force_miss=False))


class DuplicateFreeingRadix(RadixCache):
    """Broken: insert frees the caller's duplicate slots itself (they are the caller's)."""

    def insert(self, key: Any, slots: torch.Tensor) -> int:
        n = super().insert(key, slots)
        if n:
            self.init.free_slots(slots[:n].clone())
        return n


class SlotListLosingRadix(RadixCache):
    """Broken: ``cached_slots`` leaves out the slots of locked entries."""

    def cached_slots(self) -> torch.Tensor:
        values, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if not node.lock_ref:
                values.append(node.value)
            stack.extend(node.children.values())
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)


class OverUnlockingRadix(RadixCache):
    """Broken: an unlock more than the locks is ignored instead of refused."""

    def unlock(self, node: Any) -> None:
        if node is not self._root and getattr(node, "lock_ref", 1) == 0:
            return
        super().unlock(node)


class StaleNodeRadix(RadixCache):
    """Broken: lock and unlock of a node no longer in the tree do nothing, silently."""

    def lock(self, node: Any) -> None:
        if node.tree is self._tree:
            super().lock(node)

    def unlock(self, node: Any) -> None:
        if node.tree is self._tree:
            super().unlock(node)


class ResetListingRadix(RadixCache):
    """Broken: ``cached_slots`` still lists the slots of entries from before ``reset``."""

    _before_reset = torch.empty(0, dtype=torch.int64)

    def reset(self) -> None:
        if hasattr(self, "_root"):  # the constructor resets an empty tree first
            self._before_reset = self.cached_slots()
        super().reset()

    def cached_slots(self) -> torch.Tensor:
        return torch.cat([super().cached_slots(), self._before_reset])


class ListKeyRadix(RadixCache):
    """Broken: finds a cached prefix only when the key is a list (a fast path comparing keys
    with ``==`` against stored lists); KVMemory passes memoryviews, so it never matches."""

    def match(self, key: Any) -> PrefixMatch:
        return super().match(key) if isinstance(key, list) else PrefixMatch(self._empty, self._root)


class StaleMatchNodeRadix(RadixCache):
    """Broken: ``insert_and_match`` returns the right slots but the node of what was cached
    before the insert, so the lock KVMemory moves to it protects too little (or nothing)."""

    def insert_and_match(self, key: Any, slots: torch.Tensor) -> tuple[int, PrefixMatch]:
        before = super().match(key).node
        n, m = super().insert_and_match(key, slots)
        return n, PrefixMatch(m.slots, before)


class InsertNoTouchRadix(RadixCache):
    """Broken: insert does not mark the key used (entries keep their last access)."""

    def insert(self, key: Any, slots: torch.Tensor) -> int:
        nodes, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            nodes.append((node, node.last_access))
            stack.extend(node.children.values())
        n = super().insert(key, slots)
        for node, access in nodes:
            if node.last_access != access:
                node.last_access = access
                self._queue_if_evictable(node)  # queued again at the old time
        return n


class ForceMissNoWalkRadix(RadixCache):
    """Broken: under force_miss, match returns at once without walking or marking use."""

    def match(self, key: Any) -> PrefixMatch:
        if self.init.force_miss:
            return PrefixMatch(self._empty, self._root)
        return super().match(key)


class NoSuperInitRadix(RadixCache):
    """Broken: its ``__init__`` skips ``PrefixCache.__init__`` (no ``capabilities``)."""

    def __init__(self, init: PrefixCacheInit) -> None:
        self.init, self.device = init, init.device
        self._uids = itertools.count()
        self._clock = itertools.count(1)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.reset()


class PathCountUnlockRadix(RadixCache):
    """Broken: ``unlock`` of a node accepts the locks of a longer match through it."""

    def unlock(self, node: Any) -> None:
        if node is not self._root and node.own_locks == 0 and node.lock_ref > 0:
            node.own_locks += 1
        super().unlock(node)


class CappedRadix(RadixCache):
    """Broken (an audit's plugin): holds at most 256 tokens; past that, insert stores nothing
    yet returns the cached length as if it had taken the rest."""

    CAP = 256

    def insert(self, key: Any, slots: torch.Tensor) -> int:
        if self.evictable_size() + self.protected_size() >= self.CAP:
            return self._descend(_as_key(key, "insert"), next(self._clock))[1]
        return super().insert(key, slots)


class RecursiveLockRadix(RadixCache):
    """Broken (an audit's plugin): walks a locked path one token per recursive call, so a
    long prompt's lock overflows Python's stack."""

    def lock(self, node: Any) -> None:
        tokens = len(self._path_slots(node)) if node is not self._root else 0

        def walk(i: int) -> int:
            return 0 if i >= tokens else 1 + walk(i + 1)

        walk(0)
        super().lock(node)


class NarrowSlotsRadix(RadixCache):
    """Broken (an audit's plugin): keeps slot ids as int16 (fine for a test pool of 40, wrong
    past 32,767: a GPU's pool)."""

    def insert(self, key: Any, slots: torch.Tensor) -> int:
        return super().insert(key, slots.to(torch.int16).to(torch.int64))

    def insert_and_match(self, key: Any, slots: torch.Tensor) -> tuple[int, PrefixMatch]:
        return super().insert_and_match(key, slots.to(torch.int16).to(torch.int64))


class SharedBufferRadix(RadixCache):
    """Broken: every match's slots are a view of one buffer the next match overwrites."""

    def match(self, key: Any) -> PrefixMatch:
        m = super().match(key)
        if not hasattr(self, "_buffer") or self._buffer.numel() < m.length:
            self._buffer = torch.empty(max(m.length, 4096), dtype=torch.int64)
        view = self._buffer[: m.length]
        view.copy_(m.slots)
        return PrefixMatch(view, m.node)


class CloseOnceRadix(RadixCache):
    """Broken: a second close() raises (the contract says close is idempotent)."""

    def close(self) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError("closed twice")
        self._closed = True
        super().close()


class FreshEmptyRadix(RadixCache):
    """Correct: a new empty tensor for every empty match (the caller's own copy)."""

    def match(self, key: Any) -> PrefixMatch:
        m = super().match(key)
        return m if m.length else PrefixMatch(torch.empty(0, dtype=torch.int64), m.node)

    def insert_and_match(self, key: Any, slots: torch.Tensor) -> tuple[int, PrefixMatch]:
        n, m = super().insert_and_match(key, slots)
        return n, m if m.length else PrefixMatch(torch.empty(0, dtype=torch.int64), m.node)
