"""The cache of generated checkpoint directories: atomic builds, damage detected and rebuilt."""

from __future__ import annotations

import json
import os

import pytest

from execrt.core.errors import ConfigError
from execrt.models.cache import MANIFEST, cached_dir


def _builder(calls: list[str]):  # type: ignore[no-untyped-def]
    def build(out: str) -> None:
        calls.append(out)
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump({"vocab_size": 384}, fh)
        with open(os.path.join(out, "model.safetensors"), "wb") as fh:
            fh.write(b"w" * 64)

    return build


def test_a_same_size_corruption_of_a_small_file_is_rebuilt() -> None:
    calls: list[str] = []
    root = cached_dir("same-size", _builder(calls))
    assert cached_dir("same-size", _builder(calls)) == root and len(calls) == 1  # a hit
    config = os.path.join(root, "config.json")
    with open(config) as fh:
        good = fh.read()
    with open(config, "w") as fh:
        fh.write(good.replace("384", "999"))  # same size, different content
    assert os.path.getsize(config) == len(good)
    assert cached_dir("same-size", _builder(calls)) == root and len(calls) == 2
    with open(config) as fh:
        assert fh.read() == good


def test_a_truncated_file_is_rebuilt_and_a_sizes_only_manifest_still_counts() -> None:
    calls: list[str] = []
    root = cached_dir("sizes", _builder(calls))
    weights = os.path.join(root, "model.safetensors")
    with open(weights, "r+b") as fh:
        fh.truncate(10)
    assert cached_dir("sizes", _builder(calls)) == root and len(calls) == 2
    assert os.path.getsize(weights) == 64
    # A directory written before hashes were recorded is checked by size only, not rebuilt.
    with open(os.path.join(root, MANIFEST), "w") as fh:
        json.dump(
            {
                "config.json": os.path.getsize(os.path.join(root, "config.json")),
                "model.safetensors": 64,
            },
            fh,
        )
    assert cached_dir("sizes", _builder(calls)) == root and len(calls) == 2


def test_an_unwritable_cache_is_one_error_naming_the_directory_and_the_variable(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EXECRT_CACHE_DIR", str(blocker / "cache"))  # under a regular file
    with pytest.raises(
        ConfigError, match=r"cannot build ck under '.*a-file/cache' .*EXECRT_CACHE_DIR"
    ):
        cached_dir("ck", _builder([]))
