"""FlashInfer's prefill variant: FA3 where it runs (sm90, one dtype for Q and K/V), else FA2."""

from __future__ import annotations

import pytest
import torch

from execrt.backends.attention.flashinfer_prefill import fa3_refusals, prefill_variant
from execrt.core.errors import BackendUnavailableError

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
H200, A100, B200 = (9, 0), (8, 0), (10, 0)


@pytest.mark.parametrize(
    ("capability", "cuda", "kv_dtype", "expected"),
    [
        (H200, "13.0", BF16, "fa3"),  # FlashInfer's own auto on Hopper
        (A100, "13.0", BF16, "fa2"),
        (B200, "12.8", BF16, "fa2"),
        (H200, "12.1", BF16, "fa2"),  # sm90a kernels need CUDA 12.3
        (H200, "13.0", FP8, "fa2"),  # a bf16 query cannot meet an fp8 cache in FA3
    ],
)
def test_auto_takes_fa3_only_where_it_runs(capability, cuda, kv_dtype, expected) -> None:  # type: ignore[no-untyped-def]
    assert prefill_variant("auto", capability, cuda, BF16, kv_dtype) == expected


def test_an_explicit_variant_is_kept_where_it_runs() -> None:
    assert prefill_variant("fa2", H200, "13.0", BF16, BF16) == "fa2"
    assert prefill_variant("fa3", H200, "13.0", BF16, BF16) == "fa3"
    assert prefill_variant("fa2", A100, None, BF16, FP8) == "fa2"


def test_fa3_where_it_cannot_run_is_refused_with_every_reason() -> None:
    with pytest.raises(BackendUnavailableError) as info:
        prefill_variant("fa3", A100, "12.1", BF16, FP8)
    message = str(info.value)
    assert message.startswith("attention backend 'flashinfer' unavailable: ")
    for part in ("sm90 GPU (this one is sm80)", "CUDA >= 12.3 (torch was built with 12.1)"):
        assert part in message
    assert "cannot read a float8_e4m3fn KV cache with bfloat16 queries" in message
    assert message.endswith("use 'fa2' or 'auto'")


def test_unknown_variant_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"'fa4' unsupported \(supported: auto, fa2, fa3\)"):
        prefill_variant("fa4", H200, "13.0", BF16, BF16)


def test_no_cuda_build_refuses_fa3() -> None:
    assert fa3_refusals(H200, None, BF16, BF16) == [
        "FA3 needs CUDA >= 12.3 (torch was built with None)"
    ]
    assert fa3_refusals(H200, "12.3", torch.float16, torch.float16) == []
