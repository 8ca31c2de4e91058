"""Stopping end to end on an eos id that only generation_config.json lists (Qwen and Llama chat
checkpoints keep their end-of-turn token there)."""

from __future__ import annotations

import json
import shutil

from execrt import Engine, SamplingParams

PROMPT = [5, 17, 33, 2, 90]


def test_greedy_generation_stops_at_the_generation_config_eos(checkpoint, tmp_path) -> None:
    source = checkpoint("dense-tied-hd64")
    free_run = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    with Engine(source, device="cpu") as engine:
        tokens = engine.generate(PROMPT, free_run).token_ids
    # The eos to be: a token greedy decoding produces, first seen a few tokens in.
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    never = next(t for t in range(2, 384) if t not in tokens)  # config.json's eos: not produced

    model = tmp_path / "model"
    shutil.copytree(source, model)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = never
    (model / "config.json").write_text(json.dumps(config))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[k]]}))

    with Engine(str(model), device="cpu") as engine:
        assert set(engine.model_config.eos_token_ids) == {never, tokens[k]}
        stopped = engine.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0))
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == tokens[: k + 1]  # the eos itself is the last token
        assert engine.generate(PROMPT, free_run).token_ids == tokens  # ignore_eos: runs on
