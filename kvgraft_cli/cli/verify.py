"""`kvgraft verify`: re-check a ledger without torch (canonical lines, schema, chain, Merkle root, files)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..errors import CheckFailed, InputError
from ._common import JSON_OPT, MANIFEST_OPT, ledger_path
from ._output import out, print_json


def verify(
    ledger: Optional[Path] = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="Check the root against this checkpoint."),
    key: list[str] = typer.Option([], "--key", help="Verifier key (string or file) the checkpoint must be signed with."),
    since: Optional[Path] = typer.Option(None, "--since", help="Older ledger file or checkpoint: fail unless this ledger only appended to it."),
    full: bool = typer.Option(False, "--full", help="Re-hash every file, ignoring the cache of verified files."),
    no_files: bool = typer.Option(False, "--no-files", help="Do not re-hash referenced files."),
    require_files: bool = typer.Option(False, "--require-files", help="Fail when a referenced file is missing."),
    manifest: Optional[Path] = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Re-check a ledger without torch: canonical lines, schema, chain, Merkle root, append-only, file hashes."""
    from ..audit.verify import verify_ledger

    if key and checkpoint is None:
        raise InputError("--key needs --checkpoint (the signed note to check)")
    report = verify_ledger(ledger_path(ledger, manifest), checkpoint=checkpoint, keys=key, since=since,
                           rehash=not no_files, full=full, require_files=require_files)
    if as_json:
        print_json(report.to_json())
    else:
        _render_verify(report)
    if not report.passed:
        raise CheckFailed(f"{report.ledger}: {report.first_problem()}",
                          "run with --json for every finding" if len(report.findings) > 1 else None)


def _render_verify(r) -> None:
    def status(checks: tuple[str, ...]) -> str:
        bad = [f for f in r.findings if f.check in checks]
        if not bad:
            return "[green]ok[/]"
        first = min(bad, key=lambda f: f.line or 0)
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        return f"[red]line {first.line}: {first.message}[/]{more}" if first.line else f"[red]{first.message}[/]"

    t = Table(title=f"verify {r.ledger}: {r.entries} entries", title_justify="left", show_header=False)
    t.add_column("check")
    t.add_column("result", overflow="fold")
    t.add_row("JSON, canonical form, values", status(("json", "canonical", "values")))
    t.add_row("schema", status(("schema",)))
    t.add_row("sequence and hash chain", status(("sequence", "chain")))
    t.add_row("last line complete", status(("torn",)))
    t.add_row("Merkle root (RFC 6962)", r.root)
    if r.checkpoint is not None:
        c = r.checkpoint
        signed = f", signed by {', '.join(c['signed_by'])}" if c["signed_by"] else ""
        t.add_row(f"checkpoint {c['origin']} @ {c['size']}", status(("checkpoint", "signature")) + signed)
    if r.since is not None:
        s = r.since
        extra = f" ({s.get('appended', 0)} entries appended)" if s.get("consistent") else ""
        t.add_row(f"append-only since {s['base']} ({s['size']} lines)", status(("append-only",)) + extra)
    if r.files:
        ok = sum(f.status == "ok" for f in r.files)
        t.add_row("referenced files", f"{ok} ok, {len(r.missing)} missing, "
                  + (f"[red]{len(r.mismatched)} mismatched[/]" if r.mismatched else "0 mismatched"))
    if r.scores_checked or any(f.check == "score" for f in r.findings):
        t.add_row("scores recomputed", status(("score",)) + f" ({r.scores_checked} checked)")
    out.print(t)
    for f in r.mismatched[:20]:
        out.print(f"[red]mismatch[/] line {f.line} {f.field}: {f.path} (recorded {f.expected[:16]}..., "
                  f"now {(f.actual or '')[:40]})", soft_wrap=True)
    for f in r.missing[:20]:
        out.print(f"[yellow]missing[/]  line {f.line} {f.field}: {f.path}", soft_wrap=True)
    out.print("[green]PASS[/]" if r.passed else f"[red]FAIL[/] {r.first_problem()}", soft_wrap=True)
