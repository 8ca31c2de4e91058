"""Loading a checkpoint: a Hugging Face directory (config.json plus sharded safetensors) or a
GGUF file, which is first converted into such a directory in the cache."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from execrt.core.errors import ModelLoadError
from execrt.core.interfaces import MoEDispatcher
from execrt.core.model_spec import ModelLoadRequest, ModelSpec
from execrt.core.parallel import ParallelState
from execrt.kernels import use_triton
from execrt.models.config import FAMILIES, ModelConfig, checkpoint_dir, read_json
from execrt.models.decoder import DecoderForCausalLM
from execrt.models.gguf_file import find_gguf, gguf_name
from execrt.models.layers import RotaryEmbedding
from execrt.models.quantized import dequantized

#: Hugging Face ``architectures`` value -> model class (one decoder, configured per family)
ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = dict.fromkeys(FAMILIES, DecoderForCausalLM)
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
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"model: {index} has no 'weight_map' object")
        shards = sorted({str(s) for s in weight_map.values()})
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
    """Every tensor of the files; a truncated or corrupt file raises ModelLoadError naming it."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        name = None
        try:
            with safe_open(file, framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            where = f" (tensor {name!r})" if name is not None else ""
            raise ModelLoadError(
                f"model: {file} is not a readable safetensors file{where}: {exc}"
            ) from None


def _noting_names(
    weights: Iterator[tuple[str, torch.Tensor]], seen: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        seen.add(name)
        yield name, tensor


def load_model(
    path: str | os.PathLike[str],
    config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    dispatcher: MoEDispatcher | None,
    fused_kernels: bool = False,
    parallel: ParallelState | None = None,
) -> DecoderForCausalLM:
    """Build the model for ``config.architecture`` on ``device`` and fill it from ``path``
    (a checkpoint directory, a ``.gguf`` file or a directory holding one). ``fused_kernels``
    runs the Triton kernels of ``execrt.kernels`` (see ``DecoderForCausalLM.set_fused_kernels``).
    ``parallel`` (tensor parallel): only this rank's heads and MLP rows are built and read.

    Raises ModelLoadError for an unknown architecture, a missing or mis-shaped tensor.
    """
    cls = ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise ModelLoadError(
            f"model: architecture {config.architecture!r} unsupported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    files = checkpoint_files(checkpoint_dir(path))
    model = build_empty(
        cls,
        config,
        device=device,
        dtype=dtype,
        max_positions=max_positions,
        dispatcher=dispatcher,
        parallel=parallel,
    )
    seen: set[str] = set()
    weights = dequantized(iter_weights(files), config.quantization, device)
    loaded = model.load_weights(_noting_names(weights, seen))
    missing = model.missing_weights(loaded, seen)
    if missing and find_gguf(path) is not None:  # name them as the GGUF file does
        missing = list(dict.fromkeys(gguf_name(m) for m in missing))
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"model: checkpoint {os.fspath(path)!r} lacks tensor(s) {shown}")
    model.set_fused_kernels(fused_kernels)
    return model.eval()


def build_empty(
    cls: type[DecoderForCausalLM],
    config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    dispatcher: MoEDispatcher | None,
    parallel: ParallelState | None = None,
) -> DecoderForCausalLM:
    """The model with uninitialised parameters in ``dtype`` on ``device`` (no random init)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, max_positions, dispatcher, parallel)
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

    def load(self, request: ModelLoadRequest) -> DecoderForCausalLM:
        return load_model(
            self.path,
            self.config,
            device=request.device,
            dtype=request.dtype,
            max_positions=request.max_positions,
            dispatcher=request.dispatcher,
            fused_kernels=use_triton(request.device, request.fused_kernels),
            parallel=request.parallel,
        )
