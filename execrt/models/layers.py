"""Model building blocks: RMSNorm, RoPE, attention through the backend, SwiGLU MLP, sparse MoE."""

from __future__ import annotations

import math

import torch
from torch import nn

from execrt.core.batch import ForwardBatch
from execrt.core.experts import run_experts
from execrt.core.interfaces import AttentionLayer, AttentionStep, MoEDispatcher, QKPrologue
from execrt.core.memory import KVCache
from execrt.core.parallel import ParallelState, shard_heads, shard_rows
from execrt.kernels.fused_moe import fused_experts
from execrt.kernels.linear import linear, norm_linear
from execrt.kernels.norm import fused_add_rmsnorm, rmsnorm
from execrt.kernels.rotary import qk_norm_rope
from execrt.kernels.router import topk_softmax
from execrt.models.config import RopeScaling


class RMSNorm(nn.Module):
    """RMS normalisation computed in fp32, scaled in the input dtype (as Hugging Face does).

    ``fused`` (set by the model) runs the one-launch Triton kernels of ``execrt.kernels``.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps, use_triton=self.fused)

    def add_forward(
        self, delta: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + delta`` (in the model dtype) and its norm: ``(normed, new_residual)``."""
        return fused_add_rmsnorm(delta, residual, self.weight, self.eps, use_triton=self.fused)

    def project(
        self,
        proj: Linear,
        residual: torch.Tensor,
        delta: torch.Tensor | None = None,
        *,
        swiglu_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``proj(norm(residual + delta))`` and ``residual + delta`` (``residual`` itself when
        ``delta`` is None); fused, decode-size calls normalise inside the projection's kernel.
        ``swiglu_out``: ``proj`` is a gate/up projection whose kernel may also apply the
        SwiGLU (``norm_linear``; ``MLP.down`` takes either output)."""
        x, res = (residual, None) if delta is None else (delta, residual)
        return norm_linear(
            x,
            proj.weight,
            proj.bias,
            self.weight,
            self.eps,
            residual=res,
            swiglu_out=swiglu_out,
            use_triton=self.fused,
        )


class Linear(nn.Linear):
    """``nn.Linear`` whose decode-size calls run the Triton skinny GEMM when ``fused`` is set
    (``execrt.kernels.linear``); the parameters and checkpoint names are nn.Linear's."""

    fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, use_triton=self.fused)


class RotaryEmbedding(nn.Module):
    """The fp32 cos/sin tables of rotate-half RoPE, indexed by position (``qk_norm_rope``
    applies them)."""

    cos: torch.Tensor  # [P, D] fp32
    sin: torch.Tensor  # [P, D] fp32

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the tables on the buffers' device, e.g. after ``to_empty``."""
        if self.cos.is_meta:
            return
        device = self.cos.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)  # [D/2]
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        emb = torch.outer(pos, inv_freq).repeat(1, 2)  # [P, D]
        scale = self.scaling.attention_factor if self.scaling is not None else 1.0
        self.cos.copy_(emb.cos() * scale)  # (yarn scales both: every q.k by its square)
        self.sin.copy_(emb.sin() * scale)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` (fp32) of RoPE, scaled as the config asks."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":  # positions / factor, folded into the frequencies
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # llama3: wavelengths longer than the original context / low_freq_factor are stretched by
    # ``factor``; shorter than context / high_freq_factor are kept; in between, a linear blend
    # in (context / wavelength).
    s = scaling
    wavelen = 2 * math.pi / inv_freq
    ratio = s.original_max_position_embeddings / wavelen
    smooth = (ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = torch.where(wavelen > low_wavelen, inv_freq / s.factor, blended)
    return torch.where(wavelen < high_wavelen, inv_freq, out)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling
) -> torch.Tensor:
    """YaRN's frequencies. Frequency pair i turns ``L * inv_freq[i] / 2pi`` times over the
    original context L; solving that for i at ``beta_fast`` and ``beta_slow`` turns gives the
    band's bounds (rounded outwards with ``truncate``, clamped to the head). Below the band the
    pairs keep their frequency, above it they are divided by ``factor``, inside it the weight
    of the divided one rises linearly."""

    def pair_at(turns: float) -> float:  # the (fractional) dimension where pairs turn so often
        wavelengths = s.original_max_position_embeddings / (turns * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(theta))

    lo, hi = pair_at(s.beta_fast), pair_at(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if hi == lo:
        hi += 0.001  # a one-point band: a step, not a division by zero
    pairs = torch.arange(head_dim // 2, dtype=torch.float32)
    divided = ((pairs - lo) / (hi - lo)).clamp(0, 1)  # 0: kept, 1: divided by factor
    return inv_freq / s.factor * divided + inv_freq * (1 - divided)


def row_parallel(
    proj: Linear, x: torch.Tensor, parallel: ParallelState, *, swiglu: bool = False
) -> torch.Tensor:
    """``proj(x)`` when ``proj`` holds this rank's input columns: the partial products are
    summed over the TP group, and the (replicated) bias is added once, after the sum.
    ``swiglu``: ``x`` is the gate/up output and ``silu(gate) * up`` is the input."""
    if parallel.tp_size == 1:
        return linear(x, proj.weight, proj.bias, swiglu=swiglu, use_triton=proj.fused)
    out = linear(x, proj.weight, swiglu=swiglu, use_triton=proj.fused)  # [T, H_out] a share
    parallel.all_reduce(out, parallel.tp_group)
    return out if proj.bias is None else out + proj.bias


class Attention(nn.Module):
    """GQA self-attention, per-head q/k RMSNorm optional (Qwen3 has it, Llama and Qwen2 do not);
    the kernel is the backend's.

    q, k and v come from one fused projection ``qkv_proj [(Hq + 2 Hkv) D, H]``. One call
    normalises and rotates q and k and, when the model is the K/V writer, stores this step's
    K/V in the cache: a Triton kernel (fused) or its torch reference, which stores through
    the same rule as ``KVCache.set_kv`` (fp8: quantized with the layer's scales).

    Under tensor parallelism (``parallel.tp_size`` > 1) the module holds this rank's heads only
    (``shard_heads``): ``qkv_proj`` its q rows, then its kv heads' k and v rows, ``o_proj`` the
    matching input columns; the output is summed over the TP group.
    """

    def __init__(
        self,
        layer_id: int,
        hidden_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        rotary: RotaryEmbedding,
        bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = True,
        parallel: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel = parallel or ParallelState.single()
        heads = shard_heads(num_q_heads, num_kv_heads, parallel.tp_size, parallel.tp_rank)
        num_q_heads, num_kv_heads = heads.num_q, heads.num_kv  # this rank's
        self.q_size, self.kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(num_q_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.eps = rms_norm_eps
        self.rotary = rotary
        self.fused = False
        #: q and k rotated by a Hadamard matrix after RoPE (``kv_cache_rotation``)
        self.hadamard = False
        #: Where the model stores this step's K/V (set by ``attach_kv_cache``); None: the
        #: attention backend stores them (it declares ``stores_kv``).
        self.kv_cache: KVCache | None = None
        self.spec = AttentionLayer(
            layer_id=layer_id,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            scaling=head_dim**-0.5,
        )

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, attn: AttentionStep
    ) -> torch.Tensor:
        """Everything after the q/k/v projection ``qkv [T, (Hq + 2 Hkv) D]`` (the decoder
        layer projects itself, with the norm fused in): -> ``[T, H]``."""
        s = self.spec
        t = qkv.shape[0]
        q = qkv[:, : self.q_size].view(t, s.num_q_heads, s.head_dim)  # [T, Hq, D] (strided)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, s.num_kv_heads, s.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, s.num_kv_heads, s.head_dim)
        q_w = None if self.q_norm is None else self.q_norm.weight
        k_w = None if self.k_norm is None else self.k_norm.weight
        if attn.backend.fuses_qk_prologue(attn):  # the backend rotates and stores in its kernel
            rotation = QKPrologue(
                positions, self.rotary.cos, self.rotary.sin, q_w, k_w, self.eps, self.hadamard
            )
            o = attn.backend.attend_with_prologue(q, k, v, s, attn, rotation)
            return row_parallel(self.o_proj, o.reshape(t, -1), self.parallel)
        cache = self.kv_cache  # the K/V writer, fixed at build: this model or the backend
        scales = cache.layer_scales[s.layer_id] if cache is not None and cache.is_fp8 else None
        q, k = qk_norm_rope(
            q,
            k,
            positions,
            self.rotary.cos,
            self.rotary.sin,
            q_w,
            k_w,
            self.eps,
            v=v if cache is not None else None,
            k_cache=None if cache is None else cache.k_buffers[s.layer_id],
            v_cache=None if cache is None else cache.v_buffers[s.layer_id],
            out_cache_loc=attn.out_cache_loc if cache is not None else None,
            cache_scales=scales,
            hadamard=self.hadamard,
            use_triton=self.fused,
        )
        # Every backend gets this step's K/V: a storing one stores them, the others may read
        # the new tokens' rows here (consecutive, unquantized) instead of through the cache.
        o = attn.backend.attend(q, s, attn, (k, v))  # [T, Hq, D]
        return row_parallel(self.o_proj, o.reshape(t, -1), self.parallel)  # [T, H]


class MLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matrix ``[2I, H]``.

    Under tensor parallelism each rank holds a contiguous block of the intermediate rows
    (``gate_up_proj``: its gate rows, then its up rows; ``down_proj``: those input columns) and
    the output is summed over the TP group.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        parallel: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel = parallel or ParallelState.single()
        rows = shard_rows(
            intermediate_size, parallel.tp_size, parallel.tp_rank, "intermediate_size"
        )
        local = rows.stop - rows.start
        self.gate_up_proj = Linear(hidden_size, 2 * local, bias=bias)
        self.down_proj = Linear(local, hidden_size, bias=bias)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up [T, 2I / tp]`` -> ``[T, H]``: SwiGLU inside down's skinny GEMM where the
        tuned table says so, else as its own kernel. Also takes ``silu(gate) * up``
        ``[T, I / tp]`` where gate/up's kernel applied it (``RMSNorm.project(swiglu_out=)``)."""
        activated = gate_up.shape[-1] == self.down_proj.weight.shape[1]
        return row_parallel(self.down_proj, gate_up, self.parallel, swiglu=not activated)


class SparseMoE(nn.Module):
    """Softmax top-k router, this rank's experts, and the dispatcher between them.

    Expert weights are stacked: ``w13 [E_local, 2I, H]`` (gate rows, then up rows) and
    ``w2 [E_local, H, I]``. Expert compute reads the dispatch *format*, never the dispatcher.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        dispatcher: MoEDispatcher,
    ) -> None:
        super().__init__()
        local = dispatcher.init.num_local_experts
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, intermediate_size))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.dispatcher = dispatcher
        self.fused = False  # Triton fused_experts instead of the core's torch expert compute

    def route(
        self, x: torch.Tensor, num_token_non_padded: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(topk_ids [T, K] int64, topk_weights [T, K] fp32)``: softmax
        top-k, weights rounded to the model dtype as Hugging Face applies them; rows at or past
        ``num_token_non_padded`` (graph padding) route nowhere (id -1)."""
        return topk_softmax(
            self.gate(x),
            self.top_k,
            self.norm_topk_prob,
            num_token_non_padded,
            use_triton=self.fused,  # one launch instead of ~10 small ones
        )

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        # num_token_non_padded_device is set whenever rows may be graph padding.
        ids, weights = self.route(x, fb.num_token_non_padded_device)
        dispatched = self.dispatcher.dispatch(x, ids, weights)
        experts = fused_experts if self.fused else run_experts
        out = experts(dispatched, self.w13, self.w2)
        return self.dispatcher.combine(out, dispatched)
