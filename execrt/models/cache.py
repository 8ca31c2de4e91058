"""Generated checkpoint directories in the cache: built atomically, checked before each use."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable

from execrt.core import envs

logger = logging.getLogger(__name__)

#: Written last into a finished directory: every file's size, so truncation shows.
MANIFEST = ".execrt-complete.json"


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
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=parent)
    try:
        build(tmp)
        sizes = {
            f: os.path.getsize(os.path.join(tmp, f))
            for f in sorted(os.listdir(tmp))
            if os.path.isfile(os.path.join(tmp, f))
        }
        with open(os.path.join(tmp, MANIFEST), "w") as fh:
            json.dump(sizes, fh)
        try:
            os.replace(tmp, root)
        except OSError:  # another process won the race; its copy is equivalent
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def is_complete(root: str) -> bool:
    """True when ``root`` has a manifest and every file it lists has the recorded size."""
    try:
        with open(os.path.join(root, MANIFEST)) as fh:
            sizes = json.load(fh)
        return isinstance(sizes, dict) and all(
            os.path.getsize(os.path.join(root, f)) == n for f, n in sizes.items()
        )
    except (OSError, ValueError):
        return False
