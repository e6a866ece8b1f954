"""All printing goes through here: a console for results (stdout), one for messages and progress (stderr).

Two rules hold for everything printed:

- Text that comes from a model, a data file or a ledger is passed through :func:`printable` (or :func:`cell` in a
  table): control characters (the random default model emits them), bidi overrides and other invisible code points
  are shown as ``\\x07`` / ``\\u202e`` escapes instead of reaching the terminal raw, and rich markup in them
  (``[a-z]``) is printed as it is.
- Copyable values are never cut. When output goes to a file or a pipe (no terminal), the consoles are as wide as
  the widest line, so tables neither wrap nor truncate (rich would assume 80 columns); on a terminal, hash columns
  show a 16-hex prefix (every command accepts a unique prefix of at least 6) and other columns fold instead of
  being cut with an ellipsis. ``--json`` always has every value in full.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from collections.abc import Iterable
from typing import Any

from rich.console import Console

# Width of a console that writes to a file or a pipe: wide enough that no table row is ever wrapped or cut.
PIPE_WIDTH = 1 << 16
SHORT_HASH = 16


def _console(stream, **kw) -> Console:
    """A console on ``stream`` (as the process starts): the terminal's width on a terminal, else
    :data:`PIPE_WIDTH` (even when COLUMNS is set: a file or a pipe gets every value whole)."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        return Console(highlight=False, **kw)
    return Console(highlight=False, width=PIPE_WIDTH, **kw)


out = _console(sys.stdout)
err = _console(sys.stderr, stderr=True)

# Unicode categories never printed raw: controls, format characters (bidi overrides, zero-width), surrogates,
# private use, unassigned, and line/paragraph separators.
_HIDDEN = frozenset(("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"))


def _escape(ch: str) -> str:
    o = ord(ch)
    if ch == "\n":
        return "\\n"
    if ch == "\t":
        return "\\t"
    if ch == "\r":
        return "\\r"
    if o < 0x100:
        return f"\\x{o:02x}"
    return f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def printable(text: Any, newlines: bool = True) -> str:
    """``text`` safe for a terminal: every control or invisible character as a Python-style escape (``\\x07``,
    ``\\x1b``, ``\\u202e``). With ``newlines`` (the default) line breaks and tabs stay as they are; without, they are
    escaped too (a table cell or a one-line message). Backslashes are left alone (``\\boxed{5}`` stays readable)."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable():
        return s
    keep = "\n\t" if newlines else ""
    return "".join(ch if (ch in keep or unicodedata.category(ch) not in _HIDDEN) else _escape(ch) for ch in s)


def cell(value: Any):
    """A table cell for a value from data (an id, a model's answer, a path): escaped with :func:`printable` on one
    line, and never read as rich markup."""
    from rich.text import Text

    return Text("" if value is None else printable(value, newlines=False))


def short(sha: str | None) -> str:
    """A hash for a table: in full when the output is not a terminal, else its 16-hex prefix (a unique prefix every
    command accepts; ``--json`` has it in full)."""
    if not sha:
        return ""
    return sha[:SHORT_HASH] if out.is_terminal and len(sha) > SHORT_HASH else sha


def table(title: str | None = None, columns: Iterable[str] = (), right: Iterable[str] = (), **kw):
    """A results table whose columns fold long values instead of cutting them (``right``: right-aligned columns)."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(printable(title, newlines=False)) if title else None, title_justify="left", **kw)
    right = set(right)
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left", overflow="fold")
    return t


def print_json(obj: Any) -> None:
    """A machine-readable result on stdout: indented, sorted keys, UTF-8 (json escapes control characters)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def human_bytes(n: float) -> str:
    """``512 B``, ``1.5 KB``, ``94.4 MB``, ``2.0 GB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
