"""Engine commands: `kvgraft deposit` and `kvgraft graft` (they import torch, inside the command body)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ._common import (ARTIFACT_ARG, DRIFT_OPT, JSON_OPT, LEDGER_OPT, MANIFEST_OPT, STORE_OPT,
                         _artifact_and_engine, _context, _field_overrides, _human_bytes, _print_json, app, err,
                         handle_errors, out)
from ..errors import CheckFailed

# ---------------------------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def deposit(
    problems: Path = typer.Argument(..., help="JSON Lines file, one problem per line."),
    manifest: Optional[Path] = MANIFEST_OPT,
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Deposit only the first N problems."),
    field: list[str] = typer.Option([], "--field", help="Map a role to a field name: ROLE=NAME (id, problem, solution, answer); 'id=' derives ids."),
    answer_extract: Optional[str] = typer.Option(None, "--answer-extract", help="Read the reference answer: verbatim, boxed or trailer."),
    allow_unverified: bool = typer.Option(False, "--allow-unverified", help="Also deposit unverifiable or wrong solutions (marked unverified)."),
    recompute: bool = typer.Option(False, "--recompute", help="Prefill again even when the store has the prefix; fail if the bytes differ."),
    store: Optional[Path] = STORE_OPT,
    ledger: Optional[Path] = LEDGER_OPT,
    allow_drift: bool = DRIFT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Verify, prefill and store each problem's solution as a byte-exact KV artifact; record it in the ledger."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..runs.deposit import deposit as run_deposit

    ctx = _context(manifest, store, ledger, allow_drift, _field_overrides(field, answer_extract))
    progress = Progress(TextColumn("depositing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=err, transient=True,
                        disable=as_json or not err.is_terminal)
    with progress:
        # Indeterminate until the model is loaded and its hash checked (seconds per GB of weights).
        task = progress.add_task("loading model, checking hashes", total=None)

        def on_start(n: int) -> None:
            progress.update(task, total=n, completed=0, description="")

        def on_progress(r) -> None:
            progress.update(task, advance=1, description=r.id)

        report = run_deposit(ctx, problems, limit=limit, allow_unverified=allow_unverified, recompute=recompute,
                             on_start=on_start, on_progress=on_progress)
    if as_json:
        _print_json(report.to_json())
        return
    table = Table(title=f"deposit {problems}", title_justify="left")
    for col in ("id", "line", "status", "tokens", "bytes", "artifact", "note"):
        table.add_column(col, justify="right" if col in ("line", "tokens", "bytes") else "left")
    for r in report.results:
        style = {"deposited": "green", "existing": "cyan", "skipped": "yellow"}[r.status]
        note = r.reason if r.status == "skipped" else ("verified" if r.verified else "UNVERIFIED: " + r.reason)
        table.add_row(r.id, str(r.line), f"[{style}]{r.status}[/]", str(r.num_tokens or ""),
                      _human_bytes(r.file_bytes) if r.file_bytes else "", (r.artifact or "")[:12], note)
    out.print(table)
    t = report.totals()
    summary = Table(show_header=True, title="summary", title_justify="left")
    for col in ("problems", "deposited", "already stored", "skipped", "tokens", "bytes written"):
        summary.add_column(col, justify="right")
    summary.add_row(str(t["problems"]), str(t["deposited"]), str(t["existing"]), str(t["skipped"]),
                    str(t["tokens"]), _human_bytes(t["bytes"]))
    out.print(summary)
    out.print(f"store: {ctx.store}   ledger: {ctx.ledger}   manifest: {ctx.manifest.source}")


# ---------------------------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def graft(
    artifact: Optional[str] = ARTIFACT_ARG,
    query: str = typer.Option("What is the final answer?", "--query", "-q", help="Query text for the manifest's query template."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", min=0, help="Tokens to decode (default: the manifest's decode.max_new_tokens)."),
    check: bool = typer.Option(False, "--check", help="Prove byte-exactness against a fresh computation instead of generating."),
    samples: int = typer.Option(50, "--samples", min=1, help="With --check: how many different suffixes."),
    manifest: Optional[Path] = MANIFEST_OPT,
    store: Optional[Path] = STORE_OPT,
    ledger: Optional[Path] = LEDGER_OPT,
    allow_drift: bool = DRIFT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Restore an artifact at its own position and continue it; with --check, compare against fresh computation."""
    from ..runs.graft import graft_check, graft_generate

    ctx, loaded, engine = _artifact_and_engine(manifest, store, ledger, allow_drift, artifact)
    n_new = ctx.manifest.data["decode"]["max_new_tokens"] if max_new_tokens is None else max_new_tokens
    if not check:
        r = graft_generate(ctx, engine, loaded, query, n_new)
        if as_json:
            _print_json({"artifact": r.artifact, "prefix_tokens": r.prefix_tokens, "query": r.query,
                         "generated_ids": r.generated_ids, "text": r.text, "ledger_seq": r.ledger_seq})
        else:
            err.print(f"artifact {r.artifact[:16]}... ({r.prefix_tokens} prefix tokens) + query {r.query!r}")
            out.print(r.text, markup=False)
        return

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("checking"), BarColumn(), MofNCompleteColumn(), console=err, transient=True,
                  disable=as_json or not err.is_terminal) as progress:
        task = progress.add_task("", total=samples)
        report = graft_check(ctx, engine, loaded, samples, n_new, on_sample=lambda s: progress.advance(task))
    if as_json:
        _print_json(report.to_json())
    else:
        _render_check(report)
    if not report.passed:
        raise CheckFailed(f"graft is not byte-exact: {report.sha_equal}/{report.n} samples SHA-equal, "
                          f"largest KL {report.max_kl:.3g}, deposit reproduced: {report.deposit_reproduced}")


def _render_check(report) -> None:
    table = Table(title=f"graft --check {report.artifact[:16]}... ({report.prefix_tokens} prefix tokens, "
                        f"schedule {report.schedule['schedule']})", title_justify="left")
    for col in ("sample", "suffix tokens", "logits SHA-256 (fresh)", "equal", "KL", "argmax", "decode"):
        table.add_column(col)
    for s in report.samples:
        mark = "[green]yes[/]" if s.sha_equal else "[red]NO[/]"
        table.add_row(str(s.index), str(s.suffix_tokens), s.fresh_sha256[:16], mark, f"{s.max_kl:.3g}",
                      f"{100 * s.argmax_agreement:.0f}%", "same" if s.generated_equal else "[red]differs[/]")
    out.print(table)
    ok = "[green]PASS[/]" if report.passed else "[red]FAIL[/]"
    out.print(f"{ok}  {report.sha_equal}/{report.n} samples SHA-equal, largest KL {report.max_kl}, "
              f"argmax agreement {100 * report.argmax_agreement:.1f}%, deposit reproduced: "
              f"{'yes' if report.deposit_reproduced else 'NO'}")
    out.print(f"single forward over prefix+suffix vs this schedule: max |diff| {report.single_pass_max_abs_diff:.3g} "
              "(informative: exactness is defined against the manifest's prefill schedule)")


# ---------------------------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def replay(
    prereg: Path = typer.Argument(..., help="Pre-registration YAML."),
    register: bool = typer.Option(False, "--register", help="Only register the prereg (append its hash to the ledger)."),
    target: Optional[str] = typer.Option(None, "--target", help="Which target's expected hashes to compare with."),
    store: Optional[Path] = STORE_OPT,
    ledger: Optional[Path] = LEDGER_OPT,
    allow_drift: bool = DRIFT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Register a prereg, or replay a registered one and compare every hash (exit 1 on any mismatch)."""
    from ..runs.replay import find_registration, load_prereg, prereg_manifest
    from ..runs.replay import register as do_register
    from ..runs.replay import replay as do_replay
    from ..runs.context import RunContext

    pr = load_prereg(prereg)
    ctx = RunContext.make(prereg_manifest(pr), store, ledger, allow_drift)
    if register:
        found = find_registration(ctx.ledger, pr.sha256)
        if found:
            err.print(f"{prereg} is already registered in {ctx.ledger} (line {found[0] + 1}); nothing appended")
            return
        e = do_register(ctx, pr)
        if as_json:
            _print_json({"registered": str(prereg), "sha256": pr.sha256, "ledger_seq": e["seq"]})
        else:
            out.print(f"registered {prereg} (sha256 {pr.sha256[:16]}...) in {ctx.ledger} at line {e['seq'] + 1}",
                      markup=False)
        return
    with err.status("replaying") as status:
        report = do_replay(ctx, pr, target, on_run=lambda rid: status.update(f"replaying {rid}"))
    if as_json:
        _print_json(report.to_json())
    else:
        t = Table(title=f"replay {prereg} (target {report.target}, registered at line {report.registration_seq + 1})",
                  title_justify="left")
        for col in ("run", "what", "expected", "actual", "match"):
            t.add_column(col, overflow="fold")
        for c in report.comparisons:
            short = (lambda v: v[:16] if isinstance(v, str) and len(v) == 64 else str(v))
            t.add_row(c.run, c.what, short(c.expected), short(c.actual), "[green]yes[/]" if c.match else "[red]NO[/]")
        out.print(t)
        n_bad = sum(not c.match for c in report.comparisons)
        out.print(f"{'[green]PASS[/]' if report.passed else '[red]FAIL[/]'}  {len(report.comparisons) - n_bad} "
                  f"matched, {n_bad} mismatched; ledger line {report.ledger_seq + 1}")
    if not report.passed:
        bad = next(c for c in report.comparisons if not c.match)
        raise CheckFailed(f"replay of {prereg} differs from target {report.target}: {bad.run} {bad.what}",
                          "every hash must match; see the table (or --json)")
