"""All printing goes through here: a console for results (stdout), one for messages and progress (stderr)."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def print_json(obj: Any) -> None:
    """A machine-readable result on stdout: indented, sorted keys, UTF-8."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def human_bytes(n: float) -> str:
    """``512 B``, ``1.5 KB``, ``94.4 MB``, ``2.0 GB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
