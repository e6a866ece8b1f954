"""`kvgraft ledger log|checkpoint|keygen|repair|diff|prove` (torch-free)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import typer

from ..errors import CheckFailed, InputError
from ..ledger import entries
from ..ledger.entries import Entry, EntryError, ManifestRef
from ..util import jsonio
from ._common import JSON_OPT, MANIFEST_OPT, at_most_max_count, ledger_path
from ._help import Command, Group
from ._output import cell, err, out, print_json, printable, short, table

app = typer.Typer(cls=Group, no_args_is_help=True, help="List, checkpoint, sign, diff, prove and repair a ledger.")
LEDGER_ARG = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger).")


@app.command("log", cls=Command)
def log(
    ledger: Path | None = LEDGER_ARG,
    kind: list[str] = typer.Option(
        [],
        "--kind",
        help="Only entries of this kind (repeatable): deposit, graft, "
        "graft-check, probe, score, solve, solve-outputs, register, replay.",
    ),
    from_seq: int = typer.Option(
        0,
        "--from-seq",
        "--since-seq",
        min=0,
        callback=at_most_max_count,
        help="Only entries from this seq on (0-based, the number `prereg make --from-seq` takes).",
    ),
    manifest: str | None = typer.Option(
        None,
        "--manifest",
        "-m",
        help="Only entries run under this manifest: "
        "a manifest file (its ledger is then the default), a hash prefix of its "
        "file or compute pin (>= 6 hex), or its recorded path or source "
        "(e.g. builtin:default.yaml).",
    ),
    last: int | None = typer.Option(
        None, "--last", min=1, callback=at_most_max_count, help="Only the last N entries that match."
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """One row per entry: seq, kind, time, manifest, what it did, and its key outputs (artifact, logits, records,
    outputs hashes). Hashes are in full when the output is redirected (16-hex prefixes on a terminal); --json has
    every row as an object. Does not verify anything: that is `kvgraft verify`."""
    from ..ledger.log import split_lines

    match, manifest_file = _manifest_filter(manifest)
    path = ledger_path(ledger, manifest_file)
    if not path.is_file():
        raise InputError(f"ledger not found: {path}", "pass the ledger file, or run a command that writes one")
    lines, tail = split_lines(path.read_bytes())
    rows: list[dict] = []
    seen_kinds: set[str] = set()
    for i, raw in enumerate(lines):
        if i < from_seq:
            continue
        try:
            raw_entry = jsonio.loads(raw)
        except ValueError:
            raw_entry = None
        if not isinstance(raw_entry, dict):
            rows.append(_bad_row(i, None, "not a JSON object: run `kvgraft verify`"))
            continue
        k = raw_entry.get("kind")
        seen_kinds.add(str(k))
        if kind and k not in kind:
            continue
        try:
            e = entries.parse(raw_entry)
        except EntryError as x:
            if match is None or match(_manifest_of(raw_entry)):
                rows.append(_bad_row(i, k, f"{x.message}: run `kvgraft verify`"))
            continue
        if match is not None and not match(e.manifest):
            continue
        rows.append(_row(i, e))
    if last is not None:
        rows = rows[-last:]
    if as_json:
        print_json({"ledger": str(path), "lines": len(lines), "torn_tail_bytes": len(tail), "entries": rows})
        return
    _render_rows(rows, f"{path}: {len(rows)} of {len(lines)} entries")
    absent = sorted(set(kind) - seen_kinds)
    if absent:  # a typo, most likely: say which kinds there are (custom kinds are allowed, so it is no error)
        err.print(
            printable(
                f"note: no entry of kind {', '.join(absent)} here; this ledger's kinds: "
                f"{', '.join(sorted(seen_kinds)) or 'none'}"
            ),
            markup=False,
            soft_wrap=True,
        )
    if tail:
        err.print(
            printable(
                f"{path}: the last line is torn ({len(tail)} bytes after the last newline); "
                f"`kvgraft ledger repair {path}` removes it",
                False,
            ),
            markup=False,
            soft_wrap=True,
        )


def _manifest_filter(value: str | None):
    """(a predicate on an entry's manifest (ledger.entries.ManifestRef, None for none) or None, the manifest file whose paths.ledger is the default)."""
    if value is None:
        return None, None
    from ..config.manifest import BUILTIN_PREFIX

    if Path(value).is_file():
        from ..config.manifest import load_manifest

        sha = load_manifest(Path(value)).file_sha256
        return (lambda m: m is not None and m.sha256 == sha), Path(value)
    if re.fullmatch(r"[0-9a-f]{6,64}", value):
        return (lambda m: m is not None and (m.sha256.startswith(value) or m.compute_sha256.startswith(value))), None
    if value.startswith(BUILTIN_PREFIX) or "/" in value or "\\" in value or value.endswith((".yaml", ".yml")):
        return (lambda m: m is not None and value in (m.source, m.path)), None
    raise InputError(
        f"--manifest {value!r}: not a manifest file, a hash prefix of at least 6 hex characters, or a "
        "recorded path or source",
        "e.g. --manifest manifests/math500.yaml or --manifest 1a4160",
    )


def _manifest_of(raw: dict) -> ManifestRef | None:
    """The manifest a line that is not what its kind records names, if that part of it reads."""
    try:
        return ManifestRef.from_json(raw.get("manifest"), "manifest")
    except EntryError:
        return None


def _bad_row(i: int, kind: Any, why: str) -> dict:
    """The row of a line that is not an entry, or not what its kind records."""
    return {"seq": i, "line": i + 1, "kind": kind, "time": None, "manifest": None, "summary": why, "outputs": {}}


def _row(i: int, e: Entry) -> dict:
    """What `ledger log` shows of one entry (and prints with --json)."""
    m = e.manifest
    manifest = {"ref": m.path or m.source, "sha256": m.sha256, "compute_sha256": m.compute_sha256} if m else None
    try:
        summary = e.summary()
    except (TypeError, ValueError, KeyError, AttributeError):  # a result object of another shape
        summary = ""
    return {
        "seq": e.seq if e.seq is not None else i,
        "line": i + 1,
        "kind": e.kind,
        "time": e.time,
        "manifest": manifest,
        "summary": summary,
        "outputs": e.shown_digests(),
    }


def _render_rows(rows: list[dict], title: str) -> None:
    t = table(title, ("seq", "kind", "time (UTC)", "manifest", "what", "outputs"), right=("seq",))
    for r in rows:
        m = r["manifest"]
        when = r["time"][:19].replace("T", " ") if isinstance(r["time"], str) else ""
        t.add_row(
            str(r["seq"]),
            cell(r["kind"]),
            cell(when),
            cell(f"{m['ref']} {short(m['sha256'])}" if m else ""),
            cell(r["summary"]),
            cell("; ".join(f"{k} {short(v)}" for k, v in r["outputs"].items())),
        )
    out.print(t)


@app.command("checkpoint", cls=Command)
def checkpoint(
    ledger: Path | None = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    origin: str = typer.Option("kvgraft-ledger", "--origin", help="The log's name (first line of the checkpoint)."),
    key: str | None = typer.Option(None, "--key", help="Signer key (file or string) to sign the checkpoint with."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write here (default: stdout)."),
    manifest: Path | None = MANIFEST_OPT,
) -> None:
    """Write a checkpoint (origin, size, RFC 6962 root) of a ledger, optionally Ed25519-signed (signed note)."""
    from ..ledger.checkpoint import load_key, sign, write_checkpoint
    from ..ledger.proofs import LedgerTree
    from ..runs.owned import check_output

    path = ledger_path(ledger, manifest)
    if output is not None:
        check_output(output, "--output", ledger=path)  # a checkpoint never replaces the ledger it checkpoints
    cp = LedgerTree.read(path, complete=True).checkpoint(origin)
    text = cp.body() if key is None else sign(cp.body(), load_key(key))
    if output is None:
        sys.stdout.write(text)
    else:
        write_checkpoint(output, text)
        err.print(
            printable(
                f"wrote {output}: {origin} @ {cp.size} lines, root {cp.root.hex()}" + (" (signed)" if key else ""),
                False,
            ),
            markup=False,
            soft_wrap=True,
        )


@app.command("keygen", cls=Command)
def keygen(
    name: str = typer.Argument(..., help="Key name (no spaces or '+'), e.g. the log's origin."),
    output: Path = typer.Option(Path("."), "--dir", help="Folder for NAME.key (private, mode 600) and NAME.pub."),
) -> None:
    """Make an Ed25519 key pair for signing checkpoints (signed-note key strings)."""
    from ..ledger.checkpoint import generate_key
    from ..util.fsio import atomic_write_bytes

    signer, verifier = generate_key(name)
    priv, pub = output / f"{name}.key", output / f"{name}.pub"
    if priv.exists():
        raise InputError(f"{priv} exists", "pick another name or folder; keys are never overwritten")
    atomic_write_bytes(priv, (signer + "\n").encode(), mode=0o600)
    atomic_write_bytes(pub, (verifier + "\n").encode())
    err.print(f"wrote {priv} (keep it secret) and {pub}")
    sys.stdout.write(verifier + "\n")


@app.command("repair", cls=Command)
def repair(
    ledger: Path | None = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    manifest: Path | None = MANIFEST_OPT,
) -> None:
    """Remove a torn last line (bytes after the last newline) and nothing else."""
    from ..audit.verify import first_bad_line
    from ..ledger.log import repair

    path = ledger_path(ledger, manifest)
    removed = repair(path)
    if removed:
        out.print(f"{path}: removed a torn last line of {removed} bytes; complete lines untouched", markup=False)
    # A damaged line in the middle is complete (it ends with a newline): no repair of the tail mends it, and saying
    # "nothing changed" alone would read as "the ledger is fine" (#24.11).
    bad = first_bad_line(path)
    if bad is not None:
        raise CheckFailed(
            f"{path}: line {bad[0]} is damaged ({bad[1]}); repair removes only a "
            "torn last line and never rewrites complete lines",
            f"run `kvgraft verify {path}` for every finding, and restore the ledger from a good copy "
            "(`kvgraft verify --since COPY` checks it only appended)",
        )
    if not removed:
        out.print(f"{path}: no torn line; nothing changed", markup=False)


@app.command("diff", cls=Command)
def diff(
    base: Path = typer.Argument(..., help="The older ledger file."),
    ledger: Path | None = typer.Argument(None, help="The newer ledger (default: the manifest's paths.ledger)."),
    manifest: Path | None = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """List the entries appended since BASE; exit 1 if the ledger is not an append to it."""
    from ..ledger.log import appended_since, split_lines

    path = ledger_path(ledger, manifest)
    for p in (base, path):
        if not p.is_file():
            raise InputError(f"ledger not found: {p}")
    base_lines = split_lines(base.read_bytes())[0]
    new = appended_since(base_lines, split_lines(path.read_bytes())[0])
    if as_json:
        print_json({"base": str(base), "ledger": str(path), "appended": new})
        return
    rows = []
    for i, raw in enumerate(new, len(base_lines)):  # (the line's own index in the newer ledger)
        try:
            rows.append(_row(i, entries.parse(raw)))
        except EntryError as x:
            rows.append(_bad_row(i, raw.get("kind"), f"{x.message}: run `kvgraft verify`"))
    _render_rows(rows, f"{len(new)} entries appended to {base}")


@app.command("prove", cls=Command)
def prove(
    line: int = typer.Argument(..., min=1, callback=at_most_max_count, help="1-based line of the entry to prove."),
    ledger: Path | None = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    size: int | None = typer.Option(
        None,
        "--size",
        min=1,
        callback=at_most_max_count,
        help="Prove against the tree of the first SIZE lines (e.g. a checkpoint's size).",
    ),
    manifest: Path | None = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """RFC 6962 inclusion proof of one line in the ledger's Merkle tree (checked before it is printed)."""
    from ..ledger.proofs import LedgerTree

    p = LedgerTree.read(ledger_path(ledger, manifest)).inclusion(line, size)
    if as_json:
        print_json(p.to_json())
        return
    out.print(f"line {line} is leaf {p.index} of the tree of {p.size} lines, root {p.root.hex()}", markup=False)
    for h in p.proof:
        out.print(f"  {h.hex()}", markup=False)
