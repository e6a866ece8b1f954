"""`kvgraft report`: a ledger as one self-contained HTML page (torch-free)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import CheckFailed, InputError
from ._common import JSON_OPT, MANIFEST_OPT, ledger_path
from ._output import err, print_json, printable


def report(
    ledger: Path | None = typer.Argument(None, help="Ledger file (default: the manifest's paths.ledger)."),
    output: Path = typer.Option(
        ...,
        "--output",
        "-o",
        help="The HTML file to write (replaced atomically; never the ledger, a file it names or a store, and only an earlier report if it exists).",
    ),
    checkpoint: Path | None = typer.Option(
        None, "--checkpoint", help="Check the root against this checkpoint and show it."
    ),
    key: list[str] = typer.Option(
        [], "--key", help="Verifier key (string or file) the checkpoint must be signed with."
    ),
    no_files: bool = typer.Option(False, "--no-files", help="Do not re-hash the files the ledger names."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Tables only, even with matplotlib installed."),
    manifest: Path | None = MANIFEST_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Write one self-contained HTML report of a ledger: verification first, then solve comparisons (accuracy with
    Wilson intervals, decode tokens), graft checks, probes, scores and deposits. Plots need pip install
    'kvgraft[report]'. Exit 1 when the ledger does not verify (the report is written and says so)."""
    from ..report import write_report

    if key and checkpoint is None:
        raise InputError("--key needs --checkpoint (the signed note to check)")
    path = ledger_path(ledger, manifest)
    data = write_report(
        path, output, checkpoint=checkpoint, keys=key, rehash=not no_files, plots=False if no_plots else None
    )
    if as_json:
        print_json({"output": str(output), **data.to_json()})
    v = data.verification
    status = "verified" if v["passed"] else "NOT verified"
    err.print(
        printable(f"wrote {output}: {path} {status}, {v['entries']} entries, root {v['root']}", False),
        markup=False,
        soft_wrap=True,
    )
    if not v["passed"]:
        raise CheckFailed(f"{path}: {v['first_problem']}", f"the report {output} shows every finding")
