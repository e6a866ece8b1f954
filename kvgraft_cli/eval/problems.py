"""Problem files: JSON Lines read with the manifest's field mapping, every line checked before any work starts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.modelhash import CHARS_PER_TOKEN
from ..errors import ProblemFileError
from ..util.hashing import sha256_bytes, sha256_json
from ..util.limits import read_lines
from . import answers


@dataclass(frozen=True)
class Problem:
    """One problem record, mapped to kvgraft's own field names."""

    line: int  # 1-based line number in the file
    id: str
    problem: str
    solution: str
    answer: str | None  # reference answer, already extracted from its field
    record_sha256: str  # SHA-256 of the record's RFC 8785 canonical JSON

    def fields(self) -> dict[str, str]:
        """Values for the prompt template placeholders."""
        return {"id": self.id, "problem": self.problem, "solution": self.solution, "answer": self.answer or ""}


@dataclass(frozen=True)
class Verdict:
    """Whether a solution's final answer was checked against the reference answer."""

    status: str  # "verified" | "wrong" | "unverifiable"
    reason: str
    extracted: str | None


def normalize_key(text: str) -> str:
    """The normalized problem text used for derived ids: whitespace runs collapsed, ends stripped."""
    return " ".join(text.split())


def read_problems(path: Path, mapping: dict[str, Any], require_solution: bool = True) -> list[Problem]:
    """Parse and map every line of a JSONL file; raise ProblemFileError naming the first bad line and field.

    ``mapping`` is the manifest's ``input`` section: field names for id (or null: derived from the problem text),
    problem, solution and answer (or null), and how to read the reference answer (``answer_extract``). Without
    ``require_solution`` (problems to solve) a record may lack the solution field; its solution is then "".
    """
    path = Path(path)
    try:
        lines = read_lines(path, "problems file")  # each line bounded: /dev/zero is refused, not read whole
    except FileNotFoundError:
        raise ProblemFileError(
            f"problems file not found: {path}", "pass a JSON Lines file, one problem per line"
        ) from None
    except IsADirectoryError:
        raise ProblemFileError(f"{path} is a directory, expected a JSON Lines file") from None
    out: list[Problem] = []
    seen: dict[str, int] = {}
    for n, line in lines:
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, or an int of 5,000 digits
            raise ProblemFileError(
                f"{where}: malformed JSON ({_clip(str(e))})", "each line must be one JSON object"
            ) from None
        except RecursionError:
            raise ProblemFileError(
                f"{where}: JSON nested too deeply", "each line must be one flat JSON object"
            ) from None
        if not isinstance(rec, dict):
            raise ProblemFileError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        problem = _text(rec, mapping["problem"], where, "problem")
        has_solution = mapping["solution"] is not None and mapping["solution"] in rec
        solution = _text(rec, mapping["solution"], where, "solution") if require_solution or has_solution else ""
        pid = _id(rec, mapping["id"], where, problem)
        if pid in seen:
            raise ProblemFileError(
                f"{where}: duplicate id {_clip(repr(pid), 80)} (first on line {seen[pid]})", "ids must be unique"
            )
        seen[pid] = n
        ref = None
        if mapping["answer"] is not None and rec.get(mapping["answer"]) is not None:
            raw_ans = _text(rec, mapping["answer"], where, "answer")
            ref = answers.extract_with(mapping["answer_extract"], raw_ans)
        try:
            rec_hash = sha256_json(rec)
        except Exception as e:  # numbers JCS cannot represent (NaN, huge ints)
            raise ProblemFileError(f"{where}: record cannot be canonicalized ({_clip(str(e))})") from None
        out.append(Problem(n, pid, problem, solution, ref, rec_hash))
    if not out:
        raise ProblemFileError(f"{path}: no problems (empty file)")
    return out


def check_lengths(
    problems: list[Problem], path: Path, positions: int | None, fields: tuple[str, ...] = ("problem", "solution")
) -> None:
    """Refuse, before anything is tokenized, a problem whose ``fields`` hold more characters than the model's
    ``positions`` could ever fit (CHARS_PER_TOKEN a position, config/modelhash.py): ProblemFileError naming the line.
    ``positions``: the model's limit (config.modelhash.context_window); None checks nothing."""
    if not positions:
        return
    limit = positions * CHARS_PER_TOKEN
    for p in problems:
        n = sum(len(getattr(p, f)) for f in fields)
        if n > limit:
            raise ProblemFileError(
                f"{path}:{p.line}: problem {_clip(repr(p.id), 60)}: {n:,} characters of {' and '.join(fields)} "
                f"cannot fit the model's {positions:,} positions (kvgraft refuses over {CHARS_PER_TOKEN} characters a position: "
                f"{limit:,})",
                "shorten or split it",
            )


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}…({len(text):,} chars)"


def _text(rec: dict, field: str, where: str, role: str) -> str:
    if field not in rec:
        have = _clip(", ".join(_clip(k, 40) for k in sorted(rec)[:8]))
        raise ProblemFileError(
            f"{where}: missing field {field!r} (the {role}); the record has: {have}",
            f"map the {role} field with --field {role}=NAME or in the manifest's input section",
        )
    v = rec[field]
    if isinstance(v, (int, float)) and not isinstance(v, bool) and role in ("answer", "id"):
        return str(v)
    if not isinstance(v, str):
        raise ProblemFileError(f"{where}: field {field!r} (the {role}) must be a string, got {type(v).__name__}")
    if role in ("problem", "solution") and not v.strip():
        raise ProblemFileError(f"{where}: field {field!r} (the {role}) is empty")
    return v


def _id(rec: dict, field: str | None, where: str, problem: str) -> str:
    if field is None:
        # No id in the data: derive a stable one from the problem text (independent of line order).
        return "p-" + sha256_bytes(normalize_key(problem).encode())[:12]
    return _text(rec, field, where, "id")


def verify_solution(p: Problem) -> Verdict:
    """Check the solution's extracted final answer against the reference answer, when there is one."""
    got = answers.extract(p.solution)
    if p.answer is None:
        return Verdict("unverifiable", "no reference answer", got)
    if got is None:
        return Verdict("unverifiable", "no final answer found in the solution", None)
    if answers.answers_match(got, p.answer):
        return Verdict("verified", "final answer matches the reference", got)
    return Verdict("wrong", f"solution says {got!r}, reference says {p.answer!r}", got)
