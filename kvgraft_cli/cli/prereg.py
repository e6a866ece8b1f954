"""`kvgraft prereg make`: pre-registrations from finished runs."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import InputError
from ._common import MANIFEST_OPT, at_most_max_count, context
from ._help import Command, Group
from ._output import out

app = typer.Typer(cls=Group, no_args_is_help=True, help="Make pre-registrations from finished runs.")


@app.command("make", cls=Command)
def make(
    ledger: Path | None = typer.Argument(
        None, help="Ledger of the finished run (default: the manifest's paths.ledger)."
    ),
    target: str = typer.Option(
        ..., "--target", help="Name of the target these hashes were produced on, e.g. cpu-portable."
    ),
    output: Path = typer.Option(..., "--output", "-o", help="Prereg YAML to write."),
    name: str | None = typer.Option(None, "--name", help="The prereg's name."),
    from_seq: int = typer.Option(
        0, "--from-seq", min=0, callback=at_most_max_count, help="Use entries from this 0-based line on."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
    manifest: Path | None = MANIFEST_OPT,
) -> None:
    """Turn a finished run's ledger entries into a prereg.yaml that another machine or target can replay. A served
    log (the ledger `kvgraft serve` wrote) becomes a `serve` run: the answered requests' bodies are copied, in order,
    into PREREG-NAME.serve-N.requests.jsonl beside the prereg, which pins that file's hash."""
    from ..runs.owned import check_output
    from ..runs.replay import prereg_from_ledger, write_prereg

    if output.exists() and not force:
        raise InputError(f"{output} exists", "pass --force to overwrite it (then register the new version)")
    path = ledger or Path(context(manifest, None, None, False).ledger)
    check_output(output, "--output", ledger=path)  # never over the ledger it reads
    files: dict[Path, bytes] = {}  # the requests files of served runs, written beside the prereg
    data = prereg_from_ledger(path, target, output, name, from_seq, files)
    for extra in files:
        if extra.exists() and not force:
            raise InputError(f"{extra} exists", "pass --force to overwrite it (then register the new version)")
        check_output(extra, "--output", ledger=path)
    from ..util.fsio import atomic_write_bytes

    for extra, blob in files.items():  # before the prereg that pins their hashes
        atomic_write_bytes(extra, blob)
    write_prereg(output, data)
    also = "".join(f" and {f}" for f in files)
    out.print(
        f"wrote {output}{also}: {len(data['runs'])} runs, target {target}; register it with "
        f"`kvgraft replay --register {output}`",
        markup=False,
    )
