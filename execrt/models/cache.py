"""Generated checkpoint directories in the cache: built atomically, checked before each use,
one version per source file kept, and stale ones listed and cleared (``execrt cache``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from execrt.core import envs
from execrt.core.errors import ConfigError

logger = logging.getLogger(__name__)

#: Written last into a finished directory: every file's size, so truncation shows, and the
#: SHA-256 of the small ones (config, tokenizer), so a same-size corruption of those shows too.
MANIFEST = ".execrt-complete.json"
#: Files up to this size are hashed (a few ms per use); weights are only sized.
HASHED_BYTES = 8 << 20
#: A build's temporary directory untouched for this long was cut short (its process is gone).
ABANDONED_BUILD_S = 3600


def cached_dir(name: str, build: Callable[[str], None], source: str | None = None) -> str:
    """``<cache>/<name>``, built by ``build(tmp_dir)`` when absent or damaged.

    The directory is built under a temporary name and renamed into place, so a reader never
    sees a half-written one; a directory whose files no longer match its manifest (truncated,
    deleted) is rebuilt. ``source``: the file it is derived from (e.g. a GGUF file), recorded
    in the manifest with its size and mtime; every other directory derived from that file
    (an older version of it) is removed, so each file keeps one copy.
    """
    root = os.path.join(envs.cache_dir(), name)
    if not is_complete(root):
        _build(root, name, build, source)
    if source is not None:
        _remove_other_versions(root, source)
    return root


def _build(root: str, name: str, build: Callable[[str], None], source: str | None) -> None:
    if os.path.exists(root):
        if is_complete(root):  # another process (a torchrun rank) built it since we looked
            return
        # Without a manifest it predates them (or a build was cut short): rebuild quietly.
        damaged = os.path.isfile(os.path.join(root, MANIFEST))
        log = logger.warning if damaged else logger.info
        log("cache: %s is %s; rebuilding it", root, "damaged" if damaged else "incomplete")
        shutil.rmtree(root, ignore_errors=True)
    parent = os.path.dirname(root)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=parent)
    except OSError as exc:
        raise ConfigError(
            f"cache: cannot build {name} under {parent!r} ({exc.strerror or exc}); "
            f"set {envs.CACHE_DIR} to a writable directory"
        ) from exc
    try:
        build(tmp)
        files = [f for f in sorted(os.listdir(tmp)) if os.path.isfile(os.path.join(tmp, f))]
        sizes = {f: os.path.getsize(os.path.join(tmp, f)) for f in files}
        hashes = {f: _sha256(os.path.join(tmp, f)) for f in files if sizes[f] <= HASHED_BYTES}
        manifest: dict[str, Any] = {"sizes": sizes, "sha256": hashes}
        if source is not None:
            manifest["source"] = _stamp(source)
        with open(os.path.join(tmp, MANIFEST), "w") as fh:
            json.dump(manifest, fh)
        try:
            os.replace(tmp, root)
        except OSError:  # another process won the race; its copy is equivalent
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _stamp(source: str) -> dict[str, Any]:
    st = os.stat(source)
    return {"file": os.path.realpath(source), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_manifest(root: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(root, MANIFEST)) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _remove_other_versions(root: str, source: str) -> None:
    """Remove the cache directories other than ``root`` derived from the same ``source``."""
    real = os.path.realpath(source)
    parent = os.path.dirname(root)
    for entry in _scan(parent):
        if entry.path == root or entry.name.startswith("."):
            continue
        recorded = (_read_manifest(entry.path) or {}).get("source")
        if isinstance(recorded, dict) and recorded.get("file") == real:
            logger.info("cache: removing %s, an older conversion of %s", entry.path, real)
            shutil.rmtree(entry.path, ignore_errors=True)


def _scan(folder: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return [e for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def is_complete(root: str) -> bool:
    """True when ``root`` has a manifest, every file it lists has the recorded size and each
    hashed file its recorded SHA-256. (A manifest of sizes alone, from before hashes were
    recorded, is checked by size.)"""
    try:
        with open(os.path.join(root, MANIFEST)) as fh:
            manifest = json.load(fh)
        if not isinstance(manifest, dict):
            return False
        sizes = manifest.get("sizes", manifest)
        hashes = manifest.get("sha256", {})
        return (
            isinstance(sizes, dict)
            and isinstance(hashes, dict)
            and all(os.path.getsize(os.path.join(root, f)) == n for f, n in sizes.items())
            and all(_sha256(os.path.join(root, f)) == h for f, h in hashes.items())
        )
    except (OSError, ValueError, TypeError):
        return False


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    """One directory of the cache, its size, and why it is stale ("" when it is not)."""

    path: str
    bytes: int
    stale: str = ""


def cache_entries(
    derived_prefixes: Iterable[str] = (), names: Iterable[str] = ()
) -> list[CacheEntry]:
    """The directories ``cached_dir`` made in the cache, by name: each with a manifest, and,
    named with a ``derived_prefixes`` prefix or one of ``names``, one without (a build that
    predates manifests) and a build's temporary directory. Other directories there (the
    conformance reports, anything else put there) are not entries: never listed or cleared.

    Stale: a build cut short, an incomplete or damaged directory, one whose source file is
    gone or changed since, and a derived one that records no source (made before sources were
    recorded)."""
    prefixes, known = tuple(derived_prefixes), tuple(names)
    out = []
    for entry in sorted(_scan(envs.cache_dir()), key=lambda e: e.name):
        if entry.name.startswith("."):  # a build's temporary directory, `.<name>-<random>`
            building = entry.name[1:]
            listed = building.startswith(prefixes + tuple(f"{n}-" for n in known))
        else:
            listed = (
                entry.name.startswith(prefixes)
                or entry.name in known
                or os.path.isfile(os.path.join(entry.path, MANIFEST))
            )
        if listed:
            out.append(CacheEntry(entry.path, _tree_bytes(entry.path), _staleness(entry, prefixes)))
    return out


def clear_cache(entries: Iterable[CacheEntry], everything: bool = False) -> list[CacheEntry]:
    """Remove the stale ``entries`` (all of them with ``everything``); returns those removed."""
    removed = []
    for entry in entries:
        if everything or entry.stale:
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.exists(entry.path):
                removed.append(entry)
    return removed


def _staleness(entry: os.DirEntry[str], derived_prefixes: tuple[str, ...]) -> str:
    if entry.name.startswith("."):
        age = time.time() - entry.stat(follow_symlinks=False).st_mtime
        return "a build cut short" if age > ABANDONED_BUILD_S else ""
    manifest = _read_manifest(entry.path)
    if manifest is None:  # listed by its name: cached_dir would build it again
        return "incomplete"
    if not is_complete(entry.path):
        return "damaged"
    source = manifest.get("source")
    if not isinstance(source, dict):
        return "no source recorded" if entry.name.startswith(derived_prefixes) else ""
    file = str(source.get("file"))
    try:
        now = _stamp(file)
    except OSError:
        return f"{file} is gone"
    if (now["size"], now["mtime_ns"]) != (source.get("size"), source.get("mtime_ns")):
        return f"{file} changed since"
    return ""


def _tree_bytes(root: str) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total
