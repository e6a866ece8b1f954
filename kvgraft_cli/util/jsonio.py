"""JSON from files kvgraft did not write itself (ledgers, outputs, records, headers): every way it can be unreadable
is a ValueError, so callers turn it into one finding or one input error, never an internal error."""

from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads``, with nesting past the interpreter's recursion limit reported as a ValueError (as malformed
    JSON, bad UTF-8 and integers longer than Python's 4,300-digit limit already are)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
