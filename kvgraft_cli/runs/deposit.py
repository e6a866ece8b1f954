"""``kvgraft deposit``: verify each problem's solution, prefill it, store the artifact, record it in the ledger."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..artifacts import format as kvg
from ..config.modelhash import context_window
from ..engine.engine import Engine, load_engine, tensor_sha256, token_ids_sha256
from ..errors import CheckFailed, IntegrityError, StoreError
from ..eval.problems import Problem, Verdict, check_lengths, normalize_key, read_problems, verify_solution
from ..ledger import entries
from ..ledger import log as ledger
from ..ledger.entries import DepositEntry, Digest, Verification
from ..store import writers
from ..store.local import Store, prefix_key, problem_key
from ..util.hashing import sha256_file
from .context import RunContext, engine_facts

if TYPE_CHECKING:
    from .workers.ray import RayPool


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
        return {
            "input": self.input,
            "input_sha256": self.input_sha256,
            "store": self.store,
            "ledger": self.ledger,
            "manifest": self.manifest,
            "totals": self.totals(),
            "results": [asdict(r) for r in self.results],
        }


def render_prefix(template: str, p: Problem) -> str:
    """Fill the prefix template (str.format placeholders; braces inside the values are left alone)."""
    return template.format(**p.fields())


def deposit(
    ctx: RunContext,
    problems_path: Path,
    *,
    limit: int | None = None,
    allow_unverified: bool = False,
    recompute: bool = False,
    level: int = 3,
    engine: Engine | Callable[[], Engine] | None = None,
    codec: str = "auto",
    pool: RayPool | None = None,
    on_start: Callable[[int], None] | None = None,
    on_progress: Callable[[DepositResult], None] | None = None,
) -> DepositReport:
    """Deposit every verified problem of a JSONL file. The whole file is parsed and checked before any work.
    ``codec``: how new artifact files are written (``auto``, ``raw`` or ``zstd``; the identity is the same).
    ``engine``: the engine, or a function that loads it (called only when there is work); None: loaded here.
    ``pool`` (runs.workers.ray): compute the artifacts on Ray workers, in shards; this process alone indexes them
    and appends the ledger, in input order, so the ledger records what a single-process run records."""
    problems = read_problems(problems_path, ctx.manifest.input.as_written())
    if limit is not None:
        problems = problems[:limit]
    # A text no position limit could fit is refused by its length, before anything is tokenized or loaded.
    check_lengths(problems, problems_path, context_window(ctx.manifest.model_dir))
    report = DepositReport(
        str(problems_path), sha256_file(problems_path), ctx.store_name, str(ctx.ledger), ctx.manifest.source
    )
    plan: list[tuple[Problem, Verdict]] = []
    for p in problems:
        verdict = verify_solution(p)
        if verdict.status == "verified" or allow_unverified:
            plan.append((p, verdict))
        else:
            report.results.append(DepositResult(p.id, p.line, "skipped", f"{verdict.status}: {verdict.reason}"))
    if not plan:
        return report
    ledger.check_appendable(ctx.ledger)  # refuse before any work, so nothing lands in the store unrecorded
    # How the file was read: enough for `kvgraft prereg make` to replay the same deposit elsewhere.
    settings = {"mapping": ctx.manifest.input.as_written(), "limit": limit, "allow_unverified": allow_unverified}
    where = str(problems_path)
    if pool is not None:
        pool.start()  # engines load in the workers (each checks the pins and refuses drift)
        if on_start:
            on_start(len(plan))
        # Every prefix is tokenized (and one the model cannot hold refused) before the store is created.
        prefixes = pool.map_all("deposit-prefix", [p for p, _ in plan], {"where": where})
        computed = pool.map_ordered(
            "deposit", list(zip((p for p, _ in plan), prefixes)), {"recompute": recompute, "level": level}, codec=codec
        )
    else:
        # Loaded only now, once the file is read and checked whole: a bad line is refused before the model loads.
        if engine is None:
            engine = load_engine(ctx.manifest, ctx.allow_drift)
        elif not isinstance(engine, Engine):
            engine = engine()
        if on_start:
            on_start(len(plan))
        prefixes = [prefix_job(ctx, engine, p, where=where) for p, _ in plan]
        computed = None
    # Registered as a running writer while it writes: gc keeps what it writes, whatever its grace (store.writers).
    with ctx.open_store(codec=codec) as store, writers.registered(store.root):
        for (p, verdict), ids in zip(plan, prefixes):
            if computed is None:
                assert isinstance(engine, Engine)  # (loaded above when there is no pool)
                c = compute_deposit(ctx.manifest, engine, store, p, ids, recompute, level, engine_facts(engine))
            else:
                c = next(computed)  # the workers' results, in input order, as their shards finish
            r = record_deposit(ctx, store, report, p, verdict, c, recompute, settings, by_worker=computed is not None)
            report.results.append(r)
            if on_progress:
                on_progress(r)
    report.results.sort(key=lambda r: r.line)
    return report


@dataclass
class Computed:
    """One problem's deposit as an engine computed it (here or in a Ray worker): the object is in the store, not
    yet indexed or recorded. Plain data, so a worker can return it to the process that records it."""

    key: str  # the store's index key: the compute pin and the prefix's token ids
    ids_sha256: str
    num_tokens: int
    artifact: str
    logits_sha256: str
    payload_bytes: int | None  # None: the store already held the prefix (its object re-hashed, nothing computed)
    model_sha256: str
    engine: dict  # the ledger entry's environment, model and drift parts, from the engine that computed it


def prefix_job(ctx: RunContext, engine: Engine, p: Problem, *, where: str) -> list[int]:
    """A problem's prefix token ids (InputError naming ``where:line`` for one the model cannot hold)."""
    return engine.prefix_ids(engine.prompts.root_text(p.fields()), where=f"{where}:{p.line}")


def compute_deposit(
    m, engine: Engine, store: Store, p: Problem, ids: list[int], recompute: bool, level: int, facts: dict
) -> Computed:
    """The compute step: prefill the prefix, encode and hash the artifact, write its object file (not indexed).
    When the store already holds the prefix (and not ``recompute``), its stored object is re-hashed instead."""
    ids_sha = token_ids_sha256(ids)
    key, sha, logits_sha, payload_bytes = prefix_artifact(m, engine, store, ids, ids_sha, p.id, recompute, level)
    return Computed(key, ids_sha, len(ids), sha, logits_sha, payload_bytes, engine.hashes.model_sha256, facts)


def prefix_artifact(
    m,
    engine: Engine,
    store: Store,
    ids: list[int],
    ids_sha: str,
    label: str,
    recompute: bool = False,
    level: int = 3,
) -> tuple[str, str, str, int | None]:
    """A prefix's artifact in the store (its object written, not indexed), ``ids_sha`` its token ids' hash: (index
    key, identity, last logits' hash, payload bytes or None where the store held it already and it was re-hashed
    instead of computed)."""
    key = prefix_key(m.machine_compute_sha256, ids_sha)
    existing = store.lookup_key(key)
    if existing and store.has_object(existing.artifact) and not recompute:
        # Already stored under this pin: re-hash the stored object rather than trusting the index, and check it
        # holds exactly this prefix (an index row is only a label: a remote batch or an edited index could point
        # this key at another artifact, and the ledger line would then say these tokens made it).
        _, art = store.load(existing.artifact)
        if (
            art.token_ids != ids
            or art.parent is not None
            or art.meta.get("manifest_sha256") != m.machine_compute_sha256
        ):
            raise IntegrityError(
                f"{label}: the store's index names artifact {existing.artifact[:16]}... for this prefix, but that "
                "artifact holds other tokens or another compute pin: the index row was altered",
                "deposit with --recompute into a store whose index you trust; for a remote store see docs/REMOTE.md",
            )
        return key, existing.artifact, art.meta["logits_sha256"], None
    cache, last = engine.prefill(ids)
    logits_sha = tensor_sha256(last)
    payload = kvg.encode(ids, engine.capture(cache), engine.artifact_meta(logits_sha))
    sha = kvg.payload_identity(payload)
    _check_same(label, existing.artifact if existing else None, sha, lambda: payload)
    store.put_object(sha, payload, level)
    return key, sha, logits_sha, len(payload)


def store_prefix(m, engine: Engine, store: Store, ids: list[int]) -> tuple[str, str, bool]:
    """A prompt's prefix deposited and indexed, with no ledger line (the API's deposit_prompt): (identity, last
    logits' hash, whether it was computed now rather than found)."""
    ids_sha = token_ids_sha256(ids)
    key, sha, logits_sha, payload_bytes = prefix_artifact(m, engine, store, ids, ids_sha, f"prompt {ids_sha[:16]}")
    if payload_bytes is not None:
        store.index(
            sha,
            payload_bytes=payload_bytes,
            key=key,
            problem_id=f"prompt {ids_sha[:16]}",
            num_tokens=len(ids),
            model_sha256=engine.hashes.model_sha256,
            manifest_sha256=m.machine_compute_sha256,
            verified=False,
        )
    return sha, logits_sha, payload_bytes is not None


def _check_same(label: str, stored: str | None, sha: str, payload: Callable[[], bytes | bytearray]) -> None:
    # Under another identity scheme the same cache has another name: then compare the bytes, not the names.
    if stored is not None and stored != sha and not kvg.same_cache(payload(), stored):
        raise CheckFailed(
            f"{label}: re-deposit gave artifact {sha[:16]}..., the store holds {stored[:16]}... "
            "for the same prefix and pin: this environment does not reproduce the deposit",
            "check the kernel flags and versions against the manifest",
        )


def record_deposit(
    ctx: RunContext,
    store: Store,
    report: DepositReport,
    p: Problem,
    verdict,
    c: Computed,
    recompute: bool,
    settings: dict,
    by_worker: bool = False,
) -> DepositResult:
    """The record step: index the computed artifact and append its ledger entry (or nothing). ``by_worker``: a Ray
    worker computed it (its object may be in a store this process does not reach)."""
    m = ctx.manifest
    verified = verdict.status == "verified"
    # What `kvgraft solve` finds: the problem (exact hits by its normalized text) and the solution (full text).
    library = {
        "problem_key": problem_key(m.machine_compute_sha256, normalize_key(p.problem)),
        "problem": p.problem,
        "solution": p.solution,
        "answer": p.answer,
    }
    payload_len = c.payload_bytes
    if payload_len is not None:
        # In a sharded run an earlier problem of the same run may have indexed this prefix since a worker computed
        # it: record it as the single-process run would have (already stored), so the ledgers agree.
        existing = store.lookup_key(c.key)
        _check_same(
            p.id,
            existing.artifact if existing else None,
            c.artifact,
            lambda: kvg.read_file(store.object_path(c.artifact), c.artifact)[0],
        )
        if existing and store.has_object(existing.artifact) and not recompute:
            payload_len = None
    sha = c.artifact
    _object_here(store, sha, by_worker)
    if payload_len is None:
        if verified:
            store.add_to_library(sha, p.id, m.machine_compute_sha256, c.num_tokens, library)
    else:
        store.index(
            sha,
            payload_bytes=payload_len,
            key=c.key,
            problem_id=p.id,
            num_tokens=c.num_tokens,
            model_sha256=c.model_sha256,
            manifest_sha256=m.machine_compute_sha256,
            verified=verified,
            library=library,
        )
    out_bytes = {"payload_bytes": payload_len} if payload_len is not None else {}
    entry = DepositEntry(
        manifest=ctx.manifest_ref(),
        **c.engine,
        problems_file=Digest(report.input_sha256, ctx.rel(Path(report.input))),
        record=Digest.of(p.record_sha256, id=p.id, line=p.line),
        token_ids=Digest.of(c.ids_sha256, count=c.num_tokens),
        settings=settings,
        artifact=Digest.of(sha, ctx.rel(store.object_path(sha)), **out_bytes),
        logits=Digest.of(c.logits_sha256, dtype=m.model.dtype, position=c.num_tokens - 1),
        verification=Verification.of(verdict.status, verdict.reason, verdict.extracted, p.answer),
    )

    def first_record(e: DepositEntry) -> DepositEntry:
        # Decided under the ledger's append lock: the first line to record an artifact says "deposited", whoever
        # wrote the object (a run whose append failed leaves its object for the next run to record).
        return replace(e, status="existing" if store.is_recorded(sha) else "deposited")

    # If the append fails, the object and index rows stay (unrecorded): another run may already name this
    # artifact in its own ledger line, so deleting it could leave that line pointing at nothing.
    written = entries.write(ctx.ledger, entry, finalize=first_record, after=lambda _: store.mark_recorded([sha]))
    return DepositResult(
        p.id,
        p.line,
        written.status or "",
        verdict.reason,
        verified,
        sha,
        c.num_tokens,
        store.object_path(sha).stat().st_size,
        c.logits_sha256,
        written.line_seq,
    )


def _object_here(store: Store, sha: str, by_worker: bool = True) -> None:
    """Make sure the object written for this problem is in this process's store folder (indexing reads its size): a
    remote store's cache fetches it; a local folder that lacks it is not the one the workers wrote to, or (written
    by this process) something deleted it before its index row."""
    if store.object_path(sha).is_file():
        return
    fetch = getattr(store, "local_object", None)  # store.remote.RemoteStore: fetched into the cache
    if fetch is not None:
        fetch(sha)
        return
    if not by_worker:
        # This process wrote it moments ago: it was deleted between the object and its index row, which only
        # `kvgraft store gc` with a grace shorter than the deposit does (#24.12). Nothing was recorded for it.
        raise StoreError(
            f"artifact {sha[:16]}... written by this deposit was deleted from the store at {store.root} "
            "before it was indexed (`kvgraft store gc` with a --grace shorter than a running deposit, "
            "e.g. --grace 0, deletes objects not yet indexed); nothing was recorded for it",
            "re-run the same deposit (what is recorded is kept; this problem is computed again), and "
            "run gc with its default --grace (3600 s), or when no deposit is running",
        )
    raise StoreError(
        f"artifact {sha[:16]}... computed by a worker is not in the store at {store.root}",
        "with --ray-address every node must reach the store: an s3:// store, or a folder mounted at "
        "the same path on every node",
    )


def deposit_one(
    ctx: RunContext,
    engine: Engine,
    store: Store,
    report: DepositReport,
    p: Problem,
    verdict,
    recompute: bool,
    level: int,
    settings: dict,
    ids: list[int] | None = None,
) -> DepositResult:
    """Prefill, store and record one problem (``report`` names the input file; ``ids``: its prefix's token ids,
    when already made); the ledger entry or nothing."""
    if ids is None:
        ids = prefix_job(ctx, engine, p, where=report.input)
    c = compute_deposit(ctx.manifest, engine, store, p, ids, recompute, level, engine_facts(engine))
    return record_deposit(ctx, store, report, p, verdict, c, recompute, settings)


# -- Ray worker jobs (runs.workers.ray runs them; each takes the worker and one item, returns plain data) -----------
def ray_prefix_job(w, p: Problem, *, where: str) -> list[int]:
    return prefix_job(w.ctx, w.engine, p, where=where)


def ray_deposit_job(w, item: tuple[Problem, list[int]], *, recompute: bool, level: int) -> Computed:
    p, ids = item
    return compute_deposit(w.ctx.manifest, w.engine, w.store, p, ids, recompute, level, w.facts)
