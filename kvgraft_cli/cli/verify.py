"""`kvgraft verify`: re-check a ledger without torch (canonical lines, schema, chain, Merkle root, files)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import CheckFailed, InputError
from ._common import JSON_OPT, MANIFEST_OPT, ledger_path
from ._output import out, print_json


def verify(
    ledger: Path | None = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="Check the root against this checkpoint."),
    key: list[str] = typer.Option(
        [], "--key", help="Verifier key (string or file) the checkpoint must be signed with."
    ),
    origin: str | None = typer.Option(
        None, "--origin", help="The log identity the checkpoint must name (its first line); default: not compared."
    ),
    since: Path | None = typer.Option(
        None, "--since", help="Older ledger file or checkpoint: fail unless this ledger only appended to it."
    ),
    full: bool = typer.Option(False, "--full", help="Re-hash every file, ignoring the cache of verified files."),
    no_files: bool = typer.Option(False, "--no-files", help="Do not re-hash referenced files."),
    require_files: bool = typer.Option(False, "--require-files", help="Fail when a referenced file is missing."),
    cache: Path | None = typer.Option(
        None,
        "--cache",
        metavar="FILE",
        help="Cache of verified file hashes (default: one file per ledger under $XDG_CACHE_HOME/kvgraft/verify/, else ~/.cache/kvgraft/verify/; never in the ledger's folder).",
    ),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither read nor write the cache of verified files."),
    manifest: Path | None = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Re-check a ledger without torch: canonical lines, schema, chain, Merkle root, append-only, file hashes."""
    from ..api import verify_ledger

    if (key or origin is not None) and checkpoint is None:
        raise InputError("--key and --origin need --checkpoint (the signed note to check)")
    if cache is not None and no_cache:
        raise InputError("--cache and --no-cache exclude each other")
    report = verify_ledger(
        ledger_path(ledger, manifest),
        checkpoint=checkpoint,
        keys=key,
        since=since,
        rehash=not no_files,
        full=full,
        require_files=require_files,
        cache=False if no_cache else cache,
        origin=origin,
    )
    if as_json:
        print_json(report.to_json())
    else:
        _render_verify(report)
    if not report.passed:
        raise CheckFailed(
            f"{report.ledger}: {report.first_problem()}",
            "run with --json for every finding" if len(report.findings) > 1 else None,
        )


def _shown(actual: str | None) -> str:
    """A file's digest now: a hash prefix, or the whole reason it has none (an unreadable artifact)."""
    if actual and not actual.startswith("unreadable"):
        return actual[:16] + "..."
    return actual or ""


def _render_verify(r) -> None:
    def status(checks: tuple[str, ...]) -> str:
        bad = [f for f in r.findings if f.check in checks]
        if not bad:
            return "[green]ok[/]"
        first = min(bad, key=lambda f: f.line or 0)
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        msg = escape(first.message)  # a recorded value may hold [brackets] rich would take for markup
        return f"[red]line {first.line}: {msg}[/]{more}" if first.line else f"[red]{msg}[/]"

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
        t.add_row(
            "referenced files",
            f"{ok} ok, {len(r.missing)} missing, "
            + (f"[red]{len(r.mismatched)} mismatched[/]" if r.mismatched else "0 mismatched"),
        )
    if r.scores_checked or r.scores_not_recomputable or any(f.check.startswith("score") for f in r.findings):
        partial = f", {len(r.scores_from_records)} from records only" if r.scores_from_records else ""
        none = f", [yellow]{len(r.scores_not_recomputable)} not recomputable[/]" if r.scores_not_recomputable else ""
        t.add_row(
            "scores recomputed", status(("score", "score-settings")) + f" ({r.scores_checked} checked{partial}{none})"
        )
    if r.prompt_cache:
        pc = r.prompt_cache
        unchecked = f", {pc['not_checked']} not checked (remote or unnamed store)" if pc["not_checked"] else ""
        t.add_row(
            "prompt-cache chunks (cache, not records)",
            f"{pc['named']} named by served lines: {pc['in_store']} in their store, {pc['not_in_store']} evicted "
            f"or not here{unchecked}",
        )
    out.print(t)
    for f in r.mismatched[:20]:
        out.print(
            f"[red]mismatch[/] line {f.line} {f.field}: {escape(f.path)} (recorded {f.expected[:16]}..., "
            f"now {escape(_shown(f.actual))})",
            soft_wrap=True,
        )
    for f in r.missing[:20]:
        out.print(f"[yellow]missing[/]  line {f.line} {f.field}: {escape(f.path)}", soft_wrap=True)
    if len(r.missing) > 20:
        out.print(f"[yellow]missing[/]  ... and {len(r.missing) - 20} more (--json lists all)")
    for x in r.scores_from_records:
        out.print(
            f"[yellow]score[/]    line {x['line']}: verdicts not recomputed, only the aggregate from the records "
            f"file: {escape(x['reason'])}",
            soft_wrap=True,
        )
    for x in r.scores_not_recomputable:
        out.print(f"[yellow]score[/]    line {x['line']}: not recomputable: {escape(x['reason'])}", soft_wrap=True)
    for w in r.warnings():
        out.print(f"[bold yellow]WARN[/] {escape(w)}", soft_wrap=True)
    if r.passed:
        out.print(
            "[green]PASS[/]" + (f" ({len(r.missing)} files not checked: missing)" if r.missing else ""), soft_wrap=True
        )
    else:
        out.print(f"[red]FAIL[/] {escape(r.first_problem() or '')}", soft_wrap=True)
