"""``kvgraft score``: extract each output's final answer, compare it exactly (after normalization) with the
reference, and report accuracy with a 95% Wilson interval. Torch-free: `kvgraft verify` recomputes scores with it.

Per-sample records are sorted by id and written as canonical JSON lines, so their hash does not depend on the order
of the outputs file (unlike an aggregate over samples in file order).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import answers
from ..errors import ProblemFileError
from ..util.fsio import atomic_write_bytes
from ..util.hashing import canonical_json, sha256_bytes
from .problems import read_problems

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials ((0, 1) when n == 0: nothing is known)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # At k == 0 and k == n the exact bounds are 0 and 1; floating point would give 4e-22 or 0.9999999999999999.
    return (0.0 if k == 0 else max(0.0, center - half)), (1.0 if k == n else min(1.0, center + half))


@dataclass(frozen=True)
class ScoreRecord:
    """One scored output."""

    id: str
    extracted: str | None
    reference: str
    correct: bool

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "extracted": self.extracted, "reference": self.reference, "correct": self.correct,
                "extractor_version": answers.EXTRACTOR_VERSION}


@dataclass
class ScoreResult:
    """Records and the aggregate."""

    records: list[ScoreRecord]
    problems: int  # reference answers available

    @property
    def n(self) -> int:
        return len(self.records)

    @property
    def correct(self) -> int:
        return sum(r.correct for r in self.records)

    def summary(self) -> dict[str, Any]:
        lo, hi = wilson_interval(self.correct, self.n)
        acc = self.correct / self.n if self.n else 0.0
        # Floats as repr strings: the ledger holds no JSON floats, and repr round-trips exactly.
        return {"n": self.n, "correct": self.correct, "accuracy": repr(acc), "wilson95_low": repr(lo),
                "wilson95_high": repr(hi), "unscored_problems": self.problems - self.n,
                "extractor_version": answers.EXTRACTOR_VERSION}

    def records_bytes(self) -> bytes:
        """The records file: one canonical JSON line per record, sorted by id."""
        return b"".join(canonical_json(r.to_json()) + b"\n" for r in self.records)


def read_outputs(path: Path, id_field: str, output_field: str) -> list[tuple[int, str, str]]:
    """(line, id, output text) of an outputs JSONL file; the first bad line raises ProblemFileError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ProblemFileError(f"outputs file not found: {path}") from None
    out, seen = [], {}
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProblemFileError(f"{path}:{n}: malformed JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ProblemFileError(f"{path}:{n}: expected a JSON object")
        for f in (id_field, output_field):
            if not isinstance(rec.get(f), (str, int)) or isinstance(rec.get(f), bool):
                raise ProblemFileError(f"{path}:{n}: missing or non-string field {f!r}",
                                       "name the fields with --id-field / --output-field")
        rid = str(rec[id_field])
        if rid in seen:
            raise ProblemFileError(f"{path}:{n}: duplicate id {rid!r} (first on line {seen[rid]})")
        seen[rid] = n
        out.append((n, rid, str(rec[output_field])))
    return out


def score(outputs_path: Path, answers_path: Path, mapping: dict[str, Any], id_field: str = "id",
          output_field: str = "output") -> ScoreResult:
    """Score an outputs file against the reference answers of a problems file read with the manifest mapping."""
    refs = {p.id: p.answer for p in read_problems(answers_path, mapping, require_solution=False)}
    records = []
    for line, rid, text in read_outputs(outputs_path, id_field, output_field):
        if rid not in refs:
            raise ProblemFileError(f"{outputs_path}:{line}: id {rid!r} is not in {answers_path}",
                                   "ids must match the problems file's ids (derived ids start with p-)")
        ref = refs[rid]
        if ref is None:
            raise ProblemFileError(f"{answers_path}: problem {rid!r} has no reference answer")
        got = answers.extract(text)
        records.append(ScoreRecord(rid, got, ref, got is not None and answers.answers_match(got, ref)))
    records.sort(key=lambda r: r.id)
    return ScoreResult(records, len(refs))


def write_records(path: Path, result: ScoreResult) -> str:
    """Write the records file atomically; returns its SHA-256."""
    data = result.records_bytes()
    atomic_write_bytes(Path(path), data)
    return sha256_bytes(data)


def summary_from_records(data: bytes) -> dict[str, Any]:
    """The aggregate recomputed from a records file alone (what verify does when the inputs are absent)."""
    recs = [json.loads(line) for line in data.splitlines() if line]
    result = ScoreResult([ScoreRecord(r["id"], r["extracted"], r["reference"], bool(r["correct"])) for r in recs], 0)
    s = result.summary()
    s.pop("unscored_problems")
    versions = {r.get("extractor_version") for r in recs}
    s["extractor_version"] = versions.pop() if len(versions) == 1 else sorted(map(str, versions))
    return s
