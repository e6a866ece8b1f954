"""`kvgraft store list|stats`: look into an artifact store."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ._common import JSON_OPT, MANIFEST_OPT, STORE_OPT, at_most_max_count, context
from ._help import Command, Group
from ._output import cell, human_bytes, out, print_json, short, table

app = typer.Typer(cls=Group, no_args_is_help=True, help="Look into an artifact store.")


@app.command("list", cls=Command)
def list_entries(
    store: Optional[Path] = STORE_OPT,
    manifest: Optional[Path] = MANIFEST_OPT,
    limit: Optional[int] = typer.Option(None, "--limit", min=1, callback=at_most_max_count, help="Show only the first N entries (default: all)."),
    as_json: bool = JSON_OPT,
) -> None:
    """List the store's index: problem id, artifact, tokens, size, verified. Artifact hashes are in full when the
    output is redirected; on a terminal a 16-hex prefix, which every command accepts (any unique prefix of at least
    6 hex characters does)."""

    ctx = context(manifest, store, None, False)
    with ctx.open_store(create=False) as s:
        entries, stats = s.entries(limit), s.stats()
    if as_json:
        print_json({"stats": stats, "entries": [e.__dict__ for e in entries]})
        return
    t = table(f"store {ctx.store}: {stats['objects']} objects, {stats['entries']} entries, "
              f"{human_bytes(stats['file_bytes'])}", ("problem id", "artifact", "tokens", "bytes", "verified"),
              right=("tokens", "bytes"))
    for e in entries:
        t.add_row(cell(e.problem_id), short(e.artifact), str(e.num_tokens), human_bytes(e.file_bytes),
                  "yes" if e.verified else "no")
    out.print(t)


@app.command("stats", cls=Command)
def stats(
    store: Optional[Path] = STORE_OPT,
    manifest: Optional[Path] = MANIFEST_OPT,
    window: Optional[int] = typer.Option(None, "--window", min=1, callback=at_most_max_count, help="Context window to compare with (default: the manifest model's position limit)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Entries, verified entries, library size, stored tokens and bytes, and stored tokens as a multiple of the
    model's context window."""
    from ..config.modelhash import context_window

    ctx = context(manifest, store, None, False)
    with ctx.open_store(create=False) as s:
        st = s.stats()
    win = window or context_window(ctx.manifest.model_dir)
    st["context_window"] = win
    st["tokens_per_window"] = st["tokens"] / win if win else None
    if as_json:
        print_json(st)
        return
    t = table(f"store {ctx.store}", ("what", "value"), right=("value",), show_header=False)
    t.add_row("entries (verified)", f"{st['entries']} ({st['verified_entries']})")
    t.add_row("library entries (their tokens)", f"{st['library_entries']} ({st['library_tokens']:,})")
    t.add_row("objects", str(st["objects"]))
    if st["unrecorded"]:
        t.add_row("unrecorded (a failed ledger append; not served by solve until a deposit records them)",
                  str(st["unrecorded"]))
    t.add_row("stored tokens", f"{st['tokens']:,}")
    t.add_row("bytes on disk", human_bytes(st["file_bytes"]))
    if win:
        t.add_row("stored tokens / context window", f"{st['tokens']:,} / {win:,} = {st['tokens_per_window']:.2f}x")
    out.print(t)


@app.command("gc", cls=Command)
def gc(
    store: Optional[Path] = STORE_OPT,
    manifest: Optional[Path] = MANIFEST_OPT,
    ledger: list[Path] = typer.Option([], "--ledger", help="Ledger whose named artifacts are kept even when unindexed (repeatable; default: the manifest's paths.ledger)."),
    grace: float = typer.Option(3600.0, "--grace", min=0, help="Only consider files untouched for this many seconds (a writer at work writes its object before indexing it)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be deleted; delete nothing."),
    as_json: bool = JSON_OPT,
) -> None:
    """Delete temporary files left by interrupted writes and objects that no index row and no ledger line names.
    Nothing else is ever deleted: an artifact a ledger line names stays even when no index row does."""
    from ..runs.gc import collect_garbage

    ctx = context(manifest, store, None, False)
    report = collect_garbage(ctx.store, ledger or [ctx.ledger], grace, dry_run)
    if as_json:
        print_json(report.to_json())
        return
    verb = "would delete" if dry_run else "deleted"
    for p in report.temporary:
        out.print(f"{verb} temporary file {p}", markup=False, soft_wrap=True)
    for p in report.unindexed:
        out.print(f"{verb} unindexed object {p}", markup=False, soft_wrap=True)
    for sha in report.kept_for_ledger:
        out.print(f"kept unindexed object {sha}: a ledger line names it", markup=False, soft_wrap=True)
    out.print(f"store {ctx.store}: {verb} {len(report.temporary)} temporary files and {len(report.unindexed)} "
              f"unindexed objects ({human_bytes(report.bytes)}); kept {len(report.kept_for_ledger)} named by "
              f"{', '.join(report.ledgers)}", markup=False, soft_wrap=True)
