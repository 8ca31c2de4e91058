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


def test_a_directory_another_process_finished_meanwhile_is_kept(monkeypatch) -> None:
    """Two processes converting one file at once (torchrun's ranks on a fresh machine): the
    one that looked before the other's rename must not delete the finished directory, which
    the other may already be reading."""
    import execrt.models.cache as cache

    calls: list[str] = []
    root = cached_dir("raced", _builder(calls))
    inode = os.stat(root).st_ino
    looks = [False]  # this process's first look: not there yet
    real = cache.is_complete
    monkeypatch.setattr(cache, "is_complete", lambda r: looks.pop() if looks else real(r))
    assert cached_dir("raced", _builder(calls)) == root
    assert len(calls) == 1 and os.stat(root).st_ino == inode


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


def _source(tmp_path, name: str = "model.gguf", text: str = "v1"):  # type: ignore[no-untyped-def]
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_each_source_file_keeps_one_version(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EXECRT_CACHE_DIR", str(tmp_path / "cache"))
    gguf, other = _source(tmp_path), _source(tmp_path, "other.gguf")
    first = cached_dir("conv-v1", _builder([]), source=gguf)
    kept = cached_dir("other-v1", _builder([]), source=other)
    plain = cached_dir("builtin", _builder([]))
    os.utime(gguf, ns=(1, 1))  # touched: its converted name changes with its stamp
    second = cached_dir("conv-v2", _builder([]), source=gguf)
    assert not os.path.exists(first), "the older conversion of the same file stayed"
    assert all(os.path.isdir(p) for p in (second, kept, plain))
    with open(os.path.join(second, MANIFEST)) as fh:
        recorded = json.load(fh)["source"]
    assert recorded == {"file": os.path.realpath(gguf), "size": 2, "mtime_ns": 1}


def test_cache_entries_say_what_is_stale_and_clear_removes_only_that(tmp_path, monkeypatch) -> None:
    import time

    from execrt.models.cache import ABANDONED_BUILD_S, cache_entries, clear_cache

    cache = tmp_path / "cache"
    monkeypatch.setenv("EXECRT_CACHE_DIR", str(cache))
    current, gone, changed = (
        _source(tmp_path, f"{n}.gguf") for n in ("current", "gone", "changed")
    )
    dirs = {
        n: cached_dir(f"gguf-{n}", _builder([]), source=s)
        for n, s in (("current", current), ("gone", gone), ("changed", changed))
    }
    os.remove(gone)
    with open(changed, "w") as fh:
        fh.write("a new version")
    dirs["builtin"] = cached_dir("builtin", _builder([]))  # no source: never stale
    dirs["legacy"] = cached_dir("gguf-legacy", _builder([]))  # converted before sources
    # Not made by cached_dir, so no entries, never cleared: the conformance reports
    # (`execrt backends` reads them), a folder a user put there, a hidden one.
    not_ours = ["conformance", "notes", ".git", ".notes-abcdefgh"]
    for name in not_ours:
        (cache / name).mkdir()
    (cache / "conformance" / "attention-x.json").write_text("{}")
    past = time.time() - ABANDONED_BUILD_S - 60
    for old_build in (cache / ".gguf-x-abc123", cache / ".model-v1-abcdefgh"):
        old_build.mkdir()
        os.utime(old_build, (past, past))
    (cache / ".gguf-y-def456").mkdir()  # a build in progress right now
    (cache / "model-v1").mkdir()  # a named cached_dir without its manifest: built again on use
    damaged = cached_dir("gguf-damaged", _builder([]), source=_source(tmp_path, "d.gguf"))
    os.remove(os.path.join(damaged, "model.safetensors"))

    entries = {os.path.basename(e.path): e for e in cache_entries(["gguf-"], names=["model-v1"])}
    assert {n: e.stale for n, e in entries.items()} == {
        ".gguf-x-abc123": "a build cut short",
        ".gguf-y-def456": "",
        ".model-v1-abcdefgh": "a build cut short",
        "builtin": "",
        "gguf-changed": f"{os.path.realpath(changed)} changed since",
        "gguf-current": "",
        "gguf-damaged": "damaged",
        "gguf-gone": f"{os.path.realpath(gone)} is gone",
        "gguf-legacy": "no source recorded",
        "model-v1": "incomplete",
    }
    assert entries["builtin"].bytes > 64  # the files and the manifest
    removed = clear_cache(entries.values())
    assert sorted(os.path.basename(e.path) for e in removed) == [
        ".gguf-x-abc123",
        ".model-v1-abcdefgh",
        "gguf-changed",
        "gguf-damaged",
        "gguf-gone",
        "gguf-legacy",
        "model-v1",
    ]
    assert sorted(os.listdir(cache)) == sorted(
        [".gguf-y-def456", "builtin", "gguf-current", *not_ours]
    )
    clear_cache(cache_entries(["gguf-"]), everything=True)
    assert sorted(os.listdir(cache)) == sorted(not_ours)
    assert (cache / "conformance" / "attention-x.json").read_text() == "{}"
