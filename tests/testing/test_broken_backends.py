"""Deliberately broken backends fail their suites, with messages that say what and where."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from execrt.testing.report import run_suite_source

HEADER = """
from execrt.testing.attention import AttentionBackendSuite
from execrt.testing.graph import GraphBackendSuite
from execrt.testing.moe import MoEDispatcherSuite
from execrt.testing.prefix_cache import PrefixCacheSuite
from tests.testing import fake_backends as fakes
"""


def run_suite(
    tmp_path: Path, body: str, kind: str, select: str, extra: tuple[str, ...] = ()
) -> tuple[int, dict[str, Any]]:
    """Run a generated suite module in-process; (exit code, JSON report)."""
    path = tmp_path / "report.json"
    code = run_suite_source(
        HEADER + body,
        kind=kind,
        name="broken",
        json_path=str(path),
        extra_pytest_args=("-k", select, *extra),
        out=io.StringIO(),
    )
    return code, json.loads(path.read_text())


def cpu_suite(fake: str, capabilities: str, suite: str) -> str:
    """A suite module body holding ``fake_backends.<fake>`` to ``suite`` on CPU."""
    return f"""
class TestBroken({suite}):
    factory = "tests.testing.fake_backends:{fake}"
    capabilities = fakes.{capabilities}
    devices = ("cpu",)
"""


def cpu_attention_suite(fake: str, capabilities: str = "NATIVE_CAPS") -> str:
    return cpu_suite(fake, capabilities, "AttentionBackendSuite")


def cpu_graph_suite(fake: str) -> str:
    return cpu_suite(fake, "REEXEC_CAPS", "GraphBackendSuite")


def failures(report: dict[str, Any]) -> dict[str, str]:
    return {r["id"]: r["reason"] for r in report["results"] if r["outcome"] == "failed"}


def test_wrong_scale_attention_fails_with_scenario_and_error(tmp_path: Path) -> None:
    body = cpu_attention_suite("WrongScaleAttention")
    code, report = run_suite(tmp_path, body, "attention", "decode-ragged or extend-prefix")
    assert code == 1
    failed = failures(report)
    assert "test_scenario[cpu-float32-decode-ragged]" in failed, failed
    reason = failed["test_scenario[cpu-float32-decode-ragged]"]
    assert "cpu-float32-decode-ragged, layer 0: max relative error" in reason
    assert "exceeds tolerance 0.0001 (float32)" in reason and "worst at request" in reason
    row = next(r for r in report["results"] if r["id"].endswith("decode-ragged]"))
    assert row["max_error"] > row["tolerance"]


def failed_scenarios(tmp_path: Path, fake: str, capabilities: str, *scenarios: str) -> list[str]:
    """Run ``fake`` on the CPU float32 ``scenarios``; each must fail: their reasons."""
    body = cpu_attention_suite(fake, capabilities)
    code, report = run_suite(tmp_path, body, "attention", " or ".join(scenarios))
    assert code == 1
    failed = failures(report)
    assert set(failed) == {f"test_scenario[cpu-float32-{s}]" for s in scenarios}, failed
    return list(failed.values())


def test_a_storing_backend_that_stores_nothing_fails_naming_the_slots(tmp_path: Path) -> None:
    reasons = failed_scenarios(
        tmp_path, "ForgetfulStoringAttention", "STORES_CAPS", "decode-single", "extend-single"
    )
    for reason in reasons:
        assert "K at out_cache_loc not stored exactly (slots [" in reason, reason


def test_a_softmax_without_its_row_maximum_fails_the_large_logit_scenarios(
    tmp_path: Path,
) -> None:
    # Random q and k keep logits within a few units: it passed every other case (an audit
    # of 52 broken backends found it among 12 the suite passed).
    reasons = failed_scenarios(
        tmp_path, "NoMaxSoftmaxAttention", "NATIVE_CAPS", "decode-large-logits",
        "extend-large-logits",
    )  # fmt: skip
    for reason in reasons:
        assert "non-finite output values" in reason or "max relative error" in reason, reason


def test_a_16_bit_path_with_the_wrong_groups_fails_at_gqa_3_and_7(tmp_path: Path) -> None:
    # GQA ratios ran in the primary dtype only (fp32 on CPU): its fp16 path was never held.
    body = cpu_attention_suite("HalfModuloGroupsAttention", "HALF_CAPS")
    code, report = run_suite(tmp_path, body, "attention", "test_gqa_ratio")
    assert code == 1
    failed = failures(report)
    assert set(failed) == {
        f"test_gqa_ratio[cpu-float16-{mode}-gqa{ratio}]"
        for mode in ("decode", "extend")
        for ratio in (3, 7)
    }, failed


def test_a_16_bit_fp8_read_without_v_scale_fails_its_dtypes_kv_cases(tmp_path: Path) -> None:
    # The fp8 cases ran in the primary dtype only (fp32 on CPU): V 4x off passed.
    body = cpu_attention_suite("HalfNoVScaleAttention", "HALF_FP8_CAPS")
    code, report = run_suite(tmp_path, body, "attention", "test_kv_dtype and float16-kv")
    assert code == 1
    failed = failures(report)
    assert failed and all("-float16-kv_float8" in case for case in failed), failed


def test_a_decode_grid_of_16_requests_fails_the_wide_batch(tmp_path: Path) -> None:
    # The largest batches were 5 (CPU) and 16 (CUDA); engines decode 64-256 at once.
    (reason,) = failed_scenarios(tmp_path, "SixteenRowsAttention", "NATIVE_CAPS", "decode-wide")
    assert "max relative error" in reason and "worst at request" in reason, reason


def test_nan_left_at_padding_slot_0_fails_the_padded_steps(tmp_path: Path) -> None:
    # Its outputs are right (it skips slot 0 itself), but every gathering backend reads slot
    # 0 under a mask, and 0 x NaN is NaN; the cache check excused slot 0 in padded steps.
    reasons = failed_scenarios(tmp_path, "Slot0NaNStoringAttention", "STORES_CAPS", "decode-padded")
    assert "K cache slot 0 (padding's) holds inf or NaN after a padded step" in reasons[0]


def test_wrong_scale_is_caught_by_generated_cases_too(tmp_path: Path) -> None:
    pytest.importorskip("hypothesis")  # the generated cases draw with it (absent: they skip)
    body = """
class TestBroken(AttentionBackendSuite):
    factory = "tests.testing.fake_backends:WrongScaleAttention"
    capabilities = fakes.NATIVE_CAPS
    devices = ("cpu",)
    max_examples = 3
"""
    code, report = run_suite(tmp_path, body, "attention", "test_generated")
    assert code == 1
    failed = failures(report)
    assert set(failed) == {f"test_generated[cpu-float32-{m}]" for m in ("decode", "extend")}
    # The one-line reason of the table is the error; the drawn step (and Hypothesis's example)
    # follow it.
    for mode in ("decode", "extend"):
        first, *rest = failed[f"test_generated[cpu-float32-{mode}]"].splitlines()
        assert f"cpu-float32-{mode}, layer 0: max relative error" in first, first
        assert any(line.startswith(f"in Step(mode='{mode}'") for line in rest), rest
    for row in (r for r in report["results"] if r["outcome"] == "failed"):
        assert row["max_error"] > row["tolerance"], row


def test_a_context_cut_at_4096_tokens_fails_the_long_decode_on_cpu(tmp_path: Path) -> None:
    (reason,) = failed_scenarios(tmp_path, "FourKContextAttention", "NATIVE_CAPS", "decode-long")
    assert "max relative error" in reason and "worst at request 1" in reason, reason


@pytest.mark.parametrize(
    ("backend", "expect"),
    [
        ("FreshBuffersGraphAttention", "moved (data_ptr"),
        ("StaleSeqLensGraphAttention", "max relative error"),
    ],
)
def test_broken_graph_metadata_fails_the_graph_test(
    tmp_path: Path, backend: str, expect: str
) -> None:
    body = cpu_attention_suite(backend, "GRAPH_CAPS")
    code, report = run_suite(tmp_path, body, "attention", "test_graph_metadata or decode-single")
    assert code == 1
    failed = failures(report)
    assert list(failed) == ["test_graph_metadata[cpu-float32]"], failed  # eager path is fine
    assert "cpu-float32 graph step 1 (bucket 4)" in failed["test_graph_metadata[cpu-float32]"]
    assert expect in failed["test_graph_metadata[cpu-float32]"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (sync, memory)")
@pytest.mark.parametrize(
    ("backend", "expect", "step"),
    [
        ("SyncingGraphAttention", "plan_graph waited for the device", 0),
        # Memory kept by a bucket's first plan is allowed: the repeated plan (step 1) is not.
        ("HoardingGraphAttention", "plan_graph kept", 1),
    ],
)
def test_a_graph_plan_that_syncs_or_keeps_memory_fails_on_cuda(
    tmp_path: Path, backend: str, expect: str, step: int
) -> None:
    body = f"""
class TestBroken(AttentionBackendSuite):
    factory = "tests.testing.fake_backends:{backend}"
    capabilities = fakes.CUDA_GRAPH_CAPS
    devices = ("cuda",)
"""
    select = "test_graph_metadata or test_cuda_graph_replay or decode-single"
    code, report = run_suite(tmp_path, body, "attention", select)
    assert code == 1
    failed = failures(report)
    assert set(failed) == {
        "test_graph_metadata[cuda-float32]",
        "test_cuda_graph_replay[cuda-float32]",
    }, failed  # the eager path is fine, and so are the outputs
    for reason in failed.values():
        assert expect in reason and "max relative error" not in reason, reason
    label = f"cuda-float32 graph step {step} (bucket 8)"
    assert label in failed["test_graph_metadata[cuda-float32]"]


@pytest.mark.parametrize("backend", ["StaticGraphAttention", "LazyBucketGraphAttention"])
def test_the_graph_plan_checks_pass_a_well_behaved_backend_on_cuda(
    tmp_path: Path, backend: str
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (sync, memory)")
    body = f"""
class TestGood(AttentionBackendSuite):
    factory = "tests.testing.fake_backends:{backend}"
    capabilities = fakes.CUDA_GRAPH_CAPS
    devices = ("cuda",)
"""
    code, report = run_suite(tmp_path, body, "attention", "test_graph_metadata or test_cuda_graph")
    assert code == 0, failures(report)


def test_dispatcher_dropping_a_token_fails_at_world_1_and_2_and_in_generated_cases(
    tmp_path: Path,
) -> None:
    pytest.importorskip("hypothesis")  # the generated cases draw with it (absent: they skip)
    body = """
class TestBroken(MoEDispatcherSuite):
    factory = "tests.testing.fake_backends:DropLastTokenDispatcher"
    capabilities = fakes.ALLREDUCE_LIKE_CAPS
    devices = ("cpu",)
    max_examples = 3
"""
    select = "w1-random or w2 or all_masked or test_generated"
    code, report = run_suite(tmp_path, body, "moe_dispatch", select)
    assert code == 1
    failed = failures(report)
    reason = failed["test_routing[cpu-float32-w1-random]"]
    assert "rank 0 routing random (9 tokens): max relative error" in reason
    assert "worst at token 8" in reason  # the dropped one
    w2 = failed["test_world_size[cpu-float32-w2-replicated]"]
    assert "rank 1 routing hot_expert" in w2 and "rank 0 routing hot_expert" in w2
    passed = {r["id"] for r in report["results"] if r["outcome"] == "passed"}
    assert "test_routing[cpu-float32-w1-all_masked]" in passed  # nothing to drop there
    # A generated case's one-line reason is the error, the drawn counts after it.
    row = next(r for r in report["results"] if r["id"] == "test_generated[cpu-float32-w1]")
    assert row["outcome"] == "failed" and row["max_error"] > row["tolerance"], row
    first = row["reason"].splitlines()[0]
    assert first.startswith("AssertionError: max relative error") and "(T=" in first, first


@pytest.mark.parametrize(
    ("broken", "caps", "failing", "message"),
    [
        # Each passed before the suite checked unnormalised weights, the inputs after dispatch,
        # the max_tokens_per_rank bound and rows past expert_counts (a black-box plugin audit).
        ("RenormalisingDispatcher", "ALLREDUCE_LIKE_CAPS", "routing-w1-balanced", "max relative"),
        (
            "MaskedToExpertZeroDispatcher",
            "ALLREDUCE_LIKE_CAPS",
            "routing-w1-all_masked",
            "max absolute (the reference is zero) error",
        ),
        (
            "InputWritingDispatcher",
            "ALLREDUCE_LIKE_CAPS",
            "routing-w1-all_masked",
            "wrote into the caller's hidden_states",
        ),
        (
            "BoundExclusiveDispatcher",
            "ALLREDUCE_LIKE_CAPS",
            "routing-w1-random",
            "worst at token 8",
        ),
        ("CountsFlippingDispatcher", "EXPERT_MAJOR_CAPS", "routing-w1-random", "rows past expert_"),
        # Each passed before the suite ran 300 tokens, other expert counts, hidden size 72, and
        # checked outputs across calls (a second audit, session 38).
        ("Int8CountsDispatcher", "PER_RANK_CAPS", "routing-w1-many_tokens", ""),
        ("EightExpertsDispatcher", "ALLREDUCE_LIKE_CAPS", "expert_count-w1-e12", "max relative"),
        (
            "BlockScaledDispatcher",
            "ALLREDUCE_LIKE_CAPS",
            "hidden_size-w1-h72",
            "shape '[9, -1, 32]' is invalid",
        ),
        (
            "HoardingDispatcher",
            "ALLREDUCE_LIKE_CAPS",
            "reused_dispatcher-w1",
            "still holds 3 tensor(s) of this call",
        ),
        (
            "TransposedOutputDispatcher",
            "ALLREDUCE_LIKE_CAPS",
            "routing-w1-random",
            "combine returned a non-contiguous tensor (strides (1, 9))",
        ),
        (
            "ReusedOutputDispatcher",
            "ALLREDUCE_LIKE_CAPS",
            "reused_dispatcher-w1",
            "combine's output for routing random changed when the dispatcher ran",
        ),
    ],
)
def test_dispatchers_broken_in_ways_the_oracle_alone_missed_fail_saying_what(
    tmp_path: Path, broken: str, caps: str, failing: str, message: str
) -> None:
    test, case = failing.split("-", 1)  # "routing-w1-random": test_routing[cpu-float32-w1-random]
    body = cpu_suite(broken, caps, "MoEDispatcherSuite")
    code, report = run_suite(tmp_path, body, "moe_dispatch", f"test_{test} and {case}")
    assert code == 1
    failed = failures(report)
    assert list(failed) == [f"test_{test}[cpu-float32-{case}]"], failed
    assert message in failed[f"test_{test}[cpu-float32-{case}]"], failed


def test_a_dispatcher_written_for_two_ranks_fails_at_three(tmp_path: Path) -> None:
    body = cpu_suite("TwoRanksDispatcher", "ALLREDUCE_LIKE_CAPS", "MoEDispatcherSuite")
    code, report = run_suite(tmp_path, body, "moe_dispatch", "test_world_size and w3")
    assert code == 1
    reason = failures(report)["test_world_size[cpu-float32-w3-replicated]"]
    assert "rank 2 routing random (9 tokens): max relative error" in reason, reason


def test_a_rank_that_raises_fails_the_world_test_without_hanging(tmp_path: Path) -> None:
    body = """
class TestBroken(MoEDispatcherSuite):
    factory = "tests.testing.fake_backends:RankOneRaisesDispatcher"
    capabilities = fakes.ALLREDUCE_LIKE_CAPS
    devices = ("cpu",)
    multiprocess_timeout_s = 120.0
"""
    # A hang would end only at the 120 s timeout, with a timeout as the reason; the bound leaves
    # room for a loaded machine (a GPU host compiling kernels on every core took 35 s).
    started = time.monotonic()
    code, report = run_suite(tmp_path, body, "moe_dispatch", "w2")
    assert code == 1 and time.monotonic() - started < 110
    reason = failures(report)["test_world_size[cpu-float32-w2-replicated]"]
    # Where every rank was: the one that raised, and the one left waiting for it.
    assert "rank 1 raised in routing random (9 tokens) (rank 0: " in reason, reason
    assert "rank 1 dispatch exploded" in reason


def test_graph_backend_replaying_stale_outputs_fails(tmp_path: Path) -> None:
    body = cpu_graph_suite("StaleReplayGraph")
    code, report = run_suite(tmp_path, body, "graph", "cpu")
    assert code == 1
    failed = failures(report)
    assert set(failed) >= {
        "test_replay_matches_eager[cpu]",
        "test_cleanup_is_idempotent_and_allows_recapture[cpu]",
    }
    assert "test_replay_returns_captured_objects[cpu]" not in failed
    assert "replay 0 of ShapeKey(batch_size=8" in failed["test_replay_matches_eager[cpu]"]
    assert "differs from eager" in failed["test_replay_matches_eager[cpu]"]


@pytest.mark.parametrize(
    ("broken", "failing", "message"),
    [
        ("FloatOnlyCopyGraph", "test_replay_matches_eager", "the int64 output 'positive' is"),
        ("HoardingGraph", "test_cleanup_is_idempotent_and_allows_recapture", "still holds"),
        ("ClosedResourcesGraph", "test_graph_resources", "close_graph_resources calls"),
        ("ResourcesFirstGraph", "test_graph_resources", "were still captured"),
        ("UnboundReplayGraph", "test_graph_resources", "warmed for another bucket"),
        (
            "EagerKeyGraph",
            "test_a_failed_capture_leaves_the_key_uncaptured",
            "is True after its capture failed",
        ),
        ("TwiceRunGraph", "test_replay_matches_eager", "variant=''): 2}"),
        ("EveryKeyGraph", "test_replay_matches_eager", "runs the function of this key once"),
    ],
)
def test_graph_backends_the_audit_wrote_fail_saying_what(
    tmp_path: Path, broken: str, failing: str, message: str
) -> None:
    """Each a graph backend written from the docs that passed the suite before its check
    (integer outputs left stale give wrong sampled tokens in the engine; the rest leak,
    use closed resources, replay on the wrong bucket or run a step twice)."""
    body = cpu_graph_suite(broken)
    code, report = run_suite(tmp_path, body, "graph", "cpu")
    failed = failures(report)
    assert code == 1 and f"{failing}[cpu]" in failed, failed
    assert message in failed[f"{failing}[cpu]"]


def test_graph_backend_accepting_a_duplicate_capture_fails_saying_so(tmp_path: Path) -> None:
    body = cpu_graph_suite("RecapturingGraph")
    code, report = run_suite(tmp_path, body, "graph", "test_has_and_duplicate_capture")
    assert code == 1
    assert failures(report) == {
        "test_has_and_duplicate_capture[cpu]": (
            "Failed: cpu: capture(ShapeKey(batch_size=4, variant='')) a second time did not "
            "raise; a captured key must be refused until cleanup(), not silently re-recorded"
        )
    }


@pytest.mark.parametrize(
    ("broken", "failing", "message"),
    [
        (
            "LockBlindRadix",
            {"test_lock_moves_the_path_between_evictable_and_protected[cpu]"},
            "after lock: protected 0, locked paths: 5",
        ),
        (
            "EvictsLockedRadix",
            {"test_eviction_never_touches_locked_entries[cpu]"},
            "evict freed slot 3 of locked [1, 2, 3]",
        ),
        ("EvictsLockedRadix", {"test_generated[cpu-hits]"}, "locked"),
        ("AliasingRadix", {"test_generated[cpu-hits]"}, "a cache must copy the slot ids"),
        (
            "OverUnlockingRadix",
            {"test_lock_misuse_raises_value_error[cpu]"},
            "an unlock more than the locks did not raise ValueError",
        ),
        (
            "StaleNodeRadix",
            {"test_lock_misuse_raises_value_error[cpu]"},
            "lock of an evicted node did not raise ValueError",
        ),
        (
            "ResetListingRadix",
            {"test_reset_forgets_without_freeing[cpu]"},
            "cached_slots() lists [1, 2, 3] after reset()",
        ),
        ("ListKeyRadix", {"test_match_returns_the_inserted_slots[cpu]"}, "the longest cached"),
        (
            "MostRecentFirstRadix",
            {"test_eviction_takes_least_recently_used_leaves_first[cpu]"},
            "evicting 4 left z cached",
        ),
        (
            "InsertNoTouchRadix",
            {"test_eviction_takes_least_recently_used_leaves_first[cpu]"},
            "evicting 4 took y before z",
        ),
        ("ForceMissNoWalkRadix", {"test_force_miss_reports_no_match[cpu]"}, "still mark"),
        (
            "StaleMatchNodeRadix",
            {"test_insert_and_match_hands_a_running_prefix_to_the_cache[cpu]"},
            "(the lock moved to its node): protected 0, locked paths: 4",
        ),
        ("StaleMatchNodeRadix", {"test_generated[cpu-hits]"}, "protected"),
        ("NoSuperInitRadix", {"test_empty_cache[cpu]"}, "must call super().__init__(init)"),
        (
            "PathCountUnlockRadix",
            {"test_lock_misuse_raises_value_error[cpu]"},
            "unlock of a node that was not locked itself",
        ),
        ("ShortMatchRadix", {"test_match_returns_the_inserted_slots[cpu]"}, "the longest cached"),
        ("ForceMissIgnoredRadix", {"test_force_miss_reports_no_match[cpu]"}, "under force_miss"),
        (
            "DuplicateFreeingRadix",
            {"test_insert_returns_the_cached_length[cpu]"},
            "disposed of duplicates",
        ),
        (
            "SlotListLosingRadix",
            {"test_lock_moves_the_path_between_evictable_and_protected[cpu]"},
            "after lock: cached_slots() lists",
        ),
        # a prefix-cache plugin audit's escapes (each crashed the engine or served wrong KV)
        (
            "CappedRadix",
            {"test_long_keys_many_slots_and_wide_slot_ids[cpu]"},
            "after finish: free 2196 + evictable 1500",
        ),
        (
            "RecursiveLockRadix",
            {"test_long_keys_many_slots_and_wide_slot_ids[cpu]"},
            "RecursionError",
        ),
        (
            "NarrowSlotsRadix",
            {"test_long_keys_many_slots_and_wide_slot_ids[cpu]"},
            "(listed, not owned: [-31072",
        ),
        (
            "SharedBufferRadix",
            {"test_long_keys_many_slots_and_wide_slot_ids[cpu]"},
            "the slots of an earlier match changed",
        ),
        ("CloseOnceRadix", {"test_empty_cache[cpu]"}, "RuntimeError: closed twice"),
    ],
)
def test_broken_prefix_caches_fail_saying_what(
    tmp_path: Path, broken: str, failing: set[str], message: str
) -> None:
    body = f"""
class TestBroken(PrefixCacheSuite):
    devices = ("cpu",)
    max_examples = 25
    shrink_failures = False
    capabilities = fakes.RADIX_CAPS
    factory = "tests.testing.fake_backends:{broken}"
"""
    select = " or ".join(sorted(f.split("[")[0] for f in failing))
    code, report = run_suite(tmp_path, body, "prefix_cache", select)
    assert code == 1
    failed = failures(report)
    assert failing <= set(failed), failed
    for test_id in failing:
        assert message in failed[test_id], failed[test_id]


def test_a_cache_with_a_new_empty_tensor_per_miss_passes(tmp_path: Path) -> None:
    # The harness tells requests apart by identity: comparing two matches compared their
    # slot tensors, which raised for any cache but one that shares a single empty tensor.
    body = """
class TestFresh(PrefixCacheSuite):
    devices = ("cpu",)
    max_examples = 25
    capabilities = fakes.RADIX_CAPS
    factory = "tests.testing.fake_backends:FreshEmptyRadix"
"""
    code, report = run_suite(tmp_path, body, "prefix_cache", "generated or insert")
    assert code == 0, failures(report)


def test_a_backend_right_only_for_power_of_two_groups_fails_at_gqa_3_and_7(tmp_path: Path) -> None:
    body = cpu_attention_suite("PowerOfTwoGroupsAttention")
    code, report = run_suite(tmp_path, body, "attention", "gqa")
    assert code == 1
    failed = failures(report)
    assert {case.split("-gqa")[1].rstrip("]") for case in failed} == {"3", "7"}, failed
    passed = [r["id"] for r in report["results"] if r["outcome"] == "passed"]
    for group in ("gqa2]", "gqa4]", "gqa8]", "gqa16]"):
        assert any(case.endswith(group) for case in passed), (group, passed)


def test_a_backend_that_writes_into_the_batch_fails_naming_the_field(tmp_path: Path) -> None:
    body = cpu_attention_suite("BatchWritingAttention")
    code, report = run_suite(tmp_path, body, "attention", "decode-ragged or extend-prefix")
    assert code == 1
    reasons = failures(report).values()
    assert reasons and all("wrote into the batch's positions" in r for r in reasons), reasons


def test_a_backend_without_decode_or_extend_is_refused_where_both_run() -> None:
    import torch

    from execrt.core.interfaces import AttentionCapabilities, AttentionRequirements

    engine = AttentionRequirements("cpu", torch.float32, 64, 4, 2)  # an engine runs both
    assert AttentionCapabilities(decode=False).refusals(engine) == [
        "decode steps unsupported (capability decode is False)"
    ]
    assert AttentionCapabilities(extend=False).refusals(engine) == [
        "extend steps unsupported (capability extend is False)"
    ]
    decode_only = AttentionRequirements("cpu", torch.float32, 64, 4, 2, extend=False)
    assert AttentionCapabilities(extend=False).refusals(decode_only) == []


def test_a_plan_kept_per_set_of_requests_fails_the_continuing_steps(tmp_path: Path) -> None:
    """A black-box audit's backend that passed every check before the continuing steps (an
    engine run of it gave other greedy tokens for every prompt)."""
    body = cpu_attention_suite("RowsKeptAttention")
    code, report = run_suite(tmp_path, body, "attention", "not generated")
    failed = failures(report)
    assert code == 1 and list(failed) == ["test_multi_layer_multi_step[cpu-float32]"], failed
    assert "step 6 (decode)" in failed["test_multi_layer_multi_step[cpu-float32]"]


def test_nan_in_padded_graph_rows_fails_naming_the_padding(tmp_path: Path) -> None:
    # Every real row is exact; the padded rows' NaN would reach slot 0 in a model.
    body = cpu_attention_suite("NaNPaddingGraphAttention", "GRAPH_CAPS")
    code, report = run_suite(tmp_path, body, "attention", "test_graph_metadata or decode-padded")
    assert code == 1
    failed = failures(report)
    assert list(failed) == ["test_graph_metadata[cpu-float32]"], failed
    reason = failed["test_graph_metadata[cpu-float32]"]
    assert "padded rows 3..3 hold non-finite values" in reason, reason


def test_a_kernel_blind_to_strides_fails_on_the_models_strided_v(tmp_path: Path) -> None:
    # The model hands v as a view of the q/k/v projection; the suite did not, and such a
    # backend passed every case, then wrote wrong tokens from the first one.
    reasons = failed_scenarios(
        tmp_path, "StrideBlindStoringAttention", "STORES_CAPS", "decode-ragged", "extend-ragged"
    )
    assert all("V at out_cache_loc not stored exactly" in r for r in reasons), reasons


def test_a_plan_kept_by_shape_fails_the_multi_step_test(tmp_path: Path) -> None:
    body = cpu_attention_suite("ShapeMemoAttention")
    code, report = run_suite(tmp_path, body, "attention", "test_multi_layer_multi_step")
    assert code == 1
    reason = failures(report)["test_multi_layer_multi_step[cpu-float32]"]
    assert "step 2 (decode), layer 0: max relative error" in reason, reason


def test_a_write_into_q_is_named_as_one(tmp_path: Path) -> None:
    [reason] = failed_scenarios(tmp_path, "QScalingAttention", "NATIVE_CAPS", "decode-single")
    assert "the backend wrote into layer 0's q (q, k and v are read-only" in reason, reason
    assert "max relative error" not in reason  # the oracle read what the backend was given


def test_a_check_that_raises_fails_the_cases_instead_of_skipping_them(tmp_path: Path) -> None:
    body = """
def broken_check(requirements):
    raise RuntimeError("probe crashed")


class TestBroken(AttentionBackendSuite):
    factory = "execrt.backends.attention.torch_native:TorchNativeAttnBackend"
    capabilities = fakes.NATIVE_CAPS
    devices = ("cpu",)
    refusal_check = broken_check
"""
    code, report = run_suite(tmp_path, body, "attention", "decode-single")
    assert code == 1
    reason = failures(report)["test_scenario[cpu-float32-decode-single]"]
    assert "check raised RuntimeError('probe crashed')" in reason, reason
