"""``kvgraft score``: extract each output's final answer, grade it against the reference, and report accuracy with a
95% Wilson interval. Torch-free: `kvgraft verify` recomputes scores with it.

Per-sample records are sorted by id and written as canonical JSON lines, so their hash does not depend on the order
of the outputs file (unlike an aggregate over samples in file order).

How a score is computed is versioned, and every score entry records its version, so `kvgraft verify` (and a
prereg replay) recompute an old entry with the rules it was made with:

- Score rules 2 (current): every problem of the answers file that has a reference answer counts. A problem without
  an output is *unanswered* and incorrect; the summary reports ``answered`` / ``unanswered`` (and ``no_reference``,
  the problems that cannot be scored). ``answered_only`` (``kvgraft score --answered-only``) is the explicit opt-out:
  the denominator is then the answered problems, and the entry records the choice. Records hold one line per
  problem with a reference, ``answered`` true or false.
- Score rules 1 (entries that record no ``rules``): only the outputs present counted (missing problems were
  silently left out of the denominator), ``unscored_problems`` reported the rest; the extractor version is the one
  in the entry's result (2 when absent). Kept only to recompute such entries.

Graders (rules 2): ``exact`` (normalize, then compare exactly; answers.py) or ``math-verify`` (HuggingFace's
math-verify, pinned to :data:`MATH_VERIFY_PIN`, judging the extracted answer against the reference, exact match
first). math-verify's own time-outs (signal alarms) are disabled, so no time-out can decide a verdict; a single
comparison that runs past :data:`GRADER_TIMEOUT_S` stops the score with an error instead of a verdict.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError, ProblemFileError
from ..util import jsonio
from ..util.fsio import atomic_write_bytes
from ..util.hashing import canonical_json, sha256_bytes
from ..util.limits import read_lines
from . import answers
from .problems import read_problems

Z95 = 1.959963984540054  # two-sided 95% normal quantile

SCORE_RULES = "2"
RULES = ("1", "2")
GRADERS = ("exact", "math-verify")
MATH_VERIFY_PIN = (
    "0.9.0"  # the version evaluated (docs/SCORES.md, benchmarks/eval_graders.py); `kvgraft[mathverify]` installs it
)
MATH_VERIFY_LIBS = ("latex2sympy2_extended", "antlr4-python3-runtime", "sympy")  # recorded beside it
GRADER_TIMEOUT_S = 60  # one math-verify comparison; past it the score stops with an error, never a verdict

# Which versions each score-rules version was written with (rules 2, extractor 3 and the math-verify pin 0.9.0
# shipped together on 2026-11-30). An entry naming a version older than its rules began with, or a rules-1 entry
# carrying what came with rules 2, was written by no kvgraft: recording it is a way around the recomputation (a
# downgrade), refused by :func:`written_by_no_kvgraft`. Newer versions than these are a later kvgraft's: not a
# downgrade, only not recomputable here.
RULES_EXTRACTORS = {"1": ("1", "2"), "2": ("3",)}
MATH_VERIFY_PINS = ("0.9.0",)  # every math-verify version kvgraft has pinned, oldest first
LAST_RULES_1_DAY = "2026-12-01"  # an entry without rules dated after this day (as written) is no rules-1 kvgraft's
RULES_2_SETTINGS = ("extractor_version", "answered_only", "grader", "grader_version")  # settings rules 1 never had
RULES_2_RESULT = ("rules", "answered", "unanswered", "no_reference", "answered_only", "grader", "grader_libs")
MATH_VERIFY_HINT = f"pip install 'kvgraft[mathverify]' (math-verify=={MATH_VERIFY_PIN})"


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


# --- settings -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoreSettings:
    """How a score is computed: score rules, extractor version, denominator and grader (module docstring)."""

    rules: str = SCORE_RULES
    extractor_version: str = answers.EXTRACTOR_VERSION
    answered_only: bool = False
    grader: str = "exact"
    grader_version: str | None = None  # math-verify's version for grader math-verify

    @classmethod
    def current(cls, answered_only: bool = False, grader: str = "exact") -> ScoreSettings:
        """The settings a new score uses (current rules and extractor); InputError for an unknown grader."""
        if grader not in GRADERS:
            raise InputError(f"unknown grader {grader!r}", f"use one of: {', '.join(GRADERS)}")
        return cls(
            answered_only=answered_only,
            grader=grader,
            grader_version=MATH_VERIFY_PIN if grader == "math-verify" else None,
        )

    @classmethod
    def from_recorded(cls, settings: dict[str, Any] | None, result: dict[str, Any] | None = None) -> ScoreSettings:
        """The settings of a recorded score (a ledger entry's ``inputs.settings`` and ``outputs.result``, or a prereg
        run's settings). Without ``rules`` the entry predates score rules 2: rules 1, the extractor version of its
        result (2 when absent, the last version of the rules-1 era)."""
        settings, result = settings or {}, result or {}
        rules = str(settings.get("rules", "1"))
        if rules == "1":  # recorded explicitly (a replay of an old run) or, before rules 2, not at all
            return cls(
                "1", str(settings.get("extractor_version", result.get("extractor_version", "2"))), False, "exact", None
            )
        return cls(
            rules,
            str(settings.get("extractor_version")),
            bool(settings.get("answered_only", False)),
            str(settings.get("grader", "exact")),
            settings.get("grader_version"),
        )

    def to_settings(self) -> dict[str, Any]:
        """The keys these settings add to a ledger entry's ``inputs.settings``. Rules 1 (only a replay of an old run
        writes it now) records its rules and extractor too: an entry without ``rules`` predates rules 2."""
        if self.rules == "1":
            return {"rules": "1", "extractor_version": self.extractor_version}
        out: dict[str, Any] = {
            "rules": self.rules,
            "extractor_version": self.extractor_version,
            "answered_only": self.answered_only,
            "grader": self.grader,
        }
        if self.grader_version is not None:
            out["grader_version"] = self.grader_version
        return out

    def unavailable(self) -> str | None:
        """Why this kvgraft cannot compute scores with these settings here (a reason), or None when it can."""
        if self.rules not in RULES:
            return f"score rules {self.rules} are not known to this kvgraft (it has {', '.join(RULES)})"
        if self.extractor_version not in answers.EXTRACTOR_VERSIONS:
            return (
                f"extractor version {self.extractor_version} is not in this kvgraft "
                f"(it has {', '.join(answers.EXTRACTOR_VERSIONS)})"
            )
        if self.grader not in GRADERS:
            return f"grader {self.grader!r} is not known to this kvgraft (it has {', '.join(GRADERS)})"
        if self.rules == "1" and (self.grader != "exact" or self.answered_only):
            return "score rules 1 have only the exact grader and no answered-only option"
        if self.grader == "math-verify":
            have = math_verify_versions()
            if have is None:
                return f"math-verify {self.grader_version} not installed"
            if have["math-verify"] != self.grader_version:
                return f"math-verify {self.grader_version} not installed (math-verify {have['math-verify']} is)"
        return None


# --- grading --------------------------------------------------------------------------------------------------


def _version(v: Any) -> tuple[int, ...] | None:
    """A dotted version of ASCII decimal numbers as a tuple ("0.9.0" -> (0, 9, 0)); None for anything else."""
    parts = v.split(".") if isinstance(v, str) else [""]
    return tuple(int(p) for p in parts) if all(p.isascii() and p.isdigit() for p in parts) else None


def _known(v: str) -> tuple[int, ...]:
    """:func:`_version` of a version kvgraft itself names (RULES_EXTRACTORS, MATH_VERIFY_PINS): never None."""
    parsed = _version(v)
    assert parsed is not None, v
    return parsed


def written_by_no_kvgraft(settings: dict[str, Any], result: dict[str, Any], time: Any = None) -> str | None:
    """Why no kvgraft could have written a score entry with these ``settings`` (``inputs.settings``), ``result``
    (``outputs.result``) and ``time``, or None. Decided from the entry's own facts: its rules began with the versions
    in :data:`RULES_EXTRACTORS` and :data:`MATH_VERIFY_PINS`, settings and result name the same extractor, and an
    entry without ``rules`` (rules 1) has nothing that came with rules 2 and is dated no later than
    :data:`LAST_RULES_1_DAY`. (That an older rules cannot follow a newer one in one ledger is the verifier's check.)"""
    if "rules" not in settings:
        later = [f"settings.{k}" for k in RULES_2_SETTINGS if k in settings]
        later += [f"result.{k}" for k in RULES_2_RESULT if k in result]
        if later:
            return (
                f"it records no score rules (read as rules 1) but has {', '.join(later)}, which came with rules 2: "
                "no kvgraft wrote both"
            )
        extractor = str(result.get("extractor_version", "2"))
        if extractor not in RULES_EXTRACTORS["1"]:
            return f"it records no score rules (read as rules 1), whose extractors were 1 and 2, not {extractor!r}"
        day = time[:10] if isinstance(time, str) else ""
        if day > LAST_RULES_1_DAY:
            return (
                f"it records no score rules (read as rules 1) but is dated {day}, after score rules 2 shipped "
                f"(every kvgraft since records its rules; a rules-1 kvgraft dates from {LAST_RULES_1_DAY} or "
                "before)"
            )
        return None
    rules, ext = settings["rules"], settings.get("extractor_version")
    rules_version = _version(rules)
    if rules_version is None:
        return f"settings.rules {json_text(rules)} is not a score rules version"
    if "extractor_version" in result and result["extractor_version"] != ext:
        return (
            f"settings.extractor_version {json_text(ext)} and result.extractor_version "
            f"{json_text(result['extractor_version'])} differ: one score has one extractor"
        )
    if rules not in RULES_EXTRACTORS:
        return (
            None
            if rules_version > max(_known(r) for r in RULES_EXTRACTORS)
            else f"score rules {rules} do not exist (kvgraft has had {', '.join(RULES_EXTRACTORS)})"
        )
    first = RULES_EXTRACTORS[rules][0]
    ext_version = _version(ext)
    if ext_version is None or ext_version < _known(first) or (rules == "1" and ext not in RULES_EXTRACTORS["1"]):
        return (
            f"score rules {rules} were written with extractor version {' or '.join(RULES_EXTRACTORS[rules])}"
            f"{' and later' if rules != '1' else ''}, never extractor version {json_text(ext)}"
        )
    if rules == "1":
        later = [f"settings.{k}" for k in RULES_2_SETTINGS[1:] if k in settings]
        later += [f"result.{k}" for k in RULES_2_RESULT if k in result]
        return f"score rules 1 have no {', '.join(later)}" if later else None
    grader, pin = settings.get("grader", "exact"), settings.get("grader_version")
    if grader == "exact" and "grader_version" in settings:
        return f"the exact grader has no version, yet settings.grader_version is {json_text(pin)}"
    if grader == "math-verify":
        pin_version = _version(pin)
        if pin_version is None or pin_version < _known(MATH_VERIFY_PINS[0]):
            return (
                f"math-verify {json_text(pin)} was never kvgraft's pin (the first was {MATH_VERIFY_PINS[0]}): "
                "no kvgraft graded with it"
            )
        libs = result.get("grader_libs")
        named = libs.get("math-verify") if isinstance(libs, dict) else libs
        if libs is not None and named != pin:
            return f"result.grader_libs names math-verify {json_text(named)}, the settings {json_text(pin)}"
    return None


def json_text(value: Any) -> str:
    """A recorded value as it reads in the ledger (JSON), cut at 80 characters."""
    import json

    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:80] + "..."


def math_verify_versions() -> dict[str, str | None] | None:
    """Installed versions of math-verify and the libraries its verdicts depend on, or None without math-verify."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    mv = version("math-verify")
    if mv is None:
        return None
    return {"math-verify": mv, **{name: version(name) for name in MATH_VERIFY_LIBS}}


class _Deadline(BaseException):
    """Raised by the grader's own alarm. A BaseException, so math-verify's ``except Exception`` cannot catch it and
    turn it into a "not equal" verdict; :func:`grade` turns it into an InputError at once."""


MATH_VERIFY_FLOAT_ROUNDING = 10  # decimals compared: math-verify's default 6 accepts 0.333333 for 1/3


_CLOSED_AT_INFINITY = re.compile(r"\[\s*[-+]?\s*\\infty|\\infty\s*\]")


def _shape(answer: str) -> tuple[bool, bool, bool]:
    """What math-verify would silently reconcile: an equation, a percentage, an interval closed at infinity."""
    return "=" in answer, "%" in answer, bool(_CLOSED_AT_INFINITY.search(answer))


def _math_verify_equal(extracted: str, reference: str) -> bool:
    """math-verify's verdict on an extracted answer (gold: the reference), both read as ``\\boxed{...}``, with
    time-outs off. Three of its leniencies are refused first: an equation against a value ("x=5" for "5": math-verify
    keeps the right-hand side), a percentage against a number ("10\\%" for "10"), and an interval closed at
    infinity against one that is not ("[-\\infty, 0]" for "(-\\infty, 0]": sympy opens it silently); and numbers
    are compared to :data:`MATH_VERIFY_FLOAT_ROUNDING` decimals, not 6 (docs/SCORES.md: the evaluation)."""
    import logging

    if _shape(extracted) != _shape(reference):
        return False

    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise InputError(f"grader math-verify is not installed ({e})", MATH_VERIFY_HINT) from None
    # Time-outs off (None): math-verify's signal alarms would turn a slow parse under load into "not equal". It
    # warns once that they are off; that is the point, so the warning is not shown.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse("\\boxed{" + reference + "}", parsing_timeout=None)
    pred = parse("\\boxed{" + extracted + "}", parsing_timeout=None)
    return bool(verify(gold, pred, float_rounding=MATH_VERIFY_FLOAT_ROUNDING, timeout_seconds=None))


def _within_deadline(fn, seconds: float, what: str):
    """Run fn() with a wall-clock limit (main thread only; elsewhere without one). Past it: InputError."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return fn()

    def on_alarm(signum, frame):
        raise _Deadline()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    except _Deadline:
        raise InputError(
            f"grader math-verify ran past {seconds:g} s on {what}; a time-out is not a verdict, so "
            "the score stops here",
            "shorten or fix that output, or score with --grader exact",
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def grade(extracted: str | None, reference: str, grader: str = "exact", what: str = "an answer") -> bool:
    """Whether an extracted answer is the reference answer. ``exact``: equal after normalization. ``math-verify``:
    exact, else math-verify's verdict with its time-outs off (past :data:`GRADER_TIMEOUT_S`: InputError)."""
    if extracted is None:
        return False
    if answers.answers_match(extracted, reference):
        return True
    if grader == "exact":
        return False
    if grader == "math-verify":
        return _within_deadline(lambda: _math_verify_equal(extracted, reference), GRADER_TIMEOUT_S, what)
    raise InputError(f"unknown grader {grader!r}", f"use one of: {', '.join(GRADERS)}")


# --- results --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoreRecord:
    """One scored problem (rules 1: one scored output)."""

    id: str
    extracted: str | None
    reference: str
    correct: bool
    extractor_version: str = answers.EXTRACTOR_VERSION
    answered: bool = True

    def to_json(self, rules: str = SCORE_RULES) -> dict[str, Any]:
        """The record as its line in the records file (rules 1: the fields it had then, no ``answered``)."""
        rec = {
            "id": self.id,
            "extracted": self.extracted,
            "reference": self.reference,
            "correct": self.correct,
            "extractor_version": self.extractor_version,
        }
        if rules != "1":
            rec["answered"] = self.answered
        return rec


@dataclass
class ScoreResult:
    """Records and the aggregate."""

    records: list[ScoreRecord]
    problems: int  # problems in the answers file (with or without a reference answer)
    settings: ScoreSettings = field(default_factory=ScoreSettings)
    no_reference: int = 0  # problems without a reference answer (cannot be scored)
    grader_libs: dict[str, str | None] | None = None  # math-verify and its libraries, as installed when scored

    @property
    def answered(self) -> int:
        """Problems with a reference answer and an output."""
        return sum(r.answered for r in self.records)

    @property
    def unanswered(self) -> int:
        """Problems with a reference answer and no output (incorrect; rules 1 had none of these)."""
        return sum(not r.answered for r in self.records)

    @property
    def n(self) -> int:
        """The denominator: every problem with a reference (rules 2), or only the answered ones when opted out."""
        return self.answered if self.settings.answered_only else len(self.records)

    @property
    def correct(self) -> int:
        """Problems graded correct."""
        return sum(r.correct for r in self.records)

    def summary(self) -> dict[str, Any]:
        """The aggregate as the ledger entry records it (``outputs.result``)."""
        lo, hi = wilson_interval(self.correct, self.n)
        acc = self.correct / self.n if self.n else 0.0
        # Floats as repr strings: the ledger holds no JSON floats, and repr round-trips exactly.
        s: dict[str, Any] = {
            "n": self.n,
            "correct": self.correct,
            "accuracy": repr(acc),
            "wilson95_low": repr(lo),
            "wilson95_high": repr(hi),
            "extractor_version": self.settings.extractor_version,
        }
        if self.settings.rules == "1":
            s["unscored_problems"] = self.problems - self.n
            return s
        s.update(
            rules=self.settings.rules,
            answered=self.answered,
            unanswered=self.unanswered,
            no_reference=self.no_reference,
            answered_only=self.settings.answered_only,
            grader=self.settings.grader,
        )
        if self.grader_libs is not None:
            s["grader_libs"] = self.grader_libs
        return s

    def records_bytes(self) -> bytes:
        """The records file: one canonical JSON line per record, sorted by id."""
        return b"".join(canonical_json(r.to_json(self.settings.rules)) + b"\n" for r in self.records)


def read_outputs(path: Path, id_field: str, output_field: str) -> list[tuple[int, str, str]]:
    """(line, id, output text) of an outputs JSONL file; the first bad line raises ProblemFileError."""
    path = Path(path)
    try:
        lines = read_lines(path, "outputs file")  # each line bounded (util.limits)
    except FileNotFoundError:
        raise ProblemFileError(f"outputs file not found: {path}") from None
    except IsADirectoryError:
        raise ProblemFileError(f"{path} is a directory, expected an outputs JSON Lines file") from None
    out: list[tuple[int, str, str]] = []
    seen: dict[str, int] = {}
    for n, line in lines:
        if not line.strip():
            continue
        try:
            rec = jsonio.loads(line)
        except ValueError as e:
            raise ProblemFileError(f"{path}:{n}: malformed JSON ({str(e)[:200]})") from None
        if not isinstance(rec, dict):
            raise ProblemFileError(f"{path}:{n}: expected a JSON object")
        for f in (id_field, output_field):
            if not isinstance(rec.get(f), (str, int)) or isinstance(rec.get(f), bool):
                raise ProblemFileError(
                    f"{path}:{n}: missing or non-string field {f!r}", "name the fields with --id-field / --output-field"
                )
        rid = str(rec[id_field])
        if rid in seen:
            raise ProblemFileError(f"{path}:{n}: duplicate id {rid!r} (first on line {seen[rid]})")
        seen[rid] = n
        out.append((n, rid, str(rec[output_field])))
    return out


def score(
    outputs_path: Path,
    answers_path: Path,
    mapping: dict[str, Any],
    id_field: str = "id",
    output_field: str = "output",
    settings: ScoreSettings | None = None,
) -> ScoreResult:
    """Score an outputs file against the reference answers of a problems file read with the manifest mapping
    (a solution field is not needed), by ``settings`` (default: the current rules, extractor and exact grader)."""
    settings = settings or ScoreSettings()
    why = settings.unavailable()
    if why:
        raise InputError(f"cannot score: {why}", MATH_VERIFY_HINT if settings.grader == "math-verify" else None)
    refs = {p.id: p.answer for p in read_problems(answers_path, mapping, require_solution=False)}
    version, rules = settings.extractor_version, settings.rules
    outputs: dict[str, str] = {}
    for line, rid, text in read_outputs(outputs_path, id_field, output_field):
        if rid not in refs:
            raise ProblemFileError(
                f"{outputs_path}:{line}: id {rid!r} is not in {answers_path}",
                "ids must match the problems file's ids (derived ids start with p-)",
            )
        if refs[rid] is None:
            raise ProblemFileError(f"{answers_path}: problem {rid!r} has no reference answer")
        outputs[rid] = text
    records = []
    for rid, ref in refs.items():
        if ref is None:
            continue
        if rid not in outputs:
            if rules != "1":  # rules 1 left unanswered problems out
                records.append(ScoreRecord(rid, None, ref, False, version, answered=False))
            continue
        got = answers.extract(outputs[rid], version)
        records.append(ScoreRecord(rid, got, ref, grade(got, ref, settings.grader, f"id {rid!r}"), version))
    records.sort(key=lambda r: r.id)
    libs = math_verify_versions() if settings.grader == "math-verify" else None
    return ScoreResult(records, len(refs), settings, sum(ref is None for ref in refs.values()), libs)


def write_records(path: Path, result: ScoreResult) -> str:
    """Write the records file atomically; returns its SHA-256."""
    data = result.records_bytes()
    atomic_write_bytes(Path(path), data)
    return sha256_bytes(data)


NOT_FROM_RECORDS = ("unscored_problems", "no_reference", "grader_libs")  # summary keys a records file cannot give


def summary_from_records(data: bytes, settings: ScoreSettings | None = None) -> dict[str, Any]:
    """The part of the aggregate a records file alone determines (what verify recomputes when the inputs are absent
    or their extractor or grader is not here): every key but :data:`NOT_FROM_RECORDS`, which depend on the answers
    file or the machine. Default settings: rules 1."""
    settings = settings or ScoreSettings.from_recorded({})
    try:
        recs = [jsonio.loads(line) for line in data.splitlines() if line]
        records = [
            ScoreRecord(
                r["id"],
                r["extracted"],
                r["reference"],
                bool(r["correct"]),
                str(r.get("extractor_version")),
                bool(r.get("answered", True)),
            )
            for r in recs
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"records file is not kvgraft score records ({type(e).__name__}: {str(e)[:120]})") from None
    s = ScoreResult(records, 0, settings).summary()
    for key in NOT_FROM_RECORDS:
        s.pop(key, None)
    versions = {r.get("extractor_version") for r in recs}
    s["extractor_version"] = versions.pop() if len(versions) == 1 else sorted(map(str, versions))
    return s
