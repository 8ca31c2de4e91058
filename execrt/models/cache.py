"""Generated checkpoint directories in the cache: built atomically, checked before each use."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable

from execrt.core import envs
from execrt.core.errors import ConfigError

logger = logging.getLogger(__name__)

#: Written last into a finished directory: every file's size, so truncation shows, and the
#: SHA-256 of the small ones (config, tokenizer), so a same-size corruption of those shows too.
MANIFEST = ".execrt-complete.json"
#: Files up to this size are hashed (a few ms per use); weights are only sized.
HASHED_BYTES = 8 << 20


def cached_dir(name: str, build: Callable[[str], None]) -> str:
    """``<cache>/<name>``, built by ``build(tmp_dir)`` when absent or damaged.

    The directory is built under a temporary name and renamed into place, so a reader never
    sees a half-written one; a directory whose files no longer match its manifest (truncated,
    deleted) is rebuilt.
    """
    root = os.path.join(envs.cache_dir(), name)
    if is_complete(root):
        return root
    if os.path.exists(root):
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
        with open(os.path.join(tmp, MANIFEST), "w") as fh:
            json.dump({"sizes": sizes, "sha256": hashes}, fh)
        try:
            os.replace(tmp, root)
        except OSError:  # another process won the race; its copy is equivalent
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


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
