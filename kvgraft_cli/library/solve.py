"""``kvgraft solve``: answer problems from the library of verified solutions, count what it saves, grow it.

For each problem: find what the library holds (an exact hit, else the top-k related solutions), graft it at its
own position (a chain when there are several), run the query template, and greedy-decode under the short answer
budget (``decode.answer_tokens``) on an exact hit or the full budget (``decode.max_new_tokens``) otherwise,
stopping at EOS or a ``decode.stop`` string. ``use_library=False`` runs the same problems with nothing grafted:
the baseline. Each problem gets one ``solve`` ledger entry (its inputs, what was grafted, its output's hash and
its costs); the outputs file, which `kvgraft score` reads as it is, gets a ``solve-outputs`` entry at the end so
`kvgraft verify` re-hashes it. With ``deposit_verified`` an answer that matches the problem's reference answer is
deposited (problem + the model's own solution) as a verified library entry: next time the problem is an exact hit.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.manifest import clip
from ..config.modelhash import context_window
from ..engine.decoding import DEFAULT_BATCH, Stream, step
from ..engine.engine import Engine, load_engine, tensor_sha256, token_ids_sha256
from ..errors import InputError
from ..eval import answers
from ..eval.problems import Problem, check_lengths, read_problems, verify_solution
from ..eval.scoring import wilson_interval
from ..ledger import entries
from ..ledger import log as ledger
from ..ledger.entries import Digest, SolveEntry, SolveOutputsEntry
from ..runs.context import RunContext, engine_facts
from ..runs.deposit import DepositReport, deposit_one
from ..runs.owned import check_output
from ..store.local import Store
from ..util.fsio import atomic_write_bytes
from ..util.hashing import canonical_json, sha256_bytes, sha256_file
from .chain import build_chain, hit_fields
from .retrieval import Found, find

if TYPE_CHECKING:
    from ..config.sections import PromptSection
    from ..runs.workers.ray import RayPool


@dataclass
class SolveRecord:
    """One problem solved: what the library gave, what it cost, what came out."""

    id: str
    line: int
    hit: str  # exact | related | none (always none without the library)
    artifacts: list[str]  # the library entries grafted, in context order
    chain: list[str]  # the artifacts restored (root, then links)
    grafted_tokens: int  # tokens restored from the store instead of computed
    prefill_tokens: int  # tokens computed: new chain links + the query
    decode_tokens: int
    budget: int
    output: str
    extracted: str | None
    reference: str | None
    correct: bool | None
    wall_s: float
    cpu_s: float
    energy_j: float | None = None
    deposited: str | None = None  # the artifact a verified answer was deposited as
    ledger_seq: int | None = None

    def output_line(self) -> dict:
        """The outputs-file record: what `kvgraft score` reads (id, output), what was grafted and how many tokens
        were decoded. Only what the model and the library decide, so the file's hash replays; costs that depend on
        the store's state (links already there) or the machine (times, energy) are in the ledger entry and --json."""
        return {
            "id": self.id,
            "output": self.output,
            "hit": self.hit,
            "artifacts": self.artifacts,
            "decode_tokens": self.decode_tokens,
        }


@dataclass
class SolveRun:
    """One pass over a problems file, with or without the library."""

    mode: str  # library | baseline
    problems: str
    outputs: str
    outputs_sha256: str = ""
    records: list[SolveRecord] = field(default_factory=list)
    ledger_seq: int | None = None
    batch: int = 1  # problems decoded together at most (1: one at a time)
    batch_note: str | None = None  # why a run asked to batch decoded one problem at a time

    def totals(self) -> dict:
        r = self.records
        scored = [x for x in r if x.correct is not None]
        correct = sum(bool(x.correct) for x in scored)
        lo, hi = wilson_interval(correct, len(scored))
        energy = [x.energy_j for x in r if x.energy_j is not None]
        return {
            "mode": self.mode,
            "problems": len(r),
            "scored": len(scored),
            "correct": correct,
            "accuracy": correct / len(scored) if scored else None,
            "wilson95_low": lo,
            "wilson95_high": hi,
            "exact_hits": sum(x.hit == "exact" for x in r),
            "related_hits": sum(x.hit == "related" for x in r),
            "decode_tokens": sum(x.decode_tokens for x in r),
            "prefill_tokens": sum(x.prefill_tokens for x in r),
            "grafted_tokens": sum(x.grafted_tokens for x in r),
            "wall_s": sum(x.wall_s for x in r),
            "cpu_s": sum(x.cpu_s for x in r),
            "energy_j": sum(energy) if energy else None,
            "deposited": sum(x.deposited is not None for x in r),
        }

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "problems": self.problems,
            "outputs": self.outputs,
            "outputs_sha256": self.outputs_sha256,
            "ledger_seq": self.ledger_seq,
            "batch": self.batch,
            "batch_note": self.batch_note,
            "totals": self.totals(),
            "records": [asdict(x) for x in self.records],
        }


def compare(baseline: SolveRun, library: SolveRun) -> dict:
    """Baseline over library for each cost (how many times cheaper the library run was); None where undefined."""
    b, w = baseline.totals(), library.totals()

    def ratio(key):
        return b[key] / w[key] if w[key] else None

    return {
        "decode_tokens": ratio("decode_tokens"),
        "prefill_tokens": ratio("prefill_tokens"),
        "wall_s": ratio("wall_s"),
        "cpu_s": ratio("cpu_s"),
        "energy_j": ratio("energy_j") if b["energy_j"] is not None and w["energy_j"] else None,
    }


def answer_text(continuation: str) -> str:
    """The outputs-file text of a decoded continuation of the query template (which ends by asking for the
    answer): the continuation itself when it states its final answer (a boxed answer, "The answer is", an
    "Answer:" line), else ``Answer: <continuation>``, so `kvgraft score` extracts a bare answer exactly."""
    text = continuation.strip()
    return text if answers.extract(text) is not None else f"Answer: {text}"


def own_solution(output: str, extracted: str) -> str:
    """The solution deposited for a verified answer: the model's output, ending with its final answer as
    "The answer is: X" (the form every deposited solution is verified by)."""
    text = output.strip()
    if answers.trailer(text) is not None:
        return text
    if text in (extracted, f"Answer: {extracted}"):
        return f"The answer is: {extracted}"
    return f"{text}\nThe answer is: {extracted}"


def check_outputs(problems_path: Path, outputs_path: Path, force: bool, ctx: RunContext | None = None) -> None:
    """Refuse to overwrite a file kvgraft owns, whatever ``force`` says (the problems file, and with ``ctx`` the
    ledger, the store and the manifest: runs.owned), or (without ``force``) an outputs file a ledger entry may name."""
    check_output(outputs_path, "--outputs", ctx, reads={"the problems file": problems_path})
    if Path(outputs_path).exists() and not force:
        raise InputError(
            f"outputs file {outputs_path} exists (an earlier run's ledger entry names its hash)",
            "pass --outputs NEW.jsonl, or --force to overwrite it",
        )


def check_library(ctx: RunContext) -> None:
    """Refuse (before any model loads) a store whose library holds nothing under this manifest's compute pin."""
    with ctx.open_store(create=False) as store:
        if store.library_size(ctx.manifest.machine_compute_sha256) == 0:
            raise InputError(
                f"the library in {ctx.store_name} holds no verified solutions for this manifest's compute pin",
                "deposit some first (`kvgraft deposit FILE.jsonl`), or run --no-library for the baseline",
            )


def solve(
    ctx: RunContext,
    problems_path: Path,
    outputs_path: Path,
    *,
    k: int = 1,
    min_score: float | None = None,
    use_library: bool = True,
    deposit_verified: bool = False,
    limit: int | None = None,
    force: bool = False,
    batch: int = 1,
    engine: Engine | None = None,
    pool: RayPool | None = None,
    on_start: Callable[[int], None] | None = None,
    on_progress: Callable[[SolveRecord], None] | None = None,
) -> SolveRun:
    """Solve every problem of a JSONL file: :func:`prepare_solve`, then the run it prepared."""
    return prepare_solve(
        ctx, problems_path, outputs_path, k=k, min_score=min_score, use_library=use_library,
        deposit_verified=deposit_verified, limit=limit, force=force, batch=batch, engine=engine, pool=pool,
        on_start=on_start, on_progress=on_progress,
    )()  # fmt: skip


def prepare_solve(
    ctx: RunContext,
    problems_path: Path,
    outputs_path: Path,
    *,
    k: int = 1,
    min_score: float | None = None,
    use_library: bool = True,
    deposit_verified: bool = False,
    limit: int | None = None,
    force: bool = False,
    batch: int = 1,
    engine: Engine | None = None,
    pool: RayPool | None = None,
    on_start: Callable[[int], None] | None = None,
    on_progress: Callable[[SolveRecord], None] | None = None,
    batcher: Batcher | None = None,
) -> Callable[[], SolveRun]:
    """Solve every problem of a JSONL file (see the module docstring). The whole file, the store and the ledger are
    checked before any work; each problem's ledger entry is written as it finishes.

    ``pool`` (runs.workers.ray): solve the problems on Ray workers, in shards, against the library as it is when
    the run starts; this process alone writes the outputs file and the ledger, in input order, so both hash as a
    single-process run's do. ``deposit_verified`` is refused there (see :func:`check_sharded`)."""
    if k < 1:
        raise InputError(f"--k must be at least 1, got {k}")
    if pool is not None:
        check_sharded(deposit_verified)
    m = ctx.manifest
    problems = read_problems(problems_path, m.input.as_written(), require_solution=False)
    if limit is not None:
        problems = problems[:limit]
    # A text no position limit could fit is refused by its length, before anything is tokenized or loaded.
    check_lengths(problems, problems_path, context_window(m.model_dir), fields=("problem",))
    check_outputs(problems_path, outputs_path, force, ctx)
    full_budget, answer_budget = m.decode.budget(exact=False), m.decode.budget(exact=True)
    stop = list(m.decode.stop)
    ledger.check_appendable(ctx.ledger)
    if use_library:
        check_library(ctx)
    where = str(problems_path)
    # Bounded for any input: characters checked first, ids truncated past the model's positions (engine.encode).
    if pool is not None:
        pool.start()  # engines load in the workers (each checks the pins and refuses drift)
        facts, limit_pos = pool.facts, pool.max_positions
        query_ids = pool.map_all("solve-query", problems, {"where": where})
    else:
        if engine is None:
            engine = load_engine(m, ctx.allow_drift)
        facts, limit_pos = engine_facts(engine), engine.max_positions
        query_ids = [query_job(ctx, engine, p, where=where) for p in problems]
    for p, ids in zip(problems, query_ids):  # refuse before any work: a query that cannot fit even alone
        if limit_pos and len(ids) + full_budget > limit_pos:
            at_least = "at least " if len(ids) > limit_pos else ""
            raise InputError(
                f"{problems_path}:{p.line}: problem {clip(repr(p.id), 80)} needs {at_least}{len(ids)} "
                f"query tokens + {full_budget} decode tokens, more than the model's {limit_pos} positions",
                "shorten the problem or lower decode.max_new_tokens",
            )
    run = SolveRun("library" if use_library else "baseline", str(problems_path), str(outputs_path))
    input_sha = sha256_file(problems_path)
    problems_file = Digest(input_sha, ctx.rel(Path(problems_path)))
    settings = {
        "mapping": m.input.as_written(),
        "k": k,
        "min_score": repr(min_score) if min_score is not None else None,
        "library": use_library,
        "answer_tokens": answer_budget,
        "max_new_tokens": full_budget,
        "stop": stop,
        "deposit_verified": deposit_verified,
        "limit": limit,
    }
    prompts = prompt_settings(m.prompt)
    if prompts is not None:
        settings["prompts"] = prompts
    args = {
        "k": k,
        "min_score": min_score,
        "use_library": use_library,
        "answer_budget": answer_budget,
        "full_budget": full_budget,
        "stop": stop,
        "limit_pos": limit_pos,
        "problems_file": problems_file,
        "settings": settings,
    }
    if on_start:
        on_start(len(problems))
    store = ctx.open_store() if use_library or deposit_verified else None
    items = list(zip(problems, query_ids))
    solved: Iterator[Solved] | None = None
    if pool is not None:  # the workers' results in input order as their shards finish (a worker reads the library)
        solved = pool.map_ordered("solve", items, args, codec="auto" if store is not None else None)
    elif batch > 1:
        assert engine is not None  # (loaded above when there is no pool)
        run.batch_note = _batch_note(engine, deposit_verified)
        if run.batch_note is None:
            run.batch = batch
            solved = (batcher or Batcher(engine, batch)).submit(items, store, args, facts)

    def finish() -> SolveRun:
        try:
            deposits = DepositReport(str(problems_path), input_sha, ctx.store_name, str(ctx.ledger), m.source)
            for p, ids in items:
                if solved is not None:
                    s = next(solved)
                else:
                    assert engine is not None  # (loaded above when there is no pool)
                    s = solve_problem(ctx, engine, store, p, ids, **args)
                    s.facts = facts
                rec = record_solve(ctx, store, s)
                if deposit_verified and rec.correct:
                    # (deposit_verified: no pool (check_sharded), so the engine is loaded, and the store is open)
                    assert engine is not None and store is not None
                    rec.deposited = _deposit_answer(ctx, engine, store, deposits, p, rec)
                run.records.append(rec)
                if on_progress:
                    on_progress(rec)
        finally:
            if store is not None:
                store.close()
        data = b"".join(canonical_json(r.output_line()) + b"\n" for r in run.records)
        atomic_write_bytes(Path(outputs_path), data)
        run.outputs_sha256 = sha256_bytes(data)
        entry = SolveOutputsEntry(
            manifest=ctx.manifest_ref(),
            **facts,
            problems_file=problems_file,
            settings=settings,
            outputs=Digest(run.outputs_sha256, ctx.rel(Path(outputs_path))),
            totals={k2: v for k2, v in run.totals().items() if k2 != "mode"},
            mode=run.mode,
        )
        run.ledger_seq = entries.write(ctx.ledger, entry).seq
        return run

    return finish


def _batch_note(engine: Engine, deposit_verified: bool) -> str | None:
    """Why a run asked to batch decodes one problem at a time, or None when it batches."""
    if deposit_verified:
        return (
            "--deposit-verified decodes one problem at a time: an answer deposited at one problem changes what the "
            "next retrieves"
        )
    return engine.batch_refusal


class Batcher:
    """Continuous batching of problems, for one run or several (``solve --compare``): problems begin (retrieval,
    graft, question: :func:`begin_problem`) in the order they were submitted, one at a time, whenever fewer than
    ``batch`` are decoding, so each sees the store a one-at-a-time run's would (runs that deposit nothing mid-run:
    :func:`_batch_note`); every step decodes one token of each problem decoding (decoding.step), whose bits are the
    problem's alone; a problem leaves when its decode stops. A step's wall and CPU time are shared equally by the
    problems it computed (their ``wall_s``/``cpu_s``), so a run's totals are what it took."""

    def __init__(self, engine: Engine, batch: int):
        self.engine, self.batch = engine, batch
        self.waiting: deque = deque()  # (key, problem, query ids, store, args, facts), in submission order
        self.active: list[tuple[int, Begun, dict, dict]] = []
        self.done: dict[int, Solved] = {}
        self.submitted = 0

    def submit(self, items: list[tuple[Problem, list[int]]], store: Store | None, args: dict, facts: dict):
        """Queue a run's problems; returns its Solved in input order, computed as they are asked for."""
        keys = range(self.submitted, self.submitted + len(items))
        self.submitted += len(items)
        self.waiting.extend((key, p, ids, store, args, facts) for key, (p, ids) in zip(keys, items))
        return self._results(keys)

    def _results(self, keys: range) -> Iterator[Solved]:
        for key in keys:
            while key not in self.done:
                self._advance()
            yield self.done.pop(key)

    def _advance(self) -> None:
        """Begin waiting problems while there is room, then one step; finish the problems that stopped."""
        while len(self.active) < self.batch and self.waiting:
            key, p, ids, store, args, facts = self.waiting.popleft()
            self.active.append((key, begin_problem(self.engine, store, p, ids, **args), args, facts))
        live = [b for _, b, _, _ in self.active if not b.stream.done]
        wall0, cpu0 = time.perf_counter(), time.process_time()
        step(self.engine, [b.stream for b in live], self.batch)
        if live:
            wall, cpu = (time.perf_counter() - wall0) / len(live), (time.process_time() - cpu0) / len(live)
            for b in live:
                b.wall_s += wall
                b.cpu_s += cpu
        finished = [x for x in self.active if x[1].stream.done]
        self.active = [x for x in self.active if not x[1].stream.done]
        for key, b, args, facts in finished:
            self.done[key] = finish_problem(self.engine, b, args["problems_file"], args["settings"])
            self.done[key].facts = facts


def check_sharded(deposit_verified: bool) -> None:
    """Refuse ``--deposit-verified`` on Ray workers: in a single pass a verified answer deposited at problem i is in
    the library when problem j > i retrieves, so problem j's output depends on the answers before it. Shards solved
    at the same time cannot see each other's deposits, so the outputs would differ from a single-process run's,
    and which ones would depend on the worker count and timing."""
    if deposit_verified:
        raise InputError(
            "--deposit-verified cannot run on Ray workers: an answer deposited mid-run changes what "
            "later problems retrieve, so sharded outputs would not match a single-process run's",
            "run --deposit-verified without --ray (solving with --ray first needs no deposits)",
        )


@dataclass
class Solved:
    """One problem solved by an engine (here or in a Ray worker), not yet recorded: plain data for the process that
    writes the ledger."""

    record: SolveRecord
    entry: SolveEntry  # the ledger entry, but for what the recording side adds (manifest, engine facts)
    chain: list[str]  # the artifacts grafted, noted as recorded once the entry is written
    facts: dict = field(default_factory=dict)  # the entry's environment, model and drift (runs.context.engine_facts)


def query_job(ctx: RunContext, engine: Engine, p: Problem, *, where: str) -> list[int]:
    """A problem's question token ids as a miss asks it, with nothing before it (bounded for any input: see
    Engine.encode): what the position checks count. solve_problem renders the question again once it knows
    whether the library holds the problem (an exact hit's question) and whether anything is grafted before it."""
    return engine.encode(engine.prompts.question_text(p.problem, first=True), where=f"{where}:{p.line}")


def prompt_settings(prompt: PromptSection) -> dict | None:
    """The question prompts a manifest pins beyond the plain ``query`` (chat format, the exact hit's question and
    answer prefix), as recorded in each solve entry's settings; None for a manifest with none of them (its entries
    stay as they were)."""
    keys = ("format", "system", "user", "assistant", "query", "query_exact", "answer_prefix")
    if not any(prompt.has(k) for k in ("format", "query_exact", "answer_prefix")):
        return None
    written = prompt.as_written()
    return {k: written[k] for k in keys if k in written}


def record_solve(ctx: RunContext, store: Store | None, s: Solved) -> SolveRecord:
    """Append a solved problem's ledger entry; returns its record with the entry's seq."""
    entry = replace(s.entry, manifest=ctx.manifest_ref(), **s.facts)

    def after(_: SolveEntry) -> None:
        if s.chain:
            assert store is not None  # (a chain is grafted from the library: its store is open)
            store.mark_recorded(s.chain)

    # A failed append leaves new links in the store, unrecorded: another run may already graft them (see
    # store.local); `kvgraft store gc` is the only deleter.
    s.record.ledger_seq = entries.write(ctx.ledger, entry, after=after).seq
    return s.record


def solve_problem(
    ctx: RunContext,
    engine: Engine,
    store: Store | None,
    p: Problem,
    query: list[int],
    **args,
) -> Solved:
    """Solve one problem: retrieve, graft, decode. Writes only chain links to the store; the caller records it.
    (:func:`begin_problem`, its decode alone, :func:`finish_problem`.)"""
    b = begin_problem(engine, store, p, query, **args)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while not b.stream.done:
        step(engine, [b.stream])
    b.wall_s += time.perf_counter() - wall0
    b.cpu_s += time.process_time() - cpu0
    return finish_problem(engine, b, args["problems_file"], args["settings"])


@dataclass
class Begun:
    """A problem retrieved, grafted and its question computed: its decode (``stream``) not yet run. ``wall_s`` and
    ``cpu_s`` gather its costs: its own work, and its share of each decode step it is computed in."""

    problem: Problem
    kind: str
    hits: list
    chain: Any
    query: list[int]
    logits: Any
    budget: int
    stream: Stream
    energy0: int | None
    wall_s: float = 0.0
    cpu_s: float = 0.0


def begin_problem(
    engine: Engine,
    store: Store | None,
    p: Problem,
    query: list[int],
    *,
    k: int,
    min_score: float | None,
    use_library: bool,
    answer_budget: int,
    full_budget: int,
    stop: list[str],
    limit_pos: int | None,
    **_: Any,
) -> Begun:
    """A problem's retrieval, graft and question: everything before its decode, which is fed the question's last
    logits and waits to be stepped (alone, or beside other problems')."""
    wall0, cpu0, energy0 = time.perf_counter(), time.process_time(), engine.gpu_energy_mj()
    if use_library:
        assert store is not None  # (the caller opens the store whenever the library is used)
        found = find(store, p.problem, engine.manifest.machine_compute_sha256, k, min_score)
    else:
        found = Found("none")
    budget = answer_budget if found.kind == "exact" else full_budget
    # Most relevant last: nearest to the question. Drop the least relevant while the context would not fit.
    hits = list(reversed(found.hits))
    while hits and limit_pos and sum(h.num_tokens for h in hits) + len(query) + budget > limit_pos:
        hits.pop(0)
    kind = found.kind if hits else "none"  # an exact hit too long to graft is a miss, with a miss's budget
    budget = answer_budget if kind == "exact" else full_budget
    chain = None
    if hits:
        assert store is not None  # (hits come from the library)
        chain, query, cache, logits = graft_question(engine, store, hits, p.problem, kind == "exact")
    else:  # nothing grafted: the context starts here, with BOS as every deposited prefix does
        query = engine.encode(engine.prompts.question_text(p.problem, first=True))
        query = engine.manifest.prompt.with_bos(query, engine.tokenizer.bos_token_id)
        cache = engine.new_cache()
        logits = engine.forward(cache, query)
    stream = engine.stream(cache, budget, stop_at_eos=True, stop=stop)
    stream.feed(logits[-1])
    b = Begun(p, kind, hits, chain, query, logits, budget, stream, energy0)
    b.wall_s, b.cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    return b


def finish_problem(engine: Engine, b: Begun, problems_file: Digest, settings: dict) -> Solved:
    """A decoded problem's answer, record and ledger body."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    p, hits, chain, query, logits, kind = b.problem, b.hits, b.chain, b.query, b.logits, b.kind
    gen = b.stream.ids
    prompts, exact = engine.prompts, kind == "exact"
    stop = b.stream.stop
    continuation = engine.decode_text(gen, skip_special=True)
    for s in stop:  # the stop string and anything after it are not part of the answer
        continuation = continuation.split(s, 1)[0]
    output = answer_text(prompts.answer_prefix(exact) + continuation)
    extracted = answers.extract(output)
    correct = None if p.answer is None else (extracted is not None and answers.answers_match(extracted, p.answer))
    energy1 = engine.gpu_energy_mj()
    energy0 = b.energy0
    rec = SolveRecord(
        p.id,
        p.line,
        kind,
        [h.artifact for h in hits],
        chain.shas if chain else [],
        chain.num_tokens - chain.prefilled_tokens if chain else 0,
        (chain.prefilled_tokens if chain else 0) + len(query),
        len(gen),
        b.budget,
        output,
        extracted,
        p.answer,
        correct,
        b.wall_s + time.perf_counter() - wall0,
        b.cpu_s + time.process_time() - cpu0,
        (energy1 - energy0) / 1000 if energy0 is not None and energy1 is not None else None,
    )
    entry = SolveEntry(
        problems_file=problems_file,
        record=Digest.of(p.record_sha256, id=p.id, line=p.line),
        query_ids=Digest.of(token_ids_sha256(query), count=len(query)),
        library={
            "hit": rec.hit,
            "artifacts": rec.artifacts,
            "chain": rec.chain,
            "scores": [repr(h.score) for h in hits if h.score is not None],
            "new_links": [sha for _, sha in chain.new_links] if chain else [],
        },
        settings=settings,
        query_logits=Digest(tensor_sha256(logits)),
        generated_ids=Digest.of(token_ids_sha256(gen), count=len(gen)),
        output=Digest(sha256_bytes(output.encode())),
        costs={
            "grafted_tokens": rec.grafted_tokens,
            "prefill_tokens": rec.prefill_tokens,
            "decode_tokens": rec.decode_tokens,
            "wall_s": rec.wall_s,
            "cpu_s": rec.cpu_s,
            "energy_j": rec.energy_j,
        },
    )
    return Solved(rec, entry, chain.shas if chain else [])


def graft_question(engine: Engine, store: Store, hits: list, question: str, exact: bool):
    """The library's hits (most relevant last) grafted as one chain, then the question asked after them: returns
    (chain, the question's ids, the cache, the question's logits). Under a chat template the grafted tokens and the
    question's must be the whole conversation's, exactly (UnsupportedModel otherwise). `solve` and `kvgraft serve`
    both answer a hit through here."""
    chain = build_chain(store, engine, hits)
    prompts = engine.prompts
    query = engine.encode(prompts.question_text(question, exact=exact))
    if prompts.chat:
        whole = engine.encode(prompts.conversation_text([hit_fields(h) for h in hits], question, exact))
        prompts.check_conversation([t for a in chain.artifacts for t in a.token_ids], query, whole)
    cache = engine.restore_chain(chain.artifacts)
    return chain, query, cache, engine.forward(cache, query)


def _deposit_answer(
    ctx: RunContext, engine: Engine, store: Store, report: DepositReport, p: Problem, rec: SolveRecord
) -> str | None:
    """Deposit a verified answer: the problem with the model's own solution, checked by the same verification
    every deposit passes. Returns the artifact, or None when the check does not pass (never deposited)."""
    own = Problem(p.line, p.id, p.problem, own_solution(rec.output, rec.extracted or ""), p.answer, p.record_sha256)
    verdict = verify_solution(own)
    if verdict.status != "verified":
        return None
    settings = {
        "mapping": ctx.manifest.input.as_written(),
        "from": "solve --deposit-verified",
        "solve_ledger_seq": rec.ledger_seq,
    }
    result = deposit_one(ctx, engine, store, report, own, verdict, False, 3, settings)
    return result.artifact


def replay_solve(ctx: RunContext, pr, run: dict, get_engine) -> dict:
    """The prereg runner of a ``solve`` run (runs.replay calls it through the runner table the CLI passes): solve
    the input again with the recorded settings, writing the outputs where the prereg says (a later score run reads
    them there), and report the hashes to compare."""
    from ..runs.replay import file_check, with_mapping

    path, sha = file_check(pr, run["input"])
    got: dict = {"input_sha256": sha}
    if sha != run["input_sha256"]:
        return got
    s = run["settings"]
    c = dataclasses.replace(ctx, manifest=with_mapping(ctx.manifest, s["mapping"]))
    min_score = float(s["min_score"]) if s.get("min_score") is not None else None
    result = solve(
        c,
        path,
        pr.resolve(run["outputs"]),
        k=s["k"],
        min_score=min_score,
        use_library=s["library"],
        deposit_verified=s.get("deposit_verified", False),
        limit=s.get("limit"),
        force=True,
        batch=DEFAULT_BATCH,  # the outputs are a one-at-a-time run's (Batcher)
        engine=get_engine(),
    )
    got["outputs_sha256"] = result.outputs_sha256
    for r in result.records:
        got[f"output {r.id}"] = sha256_bytes(r.output.encode())
        got[f"hit {r.id}"] = r.hit
    return got


# -- Ray worker jobs (runs.workers.ray runs them; each takes the worker and one item, returns plain data) -----------
def ray_query_job(w, p: Problem, *, where: str) -> list[int]:
    return query_job(w.ctx, w.engine, p, where=where)


def ray_solve_job(w, item: tuple[Problem, list[int]], **args) -> Solved:
    p, ids = item
    solved = solve_problem(w.ctx, w.engine, w.store, p, ids, **args)
    solved.facts = w.facts
    return solved
