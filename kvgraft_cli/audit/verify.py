"""``kvgraft verify``: re-check a ledger without a GPU and without torch.

Checks, line by line: canonical form (RFC 8785), the value space (no non-integer numbers, ASCII keys), the entry
schema, the sequence number and the hash chain; then the RFC 6962 Merkle root against a checkpoint (and its Ed25519
signatures), append-only consistency with an older ledger or checkpoint (``--since``), and every referenced file that
is present (artifacts by payload, everything else by file bytes). Findings name the first bad line.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import fastjsonschema

from ..errors import InputError
from ..ledger import entries as entries_mod
from ..ledger import kinds, merkle
from ..ledger.entries import Digest, EntryError, ScoreEntry, ServeEntry
from ..ledger.proofs import LedgerTree
from ..util import jsonio
from .hashcache import HashCache, digest_of

MAX_SAFE_INT = 2**53 - 1  # I-JSON (RFC 7493): integers JSON parsers everywhere read exactly
LEDGER_NOT_FOUND_HINT = "pass the ledger file (default: the manifest's paths.ledger)"


@dataclass
class Finding:
    """One thing wrong with the ledger; ``line`` is 1-based (None: the ledger as a whole)."""

    line: int | None
    check: str
    message: str


@dataclass
class FileCheck:
    """A referenced file, re-hashed (or not found)."""

    line: int
    field: str
    path: str
    status: str  # ok | missing | mismatch | remote (an s3:// object of a remote store: not checked here)
    expected: str
    actual: str | None = None


@dataclass
class VerifyReport:
    """Everything `kvgraft verify` found."""

    ledger: str
    entries: int = 0
    root: str = ""
    findings: list[Finding] = field(default_factory=list)
    files: list[FileCheck] = field(default_factory=list)
    checkpoint: dict[str, Any] | None = None
    since: dict[str, Any] | None = None
    require_files: bool = False
    # Files whose digest came from the verified-file cache, unread (size, mtime and inode unchanged): said on every
    # run that used the cache, since a change keeping all three is invisible to it; --full reads everything.
    files_from_cache: int = 0
    scores_checked: int = 0
    # Scores whose verdicts could not be recomputed here: {line, reason}. From records: the aggregate was recomputed
    # from the records file (counted in scores_checked too); not recomputable: nothing was.
    scores_from_records: list[dict[str, Any]] = field(default_factory=list)
    scores_not_recomputable: list[dict[str, Any]] = field(default_factory=list)
    # The prompt-cache chunks served lines name (inputs.prompt_cache): cache, not records, so one that is not in its
    # store is counted here (evicted by a bounded cache, or never copied here), never as a missing file
    prompt_cache: dict[str, int] | None = None

    @property
    def mismatched(self) -> list[FileCheck]:
        return [f for f in self.files if f.status == "mismatch"]

    @property
    def missing(self) -> list[FileCheck]:
        return [f for f in self.files if f.status == "missing"]

    @property
    def passed(self) -> bool:
        return not self.findings and not self.mismatched and not (self.require_files and self.missing)

    @property
    def remote(self) -> list[FileCheck]:
        return [f for f in self.files if f.status == "remote"]

    def warnings(self) -> list[str]:
        """What passed without being checked: referenced files that are not here (a failure with --require-files),
        and objects of remote stores (never fetched by verify: `kvgraft store pull` brings them here)."""
        found = []
        if self.files_from_cache:
            found.append(
                f"{self.files_from_cache} of {len(self.files)} referenced files were taken from the verify "
                "cache unread (their size, mtime and inode are unchanged since they were hashed; a change "
                "that keeps all three is not seen): `kvgraft verify --full` re-reads every file, the check "
                "for a third party"
            )
        if self.missing and not self.require_files:
            found.append(
                f"{len(self.missing)} of {len(self.files)} referenced files are missing here, so their "
                "hashes were not checked (--require-files makes this a failure)"
            )
        if self.remote:
            found.append(
                f"{len(self.remote)} of {len(self.files)} referenced files are in a remote store "
                f"({self.remote[0].path.split('/objects/')[0]}...), not checked: remote (verify reads no "
                "network; `kvgraft store pull URL` and re-deposit or graft re-hashes them)"
            )
        return found

    def first_problem(self) -> str | None:
        """One sentence naming the first bad line and what is wrong with it."""
        if self.findings:
            f = min(self.findings, key=lambda f: (f.line is None, f.line or 0))
            return f"line {f.line}: {f.message}" if f.line else f.message
        if self.mismatched:
            m = self.mismatched[0]
            return f"line {m.line}: {m.field} {m.path} does not match its recorded sha256"
        if self.require_files and self.missing:
            m = self.missing[0]
            return f"line {m.line}: {m.field} {m.path} is missing"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "ledger": self.ledger,
            "entries": self.entries,
            "root": self.root,
            "passed": self.passed,
            "first_problem": self.first_problem(),
            "warnings": self.warnings(),
            "findings": [asdict(f) for f in self.findings],
            "files": {
                "checked": len(self.files),
                "ok": sum(f.status == "ok" for f in self.files),
                "from_cache": self.files_from_cache,
                "missing": [asdict(f) for f in self.missing],
                "mismatched": [asdict(f) for f in self.mismatched],
                "remote": [asdict(f) for f in self.remote],
            },
            "checkpoint": self.checkpoint,
            "since": self.since,
            "scores_checked": self.scores_checked,
            "prompt_cache": self.prompt_cache,
            "scores_from_records": self.scores_from_records,
            "scores_not_recomputable": self.scores_not_recomputable,
        }


@lru_cache(maxsize=1)
def _validator():
    # fastjsonschema compiles the schema to Python, far faster than jsonschema per entry (docs/PERFORMANCE.md,
    # "Restore speed", ledger verification), which matters at 100,000+ lines. (Manifests use jsonschema, which
    # reports every problem in one pass.)
    text = (resources.files("kvgraft_cli") / "schemas" / "ledger-entry.schema.json").read_text()
    return fastjsonschema.compile(json.loads(text), formats={"date-time": _date_time_ok})


@lru_cache(maxsize=1)
def _date_time_regex() -> re.Pattern:
    # fastjsonschema's own date-time grammar (the one docs/LEDGER.md writes down), compiled with re.ASCII: its \d
    # otherwise matches every Unicode decimal digit ("\u0662\u0660\u0662\u0666-..."), and the spec's DIGIT is 0-9.
    from fastjsonschema.draft04 import CodeGeneratorDraft04

    return re.compile(CodeGeneratorDraft04.FORMAT_REGEXS["date-time"], re.ASCII)


def _date_time_ok(value: str) -> bool:
    """Whether ``value`` is an RFC 3339 date-time in the spec's grammar, ASCII digits only."""
    return _date_time_regex().match(value) is not None


def canonical_line(entry: Any) -> bytes:
    """The canonical bytes of an entry in the ledger's value space (equal to RFC 8785 there; docs/LEDGER.md)."""
    return json.dumps(entry, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()


def _value_problem(value: Any) -> str | None:
    """Why a value is outside the ledger's value space (floats, integers beyond I-JSON, non-ASCII keys), or None."""
    found = _find_outside(value)
    if found is None:
        return None
    path, msg = found
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in reversed(path)).lstrip(".")
    return f"{where or 'value'}: {msg}"


def _find_outside(value: Any) -> tuple[list, str] | None:
    # Hot path of verify (every value of every line): type dispatch, the path built only on a hit.
    t = type(value)
    if t is str or t is bool or value is None:
        return None
    if t is int:
        return (
            None
            if -MAX_SAFE_INT <= value <= MAX_SAFE_INT
            else ([], "an integer beyond +-(2**53 - 1), which RFC 8785 (I-JSON) cannot represent")
        )
    if t is dict:
        for k, v in value.items():
            if not (k.isascii() and k.isprintable()):
                return [k], "key is not printable ASCII"
            if type(v) is not str:
                hit = _find_outside(v)
                if hit is not None:
                    hit[0].append(k)
                    return hit
        return None
    if t is list:
        for i, v in enumerate(value):
            hit = _find_outside(v)
            if hit is not None:
                hit[0].append(i)
                return hit
        return None
    if t is float:
        return [], f"a non-integer number ({value!r}); the ledger writes those as strings"
    return [], f"unexpected JSON value {value!r}"


def check_line(raw: bytes, index: int, prev_line: bytes | None) -> tuple[dict | None, list[Finding]]:
    """Parse and check one line (0-based ``index``) against its predecessor's bytes."""
    n = index + 1
    try:
        entry = jsonio.loads(raw)
    except ValueError as e:  # malformed, bad UTF-8, nested too deeply, an integer past Python's digit limit
        return None, [Finding(n, "json", f"not JSON ({str(e)[:200]})")]
    if not isinstance(entry, dict):
        return None, [Finding(n, "json", "not a JSON object")]
    out: list[Finding] = []
    problem = _value_problem(entry)
    try:
        canonical = canonical_line(entry) if not problem else None
    except UnicodeEncodeError:  # an escaped lone surrogate (\ud800): not representable as UTF-8
        problem = "a string holds a lone UTF-16 surrogate, which RFC 8785 cannot represent"
    if problem:
        out.append(Finding(n, "values", problem))
    elif canonical != raw:
        out.append(Finding(n, "canonical", "bytes are not the RFC 8785 canonical form of the entry (edited by hand?)"))
    try:
        _validator()(entry)
    except fastjsonschema.JsonSchemaValueException as e:  # what a compiled (fail-fast) validator raises
        msg = str(e.message)
        msg = "entry" + msg[4:] if msg.startswith("data") else msg  # fastjsonschema names the root "data"
        out.append(Finding(n, "schema", msg[:200]))
    if entry.get("seq") != index:
        out.append(
            Finding(
                n, "sequence", f"seq is {entry.get('seq')!r}, expected {index} (lines deleted, inserted or reordered?)"
            )
        )
    want_prev = hashlib.sha256(prev_line).hexdigest() if prev_line is not None else None
    if entry.get("prev") != want_prev:
        out.append(
            Finding(
                n,
                "chain",
                "prev does not match the SHA-256 of the line before "
                "(the line before was edited, or lines were removed or reordered)",
            )
        )
    return entry, out


def first_bad_line(path: Path) -> tuple[int, str] | None:
    """The first complete line (1-based) of a ledger that :func:`check_line` finds wrong by itself (not JSON, not
    canonical, schema, seq or chain) and why, or None. What `kvgraft ledger repair` cannot mend: a line in the
    middle that was half-written or edited is complete (it ends with a newline), and repair never rewrites complete
    lines (#24.11)."""
    prev = None
    for i, raw in enumerate(LedgerTree.from_bytes(Path(path).read_bytes()).lines):
        _, found = check_line(raw, i, prev)
        if found:
            return i + 1, found[0].message
        prev = raw
    return None


def read_ledger_bytes(path: Path) -> bytes:
    """A ledger file's bytes; InputError (one line, with a hint) when it is missing, a folder or unreadable."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"ledger not found: {path}", LEDGER_NOT_FOUND_HINT) from None
    except IsADirectoryError:
        raise InputError(f"{path} is a directory, expected a ledger file") from None
    except OSError as e:
        raise InputError(f"cannot read ledger {path}: {e.strerror or e}") from None


def verify_ledger(
    path: Path,
    *,
    checkpoint: Path | None = None,
    keys: list[str] | None = None,
    since: Path | None = None,
    rehash: bool = True,
    full: bool = False,
    require_files: bool = False,
    cache: Path | bool | None = None,
    origin: str | None = None,
) -> VerifyReport:
    """Verify a ledger file; see the module docstring. Raises InputError only for unusable input files.

    ``cache``: where the verified-file cache lives. None: the user's cache directory (hashcache.default_cache_path),
    never the ledger's folder; a path: that file; False: no cache (nothing read or written). ``origin``: the log
    identity the checkpoint must name (its first line); None: any."""
    path = Path(path)
    data = read_ledger_bytes(path)
    report = VerifyReport(str(path), require_files=require_files)
    tree = LedgerTree.from_bytes(data)
    lines, tail = tree.lines, tree.tail
    entries: list[dict | None] = []
    prev = None
    for i, raw in enumerate(lines):
        entry, found = check_line(raw, i, prev)
        report.findings += found
        entries.append(entry)
        prev = raw
    if tail:
        report.findings.append(
            Finding(
                len(lines) + 1,
                "torn",
                f"torn last line: {len(tail)} bytes without a "
                "newline (a writer was interrupted); `kvgraft ledger repair` removes it",
            )
        )
    report.entries = len(lines)
    report.root = tree.root().hex()
    if checkpoint is not None:
        report.checkpoint = _check_checkpoint(report, Path(checkpoint), tree, keys or [], origin)
    if since is not None:
        report.since = _check_since(report, Path(since), tree)
    if rehash:
        _rehash(report, entries, path.parent, full, _open_cache(path, cache, full))
        report.prompt_cache = _count_prompt_chunks(entries, path.parent)
        verified = {(f.line, f.path) for f in report.files if f.status == "ok"}
        with_rules = None  # the first score line that records its rules: no rules-1 kvgraft wrote after it
        for i, entry in enumerate(entries):
            if entry is not None and entry.get("kind") == kinds.SCORE:
                try:
                    score = entries_mod.parse_as(ScoreEntry, entry, "score entry")
                except EntryError as e:
                    report.findings.append(Finding(i + 1, "score", e.message))
                    continue
                _check_score(report, i + 1, score, path.parent, verified, with_rules)
                if with_rules is None and "rules" in (score.settings or {}):
                    with_rules = i + 1
    return report


def _check_score(
    report: VerifyReport,
    line: int,
    entry: ScoreEntry,
    base_dir: Path,
    verified: set[tuple[int, str]],
    with_rules: int | None = None,
) -> None:
    """Recompute a recorded score by the score rules, extractor version and grader it records (eval.scoring): from
    its outputs and answers files when present (records and aggregate must come out the same, member for member),
    else from its records file alone (the aggregate must; counted in ``scores_from_records`` with the reason). A
    score that neither can recompute is counted in ``scores_not_recomputable`` with the reason, never passed in
    silence. First, settings no kvgraft could have written are a finding and nothing is recomputed (a downgrade:
    scoring.written_by_no_kvgraft, and no entry without rules after ``with_rules``, the first line that has them)."""
    from ..eval import scoring

    def present(d: Digest | None) -> Path | None:
        """The file behind a digest, if it is present and matched its hash in this run."""
        if d is not None and d.path is not None and (line, d.path) in verified:
            return base_dir / d.path
        return None

    def absent(what: str, d: Digest | None) -> str:
        path = d.path if d is not None else None
        if path is None:
            return f"it records no {what} file"
        state = next((f.status for f in report.files if f.line == line and f.path == path), None)
        said: dict[str | None, str] = {"missing": "is missing", "mismatch": "does not match its sha256"}
        return f"its {what} file {path} " + said.get(state, "was not checked")

    if entry.result is None:
        report.findings.append(Finding(line, "score", "score entry without an outputs.result object"))
        return
    recorded = dict(entry.result)
    settings = entry.settings or {}
    downgrade = scoring.written_by_no_kvgraft(settings, recorded, entry.time)
    if downgrade is None and "rules" not in settings and with_rules is not None:
        downgrade = (
            f"it records no score rules (read as rules 1), after line {with_rules}, whose score records "
            "them: an older kvgraft's entry cannot follow a newer one's in one ledger"
        )
    if downgrade is not None:  # its own check name: the spec's verifier applies it too (no scorer needed)
        report.findings.append(
            Finding(line, "score-settings", f"{downgrade}; not recomputed (settings no kvgraft wrote)")
        )
        return
    how = scoring.ScoreSettings.from_recorded(settings, recorded)
    outputs_path, answers_path = present(entry.outputs), present(entry.answers)
    why: str | None
    if not outputs_path or not answers_path:
        why = " and ".join(
            absent(w, d)
            for w, d, p in (("outputs", entry.outputs, outputs_path), ("answers", entry.answers, answers_path))
            if not p
        )
    elif "mapping" not in settings:
        why = "its settings record no input mapping"
    else:
        why = how.unavailable()
    if why is None and outputs_path and answers_path:
        try:
            result = scoring.score(
                outputs_path,
                answers_path,
                settings["mapping"],
                settings.get("id_field", "id"),
                settings.get("output_field", "output"),
                how,
            )
        except InputError as e:
            report.findings.append(Finding(line, "score", f"cannot recompute the score: {e.message}"))
            return
        except (TypeError, KeyError, ValueError, AttributeError) as e:  # settings that are not what score writes
            report.findings.append(
                Finding(
                    line,
                    "score",
                    f"cannot recompute the score: its settings are malformed ({type(e).__name__}: {str(e)[:120]})",
                )
            )
            return
        rec_sha = hashlib.sha256(result.records_bytes()).hexdigest()
        # Member for member, grader_libs included (docs/LEDGER.md): the library versions math-verify's verdicts
        # depend on are part of the recorded grader, so a machine with others cannot confirm them (#24.3).
        got = result.summary()
        libs = (recorded.get("grader_libs"), got.get("grader_libs"))
        if rec_sha != (entry.records.sha256 if entry.records else None):
            why = (
                f"; graded with {json.dumps(libs[0], sort_keys=True)}, recomputed with "
                f"{json.dumps(libs[1], sort_keys=True)}"
                if libs[0] != libs[1]
                else ""
            )
            report.findings.append(
                Finding(
                    line,
                    "score",
                    f"recomputed per-sample records differ from the recorded ones (recomputed sha256 {rec_sha}{why})",
                )
            )
        diff = _score_differences(recorded, got)
        if diff:
            only_libs = (
                " (the verdicts agree: install the recorded library versions to confirm them)"
                if _score_differences(dict(recorded, grader_libs=None), dict(got, grader_libs=None)) == ""
                else ""
            )
            report.findings.append(
                Finding(line, "score", f"the recomputed score differs from the recorded one: {diff}{only_libs}")
            )
        report.scores_checked += 1
        return
    records_path = present(entry.records)
    if records_path:
        try:
            got = scoring.summary_from_records(records_path.read_bytes(), how)
        except InputError as e:
            report.findings.append(Finding(line, "score", f"{e.message} ({entry.records and entry.records.path})"))
            return
        diff = _score_differences({k: v for k, v in recorded.items() if k not in scoring.NOT_FROM_RECORDS}, got)
        if diff:
            report.findings.append(
                Finding(
                    line, "score", f"the score recomputed from the records file differs from the recorded one: {diff}"
                )
            )
        report.scores_checked += 1
        report.scores_from_records.append({"line": line, "reason": why})
        return
    report.scores_not_recomputable.append({"line": line, "reason": f"{why}, and {absent('records', entry.records)}"})


def _score_differences(recorded: dict, recomputed: dict) -> str:
    """What differs between a recorded and a recomputed score, the recorded values verbatim (JSON)."""

    def show(d: dict, k: str) -> str:
        return json.dumps(d[k], ensure_ascii=False) if k in d else "absent"

    keys = sorted(k for k in set(recorded) | set(recomputed) if recorded.get(k, ...) != recomputed.get(k, ...))
    return "; ".join(f"{k} recorded {show(recorded, k)}, recomputed {show(recomputed, k)}" for k in keys)


def _check_checkpoint(
    report: VerifyReport, cp_path: Path, tree: LedgerTree, keys: list[str], origin: str | None = None
) -> dict:
    from ..errors import CheckFailed
    from ..ledger.checkpoint import Checkpoint, load_key, read_checkpoint, verify_note

    text = read_checkpoint(cp_path)
    cp = Checkpoint.parse(text)
    out: dict[str, Any] = {
        "path": str(cp_path),
        "origin": cp.origin,
        "size": cp.size,
        "root": cp.root.hex(),
        "root_matches": False,
        "signed_by": [],
    }
    if origin is not None and cp.origin != origin:
        report.findings.append(
            Finding(
                None,
                "checkpoint",
                f"the checkpoint names the log {cp.origin!r}, not {origin!r} (a checkpoint of another log)",
            )
        )
    if cp.size > tree.size:
        report.findings.append(
            Finding(
                None,
                "checkpoint",
                f"checkpoint covers {cp.size} lines, the ledger has only {tree.size} (lines were removed)",
            )
        )
    elif tree.root(cp.size) != cp.root:
        report.findings.append(
            Finding(
                None,
                "checkpoint",
                f"the ledger's first {cp.size} lines do not hash to the "
                "checkpoint's root (a line within them was changed)",
            )
        )
    else:
        out["root_matches"] = True
    if keys:
        try:
            out["signed_by"] = verify_note(text, [load_key(k) for k in keys])
        except CheckFailed as e:
            report.findings.append(Finding(None, "signature", e.message))
    return out


def _check_since(report: VerifyReport, base: Path, tree: LedgerTree) -> dict:
    """Append-only check against an older ledger file or a checkpoint."""
    lines = tree.lines
    from ..ledger.checkpoint import Checkpoint

    try:
        base_data = base.read_bytes()
    except FileNotFoundError:
        raise InputError(f"--since base not found: {base}") from None
    except OSError as e:
        raise InputError(f"cannot read --since base {base}: {e.strerror or e}") from None
    # A ledger's lines are JSON objects; anything else must be a checkpoint (and a bad one is bad input, never
    # mistaken for a rewritten ledger).
    is_ledger = base_data[:1] in (b"{", b"")
    if not is_ledger:
        try:
            cp = Checkpoint.parse(base_data.decode("utf-8"))
        except UnicodeDecodeError:
            raise InputError(f"--since base {base} is neither a ledger nor a checkpoint (not UTF-8)") from None
        size, root = cp.size, cp.root
        out: dict[str, Any] = {"base": str(base), "kind": "checkpoint", "size": size}
        if size == 0 and root != merkle.EMPTY_ROOT:
            report.findings.append(
                Finding(None, "append-only", f"{base}: size 0 with a root other than the empty tree's")
            )
            out["consistent"] = False
            return out
    else:
        base_tree = LedgerTree.from_bytes(base_data)
        base_lines, size, root = base_tree.lines, base_tree.size, base_tree.root()
        out = {"base": str(base), "kind": "ledger", "size": size}
        # Pinpoint the first rewritten line: plain byte comparison of the common prefix.
        for i, (a, b) in enumerate(zip(base_lines, lines)):
            if a != b:
                report.findings.append(
                    Finding(
                        i + 1,
                        "append-only",
                        f"line {i + 1} differs from {base}: the ledger was rewritten, not appended to",
                    )
                )
                break
    out["root"] = root.hex()
    if size > len(lines):
        report.findings.append(
            Finding(
                None,
                "append-only",
                f"the ledger has {len(lines)} lines, fewer than the {size} of {base}: it was truncated",
            )
        )
        out["consistent"] = False
        return out
    if size == 0:  # every ledger extends the empty one; RFC 6962 has no proof for it
        out.update(consistent=True, appended=len(lines))
        return out
    # The RFC 6962 consistency proof between the two trees, generated from the current lines and verified against
    # the base root: what a remote party holding only the base root would check.
    out["consistent"] = tree.consistent_with(size, root)
    if not out["consistent"]:
        if not any(f.check == "append-only" for f in report.findings):
            report.findings.append(
                Finding(
                    None,
                    "append-only",
                    f"the first {size} lines no longer hash to the root "
                    f"of {base}: the ledger was rewritten, not appended to",
                )
            )
    out["appended"] = len(lines) - size
    return out


def _open_cache(ledger: Path, cache: Path | bool | None, full: bool) -> HashCache:
    if cache is False:
        return HashCache(None, enabled=False)
    if cache is None or cache is True:
        return HashCache.for_ledger(ledger, enabled=not full)
    if Path(cache).is_dir():
        raise InputError(f"--cache {cache} is a directory", "name the cache file, e.g. --cache verify-cache.json")
    return HashCache(Path(cache), enabled=not full)


def _rehash(report: VerifyReport, entries: list[dict | None], base_dir: Path, full: bool, cache: HashCache) -> None:
    this_run: dict[Path, str] = {}  # a file many entries name (the problems file) is hashed once per run
    unread: set[Path] = set()  # files whose digest came from the cache
    for i, entry in enumerate(entries):
        if entry is None:
            continue
        for fld, d in entries_mod.named_files(entry):
            if d["path"].startswith("s3://"):  # a remote store's object: verify is offline (and needs no boto3)
                report.files.append(FileCheck(i + 1, fld, d["path"], "remote", d["sha256"]))
                continue
            target = (base_dir / d["path"]) if not Path(d["path"]).is_absolute() else Path(d["path"])
            try:
                present = target.is_file()
            except OSError:  # e.g. a path too long for the file system: cannot exist here
                present = False
            if not present:
                report.files.append(FileCheck(i + 1, fld, d["path"], "missing", d["sha256"]))
                continue
            if target not in this_run:
                hits = cache.hits
                this_run[target] = digest_of(target, cache)
                if cache.hits > hits:
                    unread.add(target)
            # Counted per (line, field), as report.files is: "N of M referenced files".
            report.files_from_cache += target in unread
            actual = this_run[target]
            status = "ok" if actual == d["sha256"] else "mismatch"
            report.files.append(FileCheck(i + 1, fld, d["path"], status, d["sha256"], actual))
    cache.save()


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _count_prompt_chunks(entries: list[dict | None], base_dir: Path) -> dict[str, int] | None:
    """How many distinct prompt-cache chunks served lines name, and how many of them are in the store a line names
    (``inputs.prompt_cache.store``; its objects are ``objects/<first 2 hex>/<sha256>.kvg``, docs/STORE.md). A chunk
    is cache by the field that names it (a record is a ``{path, sha256}`` digest, re-hashed above): one not there was
    evicted by a bounded cache (kvgraft serve --cache-max) or never copied here, and `replay --served` needs none.
    None when no served line names a chunk."""
    named: set[tuple[str | None, str]] = set()
    for entry in entries:
        if entry is None or entry.get("kind") != kinds.SERVE:
            continue
        try:
            pc = entries_mod.parse_as(ServeEntry, entry).prompt_cache
        except EntryError:  # a served line without its fields: nothing to count (the schema finding says why)
            continue
        store = pc.get("store") if isinstance(pc.get("store"), str) else None
        for name in ("chunks", "deposited"):
            shas = pc.get(name)
            if isinstance(shas, list):
                named.update((store, s) for s in shas if isinstance(s, str) and _HEX64.fullmatch(s))
    if not named:
        return None
    here = unchecked = 0
    for store, sha in named:
        if store is None or store.startswith("s3://"):  # an older line, or a remote store: verify reads no network
            unchecked += 1
            continue
        root = Path(store) if Path(store).is_absolute() else base_dir / store
        here += (root / "objects" / sha[:2] / f"{sha}.kvg").is_file()
    return {
        "named": len(named),
        "in_store": here,
        "not_in_store": len(named) - here - unchecked,
        "not_checked": unchecked,
    }
