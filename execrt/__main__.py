"""``python -m execrt`` and the ``execrt`` command: the command-line interface."""

from __future__ import annotations

import sys


def entry() -> int:
    """Import the CLI and run it. A Ctrl-C while the CLI imports (torch takes seconds) ends
    as quietly as one while it runs: status 130 (128 + SIGINT), no import traceback."""
    try:
        from execrt.cli import main
    except KeyboardInterrupt:
        return 128 + 2
    return main()


if __name__ == "__main__":
    sys.exit(entry())
