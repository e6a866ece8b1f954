"""`kvgraft ledger checkpoint|keygen|repair|diff|prove` (torch-free)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..errors import InputError
from ._common import JSON_OPT, MANIFEST_OPT, ledger_path
from ._output import err, out, print_json

app = typer.Typer(no_args_is_help=True, help="Checkpoint, sign, diff, prove and repair a ledger.")


@app.command("checkpoint")
def checkpoint(
    ledger: Optional[Path] = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    origin: str = typer.Option("kvgraft-ledger", "--origin", help="The log's name (first line of the checkpoint)."),
    key: Optional[str] = typer.Option(None, "--key", help="Signer key (file or string) to sign the checkpoint with."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write here (default: stdout)."),
    manifest: Optional[Path] = MANIFEST_OPT,
) -> None:
    """Write a checkpoint (origin, size, RFC 6962 root) of a ledger, optionally Ed25519-signed (signed note)."""
    from ..ledger.checkpoint import load_key, sign, write_checkpoint
    from ..ledger.proofs import LedgerTree

    cp = LedgerTree.read(ledger_path(ledger, manifest), complete=True).checkpoint(origin)
    text = cp.body() if key is None else sign(cp.body(), load_key(key))
    if output is None:
        sys.stdout.write(text)
    else:
        write_checkpoint(output, text)
        err.print(f"wrote {output}: {origin} @ {cp.size} lines, root {cp.root.hex()[:16]}..."
                  + (" (signed)" if key else ""))


@app.command("keygen")
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


@app.command("repair")
def repair(
    ledger: Optional[Path] = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    manifest: Optional[Path] = MANIFEST_OPT,
) -> None:
    """Remove a torn last line (bytes after the last newline) and nothing else."""
    from ..ledger.log import repair

    path = ledger_path(ledger, manifest)
    removed = repair(path)
    if removed:
        out.print(f"{path}: removed a torn last line of {removed} bytes; complete lines untouched", markup=False)
    else:
        out.print(f"{path}: no torn line; nothing changed", markup=False)


@app.command("diff")
def diff(
    base: Path = typer.Argument(..., help="The older ledger file."),
    ledger: Optional[Path] = typer.Argument(None, help="The newer ledger (default: the manifest's paths.ledger)."),
    manifest: Optional[Path] = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """List the entries appended since BASE; exit 1 if the ledger is not an append to it."""
    from ..ledger.log import appended_since, split_lines

    path = ledger_path(ledger, manifest)
    for p in (base, path):
        if not p.is_file():
            raise InputError(f"ledger not found: {p}")
    new = appended_since(split_lines(base.read_bytes())[0], split_lines(path.read_bytes())[0])
    if as_json:
        print_json({"base": str(base), "ledger": str(path), "appended": new})
        return
    t = Table(title=f"{len(new)} entries appended to {base}", title_justify="left")
    for col in ("seq", "kind", "time", "outputs"):
        t.add_column(col, overflow="fold")
    for e in new:
        outs = ", ".join(f"{k} {v['sha256'][:12]}" for k, v in (e.get("outputs") or {}).items()
                         if isinstance(v, dict) and "sha256" in v)
        t.add_row(str(e.get("seq")), str(e.get("kind")), str(e.get("time")), outs)
    out.print(t)


@app.command("prove")
def prove(
    line: int = typer.Argument(..., min=1, help="1-based line of the entry to prove."),
    ledger: Optional[Path] = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    size: Optional[int] = typer.Option(None, "--size", min=1, help="Prove against the tree of the first SIZE lines (e.g. a checkpoint's size)."),
    manifest: Optional[Path] = MANIFEST_OPT,
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
