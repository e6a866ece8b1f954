"""`kvgraft store list`: look into an artifact store."""

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
