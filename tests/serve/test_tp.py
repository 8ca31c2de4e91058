"""``execrt serve --tp 2`` under torchrun on CPU (gloo): rank 0 serves, rank 1 follows its
schedule; the openai client gets the single-process text, a disconnect aborts on both ranks,
and rank 1 stops when rank 0 does."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import threading
from dataclasses import replace

import openai

from execrt import Engine, SamplingParams
from execrt.engine.client import RequestOutput
from tests.serve.http import abandon_stream
from tests.torchrun import torchrun_execrt

PROMPTS = ["tensor", "parallel ✓"]


def test_tp2_serves_the_single_process_text_and_aborts_on_both_ranks() -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0)
    with Engine("builtin", device="cpu") as engine:
        expected = [r.text for r in engine.generate(PROMPTS, params)]
        outputs: list[RequestOutput] = []
        engine.submit(PROMPTS[1], replace(params, max_new_tokens=1), on_output=outputs.append,
                      prompt_logprobs=1)  # fmt: skip
        while engine.step():
            pass
        scored = [lp.logprob for lp in outputs[0].prompt_logprobs or []]
    assert scored
    serve = ["serve", "--tp", "2", "--model", "builtin", "--served-model-name", "builtin"]
    proc = torchrun_execrt([*serve, "--device", "cpu", "--port", "0"])
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        ready = lines.get(timeout=240)
        assert "ready at http://127.0.0.1:" in ready, ready
        url = ready.split(" ready at ")[1].split()[0]
        api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = api.completions.create(model="builtin", prompt=PROMPTS, max_tokens=8, temperature=0)
        assert [c.text for c in got.choices] == expected
        # Prompt log-probabilities (echo): both ranks bypass the cache and cap the prefill
        # alike, so they stay in lockstep, and the values are the single process's.
        echo = api.completions.create(
            model="builtin", prompt=PROMPTS[1], max_tokens=1, logprobs=1, echo=True
        ).choices[0]
        assert echo.logprobs is not None and echo.logprobs.token_logprobs is not None
        got_scored = echo.logprobs.token_logprobs[1:-1]
        assert len(got_scored) == len(scored)
        assert all(abs(a - b) <= 1e-4 for a, b in zip(got_scored, scored, strict=True))
        body = {"prompt": "abandon", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        abandon_stream(url, body, chunks=2)
        # Both ranks dropped the abandoned request: the next one runs in lockstep again.
        greedy = api.completions.create(
            model="builtin", prompt=PROMPTS[1], max_tokens=8, temperature=0
        )
        assert greedy.choices[0].text == expected[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    summary = [x for x in err.splitlines() if "rank 1 stopped with rank 0" in x]
    assert summary, err[-3000:]
    # 2 + 1 + 1 + 1 requests, the abandoned one aborted; on rank 1 every slot is free or in
    # the prefix cache (evictable: no request holds one).
    assert "5 requests, 1 aborted" in summary[0], summary
    free, total, cached = re.findall(r"KV slots free (\d+) of (\d+), (\d+) cached", summary[0])[0]
    assert int(free) + int(cached) == int(total) and int(cached) > 0, summary
