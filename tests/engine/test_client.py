"""The EngineClient seam's plain-Python parts: the output holder merges for a slow reader, the
waker wakes it once, and the module loads without torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

from execrt.engine.client import (
    EngineStats,
    OutputHolder,
    RequestOutput,
    TokenLogprobs,
    Waker,
    deliver,
)


def test_a_slow_reader_gets_one_merged_output() -> None:
    holder = OutputHolder()
    holder.put(RequestOutput([1], [TokenLogprobs(1, -0.1)], prompt_tokens=4))
    holder.put(RequestOutput([2, 3], [TokenLogprobs(2, -0.2), TokenLogprobs(3, -0.3)]))
    holder.put(RequestOutput([], finish_reason="length", num_retractions=1))
    out = holder.take()
    assert out is not None and out.token_ids == [1, 2, 3] and out.finished
    assert [lp.token_id for lp in out.logprobs or []] == [1, 2, 3]
    assert (out.finish_reason, out.prompt_tokens, out.num_retractions) == ("length", 4, 1)
    assert holder.take() is None
    assert len(holder.take_gaps()) == 1 and holder.take_gaps() == []  # two outputs with tokens
    t = holder.timing
    assert t.arrival <= (t.first_token or 0) <= (t.last_token or 0) <= (t.finished or 0)


def counting_calls(waker: Waker) -> list[int]:
    calls = [0]
    real = waker.loop.call_soon_threadsafe

    def counting(*args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*args)

    waker.loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    return calls


def test_the_waker_schedules_one_wakeup_per_read() -> None:
    async def go() -> int:
        waker = Waker()
        calls = counting_calls(waker)
        holder = OutputHolder(waker)
        thread = threading.Thread(
            target=lambda: [holder.put(RequestOutput([i])) for i in range(50)]
        )
        thread.start()
        thread.join()
        await asyncio.wait_for(waker.wait(), 5)
        assert holder.take() == RequestOutput(list(range(50)))
        holder.put(RequestOutput([99]))  # in the loop's own thread: no call needed
        await asyncio.wait_for(waker.wait(), 5)
        assert holder.take() == RequestOutput([99])
        return calls[0]

    assert asyncio.run(go()) == 1


def test_a_step_of_outputs_reaches_a_loop_in_one_call() -> None:
    async def go() -> tuple[int, list[list[int]]]:
        wakers = [Waker() for _ in range(3)]
        calls = counting_calls(wakers[0])  # one loop: the same object for all three
        holders = [OutputHolder(w) for w in wakers] + [OutputHolder()]  # one without a loop
        step = [(h, RequestOutput([i])) for i, h in enumerate(holders)]
        thread = threading.Thread(target=deliver, args=(step,))
        thread.start()
        thread.join()
        assert holders[3].take() == RequestOutput([3])  # at once
        for w in wakers:
            await asyncio.wait_for(w.wait(), 5)
        return calls[0], [h.take().token_ids for h in holders[:3]]  # type: ignore[union-attr]

    assert asyncio.run(go()) == (1, [[0], [1], [2]])


def test_kv_usage_counts_request_slots_only() -> None:
    stats = EngineStats(100, 40, 10, 3, 1, 0, 0, 0, 7)
    assert stats.kv_usage == 0.5
    assert EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0).kv_usage == 0.0


def test_the_seam_imports_without_torch() -> None:
    code = "import sys, execrt.engine.client; assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
