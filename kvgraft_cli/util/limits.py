"""Sizes a user can raise through the environment, and the bounded line reader that applies one of them.

``KVGRAFT_MAX_PAYLOAD`` bounds an artifact's payload (artifacts/payload.py); ``KVGRAFT_MAX_LINE`` bounds one line of
a JSON Lines input (problems, outputs): a file of one endless line (``/dev/zero``) is refused once the limit is
read, never read into memory whole (issue #24, item 8).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import InputError, ProblemFileError

ENV_MAX_LINE = "KVGRAFT_MAX_LINE"
DEFAULT_MAX_LINE = 64 << 20  # far past any text a model's positions fit (eval.problems.check_lengths refuses those)


def size_setting(name: str, default: int, allow_zero: bool = True) -> int:
    """A size from the environment variable ``name``: bytes, or with a K/M/G/T suffix (binary: ``64G``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    return parse_size(raw, name, f"set {name}", allow_zero)


def parse_size(raw: str, where: str, how: str = "give", allow_zero: bool = True) -> int:
    """Bytes from ``64G``-style text (a number, optionally with K, M, G or T: binary); InputError naming ``where``."""
    m = re.fullmatch(r"([0-9]{1,20})\s*([kmgt]?)(?:i?b)?", raw.strip(), re.IGNORECASE)
    if not m or (int(m.group(1)) == 0 and not allow_zero):
        shown = raw if len(raw) <= 40 else raw[:40] + f"...({len(raw)} chars)"
        raise InputError(
            f"{where}={shown!r} is not a size",
            f"{how} {where} a number of bytes, optionally with K, M, G or T (binary), e.g. 64G",
        )
    return int(m.group(1)) << (10 * "_kmgt".index(m.group(2).lower() or "_"))


def max_line() -> int:
    """The longest line a JSON Lines reader accepts: ``KVGRAFT_MAX_LINE`` (bytes, or ``256M``-style), default 64 MiB."""
    return size_setting(ENV_MAX_LINE, DEFAULT_MAX_LINE, allow_zero=False)


def read_lines(path: Path, what: str = "file") -> list[tuple[int, bytes]]:
    """(1-based line number, bytes without the newline) of every line of ``path``, each read with a bound: a line
    longer than :func:`max_line` is a ProblemFileError naming it, raised having read at most that many bytes of it.
    Numbering and splitting are those of ``data.split(b"\\n")``; ``what`` names the file in errors."""
    limit = max_line()
    out: list[tuple[int, bytes]] = []
    with open(path, "rb") as f:
        n = 0
        while True:
            line = f.readline(limit + 1)
            if not line:
                return out
            n += 1
            ends = line.endswith(b"\n")
            if len(line) - ends > limit:
                raise ProblemFileError(
                    f"{path}:{n}: a line longer than {limit:,} bytes ({ENV_MAX_LINE}, the limit "
                    f"on one line of a {what})",
                    f"each line must be one JSON object; if the file "
                    f"is genuine, raise {ENV_MAX_LINE} (bytes, or e.g. 256M)",
                )
            out.append((n, line[:-1] if ends else line))
