"""`kvgraft replay`: register a pre-registration, or replay a registered one and compare every hash."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import CheckFailed, InputError
from ._common import DRIFT_OPT, JSON_OPT, LEDGER_OPT, STORE_OPT, session
from ._output import cell, err, out, print_json, printable, short, table


def replay(
    prereg: Path = typer.Argument(
        ...,
        help="Pre-registration YAML. It names its manifest and pins that file's "
        "hash, so replay takes no --manifest: the prereg's manifest is the one it runs. With --served: the ledger "
        "`kvgraft serve` wrote.",
    ),
    served: bool = typer.Option(
        False,
        "--served",
        help="Replay a served log: compute every request of the ledger PREREG names again (prompt cache off) and "
        "compare every hash; the manifest is the one its lines name (hash pinned).",
    ),
    register: bool = typer.Option(
        False, "--register", help="Only register the prereg (append its hash to the ledger)."
    ),
    target: str | None = typer.Option(None, "--target", help="Which target's expected hashes to compare with."),
    store: str | None = STORE_OPT,
    ledger: Path | None = LEDGER_OPT,
    allow_drift: bool = DRIFT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Register a prereg, or replay a registered one and compare every hash (exit 1 on any mismatch). The manifest
    is the one the prereg names (its hash pinned), so there is no --manifest; --store and --ledger default to that
    manifest's paths."""
    if served:
        _replay_served(prereg, store, ledger, allow_drift, as_json)
        return
    from ..library.solve import replay_solve
    from ..runs.replay import RUNNERS, find_registration, load_prereg, prereg_manifest
    from ..runs.replay import register as do_register
    from ..runs.replay import replay as do_replay

    pr = load_prereg(prereg)
    s = session(prereg_manifest(pr), store, ledger, allow_drift)
    ctx = s.run
    if register:
        found = find_registration(ctx.ledger, pr.sha256)
        if found:
            err.print(
                printable(
                    f"{prereg} is already registered in {ctx.ledger} (line {found[0] + 1}); nothing appended", False
                ),
                markup=False,
                soft_wrap=True,
            )
            return
        e = do_register(ctx, pr)
        if as_json:
            print_json({"registered": str(prereg), "sha256": pr.sha256, "ledger_seq": e.line_seq})
        else:
            out.print(
                printable(f"registered {prereg} (sha256 {pr.sha256}) in {ctx.ledger} at line {e.line_seq + 1}", False),
                markup=False,
                soft_wrap=True,
            )
        return
    with err.status("replaying") as status:
        # The runner table: this layer's runs, plus the library's solve and the served requests' (runs.replay never
        # imports the library).
        from ..serve.replay import replay_served_run

        runners = {**RUNNERS, "solve": replay_solve, "serve": replay_served_run}
        report = do_replay(
            ctx,
            pr,
            target,
            on_run=lambda rid: status.update(f"replaying {rid}"),
            runners=runners,
            get_engine=lambda: s.engine,
        )
    if as_json:
        print_json(report.to_json())
    else:

        def value(v):
            return short(v) if isinstance(v, str) and len(v) == 64 else cell(v)

        t = table(
            f"replay {prereg} (target {report.target}, registered at line {report.registration_seq + 1})",
            ("run", "what", "expected", "actual", "match"),
        )
        for c in report.comparisons:
            t.add_row(
                cell(c.run),
                cell(c.what),
                value(c.expected),
                value(c.actual),
                "[green]yes[/]" if c.match else "[red]NO[/]",
            )
        out.print(t)
        n_bad = sum(not c.match for c in report.comparisons)
        assert report.ledger_seq is not None  # replay() returns after appending its ledger line
        out.print(
            f"{'[green]PASS[/]' if report.passed else '[red]FAIL[/]'}  {len(report.comparisons) - n_bad} "
            f"matched, {n_bad} mismatched; ledger line {report.ledger_seq + 1}"
        )
    if not report.passed:
        bad = next(c for c in report.comparisons if not c.match)
        raise CheckFailed(
            f"replay of {prereg} differs from target {report.target}: {bad.run} {bad.what}"
            + (f"; {report.kernels}" if report.kernels else ""),
            "replay under a profile whose kernels every machine shares (avx2, portable)"
            if report.kernels
            else "every hash must match; see the table (or --json)",
        )


def _replay_served(served: Path, store: str | None, ledger: Path | None, allow_drift: bool, as_json: bool) -> None:
    """`replay --served`: every served request computed again and compared (serve.replay); exit 1 on a mismatch.
    The manifest is the one the served lines name, checked against the hash they record, as a prereg's is."""
    from rich.text import Text

    from ..serve.replay import replay_served, served_entries, served_manifest

    if not served.is_file():
        raise InputError(f"no served ledger {served}", "name the ledger `kvgraft serve` wrote")
    entries = served_entries(served)  # refuses a ledger with no served requests before the model loads
    s = session(served_manifest(served, entries), store, ledger if ledger is not None else served, allow_drift)
    ctx = s.run
    total = len(entries)
    with err.status(f"replaying {total} served requests") as status:
        engine = s.engine
        done = 0

        def progress(_row) -> None:
            nonlocal done
            done += 1
            status.update(f"replaying served requests: {done}/{total}")

        report = replay_served(ctx, served, engine, progress)
    if as_json:
        print_json(report.to_json())
    else:
        t = table(f"replay --served {served}", ("line", "endpoint", "hit", "finish", "match"))
        for r in report.rows:
            t.add_row(
                str(r.seq + 1),
                cell(r.endpoint),
                cell(r.hit),
                cell(r.finish_reason),
                "[green]yes[/]" if r.matched else Text.assemble(("NO: ", "red"), cell(", ".join(r.mismatches))),
            )
        out.print(t)
        assert report.ledger_seq is not None
        out.print(
            f"{'[green]PASS[/]' if not report.mismatched else '[red]FAIL[/]'}  {len(report.rows) - report.mismatched} "
            f"matched, {report.mismatched} mismatched; ledger line {report.ledger_seq + 1}"
        )
    if report.mismatched:
        bad = next(r for r in report.rows if not r.matched)
        raise CheckFailed(
            f"served request at line {bad.seq + 1} of {served} computes otherwise now: {', '.join(bad.mismatches)}",
            "every hash must match; see the table (or --json)",
        )
