"""One decoder for Llama, Qwen2, Qwen3 and Qwen3-MoE; the config picks each family's variant
(q/k norm, projection biases, RoPE scaling, MoE layers) and checkpoint names map onto it."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from execrt.core.batch import ForwardBatch, LogitsOutput
from execrt.core.errors import ModelLoadError
from execrt.core.interfaces import AttentionStep, MoEDispatcher
from execrt.core.kv_quant import KVScales
from execrt.core.memory import KVCache
from execrt.core.parallel import ParallelState, shard_heads, shard_rows
from execrt.core.sampler import SamplingBatchInfo
from execrt.kernels.sampling import fused_sample
from execrt.models.config import ModelConfig
from execrt.models.layers import MLP, Attention, Linear, RMSNorm, RotaryEmbedding, SparseMoE

logger = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        dispatcher: MoEDispatcher | None,
        parallel: ParallelState,
    ) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            layer_id,
            c.hidden_size,
            c.num_q_heads,
            c.num_kv_heads,
            c.head_dim,
            c.rms_norm_eps,
            rotary,
            bias=c.attention_bias,
            o_bias=c.o_proj_bias,
            qk_norm=c.qk_norm,
            parallel=parallel,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp: nn.Module
        if c.is_moe_layer(layer_id):
            if dispatcher is None:
                raise ModelLoadError("model: a MoE layer needs a MoE dispatcher")
            self.mlp = SparseMoE(
                c.hidden_size,
                c.moe_intermediate_size,
                c.num_experts,
                c.top_k,
                c.norm_topk_prob,
                dispatcher,
            )
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, parallel=parallel)

    def forward(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        fb: ForwardBatch,
        attn: AttentionStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h`` is the residual stream and ``delta`` the previous layer's MLP output, not yet
        added (None for the first layer): each residual add is fused into the norm after it.
        Returns ``(h, mlp_out)``."""
        # Each norm runs inside the projection after it where that projection is a decode-size
        # skinny GEMM (fused kernels), else as its own kernel.
        qkv, h = self.input_layernorm.project(self.self_attn.qkv_proj, h, delta)  # h += delta
        a = self.self_attn.attend(fb.positions, qkv, attn)
        if isinstance(self.mlp, SparseMoE):
            x, h = self.post_attention_layernorm.add_forward(a, h)
            return h, self.mlp(x, fb)
        mlp = self.mlp
        assert isinstance(mlp, MLP)
        gate_up, h = self.post_attention_layernorm.project(mlp.gate_up_proj, h, a, swiglu_out=True)
        return h, mlp.down(gate_up)


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dispatcher: MoEDispatcher | None,
        parallel: ParallelState,
    ) -> None:
        super().__init__()
        # Given storage, the embedding skips its random init: on the meta device normal_ alone
        # imports ~900 torch modules (a second at every start), and importing them after
        # init_process_group keeps the process group alive past destroy_process_group.
        weight = torch.empty(config.vocab_size, config.hidden_size)  # filled by load_weights
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary, dispatcher, parallel) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head (tied or untied).

    Under tensor parallelism (``parallel``) attention heads and dense MLP rows are sharded
    (see ``Attention`` and ``MLP``); the embedding, norms, router and LM head are replicated,
    so every rank ends with the full logits.
    """

    #: Extends return the logits of ``ForwardBatch.logit_rows`` (prompt log-probabilities).
    computes_logit_rows = True

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dispatcher: MoEDispatcher | None = None,
        parallel: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel or ParallelState.single()
        self.model = DecoderModel(config, max_positions, dispatcher, parallel)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        #: The fused sampling kernel when fused kernels are on (read by the model runner).
        self.sample_fn: Callable[[torch.Tensor, SamplingBatchInfo], torch.Tensor] | None = None
        #: The checkpoint's fp8 KV cache scales: layer -> {"k": scale, "v": scale}
        self._kv_scales: dict[int, dict[str, float]] = {}

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, attn: AttentionStep) -> LogitsOutput:
        h = self.model.embed_tokens(fb.input_ids)  # [T, H]
        delta = None
        for layer in self.model.layers:
            h, delta = layer(h, delta, fb, attn)
        norm = self.model.norm
        rows = None
        if fb.mode.is_extend():
            last = _on_device(fb.extend_lens_cpu, h.device).cumsum(0) - 1  # [B]
            if fb.return_full_logits:
                full = norm.project(self.lm_head, h, delta)[0].float()
                return LogitsOutput(next_token_logits=full[last], full_logits=full)
            if fb.logit_rows is not None:  # prompt rows, e.g. for prompt log-probabilities
                at = fb.logit_rows
                rows = norm.project(self.lm_head, h[at], None if delta is None else delta[at])[0]
            # The norm is per row: normalise only the rows whose logits are wanted.
            h, delta = h[last], None if delta is None else delta[last]
        # In the model's dtype: the samplers and logprobs widen what they read (exactly), so a
        # separate fp32 copy would only add a kernel and twice the bytes to every step.
        logits = norm.project(self.lm_head, h, delta)[0]
        return LogitsOutput(next_token_logits=logits, row_logits=rows)

    def attach_kv_cache(self, kv_cache: KVCache | None) -> None:
        """Make the model the K/V writer into ``kv_cache`` (None: the attention backend
        stores K/V itself). Called once, before the first forward."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.kv_cache = kv_cache

    def set_kv_rotation(self, enabled: bool) -> None:
        """Rotate each head's q and k by a Hadamard matrix after RoPE (``kv_cache_rotation``):
        attention scores are unchanged and the cache holds rotated keys. Before the first
        forward."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.hadamard = enabled

    def kv_scales(self) -> KVScales | None:
        """The checkpoint's per-layer K/V scales for an fp8 cache (real = stored * scale); a
        layer without one gets 1.0. None when the checkpoint has none at all."""
        if not self._kv_scales:
            return None
        layers = [self._kv_scales.get(i, {}) for i in range(self.config.num_layers)]
        return KVScales(
            tuple(s.get("k", 1.0) for s in layers), tuple(s.get("v", 1.0) for s in layers)
        )

    def set_fused_kernels(self, enabled: bool) -> None:
        """Run norms, rotary (+ K/V store), decode-size projections (with SwiGLU fused into
        down's), the router and experts through the Triton kernels of ``execrt.kernels`` (True)
        or their torch references and cuBLAS (False)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, Linear, SparseMoE)):
                module.fused = enabled
        # The sampler's fused draw rides on the same switch (the core cannot import kernels).
        self.sample_fn = fused_sample if enabled else None

    # -- weights ------------------------------------------------------------------------------
    def expected_weights(self) -> set[str]:
        """Parameter names to fill: execrt's fused and stacked names (``qkv_proj``,
        ``gate_up_proj``, ``w13``), not the checkpoint's; see ``missing_weights``."""
        return {name for name, _ in self.named_parameters()}

    def missing_weights(self, loaded: set[str], seen: Collection[str]) -> list[str]:
        """The checkpoint tensors that would fill the parameters not in ``loaded``, named as
        a Hugging Face checkpoint names them (``...self_attn.k_proj.weight``, not the fused
        ``qkv_proj``). ``seen`` is every name the checkpoint had: it rules out the parts that
        were there and tells which expert layout the checkpoint uses."""
        experts = {
            name: (mod.dispatcher.init.first_local_expert, mod.w13.shape[0])
            for name, mod in self.named_modules()
            if isinstance(mod, SparseMoE)
        }
        layout = _expert_layout(seen)
        missing: list[str] = []
        for param in sorted(self.expected_weights() - loaded):
            names = [n for n in _sources(param, experts, layout) if n not in seen]
            missing += names or [param]
        return missing

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; returns the parameter names fully filled.

        Handles the fused gate/up projection, per-expert and fused expert layouts, and keeps
        only this rank's experts and (tensor parallel) its heads and MLP rows. A mis-shaped
        tensor raises ModelLoadError naming it.
        """
        params = dict(self.named_parameters())
        experts = {
            name: (mod.dispatcher.init.first_local_expert, mod.w13.shape[0])
            for name, mod in self.named_modules()
            if isinstance(mod, SparseMoE)
        }
        shard = _TpShard.of(self.config, self.parallel)
        filled: dict[str, int] = {}
        unexpected: list[str] = []
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        stored_head: torch.Tensor | None = None
        for name, tensor in weights:
            if self._load_kv_scale(name, tensor):
                continue
            if tied and name == "lm_head.weight":
                stored_head = tensor  # settled once the embedding is known (below)
                continue
            for target, index, value in _map_weight(name, tensor, self.config, experts, shard):
                if target not in params:
                    unexpected.append(name)
                    continue
                dst = params[target].data if index is None else params[target].data[index]
                if dst.shape != value.shape:
                    raise ModelLoadError(
                        f"model: tensor {name!r} has shape {tuple(value.shape)}, "
                        f"expected {tuple(dst.shape)}"
                    )
                dst.copy_(value)
                filled[target] = filled.get(target, 0) + dst.numel()
        if unexpected:
            logger.warning(
                "model: ignored %d unexpected tensor(s): %s",
                len(unexpected),
                ", ".join(unexpected[:8]),
            )
        loaded = {n for n, count in filled.items() if count >= params[n].numel()}
        if stored_head is not None:
            self._settle_tied_head(stored_head, loaded)
        if self.config.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        return loaded

    def _settle_tied_head(self, head: torch.Tensor, loaded: set[str]) -> None:
        """A checkpoint whose config ties the output head to the embedding but which stores
        ``lm_head.weight`` too, read as transformers reads it: the head fills a missing
        embedding; one that differs from the stored embedding is kept as its own head (the
        config's tie is wrong there), with a warning; an equal one changes nothing."""
        embed = self.model.embed_tokens.weight
        if tuple(head.shape) != tuple(embed.shape):
            raise ModelLoadError(
                f"model: tensor 'lm_head.weight' has shape {tuple(head.shape)}, "
                f"expected {tuple(embed.shape)}"
            )
        value = head.to(device=embed.device, dtype=embed.dtype)
        if "model.embed_tokens.weight" not in loaded:
            embed.data.copy_(value)
            loaded.add("model.embed_tokens.weight")
        elif not torch.equal(value, embed.data):
            logger.warning(
                "model: tie_word_embeddings is true, but the checkpoint's lm_head.weight "
                "differs from model.embed_tokens.weight: the stored head is used, untied "
                "(as transformers does)"
            )
            self.lm_head.weight = nn.Parameter(value.clone(), requires_grad=embed.requires_grad)
            loaded.add("lm_head.weight")

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep ``name`` if it is a layer's K/V cache scale (see ``KV_SCALE_NAME``)."""
        match = KV_SCALE_NAME.match(name)
        if match is None:
            return False
        if tensor.numel() != 1:
            raise ModelLoadError(
                f"model: tensor {name!r} has shape {tuple(tensor.shape)}; KV cache scales are "
                "per tensor (one value)"
            )
        layer = int(match["layer"])
        which = match["tail"].rsplit(".", 1)[-1].removesuffix("_scale")  # "k", "v" or "kv"
        value = float(tensor.float())
        for part in ("k", "v") if which == "kv" else (which,):
            self._kv_scales.setdefault(layer, {})[part] = value
        return True


#: Per-layer fp8 KV cache scales under the names checkpoints use: ``self_attn.k_scale`` /
#: ``v_scale`` (llm-compressor), ``k_proj.k_scale`` / ``v_proj.v_scale`` (ModelOpt) and the
#: older single ``self_attn.kv_scale`` for both.
KV_SCALE_NAME = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.self_attn\."
    r"(?P<tail>k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale)$"
)

Index = tuple[slice | int, ...]


@dataclass(frozen=True)
class _TpShard:
    """Which part of each checkpoint tensor this TP rank keeps, and the full extents."""

    q: slice  # rows of q_proj (and its bias), columns of o_proj
    kv: slice  # rows of k_proj and v_proj (and their biases)
    mlp: slice  # rows of gate_proj and up_proj (and biases), columns of down_proj
    q_size: int  # Hq * D of the checkpoint
    kv_size: int  # Hkv * D
    mlp_size: int  # the dense intermediate size

    @classmethod
    def of(cls, config: ModelConfig, parallel: ParallelState) -> _TpShard | None:
        """None at tp_size 1 (every tensor whole)."""
        tp, rank, d = parallel.tp_size, parallel.tp_rank, config.head_dim
        if tp == 1:
            return None
        heads = shard_heads(config.num_q_heads, config.num_kv_heads, tp, rank)
        q = slice(heads.q_start * d, (heads.q_start + heads.num_q) * d)
        kv = slice(heads.kv_start * d, (heads.kv_start + heads.num_kv) * d)
        inter = config.intermediate_size
        # A MoE model without dense layers need not have an intermediate size that splits.
        dense = _has_dense_mlp(config)
        mlp = shard_rows(inter, tp, rank, "intermediate_size") if dense else slice(0, inter)
        return cls(q, kv, mlp, config.num_q_heads * d, config.num_kv_heads * d, inter)


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as int64 on ``device`` without waiting for the stream: a pageable copy
    would block until the GPU finished every layer already launched, so the host could not
    build the next step meanwhile. The pinned block goes back to torch's host cache only
    after the copy is done."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _has_dense_mlp(config: ModelConfig) -> bool:
    return any(not config.is_moe_layer(i) for i in range(config.num_layers))


def _take(name: str, tensor: torch.Tensor, dim: int, part: slice, full: int) -> torch.Tensor:
    """``part`` of ``tensor`` along ``dim``, after checking that dim has the checkpoint's size
    (slicing would hide a mis-shaped tensor)."""
    if tensor.dim() <= dim or tensor.shape[dim] != full:
        raise ModelLoadError(
            f"model: tensor {name!r} has shape {tuple(tensor.shape)}, expected {full} "
            f"along dim {dim}"
        )
    return tensor[part] if dim == 0 else tensor[:, part]


def _tp_slice(name: str, tensor: torch.Tensor, shard: _TpShard) -> torch.Tensor:
    """This TP rank's part of a checkpoint tensor: q/k/v and gate/up rows (weights and
    biases), o_proj and down_proj input columns; any other tensor whole (replicated)."""
    if ".mlp.experts." in name:
        return tensor
    for key, dim, part, full in (
        (".self_attn.q_proj.", 0, shard.q, shard.q_size),
        (".self_attn.k_proj.", 0, shard.kv, shard.kv_size),
        (".self_attn.v_proj.", 0, shard.kv, shard.kv_size),
        (".self_attn.o_proj.weight", 1, shard.q, shard.q_size),
        (".mlp.gate_proj.", 0, shard.mlp, shard.mlp_size),
        (".mlp.up_proj.", 0, shard.mlp, shard.mlp_size),
        (".mlp.down_proj.weight", 1, shard.mlp, shard.mlp_size),
    ):
        if key in name:
            return _take(name, tensor, dim, part, full)
    return tensor


#: The tensors of one expert in the Hub's per-expert layout (``experts.N.<proj>.weight``).
_EXPERT_WEIGHTS = [[proj, "weight"] for proj in ("gate_proj", "up_proj", "down_proj")]


def _map_weight(
    name: str,
    tensor: torch.Tensor,
    config: ModelConfig,
    experts: dict[str, tuple[int, int]],
    shard: _TpShard | None = None,
) -> list[tuple[str, Index | None, torch.Tensor]]:
    """Checkpoint name -> [(parameter name, index into it or None, value)].

    ``experts`` maps each MoE block (``model.layers.N.mlp``) to (first local expert, count);
    ``shard`` says which attention and dense-MLP rows this TP rank keeps (None: all).
    """
    if name.endswith("rotary_emb.inv_freq"):
        return []
    q_size = config.num_q_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    if shard is not None:
        tensor = _tp_slice(name, tensor, shard)
        q_size, kv_size = shard.q.stop - shard.q.start, shard.kv.stop - shard.kv.start
    for proj, start, size in (
        ("q_proj", 0, q_size),
        ("k_proj", q_size, kv_size),
        ("v_proj", q_size + kv_size, kv_size),
    ):
        if f".self_attn.{proj}." in name:  # q, k and v rows of the fused projection
            target = name.replace(f"self_attn.{proj}", "self_attn.qkv_proj")
            return [(target, (slice(start, start + size),), tensor)]
    if ".mlp.experts." not in name:
        for proj, half in (("gate_proj", 0), ("up_proj", 1)):
            if f".mlp.{proj}." in name:
                rows = tensor.shape[0]
                target = name.replace(f"mlp.{proj}", "mlp.gate_up_proj")
                return [(target, (slice(half * rows, (half + 1) * rows),), tensor)]
        return [(name, None, tensor)]
    block, rest = name.split(".experts.", 1)
    if block not in experts:
        return [(name, None, tensor)]  # not a MoE layer here: reported as unexpected shape/name
    first, count = experts[block]
    inter = config.moe_intermediate_size
    if rest in ("gate_up_proj", "down_proj"):  # fused: [E, 2I, H] and [E, H, I]
        target = f"{block}.w13" if rest == "gate_up_proj" else f"{block}.w2"
        return [(target, None, tensor[first : first + count])]
    if rest in ("gate_proj", "up_proj"):  # stacked halves (GGUF): [E, I, H] each
        part = slice(0, inter) if rest == "gate_proj" else slice(inter, 2 * inter)
        return [(f"{block}.w13", (slice(None), part), tensor[first : first + count])]
    parts = rest.split(".", 2)  # the Hub's per-expert name: N.<proj>.weight
    if len(parts) != 3 or not parts[0].isdigit() or parts[1:] not in _EXPERT_WEIGHTS:
        return [(name, None, tensor)]  # no parameter of ours: reported as unexpected
    expert_str, proj, _ = parts
    expert = int(expert_str) - first
    if not 0 <= expert < count:
        return []  # another rank's expert
    if proj == "gate_proj":
        return [(f"{block}.w13", (expert, slice(0, inter)), tensor)]
    if proj == "up_proj":
        return [(f"{block}.w13", (expert, slice(inter, 2 * inter)), tensor)]
    return [(f"{block}.w2", (expert,), tensor)]


def _expert_layout(seen: Collection[str]) -> str:
    """How the checkpoint stores experts: ``fused`` (``experts.gate_up_proj`` [E, 2I, H]),
    ``stacked`` (GGUF's ``experts.gate_proj`` and ``experts.up_proj`` [E, I, H]) or
    ``per_expert`` (the Hub's ``experts.N.gate_proj.weight``, also the guess with none seen)."""
    rests = {n.split(".mlp.experts.", 1)[1] for n in seen if ".mlp.experts." in n}
    if "gate_up_proj" in rests:
        return "fused"
    if rests & {"gate_proj", "up_proj"}:
        return "stacked"
    return "per_expert"


def _sources(param: str, experts: dict[str, tuple[int, int]], layout: str) -> list[str]:
    """The checkpoint names that fill ``param`` (the inverse of ``_map_weight``)."""
    for fused, parts in (
        ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ):
        if f".{fused}." in param:
            block = fused.split(".")[0]
            return [param.replace(fused, f"{block}.{part}") for part in parts]
    block, _, stacked = param.rpartition(".")
    if block not in experts or stacked not in ("w13", "w2"):
        return [param]
    if layout == "fused":
        return [f"{block}.experts.{'gate_up_proj' if stacked == 'w13' else 'down_proj'}"]
    projs = ("gate_proj", "up_proj") if stacked == "w13" else ("down_proj",)
    if layout == "stacked":
        return [f"{block}.experts.{proj}" for proj in projs]
    first, count = experts[block]
    return [
        f"{block}.experts.{e}.{proj}.weight" for e in range(first, first + count) for proj in projs
    ]
