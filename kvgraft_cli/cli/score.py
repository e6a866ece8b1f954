"""`kvgraft score`: score model outputs against reference answers (torch-free)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ._common import JSON_OPT, MANIFEST_OPT, context, field_overrides
from ._output import out, print_json


def score(
    outputs: Path = typer.Argument(..., help="Model outputs, JSON Lines with an id and an output text per line."),
    answers_file: Path = typer.Option(
        ...,
        "--answers",
        help="Problems file with the reference answers (read with the manifest's input mapping; a solution field is not needed).",
    ),
    records: Path | None = typer.Option(
        None,
        "--records",
        help="Per-sample records file (default: STORE/scores/OUTPUTS-STEM-<sha256[:12]>.scores.jsonl, named by its content).",
    ),
    id_field: str = typer.Option("id", "--id-field", help="Id field of the outputs file."),
    output_field: str = typer.Option("output", "--output-field", help="Text field of the outputs file."),
    field: list[str] = typer.Option([], "--field", help="Map a role of the answers file: ROLE=NAME (as for deposit)."),
    answer_extract: str | None = typer.Option(
        None, "--answer-extract", help="Read reference answers: verbatim, boxed or trailer."
    ),
    answered_only: bool = typer.Option(
        False,
        "--answered-only",
        help="Leave problems without an output out of the denominator (default: they count as incorrect). Recorded in the ledger entry.",
    ),
    grader: str = typer.Option(
        "exact",
        "--grader",
        help="exact (normalize, compare exactly) or math-verify (exact, else math-verify; pip install 'kvgraft[mathverify]').",
    ),
    manifest: Path | None = MANIFEST_OPT,
    ledger: Path | None = typer.Option(None, "--ledger", help="Ledger file (default: the manifest's paths.ledger)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Score outputs: the last final-answer statement (\\boxed{}, 'the answer is', 'Answer:'), graded against the
    reference; every problem with a reference counts (unanswered ones as incorrect); Wilson 95%."""
    from ..eval.scoring import ScoreSettings
    from ..runs.score import default_records_path, score_and_record

    settings = ScoreSettings.current(answered_only=answered_only, grader=grader)
    ctx = context(manifest, None, ledger, False, field_overrides(field, answer_extract))
    result, rec_sha, written = score_and_record(ctx, outputs, answers_file, records, id_field, output_field, settings)
    rec_path = records or default_records_path(ctx.store, outputs, rec_sha)
    summary = result.summary()
    if as_json:
        print_json({**summary, "records": str(rec_path), "records_sha256": rec_sha, "ledger_seq": written.seq})
        return
    t = Table(title=escape(f"score {outputs} against {answers_file}"), title_justify="left")
    for col in ("id", "extracted", "reference", "correct"):
        t.add_column(col, overflow="fold")
    for r in result.records:
        t.add_row(
            escape(r.id),
            "" if r.extracted is None else escape(r.extracted),
            escape(r.reference),
            "[green]yes[/]" if r.correct else ("[red]no[/]" if r.answered else "[red]no (no output)[/]"),
        )
    out.print(t)
    counted = "answered only" if settings.answered_only else "unanswered count as incorrect"
    out.print(
        f"accuracy {result.correct}/{result.n} = {float(summary['accuracy']):.4f}, Wilson 95% "
        f"[{float(summary['wilson95_low']):.4f}, {float(summary['wilson95_high']):.4f}]; "
        f"answered {result.answered}, unanswered {result.unanswered} ({counted})"
        + (f", {result.no_reference} without a reference answer" if result.no_reference else "")
        + f"; grader {grader}; records: {rec_path}",
        markup=False,
        soft_wrap=True,
    )
