"""``python -m execrt`` runs the command-line interface."""

from __future__ import annotations

import sys

from execrt.cli import main

sys.exit(main())
