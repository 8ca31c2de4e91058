"""Checkpoint loading: formats, sharding, refusals and precise errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from execrt.core.errors import ModelLoadError
from execrt.models import ModelConfig, load_model
from execrt.models.loader import checkpoint_files


def _load(path: str):
    cfg = ModelConfig.from_pretrained(path)
    return load_model(
        path,
        cfg,
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_positions=64,
        dispatcher=None,
    )


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_sharded_checkpoint_is_read_through_its_index(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-untied-hd128-sharded"), tmp_path / "m")
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as fh:
        listed = sorted(set(json.load(fh)["weight_map"].values()))
    # A stray file beside the shards (an old export, a partial download) must not be read:
    # its tensor would shadow the real one and its garbage shape would fail the load.
    stray = os.path.join(path, "zz-stray.safetensors")
    save_file({"model.norm.weight": torch.zeros(7)}, stray)
    files = checkpoint_files(path)
    assert len(listed) > 1 and [os.path.basename(f) for f in files] == listed
    model = _load(path)
    reference = _load(checkpoint("dense-untied-hd128-sharded"))
    assert torch.equal(model.model.norm.weight, reference.model.norm.weight)


def test_missing_tensor_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match="lacks tensor.*model.layers.1.self_attn.k_norm.weight"
    ):
        _load(path)


def test_misshaped_tensor_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-tied-hd64"), tmp_path / "m")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \(3, 3\)"
    ):
        _load(path)


def test_pickle_checkpoints_are_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ModelLoadError, match="refuses to load"):
        checkpoint_files(tmp_path)


def test_missing_shard_and_unknown_architecture(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("dense-untied-hd128-sharded"), tmp_path / "m")
    shard = checkpoint_files(path)[0]
    os.remove(shard)
    with pytest.raises(ModelLoadError, match="shard.*missing"):
        checkpoint_files(path)
    other = _copy(checkpoint("dense-tied-hd64"), tmp_path / "llama")
    cfg = json.loads(open(os.path.join(other, "config.json")).read())
    cfg["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(ModelLoadError, match="architecture 'LlamaForCausalLM' unsupported"):
        load_model(
            other,
            ModelConfig.from_dict(cfg),
            device=torch.device("cpu"),
            dtype=torch.float32,
            max_positions=64,
            dispatcher=None,
        )


def test_unsupported_config_features_are_refused() -> None:
    base = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ModelLoadError, match="rope_type 'yarn' unsupported"):
        ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ModelLoadError, match="sliding-window"):
        ModelConfig.from_dict(base | {"use_sliding_window": True})
    with pytest.raises(ModelLoadError, match="'vocab_size' missing"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "vocab_size"})


def test_fused_expert_layout_loads_like_the_hub_layout(checkpoint, tmp_path) -> None:
    from execrt.backends.moe_dispatch.allreduce import AllReduceDispatcher
    from execrt.core.context import RuntimeContext
    from execrt.core.interfaces import MoEDispatcherInit
    from execrt.core.parallel import ParallelState
    from execrt.plugins.builtin import ALLREDUCE_DISPATCH

    hub = checkpoint("moe-8x2")
    fused = _copy(hub, tmp_path / "fused")
    tensors = load_file(os.path.join(fused, "model.safetensors"))
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = [
            torch.cat(
                [tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")]
            )
            for e in range(8)
        ]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)]
        tensors[p + "gate_up_proj"] = torch.stack(gate_up)
        tensors[p + "down_proj"] = torch.stack(down)
    save_file(tensors, os.path.join(fused, "model.safetensors"))
    cfg = ModelConfig.from_pretrained(hub)
    disp = AllReduceDispatcher(
        MoEDispatcherInit(
            ALLREDUCE_DISPATCH,
            8,
            2,
            cfg.hidden_size,
            torch.float32,
            torch.device("cpu"),
            16,
            ParallelState(),
            RuntimeContext(),
        )
    )
    kwargs = dict(
        device=torch.device("cpu"), dtype=torch.float32, max_positions=64, dispatcher=disp
    )
    a = load_model(hub, cfg, **kwargs).state_dict()
    b = load_model(fused, cfg, **kwargs).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
