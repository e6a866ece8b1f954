"""`kvgraft deposit`: verify, prefill and store each problem's solution (torch inside the command)."""

from __future__ import annotations

from pathlib import Path

import typer

from ._common import (
    RAY_ADDRESS_OPT,
    RAY_OPT,
    WORKERS_OPT,
    Codec,
    at_most_max_count,
    engine_options,
    field_overrides,
    ray_choice,
    session,
)
from ._output import cell, err, human_bytes, out, print_json, printable, short, table


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _lines_after(path: Path, offset: int) -> int:
    """Complete lines a file has past byte ``offset`` (the ledger lines a run appended)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


@engine_options
def deposit(
    problems: Path = typer.Argument(..., help="JSON Lines file, one problem per line."),
    limit: int | None = typer.Option(
        None, "--limit", min=1, callback=at_most_max_count, help="Deposit only the first N problems."
    ),
    field: list[str] = typer.Option(
        [], "--field", help="Map a role to a field name: ROLE=NAME (id, problem, solution, answer); 'id=' derives ids."
    ),
    answer_extract: str | None = typer.Option(
        None, "--answer-extract", help="Read the reference answer: verbatim, boxed or trailer."
    ),
    allow_unverified: bool = typer.Option(
        False, "--allow-unverified", help="Also deposit unverifiable or wrong solutions (marked unverified)."
    ),
    recompute: bool = typer.Option(
        False, "--recompute", help="Prefill again even when the store has the prefix; fail if the bytes differ."
    ),
    codec: Codec = typer.Option(
        "auto",
        "--codec",
        help="How new artifact files are written: raw (auto's choice: restored at page-cache speed), zstd or shuffle-zstd (smaller files, slower restores; shuffle-zstd the smallest); the identity is the same.",
    ),
    ray: bool = RAY_OPT,
    ray_address: str | None = RAY_ADDRESS_OPT,
    workers: int | None = WORKERS_OPT,
    manifest=None,
    store=None,
    ledger=None,
    allow_drift=False,
    as_json=False,  # engine_options
) -> None:
    """Verify, prefill and store each problem's solution as a byte-exact KV artifact; record it in the ledger."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..errors import Interrupted

    on_ray = ray_choice(ray, ray_address, workers)
    s = session(manifest, store, ledger, allow_drift, field_overrides(field, answer_extract))
    progress = Progress(
        TextColumn("depositing"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=err,
        transient=True,
        disable=as_json or not err.is_terminal,
    )
    with progress:
        # Indeterminate until the model is loaded and its hash checked (seconds per GB of weights); on Ray, in
        # every worker.
        task = progress.add_task(
            "starting Ray workers, loading models" if on_ray else "loading model, checking hashes", total=None
        )

        start = _size(s.ledger)  # lines past it are this run's: counted if it is interrupted
        total: list[int] = []

        def on_start(n: int) -> None:
            total.append(n)
            progress.update(task, total=n, completed=0, description="")

        def on_progress(r) -> None:
            progress.update(task, advance=1, description=r.id)

        try:
            report = s.deposit_problems(
                problems,
                limit=limit,
                allow_unverified=allow_unverified,
                recompute=recompute,
                codec=codec.value,
                ray=on_ray,
                workers=workers,
                on_start=on_start,
                on_progress=on_progress,
            )
        except KeyboardInterrupt:
            # Typer would turn the interrupt into a silent exit 130 (#24.10): say what was kept and how to resume.
            # Each ledger line is appended whole under the lock; an artifact stored but not yet recorded is stored
            # again (as "already stored") by the next run, or removed by `kvgraft store gc`.
            of = f" of {total[0]}" if total else ""
            raise Interrupted(
                f"interrupted: {_lines_after(s.ledger, start)}{of} problems were deposited and "
                f"recorded in {s.ledger} before it, and are kept (every ledger line is whole)",
                f"re-run `kvgraft deposit {problems}` to resume: what is already stored comes back "
                "as 'already stored'; `kvgraft verify` checks the ledger",
            ) from None
    if as_json:
        print_json(report.to_json())
        return
    t = table(
        f"deposit {problems}",
        ("id", "line", "status", "tokens", "bytes", "artifact", "note"),
        right=("line", "tokens", "bytes"),
    )
    for r in report.results:
        style = {"deposited": "green", "existing": "cyan", "skipped": "yellow"}[r.status]
        note = r.reason if r.status == "skipped" else ("verified" if r.verified else "UNVERIFIED: " + r.reason)
        t.add_row(
            cell(r.id),
            str(r.line),
            f"[{style}]{r.status}[/]",
            str(r.num_tokens or ""),
            human_bytes(r.file_bytes) if r.file_bytes else "",
            short(r.artifact),
            cell(note),
        )
    out.print(t)
    tot = report.totals()
    summary = table(
        "summary",
        ("problems", "deposited", "already stored", "skipped", "tokens", "bytes written"),
        right=("problems", "deposited", "already stored", "skipped", "tokens", "bytes written"),
    )
    summary.add_row(
        str(tot["problems"]),
        str(tot["deposited"]),
        str(tot["existing"]),
        str(tot["skipped"]),
        str(tot["tokens"]),
        human_bytes(tot["bytes"]),
    )
    out.print(summary)
    out.print(
        printable(f"store: {s.run.store_name}   ledger: {s.ledger}   manifest: {s.manifest.source}", False),
        markup=False,
        soft_wrap=True,
    )
