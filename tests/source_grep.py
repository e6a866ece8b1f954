"""The grep checks' walker (tests/test_typed_documents.py, tests/test_ledger_entries.py): a pattern searched line by
line through the project's Python (kvgraft_cli/, scripts/, benchmarks/), one folder of the package left out (the
code that owns what the pattern looks for)."""

from __future__ import annotations

import re
from pathlib import Path

TOPS = ("kvgraft_cli", "scripts", "benchmarks")


def grep_sources(root: Path, pattern: re.Pattern, owner: str) -> list[str]:
    """``path:line: text`` of every line matching ``pattern`` in the ``*.py`` files under ``root``'s TOPS, but those
    of ``kvgraft_cli/<owner>/``."""
    found = []
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("kvgraft_cli", owner):
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    return found
