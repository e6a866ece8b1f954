"""A ``score`` run: score an outputs file (eval.scoring), write the per-sample records, append the ledger entry."""

from __future__ import annotations

from pathlib import Path

from ..engine.determinism import effective_environment
from ..eval.scoring import ScoreResult, ScoreSettings, score, write_records
from ..ledger import entries
from ..ledger import log as ledger
from ..ledger.entries import Digest, ScoreEntry
from ..util.hashing import sha256_bytes, sha256_file
from .owned import check_output


def default_records_path(store: Path, outputs: Path, records_sha256: str) -> Path:
    """Where a records file goes without ``--records``: ``<store>/scores/<outputs stem>-<sha256[:12]>.scores.jsonl``.
    Named by content, so it never overwrites records another ledger entry hashed, and kept out of the outputs
    file's folder (a source tree, often)."""
    return Path(store) / "scores" / f"{Path(outputs).stem}-{records_sha256[:12]}.scores.jsonl"


def score_and_record(
    ctx,
    outputs: Path,
    answers_path: Path,
    records_path: Path | None,
    id_field: str = "id",
    output_field: str = "output",
    settings: ScoreSettings | None = None,
) -> tuple[ScoreResult, str, ScoreEntry]:
    """Score, write the records file, append a ``score`` ledger entry. ``records_path`` None: the default
    (:func:`default_records_path`). ``settings`` None: the current rules, extractor and exact grader; a replay
    passes the recorded ones. Returns (result, records sha256, entry)."""
    mapping = ctx.manifest.input.as_written()
    settings = settings or ScoreSettings()
    if records_path is not None:  # never over an input, the ledger or the store's own files (runs.owned)
        check_output(
            records_path, "--records", ctx, reads={"the outputs file": outputs, "the answers file": answers_path}
        )
    result = score(outputs, answers_path, mapping, id_field, output_field, settings)
    in_hashes = (sha256_file(outputs), sha256_file(answers_path))  # before anything is written
    ledger.check_appendable(ctx.ledger)
    if records_path is None:
        records_path = default_records_path(ctx.store, outputs, sha256_bytes(result.records_bytes()))
    rec_sha = write_records(records_path, result)
    entry = ScoreEntry(
        manifest=ctx.manifest_ref(),
        environment=effective_environment(ctx.manifest.runtime),
        outputs=Digest(in_hashes[0], ctx.rel(outputs)),
        answers=Digest(in_hashes[1], ctx.rel(answers_path)),
        settings={"mapping": mapping, "id_field": id_field, "output_field": output_field, **settings.to_settings()},
        records=Digest(rec_sha, ctx.rel(records_path)),
        result=result.summary(),
    )
    return result, rec_sha, entries.write(ctx.ledger, entry)
