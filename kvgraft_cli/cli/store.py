"""`kvgraft store list|stats|gc|push|pull|export|import`: look into an artifact store, copy it to or from a remote
one, move artifacts between machines as a bundle."""

from __future__ import annotations

from pathlib import Path

import typer

from ._common import JSON_OPT, LEDGER_OPT, MANIFEST_OPT, STORE_OPT, at_most_max_count, context
from ._help import Command, Group
from ._output import cell, human_bytes, out, print_json, short, table

app = typer.Typer(cls=Group, no_args_is_help=True, help="Look into an artifact store.")


@app.command("list", cls=Command)
def list_entries(
    store: str | None = STORE_OPT,
    manifest: Path | None = MANIFEST_OPT,
    limit: int | None = typer.Option(
        None, "--limit", min=1, callback=at_most_max_count, help="Show only the first N entries (default: all)."
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """List the store's index: problem id, artifact, tokens, size, verified. Artifact hashes are in full when the
    output is redirected; on a terminal a 16-hex prefix, which every command accepts (any unique prefix of at least
    6 hex characters does)."""

    ctx = context(manifest, store, None, False)
    with ctx.open_store(create=False) as s:
        entries, stats, notes = s.entries(limit), s.stats(), _remote_warnings(s)
    if as_json:
        print_json({"stats": stats, "entries": [e.__dict__ for e in entries], **notes})
        return
    t = table(
        f"store {ctx.store_name}: {stats['objects']} objects, {stats['entries']} entries, "
        f"{human_bytes(stats['file_bytes'])}",
        ("problem id", "artifact", "tokens", "bytes", "verified"),
        right=("tokens", "bytes"),
    )
    for e in entries:
        t.add_row(
            cell(e.problem_id),
            short(e.artifact),
            str(e.num_tokens),
            human_bytes(e.file_bytes),
            "yes" if e.verified else "no",
        )
    out.print(t)


@app.command("stats", cls=Command)
def stats(
    store: str | None = STORE_OPT,
    manifest: Path | None = MANIFEST_OPT,
    window: int | None = typer.Option(
        None,
        "--window",
        min=1,
        callback=at_most_max_count,
        help="Context window to compare with (default: the manifest model's position limit).",
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Entries, verified entries, library size, stored tokens and bytes, and stored tokens as a multiple of the
    model's context window."""
    from ..config.modelhash import context_window

    ctx = context(manifest, store, None, False)
    with ctx.open_store(create=False) as s:
        st = {**s.stats(), **_remote_warnings(s)}
    win = window or context_window(ctx.manifest.model_dir)
    st["context_window"] = win
    st["tokens_per_window"] = st["tokens"] / win if win else None
    if as_json:
        print_json(st)
        return
    t = table(f"store {ctx.store_name}", ("what", "value"), right=("value",), show_header=False)
    t.add_row("entries (verified)", f"{st['entries']} ({st['verified_entries']})")
    t.add_row("library entries (their tokens)", f"{st['library_entries']} ({st['library_tokens']:,})")
    t.add_row("objects", str(st["objects"]))
    if st["unrecorded"]:
        t.add_row(
            "unrecorded (no ledger line names them: a failed append, or a prompt the API deposited)",
            str(st["unrecorded"]),
        )
    t.add_row("stored tokens", f"{st['tokens']:,}")
    t.add_row("bytes on disk", human_bytes(st["file_bytes"]))
    if win:
        t.add_row("stored tokens / context window", f"{st['tokens']:,} / {win:,} = {st['tokens_per_window']:.2f}x")
    out.print(t)


def _remote_warnings(s) -> dict:
    """A remote store's index batches skipped on open (malformed, or from a newer kvgraft) and rows refused (they
    restate a key or artifact already indexed differently): one warning line each on stderr; {} for a local store,
    else the lists for --json."""
    if not hasattr(s, "skipped_batches"):
        return {}
    from ._output import err, printable

    notes = {"skipped_batches": s.skipped_batches, "conflicting_rows": s.conflicts}
    lines = [f"warning: index batch {x['batch']} skipped (not merged): {x['reason']}" for x in notes["skipped_batches"]]
    lines += [
        f"warning: index batch {x['batch']}: {x['rows']} rows refused: they restate a prefix key, artifact or "
        "library row already indexed differently (the first row stands)"
        for x in notes["conflicting_rows"]
    ]
    for line in lines:
        err.print(printable(line, newlines=False), markup=False, soft_wrap=True)
    return notes


@app.command("gc", cls=Command)
def gc(
    store: str | None = STORE_OPT,
    manifest: Path | None = MANIFEST_OPT,
    ledger: list[Path] = typer.Option(
        [],
        "--ledger",
        help="Ledger whose named artifacts are kept even when unindexed (repeatable; default: the manifest's paths.ledger).",
    ),
    grace: float = typer.Option(
        3600.0,
        "--grace",
        min=0,
        help="Only consider files untouched for this many seconds (a writer at work writes its object before indexing it).",
    ),
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
    out.print(
        f"store {ctx.store}: {verb} {len(report.temporary)} temporary files and {len(report.unindexed)} "
        f"unindexed objects ({human_bytes(report.bytes)}); kept {len(report.kept_for_ledger)} named by "
        f"{', '.join(report.ledgers)}",
        markup=False,
        soft_wrap=True,
    )


REMOTE_ARG = typer.Argument(
    ...,
    metavar="URL",
    help="The remote store: s3://BUCKET/PREFIX (credentials and endpoint "
    "from the standard AWS environment and config).",
)


def _sync(direction: str, url: str, store: str | None, manifest: Path | None, as_json: bool) -> None:
    """push and pull: open both sides, copy with a progress bar on a terminal, print the summary."""
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn

    from ..errors import InputError
    from ..store import sync
    from ..store.remote import RemoteStore, is_remote
    from ._output import err

    ctx = context(manifest, store, None, False)
    if ctx.remote is not None or not is_remote(url):
        raise InputError(
            f"store {direction} copies between a local store (--store DIR) and a remote one (URL), "
            f"got {ctx.store_name} and {url}",
            f"kvgraft store {direction} s3://BUCKET/PREFIX --store DIR",
        )
    progress = Progress(
        TextColumn(f"{direction}ing"),
        BarColumn(),
        MofNCompleteColumn(),
        DownloadColumn(),
        console=err,
        transient=True,
        disable=as_json or not err.is_terminal,
    )
    with progress:
        task = progress.add_task("", total=None)
        sent = [0]

        def on_progress(_sha: str, _copied: bool, n: int) -> None:
            sent[0] += n
            progress.update(task, advance=1, description=human_bytes(sent[0]))

        on_start = lambda n: progress.update(task, total=n)  # noqa: E731
        if direction == "push":
            with ctx.open_store(create=False) as local, RemoteStore(url) as remote:
                report = sync.push(local, remote, on_start, on_progress)
        else:
            with RemoteStore(url, create=False) as remote, ctx.open_store() as local:
                report = sync.pull(remote, local, on_start, on_progress)
    if as_json:
        print_json(report.to_json())
        return
    out.print(
        f"{direction} {report.source} -> {report.dest}: copied {report.copied} objects "
        f"({human_bytes(report.bytes)}), skipped {report.skipped} the other side has; "
        f"{report.index_rows} index rows" + (f" (batch {report.batch})" if report.batch else ""),
        markup=False,
        soft_wrap=True,
    )
    for sha in report.missing:
        out.print(f"not sent: {sha} is indexed but its object is missing here", markup=False, soft_wrap=True)


@app.command("push", cls=Command)
def push(
    url: str = REMOTE_ARG,
    store: str | None = STORE_OPT,
    manifest: Path | None = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Copy the local store's recorded artifacts and their index rows to a remote store, skipping what it has.
    The server checks each upload's SHA-256; the object's size and recorded hash are checked after."""
    _sync("push", url, store, manifest, as_json)


@app.command("pull", cls=Command)
def pull(
    url: str = REMOTE_ARG,
    store: str | None = STORE_OPT,
    manifest: Path | None = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Copy a remote store's recorded artifacts and their index rows into the local store, skipping what it has.
    Each object is re-hashed on arrival and kept only when it matches its identity."""
    _sync("pull", url, store, manifest, as_json)


@app.command("export", cls=Command)
def export(
    refs: list[str] = typer.Argument(
        None,
        metavar="[REF]...",
        help="Artifacts to export: hash, unique hash prefix "
        "(>= 6 hex) or problem id; a chain link brings its parents. Default: every "
        "recorded artifact.",
    ),
    output: Path = typer.Option(..., "--output", "-o", help="The bundle file to write (an uncompressed tar)."),
    key: str | None = typer.Option(
        None,
        "--key",
        help="Signer key (file or string) to sign the bundle's checkpoint with (`kvgraft ledger keygen`).",
    ),
    origin: str = typer.Option("kvgraft-ledger", "--origin", help="The log's name in the checkpoint."),
    store: str | None = STORE_OPT,
    manifest: Path | None = MANIFEST_OPT,
    ledger: Path | None = LEDGER_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Write artifacts as one bundle (docs/BUNDLE.md): the object files byte for byte, their index rows, and the
    ledger lines that recorded them with RFC 6962 inclusion proofs against a checkpoint of this ledger. Exporting the
    same things from the same ledger twice gives the same bytes. Reads only: nothing is appended."""
    from ..runs.bundle import export_bundle, plural

    ctx = context(manifest, store, ledger, False)
    report = export_bundle(ctx, refs or [], output, key=key, origin=origin)
    if as_json:
        print_json(report.to_json())
        return
    t = table(
        f"bundle {report.bundle}: {plural(len(report.artifacts), 'artifact')}, {human_bytes(report.bytes)}, "
        f"sha256 {report.sha256}",
        ("artifact", "problem ids", "bytes", "recorded by line"),
        right=("bytes",),
    )
    for a in report.artifacts:
        t.add_row(
            short(a["sha256"]),
            cell(", ".join(a["problem_ids"])),
            human_bytes(a["file_bytes"]),
            str(a["recorded_by"] + 1),
        )
    out.print(t)
    cp = report.checkpoint
    out.print(
        f"provenance: {plural(len(report.lines), 'ledger line')}, proved against checkpoint {cp['origin']} @ "
        f"{plural(cp['size'], 'line')}, root {cp['root']}" + (" (signed)" if cp["signed"] else ""),
        markup=False,
        soft_wrap=True,
    )


@app.command("import", cls=Command)
def import_(
    bundle: Path = typer.Argument(..., help="A bundle written by `kvgraft store export`."),
    key: list[str] = typer.Option(
        [],
        "--key",
        help="Verifier key (file or string) that must have signed the "
        "bundle's checkpoint (repeatable: any one suffices).",
    ),
    keep_foreign: bool = typer.Option(
        False,
        "--keep-foreign",
        help="Also keep artifacts made under another compute pin, for later (no run of this manifest grafts them).",
    ),
    store: str | None = STORE_OPT,
    manifest: Path | None = MANIFEST_OPT,
    ledger: Path | None = LEDGER_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Check a bundle completely (member types and names, sizes, every object re-hashed, the checkpoint and every
    inclusion proof, the compute pin, the index keys), then add its artifacts to the store byte for byte and append
    one `import` ledger entry naming them. Any refusal names the bundle entry and writes nothing."""
    from ..runs.bundle import import_bundle, plural

    ctx = context(manifest, store, ledger, False)
    report = import_bundle(ctx, bundle, keys=key, keep_foreign=keep_foreign)
    if as_json:
        print_json(report.to_json())
        return
    t = table(f"imported {report.bundle} into store {report.store}", ("artifact", "problem ids", "status", "pin"))
    for a in report.artifacts:
        t.add_row(
            short(a["sha256"]),
            cell(", ".join(a["problem_ids"])),
            a["status"],
            "other (kept)" if a["foreign"] else "this manifest",
        )
    out.print(t)
    cp = report.checkpoint
    assert report.ledger_seq is not None  # import_bundle() returns after appending its ledger line
    signed = f", signed by {', '.join(cp['signed_by'])}" if cp["signed_by"] else ", signature not checked (no --key)"
    out.print(
        f"provenance: every proof holds against checkpoint {cp['origin']} @ {plural(cp['size'], 'line')}, root "
        f"{cp['root']}{signed}; recorded as ledger line {report.ledger_seq + 1} of {report.ledger}",
        markup=False,
        soft_wrap=True,
    )
