"""One Engine driven from many threads, and the request-level API a driver thread uses (submit,
abort, step, wait, stats, log-probabilities), on the built-in model."""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import replace

import pytest

from execrt import Engine, SamplingParams
from execrt.core.errors import RequestError
from execrt.engine.client import RequestOutput

GREEDY = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=20, seed=11, ignore_eos=True)
#: (kind, prompts, params): the calls the threads pick from
CALLS = [
    ("generate", ["one"], GREEDY),
    ("generate", ["two", "three ✓"], GREEDY),
    ("generate", ["five"], SEEDED),
    ("generate", [[5, 17, 33], "six"], replace(SEEDED, seed=3, max_new_tokens=4)),
    ("generate", ["seven"], replace(GREEDY, max_new_tokens=1)),
    ("stream", ["eight"], GREEDY),
    ("stream", ["nine"], replace(SEEDED, seed=5)),
]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    with Engine("builtin", device="cpu", max_running_requests=8, kv_cache_tokens=256) as e:
        yield e


def run_call(engine: Engine, kind: str, prompts: list, params: SamplingParams) -> list[object]:
    if kind == "stream":
        return ["".join(engine.stream(prompts[0], params))]
    return [(r.token_ids, r.text, r.finish_reason) for r in engine.generate(prompts, params)]


def assert_all_free(engine: Engine) -> None:
    """Nothing held by a request: every slot free or in the prefix cache, unlocked."""
    s = engine.stats()
    assert (s.requests_running, s.requests_waiting, s.kv_usage) == (0, 0, 0)
    assert s.kv_slots_free + s.kv_slots_cached == s.kv_slots_total
    assert not engine.has_work and engine.scheduler.finished == []
    memory = engine.scheduler.memory
    assert memory.prefix_cache is not None
    free_slots = memory.allocator.free_slot_ids().tolist()
    free_slots += memory.prefix_cache.cached_slots().tolist()
    assert sorted(free_slots) == list(range(1, s.kv_slots_total + 1))  # no duplicates
    rows = memory.req_to_token_pool
    assert sorted(rows.free_rows()) == list(range(1, rows.size + 1))


def test_four_threads_of_fifty_calls_match_one_thread(engine) -> None:
    expected = [run_call(engine, *call) for call in CALLS]
    picks = [random.Random(t).choices(range(len(CALLS)), k=50) for t in range(4)]
    got: dict[int, list[tuple[int, list[object]]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        try:
            start.wait()
            got[t] = [(i, run_call(engine, *CALLS[i])) for i in picks[t]]
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=600)
    assert not errors, errors
    assert sorted(got) == [0, 1, 2, 3]
    for t in range(4):
        for i, result in got[t]:
            assert result == expected[i], (t, CALLS[i])
    assert engine.scheduler.stats.steps > 0
    assert_all_free(engine)


def test_a_call_returns_when_its_own_requests_are_done(engine) -> None:
    long = replace(GREEDY, max_new_tokens=80)
    alone = engine.generate("short", GREEDY).token_ids
    slow = threading.Thread(target=engine.generate, args=("long", long))
    slow.start()
    while not engine.has_work:  # the long call is queued and stepping
        time.sleep(0.001)
    steps = engine.scheduler.stats.steps
    assert engine.generate("short", GREEDY).token_ids == alone
    # Returned after a handful of shared steps, long before the other call's 80.
    assert engine.scheduler.stats.steps - steps < 40
    slow.join(timeout=300)
    assert_all_free(engine)


def collect(engine: Engine, outputs: dict[int, list[RequestOutput]]):  # type: ignore[no-untyped-def]
    def sink_for(key: int):  # type: ignore[no-untyped-def]
        return lambda out: outputs.setdefault(key, []).append(out)

    return sink_for


def test_submit_and_step_give_the_generate_tokens(engine) -> None:
    reference = engine.generate(["alpha", "beta"], [GREEDY, SEEDED])
    outputs: dict[int, list[RequestOutput]] = {}
    sink = collect(engine, outputs)
    a = engine.submit("alpha", GREEDY, on_output=sink(0))
    b = engine.submit("beta", SEEDED, on_output=sink(1))
    assert a != b and engine.has_work
    steps = 0
    while engine.step():
        steps += 1
    assert steps >= GREEDY.max_new_tokens and not engine.step()
    for key, ref in enumerate(reference):
        outs = outputs[key]
        assert [t for o in outs for t in o.token_ids] == ref.token_ids
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].error is None
        assert outs[-1].prompt_tokens == len(ref.prompt_token_ids)
        # The reference just cached the prompt: all of it but the last token is found.
        assert outs[-1].cached_tokens == len(ref.prompt_token_ids) - 1
    assert_all_free(engine)


def test_abort_request_frees_at_once_and_finishes_the_output(engine) -> None:
    outputs: dict[int, list[RequestOutput]] = {}
    rid = engine.submit(
        "abort me", replace(GREEDY, max_new_tokens=100), on_output=collect(engine, outputs)(0)
    )
    engine.step()
    engine.step()
    assert engine.stats().kv_slots_free < engine.stats().kv_slots_total
    engine.abort_request(rid, "client went away")
    assert_all_free(engine)
    last = outputs[0][-1]
    assert (last.finish_reason, last.error) == ("abort", "client went away")
    engine.abort_request(rid)  # finished already: nothing happens
    engine.abort_request(12345)  # unknown: nothing happens
    assert_all_free(engine)


def test_abort_requests_aborts_many_in_one_pass_over_the_queues(engine, monkeypatch) -> None:
    # One pass per request made a client leaving with thousands of queued choices stall
    # every other request for a time growing with the square of their number.
    outputs: dict[int, list[RequestOutput]] = {}
    sp = replace(GREEDY, max_new_tokens=100)
    rids = [
        engine.submit(f"abort {i}", sp, on_output=collect(engine, outputs)(i)) for i in range(6)
    ]
    engine.step()
    passes: list[int] = []
    real = engine.scheduler.abort
    monkeypatch.setattr(
        engine.scheduler, "abort", lambda reqs, e: passes.append(len(reqs)) or real(reqs, e)
    )
    engine.abort_requests([*rids, 12345, rids[0]], "client went away")  # unknown, repeated
    assert passes == [6]
    assert_all_free(engine)
    assert all(outputs[i][-1].finish_reason == "abort" for i in range(6))


def test_submit_rejects_bad_requests_at_once(engine) -> None:
    with pytest.raises(RequestError, match="empty prompt"):
        engine.submit([], GREEDY)
    with pytest.raises(RequestError, match="temperature -1 must be a finite number"):
        engine.submit("x", replace(GREEDY, temperature=-1))
    with pytest.raises(RequestError, match="top_logprobs 21 must be an integer in 0..20"):
        engine.submit("x", GREEDY, top_logprobs=21)
    # What generate() would finish with "abort" at once is refused up front here.
    with pytest.raises(
        RequestError, match=r"needs up to 300 KV slots \(.*\) but the whole cache holds 256"
    ):
        engine.submit("x", replace(GREEDY, max_new_tokens=300))
    assert "KV slots" in (engine.validate("x", replace(GREEDY, max_new_tokens=300)) or "")
    assert engine.validate("x", GREEDY) is None
    assert not engine.has_work


def test_a_callback_that_raises_harms_nobody(engine) -> None:
    def boom(out: RequestOutput) -> None:
        raise ValueError("consumer bug")

    engine.submit("x", GREEDY, on_output=boom)
    other = engine.generate("y", GREEDY)
    while engine.step():
        pass
    assert len(other.token_ids) == GREEDY.max_new_tokens
    assert_all_free(engine)


@pytest.mark.parametrize("call", ["generate", "step", "flush_cache", "close", "stream"])
def test_a_callback_that_calls_back_into_a_step_is_refused_not_hung(engine, call) -> None:
    """A callback runs on the thread that steps: a call that waits for a step would wait for
    itself (it hung the engine for good, and every later caller with it)."""
    seen: list[BaseException] = []

    def reenter(out: RequestOutput) -> None:
        if not out.finished:
            return
        try:
            if call == "stream":
                "".join(engine.stream("inner", GREEDY))
            else:
                getattr(engine, call)(*(["inner", GREEDY] if call == "generate" else []))
        except RuntimeError as exc:
            seen.append(exc)

    engine.submit("outer", GREEDY, on_output=reenter)
    engine.submit("longer", replace(GREEDY, max_new_tokens=6))  # still running meanwhile
    done = threading.Event()

    def drive() -> None:
        while engine.step():
            pass
        done.set()

    threading.Thread(target=drive, daemon=True).start()
    assert done.wait(timeout=60), f"{call} from a callback hung the engine"
    assert len(seen) == 1 and "from the thread that is stepping the engine" in str(seen[0])
    assert not engine._closed  # close() was refused too, before it freed anything
    assert len(engine.generate("after", GREEDY).token_ids) == GREEDY.max_new_tokens
    assert_all_free(engine)


def test_wait_for_work_blocks_until_a_request_is_queued(engine) -> None:
    assert engine.wait_for_work(timeout=0.01) is False
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(engine.wait_for_work(timeout=30)))
    waiter.start()
    time.sleep(0.05)
    assert not woke  # still blocked: nothing to do
    engine.submit("wake", GREEDY)
    waiter.join(timeout=30)
    assert woke == [True]
    while engine.step():
        pass
    assert_all_free(engine)


def test_a_driver_thread_steps_while_others_submit(engine) -> None:
    reference = engine.generate([f"p{i}" for i in range(6)], GREEDY)
    outputs: dict[int, list[RequestOutput]] = {}
    sink = collect(engine, outputs)
    stop = threading.Event()

    def drive() -> None:
        while not stop.is_set():
            if not engine.step():
                engine.wait_for_work(timeout=0.05)

    driver = threading.Thread(target=drive)
    driver.start()
    for i in range(6):
        engine.submit(f"p{i}", GREEDY, on_output=sink(i))
        time.sleep(0.01)
    deadline = time.monotonic() + 120
    while len([k for k, v in outputs.items() if v[-1].finished]) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stop.set()
    driver.join(timeout=30)
    for i, ref in enumerate(reference):
        assert [t for o in outputs[i] for t in o.token_ids] == ref.token_ids
    assert_all_free(engine)


def test_stats_count_running_and_waiting_requests(engine) -> None:
    before = engine.stats()
    for i in range(10):  # more than max_running_requests (8)
        engine.submit(f"s{i}", GREEDY)
    engine.step()  # one extend admits up to 8
    s = engine.stats()
    assert s.requests_running + s.requests_waiting == 10 and s.requests_running >= 1
    assert s.kv_slots_free < s.kv_slots_total and 0 < s.kv_usage <= 1
    assert s.prefix_query_tokens > before.prefix_query_tokens  # the admitted prompts
    assert s.prefix_hit_tokens <= s.prefix_query_tokens
    while engine.step():
        pass
    assert engine.stats().steps > before.steps
    assert_all_free(engine)


def test_a_prefill_chunked_over_steps_counts_as_running_from_its_first_chunk() -> None:
    with Engine("builtin", device="cpu", max_prefill_tokens=16, kv_cache_tokens=256) as e:
        e.submit("x" * 40, GREEDY)  # 40+ tokens: three chunks of at most 16
        assert (e.stats().requests_running, e.stats().requests_waiting) == (0, 1)
        e.step()  # the first chunk: the request holds KV and is served
        s = e.stats()
        assert e.scheduler.waiting and e.scheduler.memory.holds(e.scheduler.waiting[0])
        assert (s.requests_running, s.requests_waiting) == (1, 0)
        while e.step():
            pass
        s = e.stats()
        assert (s.requests_running, s.requests_waiting) == (0, 0)


def test_logprobs_are_the_model_distribution(engine) -> None:
    outputs: dict[int, list[RequestOutput]] = {}
    sink = collect(engine, outputs)
    engine.submit("log", GREEDY, on_output=sink(0), top_logprobs=3)
    engine.submit("log", replace(SEEDED, max_new_tokens=6), on_output=sink(1), top_logprobs=0)
    engine.submit("nolog", GREEDY, on_output=sink(2))
    while engine.step():
        pass
    greedy = [lp for o in outputs[0] for lp in o.logprobs or []]
    tokens = [t for o in outputs[0] for t in o.token_ids]
    assert [lp.token_id for lp in greedy] == tokens == engine.generate("log", GREEDY).token_ids
    for lp in greedy:
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1.0
        # Greedy picks the most likely token: it heads the list, with its own log-probability.
        assert lp.top[0] == (lp.token_id, lp.logprob) and lp.logprob <= 0
    sampled = [lp for o in outputs[1] for lp in o.logprobs or []]
    assert len(sampled) == 6 and all(lp.top == () and lp.logprob <= 0 for lp in sampled)
    assert all(o.logprobs is None for o in outputs[2])
    assert engine.worker._watched == {}  # nothing left watched after the requests finished
    assert_all_free(engine)


def test_close_while_other_threads_generate_waits_for_the_step_and_fails_them_clearly() -> None:
    """close() used to free the model under a running step (the callers then failed with an
    unrelated radix-cache error; on a GPU the step read freed memory). The step in progress
    ends first, then every running or waiting call raises 'closed'."""
    engine = Engine("builtin", device="cpu", max_running_requests=2, kv_cache_tokens=256)
    long = replace(GREEDY, max_new_tokens=200)
    errors: list[BaseException] = []
    started = threading.Event()

    def call() -> None:
        try:
            started.set()
            engine.generate("keep going", long)
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(timeout=30)
    deadline = time.monotonic() + 30
    while engine.stats().requests_running == 0 and time.monotonic() < deadline:
        time.sleep(0.005)  # a step is under way
    assert engine.close() == []
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a caller hung after close()"
    assert len(errors) == 2, errors
    assert all("closed" in str(e) for e in errors), errors
    with pytest.raises(RuntimeError, match="after close"):
        engine.generate("late", GREEDY)
