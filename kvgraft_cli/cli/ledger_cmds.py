"""Ledger commands, torch-free: `kvgraft verify` and `kvgraft ledger checkpoint|keygen|repair|diff`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ._common import JSON_OPT, MANIFEST_OPT, _print_json, app, err, handle_errors, ledger_app, out
from ..errors import CheckFailed, InputError

# ---------------------------------------------------------------------------------------------------------------
def _ledger_path(ledger: Optional[Path], manifest: Optional[Path]) -> Path:
    if ledger is not None:
        return ledger
    from ..config.manifest import load_manifest

    return Path(load_manifest(manifest).data["paths"]["ledger"])


@app.command()
@handle_errors
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
    report = verify_ledger(_ledger_path(ledger, manifest), checkpoint=checkpoint, keys=key, since=since,
                           rehash=not no_files, full=full, require_files=require_files)
    if as_json:
        _print_json(report.to_json())
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


@ledger_app.command("checkpoint")
@handle_errors
def ledger_checkpoint(
    ledger: Optional[Path] = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    origin: str = typer.Option("kvgraft-ledger", "--origin", help="The log's name (first line of the checkpoint)."),
    key: Optional[str] = typer.Option(None, "--key", help="Signer key (file or string) to sign the checkpoint with."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write here (default: stdout)."),
    manifest: Optional[Path] = MANIFEST_OPT,
) -> None:
    """Write a checkpoint (origin, size, RFC 6962 root) of a ledger, optionally Ed25519-signed (signed note)."""
    from ..ledger import merkle
    from ..ledger.checkpoint import Checkpoint, load_key, sign, write_checkpoint
    from ..ledger.log import split_lines

    path = _ledger_path(ledger, manifest)
    if not path.is_file():
        raise InputError(f"ledger not found: {path}")
    lines, tail = split_lines(path.read_bytes())
    if tail:
        raise InputError(f"{path}: torn last line", "run `kvgraft verify` and `kvgraft ledger repair` first")
    cp = Checkpoint(origin, len(lines), merkle.root([merkle.leaf_hash(raw) for raw in lines]))
    text = cp.body() if key is None else sign(cp.body(), load_key(key))
    if output is None:
        sys.stdout.write(text)
    else:
        write_checkpoint(output, text)
        err.print(f"wrote {output}: {origin} @ {cp.size} lines, root {cp.root.hex()[:16]}..."
                  + (" (signed)" if key else ""))


@ledger_app.command("keygen")
@handle_errors
def ledger_keygen(
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


@ledger_app.command("repair")
@handle_errors
def ledger_repair(
    ledger: Optional[Path] = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    manifest: Optional[Path] = MANIFEST_OPT,
) -> None:
    """Remove a torn last line (bytes after the last newline) and nothing else."""
    from ..ledger.log import repair

    path = _ledger_path(ledger, manifest)
    removed = repair(path)
    if removed:
        out.print(f"{path}: removed a torn last line of {removed} bytes; complete lines untouched", markup=False)
    else:
        out.print(f"{path}: no torn line; nothing changed", markup=False)


@ledger_app.command("diff")
@handle_errors
def ledger_diff(
    base: Path = typer.Argument(..., help="The older ledger file."),
    ledger: Optional[Path] = typer.Argument(None, help="The newer ledger (default: the manifest's paths.ledger)."),
    manifest: Optional[Path] = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """List the entries appended since BASE; exit 1 if the ledger is not an append to it."""
    from ..ledger.log import appended_since, split_lines

    path = _ledger_path(ledger, manifest)
    for p in (base, path):
        if not p.is_file():
            raise InputError(f"ledger not found: {p}")
    new = appended_since(split_lines(base.read_bytes())[0], split_lines(path.read_bytes())[0])
    if as_json:
        _print_json({"base": str(base), "ledger": str(path), "appended": new})
        return
    t = Table(title=f"{len(new)} entries appended to {base}", title_justify="left")
    for col in ("seq", "kind", "time", "outputs"):
        t.add_column(col, overflow="fold")
    for e in new:
        outs = ", ".join(f"{k} {v['sha256'][:12]}" for k, v in (e.get("outputs") or {}).items()
                         if isinstance(v, dict) and "sha256" in v)
        t.add_row(str(e.get("seq")), str(e.get("kind")), str(e.get("time")), outs)
    out.print(t)


@ledger_app.command("prove")
@handle_errors
def ledger_prove(
    line: int = typer.Argument(..., min=1, help="1-based line of the entry to prove."),
    ledger: Optional[Path] = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    size: Optional[int] = typer.Option(None, "--size", min=1, help="Prove against the tree of the first SIZE lines (e.g. a checkpoint's size)."),
    manifest: Optional[Path] = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """RFC 6962 inclusion proof of one line in the ledger's Merkle tree (checked before it is printed)."""
    import base64

    from ..ledger import merkle
    from ..ledger.log import split_lines

    path = _ledger_path(ledger, manifest)
    if not path.is_file():
        raise InputError(f"ledger not found: {path}")
    lines, _ = split_lines(path.read_bytes())
    n = size or len(lines)
    if n > len(lines) or line > n:
        raise InputError(f"line {line} of a tree of {n} lines: the ledger has {len(lines)} complete lines")
    leaves = [merkle.leaf_hash(raw) for raw in lines]
    tree = merkle.MerkleTree(leaves)
    leaf, root = leaves[line - 1], tree.root(n)
    proof = tree.inclusion_proof(line - 1, n)
    merkle.verify_inclusion(line - 1, n, leaf, proof, root)
    b64 = lambda h: base64.b64encode(h).decode()  # noqa: E731  (base64, as in checkpoints)
    result = {"leafIdx": line - 1, "treeSize": n, "leafHash": b64(leaf), "root": b64(root),
              "proof": [b64(h) for h in proof]}
    if as_json:
        _print_json(result)
        return
    out.print(f"line {line} is leaf {line - 1} of the tree of {n} lines, root {root.hex()}", markup=False)
    for h in proof:
        out.print(f"  {h.hex()}", markup=False)
