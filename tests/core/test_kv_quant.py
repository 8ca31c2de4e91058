"""The fp8 KV cache formats, the one quantize-on-store and the per-layer scales."""

from __future__ import annotations

import pytest
import torch

from execrt.core.kv_quant import (
    K_INV_SCALE,
    KV_CACHE_DTYPES,
    V_SCALE,
    KVScales,
    dequantize,
    fp8_format,
    kv_storage_dtype,
    quantize,
    store,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_every_config_name_has_a_storage_dtype() -> None:
    from execrt.core.config import KV_CACHE_DTYPES as CONFIG_NAMES

    assert tuple(KV_CACHE_DTYPES) == CONFIG_NAMES
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.bfloat16) == E4M3
    assert kv_storage_dtype("fp8_e5m2", torch.float32) == E5M2
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' unsupported .*fp8_e4m3"):
        kv_storage_dtype("fp8", torch.bfloat16)


def test_formats_as_the_kernels_need_them() -> None:
    e4m3, e5m2 = fp8_format(E4M3), fp8_format(E5M2)
    assert (e4m3.max, e4m3.mantissa_bits, e4m3.min_exponent) == (448.0, 3, -6)
    assert (e5m2.max, e5m2.mantissa_bits, e5m2.min_exponent) == (57344.0, 2, -14)


@pytest.mark.parametrize("dtype, bound", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_out_of_range_values_saturate_never_nan_or_inf(dtype: torch.dtype, bound: float) -> None:
    x = torch.tensor([1e4, -1e4, 1e6, -1e30, 480.0, 0.0])
    got = quantize(x, dtype).float()
    assert torch.isfinite(got).all()
    assert got.abs().max() == min(bound, 1e30)
    assert got[-1] == 0 and (got[:4].sign() == x[:4].sign()).all()


def test_rounds_to_nearest_even_on_the_e4m3_grid() -> None:
    # Around 1 the e4m3 spacing is 1/8: 1 + 1/16 is a tie and goes to the even 1.0; 1 + 3/16
    # goes to the even 1.25; 125 rounds up across the exponent boundary to 128.
    x = torch.tensor([1.0625, 1.1875, 1.07, 125.0, -125.0, 2.0**-10])
    assert quantize(x, E4M3).float().tolist() == [1.0, 1.25, 1.125, 128.0, -128.0, 0.0]


def test_stored_is_real_over_scale_and_reads_back_times_scale() -> None:
    scales = torch.tensor(KVScales((0.25,), (4.0,)).row(0))  # k, v, 1/k, 1/v
    x = torch.tensor([[[3.0, -96.0, 200.0]]])
    stored = quantize(x, E4M3, scales[K_INV_SCALE])  # x / 0.25 = x * 4
    assert stored.float().flatten().tolist() == [12.0, -384.0, 448.0]  # 800 clamps to 448
    back = dequantize(stored, scales[0])
    assert back.flatten().tolist() == [3.0, -96.0, 112.0]
    assert dequantize(quantize(x, E4M3), scales[V_SCALE]).flatten()[0] == 12.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_callers_tensor_is_never_modified(dtype: torch.dtype) -> None:
    x = (torch.randn(4, 2, 8) * 1e3).to(dtype)
    before = x.clone()
    quantize(x, E4M3)
    quantize(x, E4M3, torch.tensor(0.5))
    buffer = torch.zeros(6, 2, 8, dtype=E5M2)
    store(buffer, torch.tensor([1, 3, 4, 5]), x, torch.tensor(2.0))
    assert torch.equal(x, before)


def test_a_model_dtype_cache_is_a_plain_cast_whatever_the_scale() -> None:
    x = torch.tensor([1 + 2**-9, 300.0])
    assert torch.equal(quantize(x, torch.bfloat16, torch.tensor(0.001)), x.bfloat16())


def test_store_writes_exactly_the_given_slots() -> None:
    buffer = torch.full((5, 1, 2), 7.0).to(E4M3)
    store(buffer, torch.tensor([3, 1]), torch.tensor([[[1.0, 2.0]], [[500.0, -3.0]]]), None)
    assert buffer.float()[:, 0].tolist() == [[7, 7], [448, -3], [7, 7], [1, 2], [7, 7]]


def test_scales_are_validated_and_their_rows_hold_the_inverses() -> None:
    scales = KVScales((0.5, 3.0), (2.0, 1.0))
    assert scales.row(1) == [3.0, 1.0, 1 / 3.0, 1.0]
    assert KVScales.ones(3) == KVScales((1.0,) * 3, (1.0,) * 3)
    with pytest.raises(ValueError, match="2 k scales but 1 v scales"):
        KVScales((1.0, 1.0), (1.0,))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite and > 0"):
            KVScales((bad,), (1.0,))
