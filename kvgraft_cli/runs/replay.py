"""Pre-registration and replay: fix a run plan and its expected output hashes in advance, register it in the
ledger before anything runs, replay it on another machine or device, and compare every hash.

A prereg (YAML, schema in schemas/prereg.schema.json) names the manifest by hash, the runs (deposit, graft-check,
score, solve, serve) with their inputs by hash, and per *target* (e.g. ``cpu-portable``, ``cuda-h200``) the expected
outputs. Each run kind has a runner; :data:`RUNNERS` holds this layer's, and a caller above (the CLI) adds the
library's ``solve`` runner and kvgraft serve's ``serve`` runner, so this module never imports the library.

A ``serve`` run is a served log made replayable: the bodies of the requests a server answered (its ``serve``
ledger lines, each naming its body by hash in the requests log beside the ledger) copied in order into a requests
file that the prereg pins by hash, and per request the hashes the server recorded (prompt ids, first-token logits,
generated ids, text). A cancelled request is left out (its decode stopped where the client left).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..config.manifest import (
    BUILTIN_PREFIX,
    DEFAULT_MANIFEST,
    MAX_YAML_CHARS,
    Manifest,
    clip,
    dump_yaml,
    load_manifest,
    parse_text,
    with_overrides,
)
from ..errors import InputError, KvgraftError, LedgerError
from ..ledger import entries, kinds
from ..ledger import log as ledger_mod
from ..ledger.entries import (
    DepositEntry,
    Digest,
    Entry,
    EntryError,
    GraftCheckEntry,
    RegisterEntry,
    ReplayEntry,
    ScoreEntry,
    ServeEntry,
    SolveEntry,
    SolveOutputsEntry,
)
from ..util import jsonio
from ..util.hashing import sha256_bytes, sha256_file
from .context import RunContext, engine_facts

# The entries a prereg is made from (--from-ledger)
REPLAYABLE = (DepositEntry, GraftCheckEntry, ScoreEntry, SolveEntry, SolveOutputsEntry, ServeEntry)
SERVE = kinds.SERVE  # a served request's ledger kind (serve.answer.KIND), and the prereg run that replays such lines


@dataclass(frozen=True)
class Prereg:
    """A validated pre-registration file."""

    data: dict[str, Any]
    path: Path
    sha256: str  # of the file's bytes: what the registration entry pins

    def resolve(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.path.resolve().parent / p


@lru_cache(maxsize=1)
def _schema() -> dict:
    return json.loads((resources.files("kvgraft_cli") / "schemas" / "prereg.schema.json").read_text())


def load_prereg(path: Path) -> Prereg:
    """Read and validate a prereg; every problem is reported with its path."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prereg not found: {path}")
    if path.stat().st_size > 4 * MAX_YAML_CHARS:  # parse_text refuses it anyway; not read into memory first
        raise InputError(
            f"{path}: {path.stat().st_size:,} bytes, more than a prereg may have", "is this the right file?"
        )
    raw = path.read_bytes()
    data = parse_text(raw.decode("utf-8", errors="replace"), str(path))
    check_prereg(data, str(path))
    return Prereg(data, path, sha256_bytes(raw))


def check_prereg(data: Any, source: str) -> None:
    """Raise InputError listing what is wrong with a prereg's content (schema, duplicate ids, unknown run ids)."""
    import jsonschema

    problems = [
        f"{clip('.'.join(map(str, e.absolute_path)) or '(top level)', 120)}: {clip(e.message, 160)}"
        for e in jsonschema.Draft202012Validator(_schema()).iter_errors(data)
    ]
    if not problems:
        ids = [r["id"] for r in data["runs"]]
        problems += [f"runs: duplicate id {clip(i, 80)}" for i in sorted({i for i in ids if ids.count(i) > 1})]
        for t, exp in data["targets"].items():
            problems += [f"targets.{clip(t, 80)}.{clip(r, 80)}: no run with that id" for r in exp if r not in ids]
    if problems:
        raise InputError(
            f"{source}: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""),
            "see kvgraft_cli/schemas/prereg.schema.json",
        )


def prereg_manifest(pr: Prereg) -> Manifest:
    """The prereg's manifest, checked against the hash the prereg pins."""
    ref = pr.data["manifest"]["path"]
    m = load_manifest(None) if ref == BUILTIN_PREFIX + DEFAULT_MANIFEST else load_manifest(pr.resolve(ref))
    if m.file_sha256 != pr.data["manifest"]["sha256"]:
        raise InputError(
            f"{pr.path}: manifest {ref} has sha256 {m.file_sha256[:16]}..., the prereg pins "
            f"{pr.data['manifest']['sha256'][:16]}...",
            "the manifest changed since the prereg was written",
        )
    return m


def register(ctx: RunContext, pr: Prereg) -> RegisterEntry:
    """Append a ``register`` entry pinning the prereg's hash (before anything runs)."""
    entry = RegisterEntry(
        manifest=ctx.manifest_ref(),
        prereg=Digest(pr.sha256, ctx.rel(pr.path)),
        name=pr.data["name"],
        runs=[r["id"] for r in pr.data["runs"]],
        targets=sorted(pr.data["targets"]),
    )
    return entries.write(ctx.ledger, entry)


def find_registration(ledger_path: Path, prereg_sha256: str) -> tuple[int, str] | None:
    """(seq, SHA-256 of the line) of the first ``register`` entry for this prereg, or None."""
    if not Path(ledger_path).is_file():
        return None
    lines, _ = ledger_mod.split_lines(Path(ledger_path).read_bytes())
    for raw in lines:
        try:
            e = entries.parse(jsonio.loads(raw))
        except (ValueError, EntryError):
            continue  # not an entry, so not a register entry (`kvgraft verify` reports the line)
        if isinstance(e, RegisterEntry) and e.prereg.sha256 == prereg_sha256 and e.seq is not None:
            return e.seq, hashlib.sha256(raw).hexdigest()
    return None


@dataclass
class Comparison:
    """One expected-versus-actual value of a replay."""

    run: str
    what: str
    expected: Any
    actual: Any

    @property
    def match(self) -> bool:
        return self.expected is not None and self.expected == self.actual


@dataclass
class ReplayReport:
    prereg: str
    target: str
    registration_seq: int
    comparisons: list[Comparison] = field(default_factory=list)
    ledger_seq: int | None = None
    kernels: str | None = None  # why hashes differ, when the kernels did: "computed on other kernels (...)"

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and all(c.match for c in self.comparisons)

    def to_json(self) -> dict[str, Any]:
        return {
            "prereg": self.prereg,
            "target": self.target,
            "registration_seq": self.registration_seq,
            "passed": self.passed,
            "matched": sum(c.match for c in self.comparisons),
            "mismatched": sum(not c.match for c in self.comparisons),
            "ledger_seq": self.ledger_seq,
            "kernels": self.kernels,
            "comparisons": [{**asdict(c), "match": c.match} for c in self.comparisons],
        }


def with_mapping(m: Manifest, mapping: dict) -> Manifest:
    """The manifest with a run's input field mapping (as recorded in its settings)."""
    return with_overrides(m, {f"input.{k}": v for k, v in mapping.items()})


def replay(
    ctx: RunContext,
    pr: Prereg,
    target: str | None,
    on_run: Callable[[str], None] | None = None,
    runners: dict[str, Callable] | None = None,
    get_engine: Callable[[], Any] | None = None,
) -> ReplayReport:
    """Run a registered prereg and compare every output hash with the target's expectations. ``runners`` maps a
    run kind to its runner (default :data:`RUNNERS`); a run of a kind without one is reported as not run.
    ``get_engine``: loads the engine, once, when a run first needs one (default: the manifest's, loaded here)."""
    runners = RUNNERS if runners is None else runners
    targets = pr.data["targets"]
    if target is None:
        if len(targets) != 1:
            raise InputError(f"{pr.path} has targets {', '.join(sorted(targets))}", "choose one with --target")
        target = next(iter(targets))
    if target not in targets:
        raise InputError(f"{pr.path}: no target {target!r} (has {', '.join(sorted(targets))})")
    reg = find_registration(ctx.ledger, pr.sha256)
    if reg is None:
        raise InputError(
            f"{pr.path} (sha256 {pr.sha256[:16]}...) is not registered in {ctx.ledger}",
            "register it first: kvgraft replay --register PREREG",
        )
    expected = targets[target]
    report = ReplayReport(str(pr.path), target, reg[0])
    engine = None  # the engine the runs used, if any (its facts go into the replay's own ledger line)

    def engine_once():
        nonlocal engine
        if engine is None:
            if get_engine is not None:
                engine = get_engine()
            else:
                from ..engine.engine import load_engine

                engine = load_engine(ctx.manifest, ctx.allow_drift)
        return engine

    for run in pr.data["runs"]:
        if on_run:
            on_run(run["id"])
        exp = expected.get(run["id"])
        if run["kind"] not in runners:
            report.comparisons.append(Comparison(run["id"], "ran", "ok", f"no runner for kind {run['kind']!r} here"))
            continue
        try:
            got = runners[run["kind"]](ctx, pr, run, engine_once)
        except KvgraftError as e:
            report.comparisons.append(Comparison(run["id"], "ran", "ok", f"error: {e.message}"))
            continue
        for what in sorted(set(got) | set(exp or {})):
            report.comparisons.append(Comparison(run["id"], what, (exp or {}).get(what), got.get(what)))
    if engine is not None and not report.passed:
        report.kernels = other_kernels((pr.data.get("kernels") or {}).get(target), engine.environment.get("kernels"))
    summary = report.to_json()
    entry = ReplayEntry(
        manifest=ctx.manifest_ref(),
        **(engine_facts(engine) if engine is not None else {}),
        prereg=Digest(pr.sha256, ctx.rel(pr.path)),
        target=target,
        registration=Digest.of(reg[1], seq=reg[0]),
        passed=report.passed,
        matched=summary["matched"],
        mismatched=summary["mismatched"],
        comparisons=summary["comparisons"],
        kernels=report.kernels or None,
    )
    report.ledger_seq = entries.write(ctx.ledger, entry).seq
    return report


def other_kernels(there: dict | None, here: dict | None) -> str | None:
    """Why a replay's hashes differ, when the kernels tell: "computed on other kernels (X here, Y there)" where the
    prereg's target recorded other kernels than this machine runs (another kernel identity, or the same pins whose
    fixed short forward computes other bits here); None where they agree or the prereg recorded none."""
    from ..config.kernels import short_identity

    if not there or not here:
        return None
    if there.get("identity") != here.get("identity"):
        return (
            f"computed on other kernels ({short_identity(here.get('identity'))} here, "
            f"{short_identity(there.get('identity'))} there)"
        )
    if there.get("probe") != here.get("probe"):
        return (
            f"computed on other kernels: the manifest's pins ran other arithmetic here (ATen {here.get('aten')} on "
            f"{here.get('cpu')} here, ATen {there.get('aten')} on {there.get('cpu')} there; fingerprint "
            f"{str(here.get('probe'))[:12]} against {str(there.get('probe'))[:12]})"
        )
    return None


def file_check(pr: Prereg, rel: str) -> tuple[Path, str]:
    """An input of the prereg, resolved, and its SHA-256 (compared by the caller, reported either way)."""
    p = pr.resolve(rel)
    if not p.is_file():
        raise InputError(f"input {rel} of {pr.path} not found")
    return p, sha256_file(p)


def _run_deposit(ctx: RunContext, pr: Prereg, run: dict, get_engine) -> dict[str, Any]:
    from .deposit import deposit

    path, sha = file_check(pr, run["input"])
    got: dict[str, Any] = {"input_sha256": sha}
    if sha != run["input_sha256"]:
        return got
    s = run["settings"]
    c = dataclasses.replace(ctx, manifest=with_mapping(ctx.manifest, s["mapping"]))
    # recompute: a replay prefills again even when the store already holds the prefix (and fails on other bytes).
    rep = deposit(
        c, path, limit=s["limit"], allow_unverified=s["allow_unverified"], engine=get_engine(), recompute=True
    )
    for r in rep.results:
        if r.artifact:
            got[f"artifact {r.id}"] = r.artifact
            got[f"logits {r.id}"] = r.logits_sha256
    return got


def _run_check(ctx: RunContext, pr: Prereg, run: dict, get_engine) -> dict[str, Any]:
    from .graft import graft_check

    rep = graft_check(ctx, get_engine(), run["artifact"], run["samples"], run["max_new_tokens"])
    return {"fresh_logits": rep.fresh_logits_sha256, "passed": rep.passed}


def _run_score(ctx: RunContext, pr: Prereg, run: dict, get_engine) -> dict[str, Any]:
    from .score import score_and_record

    outputs, osha = file_check(pr, run["outputs"])
    answers, asha = file_check(pr, run["answers"])
    got: dict[str, Any] = {"outputs_sha256": osha, "answers_sha256": asha}
    if osha != run["outputs_sha256"] or asha != run["answers_sha256"]:
        return got
    s = run["settings"]
    c = dataclasses.replace(ctx, manifest=with_mapping(ctx.manifest, s["mapping"]))
    # One records file per prereg and run: a later prereg never overwrites the records an earlier entry hashed.
    records = ctx.store / "replay" / f"{pr.sha256[:16]}-{run['id']}.scores.jsonl"
    # The score rules, extractor and grader the registered run used (a prereg without them: rules 1, extractor 2).
    from ..eval.scoring import ScoreSettings

    result, rec_sha, _ = score_and_record(
        c, outputs, answers, records, s["id_field"], s["output_field"], ScoreSettings.from_recorded(s)
    )
    return {**got, "records": rec_sha, "n": result.n, "correct": result.correct}


RUNNERS = {kinds.DEPOSIT: _run_deposit, kinds.GRAFT_CHECK: _run_check, kinds.SCORE: _run_score}


def prereg_from_ledger(
    ledger_path: Path,
    target: str,
    out_path: Path,
    name: str | None = None,
    from_seq: int = 0,
    files: dict[Path, bytes] | None = None,
) -> dict[str, Any]:
    """Turn a finished run's ledger entries (deposit, graft-check, score, solve, served requests; from ``from_seq``
    on) into a prereg whose ``target`` expects exactly the hashes that run produced. Paths are rewritten relative to
    ``out_path``. Served requests need a requests file beside the prereg (``<prereg name>.requests.jsonl``): its
    path and bytes go into ``files``, which the caller writes with the prereg (InputError without ``files``)."""
    try:
        return _prereg_from_ledger(ledger_path, target, out_path, name, from_seq, files)
    except (AttributeError, KeyError, TypeError) as e:  # an entry that is not what kvgraft writes
        raise LedgerError(
            f"{ledger_path}: an entry lacks what a kvgraft run writes ({type(e).__name__}: {str(e)[:80]})",
            f"run `kvgraft verify {ledger_path}`",
        ) from None


def _prereg_from_ledger(
    ledger_path: Path, target: str, out_path: Path, name: str | None, from_seq: int, files: dict[Path, bytes] | None
) -> dict[str, Any]:
    ledger_path, out_dir = Path(ledger_path), Path(out_path).resolve().parent
    if not ledger_path.is_file():
        raise InputError(f"ledger not found: {ledger_path}")
    found = entries.read(ledger_path, REPLAYABLE, start=from_seq)
    if not found:
        raise InputError(
            f"{ledger_path}: no deposit, graft-check, score, solve or served entries from line {from_seq + 1} on"
        )

    current: list[Entry] = []  # the entry being read, for errors

    def rel(p: str | None) -> str:
        if p is None:
            e = current[-1]
            raise InputError(
                f"{ledger_path}:{e.lineno}: a {e.kind} entry names a file by its hash without its path",
                f"run `kvgraft verify {ledger_path}`",
            )
        return os.path.relpath((ledger_path.resolve().parent / p).resolve(), out_dir)

    if any(e.manifest is None for e in found):
        raise InputError(f"{ledger_path}: an entry records no manifest", f"run `kvgraft verify {ledger_path}`")
    manifests = {(e.manifest.path or e.manifest.source, e.manifest.sha256) for e in found if e.manifest}
    if len(manifests) != 1:
        raise InputError(
            f"{ledger_path}: the entries use {len(manifests)} manifests",
            f"pick a range with --from-seq: `kvgraft ledger log {ledger_path}` lists each entry's seq and manifest",
        )
    ((mref, msha),) = manifests
    runs: dict[tuple, dict] = {}  # (kind, what tells its runs apart...) -> the run
    exp: dict[str, dict] = {}
    solved: list[SolveEntry] = []  # the solve entries of a run, until its solve-outputs entry closes it
    served: dict[tuple, list[ServeEntry]] = {}  # (k, min_score) -> the served requests answered under those settings
    for e in found:
        current.append(e)
        try:
            if isinstance(e, ServeEntry):
                if e.finish_reason != "cancelled":
                    served.setdefault((e.settings["k"], e.settings["min_score"]), []).append(e)
            elif isinstance(e, SolveEntry):
                solved.append(e)
            elif isinstance(e, SolveOutputsEntry):
                s = e.settings
                n = sum(k[0] == kinds.SOLVE for k in runs) + 1
                keep = ("mapping", "k", "min_score", "library", "deposit_verified", "limit")
                rid = runs.setdefault(
                    (kinds.SOLVE, n),
                    {
                        "id": f"solve-{n}",
                        "kind": kinds.SOLVE,
                        "input": rel(e.problems_file.path),
                        "input_sha256": e.problems_file.sha256,
                        "outputs": rel(e.outputs.path),
                        "settings": {k: s[k] for k in keep},
                    },
                )["id"]
                x = exp.setdefault(rid, {"input_sha256": e.problems_file.sha256, "outputs_sha256": e.outputs.sha256})
                for se in solved:
                    x[f"output {se.record.get('id')}"] = se.output.sha256
                    x[f"hit {se.record.get('id')}"] = se.library["hit"]
                solved = []
            elif isinstance(e, DepositEntry) and "from" in (e.settings or {}):
                continue  # a verified answer deposited by solve --deposit-verified: the solve run replays it
            elif isinstance(e, DepositEntry):
                if e.settings is None:
                    raise InputError(
                        f"{ledger_path}:{e.lineno}: deposit entry without settings (older kvgraft)",
                        "re-run the deposit, then make the prereg from the new entries",
                    )
                key: tuple = (kinds.DEPOSIT, e.problems_file.path, json.dumps(e.settings, sort_keys=True))
                rid = runs.setdefault(
                    key,
                    {
                        "id": f"deposit-{sum(k[0] == kinds.DEPOSIT for k in runs) + 1}",
                        "kind": kinds.DEPOSIT,
                        "input": rel(e.problems_file.path),
                        "input_sha256": e.problems_file.sha256,
                        "settings": e.settings,
                    },
                )["id"]
                x = exp.setdefault(rid, {"input_sha256": e.problems_file.sha256})
                x[f"artifact {e.record.get('id')}"] = e.artifact.sha256
                x[f"logits {e.record.get('id')}"] = e.logits.sha256
            elif isinstance(e, GraftCheckEntry):
                art = e.artifact.sha256
                key = (kinds.GRAFT_CHECK, art, e.samples, e.max_new_tokens)
                # One artifact checked with other --samples or -n is another run: check-<12 hex>-2, -3, ... (the first
                # keeps the bare id; two runs under one id made the prereg invalid: "duplicate id").
                same = sum(k[0] == kinds.GRAFT_CHECK and k[1] == art for k in runs)
                rid = runs.setdefault(
                    key,
                    {
                        "id": f"check-{art[:12]}" + (f"-{same + 1}" if same else ""),
                        "kind": kinds.GRAFT_CHECK,
                        "artifact": art,
                        "samples": e.samples,
                        "max_new_tokens": e.max_new_tokens,
                    },
                )["id"]
                exp[rid] = {"fresh_logits": e.fresh_logits.sha256, "passed": e.result["passed"]}
            elif isinstance(e, ScoreEntry):
                if (
                    e.outputs is None
                    or e.answers is None
                    or e.records is None
                    or e.result is None
                    or e.settings is None
                ):
                    raise InputError(
                        f"{ledger_path}:{e.lineno}: score entry without its files, settings or result",
                        f"run `kvgraft verify {ledger_path}`",
                    )
                key = (kinds.SCORE, e.outputs.path, e.answers.path, json.dumps(e.settings, sort_keys=True))
                rid = runs.setdefault(
                    key,
                    {
                        "id": f"score-{sum(k[0] == kinds.SCORE for k in runs) + 1}",
                        "kind": kinds.SCORE,
                        "outputs": rel(e.outputs.path),
                        "outputs_sha256": e.outputs.sha256,
                        "answers": rel(e.answers.path),
                        "answers_sha256": e.answers.sha256,
                        "settings": e.settings,
                    },
                )["id"]
                exp[rid] = {
                    "outputs_sha256": e.outputs.sha256,
                    "answers_sha256": e.answers.sha256,
                    "records": e.records.sha256,
                    "n": e.result["n"],
                    "correct": e.result["correct"],
                }
        except (KeyError, TypeError, AttributeError) as x:  # a result or settings object of another shape
            raise InputError(
                f"{ledger_path}:{e.lineno}: a {e.kind} entry without what a prereg takes from it ({x!r})",
                f"run `kvgraft verify {ledger_path}`",
            ) from None

    if served:
        if files is None:
            raise InputError(f"{ledger_path}: served requests need a requests file beside the prereg")
        for n, ((k, min_score), group) in enumerate(sorted(served.items(), key=lambda x: x[1][0].lineno), 1):
            requests = Path(out_path).with_name(f"{Path(out_path).stem}.{SERVE}-{n}.requests.jsonl")
            data, expected = _served_run(ledger_path, group)
            files[requests] = data
            rid = f"{SERVE}-{n}"
            runs[(SERVE, n)] = {
                "id": rid,
                "kind": SERVE,
                "requests": os.path.relpath(requests.resolve(), out_dir),
                "requests_sha256": sha256_bytes(data),
                "settings": {"k": k, "min_score": min_score},
            }
            exp[rid] = {"requests_sha256": sha256_bytes(data), **expected}
    manifest_path = mref if mref.startswith(BUILTIN_PREFIX) else rel(mref)
    # The kernels the target's hashes came from (config.kernels, engine.fingerprint), so that a replay elsewhere can
    # say whether its kernels computed other bits: the first entry that records them (every engine line does now).
    recorded = next((k for e in found if (k := (e.environment or {}).get("kernels"))), None)
    return {
        "kvgraft_prereg": 1,
        "name": name or f"{ledger_path.stem}-from-{from_seq}",
        "manifest": {"path": manifest_path, "sha256": msha},
        "runs": list(runs.values()),
        "targets": {target: exp},
        **({"kernels": {target: recorded}} if recorded else {}),
    }


def _served_run(ledger_path: Path, served: list[ServeEntry]) -> tuple[bytes, dict[str, Any]]:
    """The requests file of served ledger lines (one canonical ``{"endpoint", "body"}`` line per request, in ledger
    order) and what a replay must compute for request i (1-based): the hashes the server recorded."""
    from ..util.hashing import canonical_json

    bodies = request_bodies(ledger_path, served)
    lines: list[bytes] = []
    expected: dict[str, Any] = {}
    for i, e in enumerate(served, 1):
        sha = e.request.sha256
        found = bodies.get(sha)
        if found is not None and found[1] is None:
            raise InputError(
                f"{ledger_path}:{e.lineno}: served request {sha[:16]}... was logged as its "
                "hash only (kvgraft serve --no-log-bodies)",
                "a prereg needs every request's body: serve without --no-log-bodies",
            )
        if found is None:
            raise InputError(
                f"{ledger_path}:{e.lineno}: the body of served request {sha[:16]}... is not "
                f"in its requests log {e.request.get('log')}",
                "a prereg needs every request's body: keep the requests log beside the ledger",
            )
        lines.append(canonical_json({"endpoint": found[0], "body": found[1]}) + b"\n")
        expected[f"request {i}"] = sha
        expected[f"hit {i}"] = e.library.get("hit")
        expected[f"prompt ids {i}"] = e.prompt_ids.sha256
        if e.first_logits is not None:
            expected[f"first-token logits {i}"] = e.first_logits.sha256
        expected[f"generated ids {i}"] = e.generated_ids.sha256
        expected[f"text {i}"] = e.output.sha256
        expected[f"finish reason {i}"] = e.finish_reason
    return b"".join(lines), expected


def request_bodies(ledger_path: Path, served: list[ServeEntry]) -> dict[str, tuple[str, dict | None]]:
    """sha256 -> (endpoint, body) from the requests logs served lines name (paths relative to the ledger's folder);
    body None: the server kept its hash only (serve --no-log-bodies). A torn or foreign line is skipped: its request
    was never answered, so no served line names it."""
    from ..util.limits import read_lines

    bodies: dict[str, tuple[str, dict | None]] = {}
    logs = {e.request.get("log") for e in served}
    for name in sorted(x for x in logs if isinstance(x, str)):
        path = Path(ledger_path).parent / name
        if not path.is_file():
            continue
        for _, line in read_lines(path, "requests log"):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if record.get("body_kept") is False:  # its hash only: a body logged elsewhere wins
                    bodies.setdefault(record["sha256"], (record["endpoint"], None))
                else:
                    bodies[record["sha256"]] = (record["endpoint"], record["body"])
            except (ValueError, KeyError, TypeError, RecursionError):
                continue
    return bodies


def write_prereg(path: Path, data: dict[str, Any]) -> None:
    """Write a prereg YAML atomically (validated first)."""
    from ..util.fsio import atomic_write_bytes

    check_prereg(data, str(path))  # nothing is written for an invalid prereg
    text = (
        "# kvgraft pre-registration: register it (kvgraft replay --register), then replay it anywhere.\n"
        + dump_yaml(data)
    )
    atomic_write_bytes(Path(path), text.encode())
