"""The README and docs/ (issue 25): every relative link resolves (the file, and its #anchor in a Markdown file), every
`kvgraft COMMAND` they show exists in `kvgraft --help`, and the README stays a landing page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _outside_code(text: str) -> str:
    """The Markdown without fenced blocks and code spans (a link inside them is an example, not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(md: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens,
    repeats numbered (-1, -2)."""
    seen: dict[str, int] = {}
    found = set()
    for line in re.sub(r"^```.*?^```", "", md.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"#{1,6} +(.*?)#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(md: Path) -> list[str]:
    """Every relative link of ``md`` whose file is missing or whose #anchor is no heading of its Markdown target."""
    bad = []
    for target in LINK.findall(_outside_code(md.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not relative
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{md.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{md.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def test_every_relative_link_resolves():
    assert len(PAGES) >= 10
    assert [b for md in PAGES for b in broken_links(md)] == []


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n\n## Another one, with `code`\n")
    md = tmp_path / "page.md"
    md.write_text(
        "[ok](there.md) [ok](there.md#another-one-with-code) [gone](missing.md) [bad](there.md#nope) "
        "[self](#nope) `[in code](missing2.md)` [web](https://example.com/x)\n"
    )
    assert broken_links(md) == [
        "page.md: missing.md (no such file)",
        "page.md: there.md#nope (no heading #nope in there.md)",
        "page.md: #nope (no heading #nope in page.md)",
    ]


def _command_tree() -> dict[str, set[str]]:
    """Every top-level command of `kvgraft --help`, with its subcommands (empty for a plain command)."""
    import typer

    from kvgraft_cli.cli.app import app

    root = typer.main.get_command(app)
    return {name: set(getattr(cmd, "commands", {})) for name, cmd in root.commands.items()}


def shown_commands(text: str) -> set[tuple[str, str | None]]:
    """(command, subcommand or None) for every `kvgraft WORD [WORD]` run as a command in code spans and fenced
    blocks: at the start of a line or a span, or after ``&&``, ``;``, ``|`` or a ``$`` prompt (not a quoted
    message such as `kvgraft deposits full-attention layers only`)."""
    code = re.findall(r"^```.*?^```", text, flags=re.S | re.M) + re.findall(r"`([^`\n]+)`", text)
    found = set()
    for block in code:
        for m in re.finditer(
            r"(?:^|&&|;|\||\$)[ \t]*kvgraft +([a-z][a-z0-9-]*)(?: +([a-z][a-z0-9-]*))?", block, flags=re.M
        ):
            found.add((m.group(1), m.group(2)))
    return found


@pytest.mark.parametrize("page", ["README.md", "docs"])
def test_every_command_shown_exists(page):
    tree = _command_tree()
    texts = [(REPO / page).read_text()] if page.endswith(".md") else [p.read_text() for p in PAGES[1:]]
    shown = set().union(*(shown_commands(t) for t in texts))
    missing = []
    for cmd, sub in sorted(shown, key=str):
        if cmd not in tree:
            missing.append(f"kvgraft {cmd}")
        elif tree[cmd] and sub not in tree[cmd]:
            missing.append(f"kvgraft {cmd} {sub}")
    assert missing == []
    if page == "README.md":  # the product page's table names every command
        assert {c for c, _ in shown} == set(tree)


def test_commands_md_names_every_subcommand():
    """docs/COMMANDS.md, the reference the README's table points to, names every command and every group's
    subcommands."""
    tree = _command_tree()
    shown = shown_commands((REPO / "docs" / "COMMANDS.md").read_text())
    assert {c for c, _ in shown} == set(tree)
    for group, subs in tree.items():
        assert subs <= {s for c, s in shown if c == group}, group


def test_shown_commands_sees_groups_and_misses():
    text = (
        "Run `kvgraft store lst` or\n```bash\nkvgraft verfy x.jsonl\nkvgraft ledger log && kvgraft gaft\n```\n"
        "kvgraft makes prose, `Error: kvgraft deposits only this`"
    )
    assert shown_commands(text) == {("store", "lst"), ("verfy", "x"), ("ledger", "log"), ("gaft", None)}


def test_the_readme_is_a_landing_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150  # a product page (issue #48): history and depth live in docs/
    assert "## Quick start" in text and "## Commands" in text
