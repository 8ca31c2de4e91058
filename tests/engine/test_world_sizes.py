"""Engines under a torchrun-style launch at a world size the other distributed tests do not
use (3): one engine after another in the same processes, the first refused, joins the world
again and generates the single-process tokens on every rank."""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from execrt.core.errors import ConfigError
from tests.drivers import spawn_ranks

WORLD = 3
PROMPTS = [[5, 17, 33, 2, 90, 44, 12], [250, 3, 77]]


def tiny_qwen3(path: Path) -> str:
    """A random Qwen3 whose heads and MLP rows split over 3 ranks (6 q, 3 kv heads)."""
    import transformers

    torch.manual_seed(3)
    config = transformers.Qwen3Config(
        vocab_size=131, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=16,
        max_position_embeddings=64, eos_token_id=1, bos_token_id=0,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)  # logits far from ties: greedy tokens are stable
    model.save_pretrained(str(path))
    return str(path)


def generate(engine) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from execrt import SamplingParams

    results = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4))
    return [r.token_ids for r in results]


def _rank_main(rank: int, port: int, path: str, out_dir: str) -> None:
    # What torchrun gives each rank: the rendezvous through its agent's store, which outlives
    # every process group the ranks create and destroy.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
    )  # fmt: skip
    torch.set_num_threads(1)
    from execrt import Engine

    try:
        # tp_size 2 in a world of 3 is refused after the engine joined the world (and left it).
        with pytest.raises(ConfigError, match="tp_size 2 / ep_size 2 unsupported in a world of 3"):
            Engine(path, device="cpu", tp_size=2)
        tokens = []
        for _ in range(2):  # the next engines create the group anew, and destroy it on close
            engine = Engine(path, device="cpu", tp_size=WORLD)
            tokens.append(generate(engine))
            engine.close()
            assert not dist.is_initialized()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(tokens))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_engines_rejoin_the_world_one_after_another(tmp_path: Path, monkeypatch) -> None:
    from execrt import Engine

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    path = tiny_qwen3(tmp_path / "qwen3-6q3kv")
    with Engine(path, device="cpu") as engine:
        expected = generate(engine)
    # torchrun's agent store: hosted here, for as long as the ranks run.
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    spawn_ranks(_rank_main, (store.port, path, str(tmp_path)), WORLD, tmp_path)
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == [expected, expected], f"rank {rank}: {got}"
