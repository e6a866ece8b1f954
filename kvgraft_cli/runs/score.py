"""A ``score`` run: score an outputs file (eval.scoring), write the per-sample records, append the ledger entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine.determinism import effective_environment
from ..errors import ProblemFileError
from ..eval.scoring import ScoreResult, score, write_records
from ..ledger import log as ledger
from ..util.hashing import digest, sha256_file


def score_and_record(ctx, outputs: Path, answers_path: Path, records_path: Path, id_field: str = "id",
                     output_field: str = "output") -> tuple[ScoreResult, str, dict[str, Any]]:
    """Score, write the records file, append a ``score`` ledger entry. Returns (result, records sha256, entry)."""
    mapping = ctx.manifest.data["input"]
    for p in (outputs, answers_path):
        if Path(records_path).resolve() == Path(p).resolve():
            raise ProblemFileError(f"--records {records_path} is an input file; it would be overwritten",
                                   "write the records elsewhere")
    result = score(outputs, answers_path, mapping, id_field, output_field)
    in_hashes = (sha256_file(outputs), sha256_file(answers_path))  # before anything is written
    ledger.check_appendable(ctx.ledger)
    rec_sha = write_records(records_path, result)
    entry = ctx.entry_base()
    entry.update(
        environment=effective_environment(ctx.manifest.data["runtime"]),
        inputs={"outputs": {"path": ctx.rel(outputs), **digest(in_hashes[0])},
                "answers": {"path": ctx.rel(answers_path), **digest(in_hashes[1])},
                "settings": {"mapping": mapping, "id_field": id_field, "output_field": output_field}},
        outputs={"records": {"path": ctx.rel(records_path), **digest(rec_sha)}, "result": result.summary()},
    )
    return result, rec_sha, ledger.append(ctx.ledger, "score", entry)
