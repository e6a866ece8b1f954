"""`kvgraft store list|stats`: look into an artifact store."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ._common import JSON_OPT, MANIFEST_OPT, STORE_OPT, context
from ._output import human_bytes, out, print_json

app = typer.Typer(no_args_is_help=True, help="Look into an artifact store.")


@app.command("list")
def list_entries(
    store: Optional[Path] = STORE_OPT,
    manifest: Optional[Path] = MANIFEST_OPT,
    limit: Optional[int] = typer.Option(None, "--limit", min=1),
    as_json: bool = JSON_OPT,
) -> None:
    """List the store's index: problem id, artifact, tokens, size, verified."""
    from ..store.local import Store

    ctx = context(manifest, store, None, False)
    with Store(ctx.store, create=False) as s:
        entries, stats = s.entries(limit), s.stats()
    if as_json:
        print_json({"stats": stats, "entries": [e.__dict__ for e in entries]})
        return
    table = Table(title=f"store {ctx.store}: {stats['objects']} objects, {stats['entries']} entries, "
                        f"{human_bytes(stats['file_bytes'])}", title_justify="left")
    for col in ("problem id", "artifact", "tokens", "bytes", "verified"):
        table.add_column(col)
    for e in entries:
        table.add_row(e.problem_id, e.artifact[:16], str(e.num_tokens), human_bytes(e.file_bytes),
                      "yes" if e.verified else "no")
    out.print(table)


@app.command("stats")
def stats(
    store: Optional[Path] = STORE_OPT,
    manifest: Optional[Path] = MANIFEST_OPT,
    window: Optional[int] = typer.Option(None, "--window", min=1, help="Context window to compare with (default: the manifest model's position limit)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Entries, verified entries, library size, stored tokens and bytes, and stored tokens as a multiple of the
    model's context window."""
    from ..config.modelhash import context_window
    from ..store.local import Store

    ctx = context(manifest, store, None, False)
    with Store(ctx.store, create=False) as s:
        st = s.stats()
    win = window or context_window(ctx.manifest.model_dir)
    st["context_window"] = win
    st["tokens_per_window"] = st["tokens"] / win if win else None
    if as_json:
        print_json(st)
        return
    t = Table(title=f"store {ctx.store}", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("entries (verified)", f"{st['entries']} ({st['verified_entries']})")
    t.add_row("library entries (their tokens)", f"{st['library_entries']} ({st['library_tokens']:,})")
    t.add_row("objects", str(st["objects"]))
    t.add_row("stored tokens", f"{st['tokens']:,}")
    t.add_row("bytes on disk", human_bytes(st["file_bytes"]))
    if win:
        t.add_row("stored tokens / context window", f"{st['tokens']:,} / {win:,} = {st['tokens_per_window']:.2f}x")
    out.print(t)
