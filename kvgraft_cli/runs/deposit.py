"""``kvgraft deposit``: verify each problem's solution, prefill it, store the artifact, record it in the ledger."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..artifacts import format as kvg
from ..ledger import log as ledger
from ..engine.engine import Engine, load_engine, tensor_sha256, token_ids_sha256
from ..errors import CheckFailed
from ..util.hashing import digest, sha256_bytes, sha256_file
from ..config.modelhash import context_window
from ..eval.problems import Problem, check_lengths, normalize_key, read_problems, verify_solution
from .context import RunContext
from ..store.local import Store, prefix_key, problem_key


@dataclass
class DepositResult:
    """What happened to one problem."""

    id: str
    line: int
    status: str  # deposited | existing | skipped
    reason: str
    verified: bool = False
    artifact: str | None = None
    num_tokens: int = 0
    file_bytes: int = 0
    logits_sha256: str | None = None
    ledger_seq: int | None = None


@dataclass
class DepositReport:
    """The whole run: per-problem results and where things were written."""

    input: str
    input_sha256: str
    store: str
    ledger: str
    manifest: str
    results: list[DepositResult] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        done = [r for r in self.results if r.status in ("deposited", "existing")]
        return {
            "problems": len(self.results),
            "deposited": sum(r.status == "deposited" for r in self.results),
            "existing": sum(r.status == "existing" for r in self.results),
            "skipped": sum(r.status == "skipped" for r in self.results),
            "tokens": sum(r.num_tokens for r in done),
            "bytes": sum(r.file_bytes for r in self.results if r.status == "deposited"),
        }

    def to_json(self) -> dict:
        return {"input": self.input, "input_sha256": self.input_sha256, "store": self.store, "ledger": self.ledger,
                "manifest": self.manifest, "totals": self.totals(), "results": [asdict(r) for r in self.results]}


def render_prefix(template: str, p: Problem) -> str:
    """Fill the prefix template (str.format placeholders; braces inside the values are left alone)."""
    return template.format(**p.fields())


def deposit(ctx: RunContext, problems_path: Path, *, limit: int | None = None, allow_unverified: bool = False,
            recompute: bool = False, level: int = 3, engine: Engine | None = None, codec: str = "auto",
            on_start: Callable[[int], None] | None = None,
            on_progress: Callable[[DepositResult], None] | None = None) -> DepositReport:
    """Deposit every verified problem of a JSONL file. The whole file is parsed and checked before any work.
    ``codec``: how new artifact files are written (``auto``, ``raw`` or ``zstd``; the identity is the same)."""
    problems = read_problems(problems_path, ctx.manifest.data["input"])
    if limit is not None:
        problems = problems[:limit]
    # A text no position limit could fit is refused by its length, before anything is tokenized or loaded.
    check_lengths(problems, problems_path, context_window(ctx.manifest.model_dir))
    report = DepositReport(str(problems_path), sha256_file(problems_path), str(ctx.store), str(ctx.ledger),
                           ctx.manifest.source)
    plan: list[tuple[Problem, object]] = []
    for p in problems:
        verdict = verify_solution(p)
        if verdict.status == "verified" or allow_unverified:
            plan.append((p, verdict))
        else:
            report.results.append(DepositResult(p.id, p.line, "skipped", f"{verdict.status}: {verdict.reason}"))
    if not plan:
        return report
    ledger.check_appendable(ctx.ledger)  # refuse before any work, so nothing lands in the store unrecorded
    if engine is None:
        engine = load_engine(ctx.manifest, ctx.allow_drift)
    # How the file was read: enough for `kvgraft prereg make` to replay the same deposit elsewhere.
    settings = {"mapping": ctx.manifest.data["input"], "limit": limit, "allow_unverified": allow_unverified}
    if on_start:
        on_start(len(plan))
    template = ctx.manifest.data["prompt"]["prefix"]
    # Every prefix is tokenized (and one the model cannot hold refused) before the store is created.
    prefixes = [engine.prefix_ids(render_prefix(template, p), where=f"{problems_path}:{p.line}") for p, _ in plan]
    with ctx.open_store(codec=codec) as store:
        for (p, verdict), ids in zip(plan, prefixes):
            r = deposit_one(ctx, engine, store, report, p, verdict, recompute, level, settings, ids)
            report.results.append(r)
            if on_progress:
                on_progress(r)
    report.results.sort(key=lambda r: r.line)
    return report


def deposit_one(ctx: RunContext, engine: Engine, store: Store, report: DepositReport, p: Problem, verdict,
                recompute: bool, level: int, settings: dict, ids: list[int] | None = None) -> DepositResult:
    """Prefill, store and record one problem (``report`` names the input file; ``ids``: its prefix's token ids,
    when already made); the ledger entry or nothing."""
    m = ctx.manifest
    if ids is None:
        ids = engine.prefix_ids(render_prefix(m.data["prompt"]["prefix"], p), where=f"{report.input}:{p.line}")
    ids_sha = token_ids_sha256(ids)
    key = prefix_key(m.compute_sha256, ids_sha)
    verified = verdict.status == "verified"
    # What `kvgraft solve` finds: the problem (exact hits by its normalized text) and the solution (full text).
    library = {"problem_key": problem_key(m.compute_sha256, normalize_key(p.problem)), "problem": p.problem,
               "solution": p.solution, "answer": p.answer}
    existing = store.lookup_key(key)
    if existing and store.has_object(existing.artifact) and not recompute:
        # Already stored under this pin: re-hash the stored object rather than trusting the index.
        _, art = store.load(existing.artifact)
        sha, logits_sha, payload_len = existing.artifact, art.meta["logits_sha256"], None
        if verified:
            store.add_to_library(sha, p.id, m.compute_sha256, len(ids), library)
    else:
        cache, last = engine.prefill(ids)
        logits_sha = tensor_sha256(last)
        payload = kvg.encode(ids, engine.capture(cache), engine.artifact_meta(logits_sha))
        sha = sha256_bytes(payload)
        if existing and existing.artifact != sha:
            raise CheckFailed(
                f"{p.id}: re-deposit gave artifact {sha[:16]}..., the store holds {existing.artifact[:16]}... "
                "for the same prefix and pin: this environment does not reproduce the deposit",
                "check the kernel flags and versions against the manifest",
            )
        payload_len = len(payload)
        store.put(sha, payload, key=key, problem_id=p.id, num_tokens=len(ids),
                  model_sha256=engine.hashes.model_sha256, manifest_sha256=m.compute_sha256,
                  verified=verified, level=level, library=library)
    entry = ctx.entry_base(engine)
    entry.update(
        inputs={
            "problems_file": {"path": ctx.rel(Path(report.input)), **digest(report.input_sha256)},
            "record": {**digest(p.record_sha256), "id": p.id, "line": p.line},
            "token_ids": {**digest(ids_sha), "count": len(ids)},
            "settings": settings,
        },
        outputs={
            "artifact": {**digest(sha), "path": ctx.rel(store.object_path(sha))},
            "logits": {**digest(logits_sha), "dtype": m.data["model"]["dtype"], "position": len(ids) - 1},
        },
        verification={"status": verdict.status, "reason": verdict.reason, "extracted": verdict.extracted,
                      "reference": p.answer},
    )
    if payload_len is not None:
        entry["outputs"]["artifact"]["payload_bytes"] = payload_len

    def first_record(e: dict) -> None:
        # Decided under the ledger's append lock: the first line to record an artifact says "deposited", whoever
        # wrote the object (a run whose append failed leaves its object for the next run to record).
        e["status"] = "existing" if store.is_recorded(sha) else "deposited"

    # If the append fails, the object and index rows stay (unrecorded): another run may already name this
    # artifact in its own ledger line, so deleting it could leave that line pointing at nothing.
    written = ledger.append(ctx.ledger, "deposit", entry, finalize=first_record,
                            after=lambda _: store.mark_recorded([sha]))
    return DepositResult(p.id, p.line, written["status"], verdict.reason, verified, sha, len(ids),
                         store.object_path(sha).stat().st_size, logits_sha, written["seq"])
