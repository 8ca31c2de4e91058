"""Loading a Hugging Face checkpoint directory: config.json plus (sharded) safetensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from execrt.core.errors import ModelLoadError
from execrt.core.interfaces import MoEDispatcher
from execrt.core.model_spec import ModelLoadRequest, ModelSpec
from execrt.models.config import ModelConfig
from execrt.models.layers import RotaryEmbedding
from execrt.models.qwen3 import Qwen3ForCausalLM

#: Hugging Face ``architectures`` value -> model class
ARCHITECTURES: dict[str, type[Qwen3ForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3ForCausalLM,
}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    """The safetensors files of a checkpoint directory, in load order.

    Reads ``model.safetensors.index.json`` when present. Pickle checkpoints are refused:
    loading them can execute arbitrary code.
    """
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise ModelLoadError(f"model: {root!r} is not a directory")
    index = os.path.join(root, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            shards = sorted(set(json.load(fh).get("weight_map", {}).values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(root, s))]
        if missing:
            raise ModelLoadError(f"model: shard(s) listed in the index are missing: {missing}")
        return [os.path.join(root, s) for s in shards]
    names = sorted(os.listdir(root))
    tensors = [n for n in names if n.endswith(".safetensors")]
    if tensors:
        return [os.path.join(root, n) for n in tensors]
    if any(n.endswith(_PICKLE_SUFFIXES) for n in names):
        raise ModelLoadError(
            f"model: {root!r} holds only pickle checkpoints, which execrt refuses to load "
            "(they can run arbitrary code); convert them to safetensors"
        )
    raise ModelLoadError(f"model: no *.safetensors file in {root!r}")


def iter_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def load_model(
    path: str | os.PathLike[str],
    config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    dispatcher: MoEDispatcher | None,
) -> Qwen3ForCausalLM:
    """Build the model for ``config.architecture`` on ``device`` and fill it from ``path``.

    Raises ModelLoadError for an unknown architecture, a missing or mis-shaped tensor.
    """
    cls = ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise ModelLoadError(
            f"model: architecture {config.architecture!r} unsupported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    files = checkpoint_files(path)
    model = build_empty(
        cls, config, device=device, dtype=dtype, max_positions=max_positions, dispatcher=dispatcher
    )
    loaded = model.load_weights(iter_weights(files))
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"model: checkpoint {os.fspath(path)!r} lacks tensor(s) {shown}")
    return model.eval()


def build_empty(
    cls: type[Qwen3ForCausalLM],
    config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    dispatcher: MoEDispatcher | None,
) -> Qwen3ForCausalLM:
    """The model with uninitialised parameters in ``dtype`` on ``device`` (no random init)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, max_positions, dispatcher)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty breaks the sharing; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.float()
            module.reset_tables()
    return model


class CheckpointLoader:
    """The ``ModelLoader`` ModelRunner receives: reads ``config.json`` at once, weights on load."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.config = ModelConfig.from_pretrained(self.path)

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec()

    def load(self, request: ModelLoadRequest) -> Qwen3ForCausalLM:
        return load_model(
            self.path,
            self.config,
            device=request.device,
            dtype=request.dtype,
            max_positions=request.max_positions,
            dispatcher=request.dispatcher,
        )
