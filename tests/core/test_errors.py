"""Exception classes: message formats and the hierarchy callers catch by."""

from __future__ import annotations

import pytest

from execrt.core.errors import (
    BackendUnavailableError,
    ConfigError,
    ExecrtError,
    KVOwnershipError,
    ModelLoadError,
    PluginError,
    RequestError,
    ResourceError,
)


def test_backend_unavailable_joins_its_reasons() -> None:
    err = BackendUnavailableError(
        "attention", "flashinfer", ("module 'flashinfer' not installed", "head_dim 80 unsupported")
    )
    assert str(err) == (
        "attention backend 'flashinfer' unavailable: "
        "module 'flashinfer' not installed; head_dim 80 unsupported"
    )
    assert (err.kind, err.name) == ("attention", "flashinfer")
    assert err.reasons == ["module 'flashinfer' not installed", "head_dim 80 unsupported"]


def test_backend_unavailable_keeps_its_own_copy_of_the_reasons() -> None:
    reasons = ["a"]
    err = BackendUnavailableError("graph", "full_cuda_graph", reasons)
    reasons.append("b")
    assert err.reasons == ["a"] and str(err) == "graph backend 'full_cuda_graph' unavailable: a"


def test_plugin_error_names_the_plugin() -> None:
    err = PluginError("my-plugin", "unknown hook 'execrt_regster'")
    assert str(err) == "plugin 'my-plugin': unknown hook 'execrt_regster'"
    assert err.plugin == "my-plugin"


@pytest.mark.parametrize(
    "cls",
    [ConfigError, KVOwnershipError, ResourceError, ModelLoadError, RequestError],
)
def test_plain_errors_carry_their_message(cls: type[ExecrtError]) -> None:
    err = cls("KV cache: 4 slots requested, 3 of 10 free")
    assert isinstance(err, ExecrtError) and str(err) == "KV cache: 4 slots requested, 3 of 10 free"


def test_only_value_errors_are_value_errors() -> None:
    # Config and request errors are bad values; callers may catch them as ValueError.
    assert issubclass(ConfigError, ValueError) and issubclass(RequestError, ValueError)
    for cls in (
        BackendUnavailableError,
        PluginError,
        KVOwnershipError,
        ResourceError,
        ModelLoadError,
    ):
        assert issubclass(cls, ExecrtError) and not issubclass(cls, ValueError), cls
