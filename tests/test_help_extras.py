"""Help texts name their extras (issue 25): rich reads ``[ray]`` in ``pip install 'kvgraft[ray]'`` as markup and
drops it, so ``kvgraft deposit --help`` printed ``pip install 'kvgraft'``. Every command's help is rendered as a
user sees it and must show each extra its help text names, brackets and all."""

from __future__ import annotations

import re
import tomllib

from conftest import REPO, every_help

EXTRA = re.compile(r"kvgraft\\*\[([a-z0-9_-]+)\]")


def _helps() -> dict:
    return every_help(3000)


def test_every_extra_named_in_help_is_printed_with_its_brackets():
    helps = _helps()
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {}  # command -> extras its help text names
    for cmd, h in helps.items():
        found = {m for text in h["raw"] for m in EXTRA.findall(text)}
        if found:
            named[cmd] = found
    # The walk sees what the command modules name: every extra a cli/ source file puts in help is found here.
    in_source = {m for f in (REPO / "kvgraft_cli" / "cli").glob("*.py") for m in EXTRA.findall(f.read_text())}
    assert in_source and in_source <= {x for found in named.values() for x in found}, (in_source, named)
    assert {"deposit", "solve", "score"} <= set(named), named
    for cmd, found in named.items():
        for extra in found:
            assert extra in extras, (cmd, extra)  # an extra pyproject defines
            assert f"'kvgraft[{extra}]'" in helps[cmd]["rendered"], (cmd, extra, helps[cmd]["rendered"])
            assert f"\\[{extra}]" not in helps[cmd]["rendered"], (cmd, extra)  # no escape shown either
    assert "pip install 'kvgraft'" not in "".join(h["rendered"] for h in helps.values())
