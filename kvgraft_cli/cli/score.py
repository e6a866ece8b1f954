"""`kvgraft score`: score model outputs against reference answers (torch-free)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ._common import JSON_OPT, MANIFEST_OPT, context, field_overrides
from ._output import out, print_json


def score(
    outputs: Path = typer.Argument(..., help="Model outputs, JSON Lines with an id and an output text per line."),
    answers_file: Path = typer.Option(..., "--answers", help="Problems file with the reference answers (read with the manifest's input mapping)."),
    records: Optional[Path] = typer.Option(None, "--records", help="Per-sample records file (default: OUTPUTS with .scores.jsonl)."),
    id_field: str = typer.Option("id", "--id-field", help="Id field of the outputs file."),
    output_field: str = typer.Option("output", "--output-field", help="Text field of the outputs file."),
    field: list[str] = typer.Option([], "--field", help="Map a role of the answers file: ROLE=NAME (as for deposit)."),
    answer_extract: Optional[str] = typer.Option(None, "--answer-extract", help="Read reference answers: verbatim, boxed or trailer."),
    manifest: Optional[Path] = MANIFEST_OPT,
    ledger: Optional[Path] = typer.Option(None, "--ledger", help="Ledger file (default: the manifest's paths.ledger)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Score outputs: last \\boxed{} (or 'The answer is:' / 'Answer:'), normalized, compared exactly; Wilson 95%."""
    from ..runs.score import score_and_record

    ctx = context(manifest, None, ledger, False, field_overrides(field, answer_extract))
    rec_path = records or outputs.with_suffix(".scores.jsonl")
    result, rec_sha, written = score_and_record(ctx, outputs, answers_file, rec_path, id_field, output_field)
    summary = result.summary()
    if as_json:
        print_json({**summary, "records": str(rec_path), "records_sha256": rec_sha, "ledger_seq": written["seq"]})
        return
    t = Table(title=f"score {outputs} against {answers_file}", title_justify="left")
    for col in ("id", "extracted", "reference", "correct"):
        t.add_column(col, overflow="fold")
    for r in result.records:
        t.add_row(r.id, "" if r.extracted is None else r.extracted, r.reference,
                  "[green]yes[/]" if r.correct else "[red]no[/]")
    out.print(t)
    out.print(f"accuracy {result.correct}/{result.n} = {float(summary['accuracy']):.4f}, Wilson 95% "
              f"[{float(summary['wilson95_low']):.4f}, {float(summary['wilson95_high']):.4f}]; records: {rec_path}",
              markup=False, soft_wrap=True)
