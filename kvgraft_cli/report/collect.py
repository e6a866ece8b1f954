"""What a report shows, read from a ledger: the verifier's verdict, then the runs by kind (torch-free).

Every number here is a value some ledger line records (floats are the ``repr`` strings the ledger holds, parsed
with ``float``); nothing is recomputed, except the served traffic's counts, token sums and latency percentiles
(report/served.py: by nearest rank, so each percentile is one request's recorded value, with its line). Each item
keeps its 1-based ``line`` so the page can cite it, and the model that produced it: the entry's model and tokenizer
hashes and its manifest (source, file hash, compute pin), with the manifest's ``name`` and ``model.path`` when the
manifest file the entry names is here and still hashes to its record.

Ledger text is untrusted: a value of the wrong type makes its item skipped with the reason (``skipped``), never a
crash, and escaping is the renderer's job (report/render.py).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..ledger import entries, kinds
from ..ledger.entries import (
    DepositEntry,
    Digest,
    Entry,
    EntryError,
    GraftCheckEntry,
    ProbeEntry,
    ReplayServedEntry,
    ScoreEntry,
    ServeEntry,
    SolveEntry,
    SolveOutputsEntry,
)
from ..ledger.log import split_lines
from ..util import jsonio
from .served import TIMES, TOKENS, summarize

# The kinds the page draws: a line of one of them that is not what its kind records is listed as skipped
SHOWN = (
    kinds.DEPOSIT,
    kinds.SOLVE,
    kinds.SOLVE_OUTPUTS,
    kinds.GRAFT_CHECK,
    kinds.PROBE,
    kinds.SCORE,
    kinds.SERVE,
    kinds.REPLAY_SERVED,
)
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KB; a larger "manifest" is not read for its model's name


class Malformed(ValueError):
    """A value in an entry that is not what its kind records."""


def num(value: Any) -> float | None:
    """A recorded number (an integer, or a float as the ledger writes it: a ``repr`` string); None when absent."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise Malformed(f"{value!r} is not a number")
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise Malformed(f"{value[:40]!r} is not a number") from None
    raise Malformed(f"{type(value).__name__} is not a number")


def count(value: Any) -> int | None:
    """A recorded count: an integer (not a boolean); None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(f"{str(value)[:40]!r} is not a count")
    return value


def text(value: Any) -> str | None:
    """A recorded string as it is (the renderer escapes it); other JSON values as their JSON text."""
    if value is None or isinstance(value, str):
        return value
    return str(value)


def _obj(value: Any, what: str) -> dict:
    """``value`` when it is an object ({} when absent); Malformed otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Malformed(f"{what} is not an object")
    return value


@dataclass
class ReportData:
    """Everything a report page shows; ``to_json`` is `kvgraft report --json`."""

    ledger: str
    verification: dict[str, Any]
    kinds: dict[str, int] = field(default_factory=dict)
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # solve runs without a partner of the other mode
    graft_checks: list[dict[str, Any]] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)
    scores: list[dict[str, Any]] = field(default_factory=list)
    deposits: list[dict[str, Any]] = field(default_factory=list)
    served: list[dict[str, Any]] = field(default_factory=list)  # {model, summary, requests} per model and manifest
    served_replays: list[dict[str, Any]] = field(default_factory=list)  # replay-served lines
    unreadable: list[int] = field(default_factory=list)  # lines that are no JSON object
    skipped: list[dict[str, Any]] = field(default_factory=list)  # {line, kind, reason}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Models:
    """The model behind an entry, with the manifest's name read once per manifest file."""

    def __init__(self, base_dir: Path):
        self.base_dir = base_dir
        self._names: dict[tuple[str, str], dict[str, str | None]] = {}

    def of(self, entry: Entry) -> dict[str, Any]:
        """The model and manifest an entry records, with the manifest's names when readable, and the manifest as
        the page names it (``manifest_shown``: :func:`shown_path`)."""
        model, manifest = entry.model, entry.manifest
        label = {
            "model_sha256": text(model.sha256 if model else None),
            "tokenizer_sha256": text(model.get("tokenizer_sha256") if model else None),
            "manifest_source": text(manifest.source if manifest else None),
            "manifest_path": text(manifest.path if manifest else None),
            "manifest_sha256": text(manifest.sha256 if manifest else None),
            "compute_sha256": text(manifest.compute_sha256 if manifest else None),
        }
        label.update(self._read(label["manifest_path"], label["manifest_source"], label["manifest_sha256"]))
        # What the page shows (render.py): no absolute path of the machine the ledger was written on. The recorded
        # source stays in the --json data as the ledger holds it.
        label["manifest_shown"] = shown_path(label["manifest_path"] or label["manifest_source"], self.base_dir)
        label["model_path"] = shown_path(label["model_path"], self.base_dir)
        return label

    def _read(self, path: str | None, source: str | None, sha: str | None) -> dict[str, str | None]:
        """``manifest_name`` and ``model_path`` from the manifest file, when it is here with its recorded hash."""
        key = (path or source or "", sha or "")
        if key not in self._names:
            self._names[key] = _manifest_names(self._locate(path, source), sha)
        return self._names[key]

    def _locate(self, path: str | None, source: str | None) -> Path | None:
        """The manifest file: ``path`` beside the ledger, or a builtin manifest of the package."""
        if path:
            return self.base_dir / path
        from ..config.manifest import BUILTIN_PREFIX, data_dir

        if source and source.startswith(BUILTIN_PREFIX):
            name = source[len(BUILTIN_PREFIX) :]
            if name and "/" not in name and "\\" not in name and not name.startswith("."):
                return data_dir() / name
        return None


def shown_path(recorded: str | None, base_dir: Path) -> str | None:
    """How the page names a file an entry records: as recorded when that is relative (to the ledger's folder, as
    ``manifest.path`` and every other recorded path are) or a ``builtin:`` manifest; an absolute path (an entry's
    ``manifest.source`` when the manifest was given by absolute path and no ``path`` was recorded) relative to the
    ledger's folder, else its file name. The page is shared: a path of its author's machine means nothing elsewhere
    and tells what it should not."""
    from ..config.manifest import BUILTIN_PREFIX

    if recorded is None or recorded.startswith(BUILTIN_PREFIX) or not absolute_anywhere(recorded):
        return recorded
    if Path(recorded).is_absolute():
        try:
            return os.path.relpath(Path(recorded).resolve(), base_dir.resolve())  # both resolved, as ctx.rel does
        except ValueError:  # another drive on Windows
            pass
    return PureWindowsPath(recorded).name  # another machine's absolute path (either separator): its file name


def absolute_anywhere(path: str) -> bool:
    """Absolute here or on another system (a POSIX path read on Windows, a drive or UNC path read on POSIX)."""
    return Path(path).is_absolute() or PurePosixPath(path).is_absolute() or PureWindowsPath(path).is_absolute()


def _manifest_names(path: Path | None, sha: str | None) -> dict[str, str | None]:
    """The manifest's name and model path from its file, when the file is there and hashes to ``sha``."""
    names: dict[str, str | None] = {"manifest_name": None, "model_path": None, "manifest_status": "not here"}
    if path is None or not sha:
        names["manifest_status"] = "not named"
        return names
    try:
        if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return names
        raw = path.read_bytes()
    except OSError:
        return names
    if hashlib.sha256(raw).hexdigest() != sha:
        names["manifest_status"] = "changed since recorded"
        return names
    from ..config.manifest import parse_text
    from ..errors import KvgraftError

    try:
        data = parse_text(raw.decode("utf-8"), str(path))
    except (KvgraftError, UnicodeDecodeError):
        names["manifest_status"] = "unreadable"
        return names
    if isinstance(data, dict):
        model = m if isinstance(m := data.get("model"), dict) else {}
        names["manifest_name"] = text(data.get("name"))
        names["model_path"] = text(model.get("path"))
    names["manifest_status"] = "read (hash matches)"
    return names


def read_entries(data: bytes) -> list[tuple[int, dict | None]]:
    """(1-based line, entry or None when the line is no JSON object) for every complete line."""
    lines, _ = split_lines(data)
    found = []
    for i, raw in enumerate(lines):
        try:
            entry = jsonio.loads(raw)
        except ValueError:
            entry = None
        found.append((i + 1, entry if isinstance(entry, dict) else None))
    return found


def collect(ledger: Path, data: bytes, verification: dict[str, Any]) -> ReportData:
    """The report's content from the ledger's bytes (``data``, read once) and the verifier's JSON report."""
    report = ReportData(str(ledger), verification)
    models = _Models(Path(ledger).parent)
    pending: list[tuple[int, SolveEntry]] = []  # solve entries waiting for their run's solve-outputs line
    solve_runs: list[dict[str, Any]] = []
    served: dict[tuple, dict[str, Any]] = {}  # serve lines by the model and manifest that answered them
    for line, raw in read_entries(data):
        if raw is None:
            report.unreadable.append(line)
            continue
        kind = raw.get("kind")
        kind = kind if isinstance(kind, str) else "(no kind)"
        report.kinds[kind] = report.kinds.get(kind, 0) + 1
        try:
            entry = entries.parse(raw, f"line {line}")
            if isinstance(entry, DepositEntry):
                report.deposits.append(_deposit(line, entry, models))
            elif isinstance(entry, SolveEntry):
                pending.append((line, entry))
            elif isinstance(entry, SolveOutputsEntry):
                solve_runs.append(_solve_run(line, entry, models, pending))
                pending = []
            elif isinstance(entry, GraftCheckEntry):
                report.graft_checks.append(_graft_check(line, entry, models))
            elif isinstance(entry, ProbeEntry):
                report.probes.append(_probe(line, entry, models))
            elif isinstance(entry, ScoreEntry):
                report.scores.append(_score(line, entry))
            elif isinstance(entry, ServeEntry):
                model, request = models.of(entry), _serve(line, entry)
                key = tuple(model[k] for k in ("model_sha256", "manifest_sha256", "compute_sha256", "manifest_shown"))
                served.setdefault(key, {"model": model, "requests": []})["requests"].append(request)
            elif isinstance(entry, ReplayServedEntry):
                report.served_replays.append(_replay_served(line, entry, models))
        except EntryError as e:
            if kind not in SHOWN:  # a kind the page does not draw: counted, nothing skipped
                continue
            report.skipped.append({"line": line, "kind": kind, "reason": e.message.removeprefix(f"line {line}: ")})
        except (Malformed, AttributeError, TypeError) as e:
            report.skipped.append({"line": line, "kind": kind, "reason": str(e)})
    report.comparisons, report.runs = _pair(solve_runs)
    _attach_runs_to_scores(report.scores, solve_runs)
    report.served = [{**g, "summary": summarize(g["requests"])} for g in served.values()]
    return report


def _digest(d: Digest | None) -> dict[str, Any]:
    """A recorded digest as {path, sha256}."""
    if d is None:
        raise Malformed("a digest is missing")
    return {"path": text(d.path), "sha256": text(d.sha256)}


def _deposit(line: int, e: DepositEntry, models: _Models) -> dict[str, Any]:
    """A deposit line: id, status, verification, tokens, artifact."""
    return {
        "line": line,
        "id": text(e.record.get("id")),
        "status": text(e.status),
        "verification": text(e.verification.status),
        "tokens": count(e.token_ids.get("count")),
        "artifact": text(e.artifact.sha256),
        "artifact_path": text(e.artifact.path),
        "payload_bytes": count(e.artifact.get("payload_bytes")),
        "model": models.of(e),
    }


def _solve_run(line: int, e: SolveOutputsEntry, models: _Models, pending: list[tuple[int, SolveEntry]]) -> dict:
    """A solve-outputs line with its per-problem solve lines: those just before it on the same problems file and
    settings (one process writes a run's lines in a row)."""
    totals = e.totals
    problems_file = _digest(e.problems_file)
    problems = []
    for pline, p in pending:
        if p.problems_file.sha256 != e.problems_file.sha256 or p.settings != e.settings:
            continue
        problems.append(
            {
                "line": pline,
                "id": text(p.record.get("id")),
                "hit": text(p.library.get("hit")),
                "decode_tokens": count(p.costs.get("decode_tokens")),
            }
        )
    mode = text(e.mode) or ("library" if e.settings.get("library") else "baseline")
    return {
        "line": line,
        "mode": mode,
        "problems_file": problems_file,
        "outputs": _digest(e.outputs),
        "problems": count(totals.get("problems")),
        "correct": count(totals.get("correct")),
        "scored": count(totals.get("scored")),
        "accuracy": num(totals.get("accuracy")),
        "wilson95_low": num(totals.get("wilson95_low")),
        "wilson95_high": num(totals.get("wilson95_high")),
        "decode_tokens": count(totals.get("decode_tokens")),
        "prefill_tokens": count(totals.get("prefill_tokens")),
        "grafted_tokens": count(totals.get("grafted_tokens")),
        "exact_hits": count(totals.get("exact_hits")),
        "related_hits": count(totals.get("related_hits")),
        "wall_s": num(totals.get("wall_s")),
        "per_problem": problems,
        "model": models.of(e),
    }


def _pair(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each library run with the nearest baseline run of the same problems file and model: a comparison; the runs
    left over stand alone."""
    used: set[int] = set()
    comparisons = []
    for lib in (r for r in runs if r["mode"] == "library"):
        same = [
            b
            for b in runs
            if b["mode"] == "baseline"
            and b["line"] not in used
            and b["problems_file"]["sha256"] == lib["problems_file"]["sha256"]
            and b["model"]["model_sha256"] == lib["model"]["model_sha256"]
        ]
        if same:
            base = min(same, key=lambda b: abs(b["line"] - lib["line"]))
            used |= {base["line"], lib["line"]}
            comparisons.append({"baseline": base, "library": lib})
    alone = [r for r in runs if r["line"] not in used]
    return comparisons, alone


def _graft_check(line: int, e: GraftCheckEntry, models: _Models) -> dict[str, Any]:
    """A graft-check line: its recorded result."""
    result = e.result
    schedule = result.get("schedule")
    schedule = _obj(schedule, "result.schedule").get("schedule") if isinstance(schedule, dict) else schedule
    return {
        "line": line,
        "artifact": text(e.artifact.sha256),
        "chain_links": len(e.chain) if e.chain is not None else None,
        "samples": count(result.get("samples")),
        "sha_equal": count(result.get("sha_equal")),
        "max_kl": num(result.get("max_kl")),
        "argmax_agreement": num(result.get("argmax_agreement")),
        "generated_equal": count(result.get("generated_equal")),
        "deposit_reproduced": result.get("deposit_reproduced")
        if isinstance(result.get("deposit_reproduced"), bool)
        else None,
        "prefix_tokens": count(result.get("prefix_tokens")),
        "schedule": text(schedule),
        "single_pass_max_abs_diff": num(result.get("single_pass_max_abs_diff")),
        "passed": result.get("passed") if isinstance(result.get("passed"), bool) else None,
        "max_new_tokens": count(e.max_new_tokens),
        "model": models.of(e),
    }


def _probe(line: int, e: ProbeEntry, models: _Models) -> dict[str, Any]:
    """A probe line: its per-offset results."""
    result = e.result
    offsets = result.get("offsets")
    if not isinstance(offsets, list):
        raise Malformed("outputs.result.offsets is not a list")
    rows = []
    for o in offsets:
        o = _obj(o, "an offset's result")
        rows.append(
            {
                "offset": count(o.get("offset")),
                "samples": count(o.get("samples")),
                "sha_equal": count(o.get("sha_equal")),
                "max_abs_diff": num(o.get("max_abs_diff")),
                "max_kl": num(o.get("max_kl")),
                "argmax_agreement": num(o.get("argmax_agreement")),
                "unmoved_max_abs_diff": num(o.get("unmoved_max_abs_diff")),
                "unmoved_argmax_agreement": num(o.get("unmoved_argmax_agreement")),
            }
        )
    if any(r["offset"] is None for r in rows):
        raise Malformed("an offset's result has no offset")
    return {
        "line": line,
        "artifact": text(e.artifact.sha256),
        "method": text(result.get("method")),
        "positions": text(result.get("positions")),
        "prefix_tokens": count(result.get("prefix_tokens")),
        "note": text(result.get("note")),
        "own_position_unique": result.get("own_position_unique")
        if isinstance(result.get("own_position_unique"), bool)
        else None,
        "offsets": rows,
        "model": models.of(e),
    }


def _score(line: int, e: ScoreEntry) -> dict[str, Any]:
    """A score line: its result and how it was scored."""
    from ..eval.scoring import ScoreSettings

    settings = _obj(e.settings, "inputs.settings")
    result = _obj(e.result, "outputs.result")
    # How it was scored, read as the scorer (and `verify`) reads it: an entry without rules predates score rules 2
    # and was scored by rules 1 with the exact grader.
    how = ScoreSettings.from_recorded(settings, result)
    return {
        "line": line,
        "outputs": _digest(e.outputs),
        "answers": _digest(e.answers),
        "records": _digest(e.records),
        "grader": text(how.grader),
        "grader_version": text(how.grader_version),
        "rules": text(how.rules),
        "extractor_version": text(how.extractor_version),
        "answered_only": how.answered_only,
        "n": count(result.get("n")),
        "correct": count(result.get("correct")),
        "answered": count(result.get("answered")),
        "unanswered": count(result.get("unanswered")),
        "accuracy": num(result.get("accuracy")),
        "wilson95_low": num(result.get("wilson95_low")),
        "wilson95_high": num(result.get("wilson95_high")),
        "run": None,
    }


def _attach_runs_to_scores(scores: list[dict[str, Any]], runs: list[dict[str, Any]]) -> None:
    """A score of a solve run's outputs names that run (its line, mode and model): a score entry has no model."""
    by_sha = {r["outputs"]["sha256"]: r for r in runs if r["outputs"]["sha256"]}
    for s in scores:
        run = by_sha.get(s["outputs"]["sha256"])
        if run is not None:
            s["run"] = {"line": run["line"], "mode": run["mode"], "model": run["model"]}


def _length(value: Any, what: str) -> int:
    """How many items a recorded list holds (0 when absent)."""
    if value is None:
        return 0
    if not isinstance(value, list):
        raise Malformed(f"{what} is not a list")
    return len(value)


def _serve(line: int, e: ServeEntry) -> dict[str, Any]:
    """A serve line (one request `kvgraft serve` answered): its library hit, prompt cache use, tokens and times
    (report/served.py summarizes them; the model is its group's)."""
    cache, settings, costs = e.prompt_cache, e.settings, e.costs
    return {
        "line": line,
        "endpoint": text(e.request.get("endpoint")),
        "hit": text(e.library.get("hit")),
        "finish_reason": text(e.finish_reason),
        "chunk": count(cache.get("chunk")),
        "cache_chunks": _length(cache.get("chunks"), "inputs.prompt_cache.chunks"),
        "deposited": _length(cache.get("deposited"), "inputs.prompt_cache.deposited"),
        "refused": _length(cache.get("refused"), "inputs.prompt_cache.refused"),
        "k": count(settings.get("k")),
        "min_score": text(settings.get("min_score")),
        "max_tokens": count(settings.get("max_tokens")),
        **{k: count(costs.get(k)) for k in TOKENS},
        **{k: num(costs.get(k)) for k in TIMES},
    }


def _replay_served(line: int, e: ReplayServedEntry, models: _Models) -> dict[str, Any]:
    """A replay-served line: which served lines `kvgraft replay --served` computed again, and how many matched."""
    served = e.served
    return {
        "line": line,
        "ledger": shown_path(text(served.get("ledger")), models.base_dir),
        "lines_sha256": text(served.get("lines_sha256")),
        "first_seq": count(served.get("first_seq")),
        "last_seq": count(served.get("last_seq")),
        "count": count(served.get("count")),
        "matched": count(e.matched),
        "mismatched": count(e.mismatched),
        "model": models.of(e),
    }
