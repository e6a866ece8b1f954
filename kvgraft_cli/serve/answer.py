"""One request computed on the engine, and its ledger line: what `kvgraft serve` does between parsing and replying.

A chat whose conversation is exactly the manifest's (its system prompt, if any, and one user turn) is a question,
looked up in the library as `kvgraft solve` does: an exact hit grafts its verified solution and asks for the final
answer under the answer budget (``decode.answer_tokens``); with ``k`` > 0 related hits graft as a chain; a miss
runs the model plainly. Every other prompt (another system prompt, several turns, a completion's text) runs
plainly. A plain prompt goes through the prompt cache (serve.promptcache), whose chunks make a warm request compute
exactly what a cold one does. The library grows only by `kvgraft deposit`/`solve --deposit-verified`: a server
does not know the right answer.

Every request, answered or cancelled, gets one ``serve`` ledger line, appended (and fsynced) before the response's
last byte leaves; the request's body goes first into the requests log beside the ledger, so `kvgraft replay
--served` can compute it again and compare every hash.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.modelhash import context_window
from ..engine.decoding import Stream, step
from ..engine.engine import Engine, tensor_sha256, token_ids_sha256
from ..engine.growcache import BufferPool, enabled, pooled
from ..errors import InputError, KvgraftError, UnsupportedModel
from ..eval.problems import normalize_key
from ..ledger import entries, kinds
from ..ledger.entries import Digest, ServeEntry
from ..library.retrieval import Found, find
from ..library.solve import graft_question
from ..runs.context import RunContext, engine_facts
from ..store.local import Store, problem_key
from ..store.remote import adopt_rows, export_rows
from ..util.hashing import canonical_json, sha256_bytes
from . import promptcache, tenants
from .protocol import Request, RequestError

KIND = kinds.SERVE
DEFAULT_CACHE_MAX = 8 << 30  # bytes of prompt-cache chunks a server's store keeps (--cache-max)


@dataclass
class Options:
    """How a server answers: related hits (``k`` > 0), the chunk of its prompt cache, whether it caches at all."""

    k: int = 0
    min_score: float | None = None
    prompt_cache: bool = True
    chunk: int = promptcache.DEFAULT_CHUNK  # under the invariant schedule only
    requests_log: Path | None = None
    warm_bytes: int = 256 << 20  # prompt chunks read into the verified cache at start (promptcache.warm)
    # An s3:// store: at most this often (seconds) the rows of what this server recorded are published as an index
    # batch, and the batches other servers and replicas published are read (0: around every request)
    sync_every: float = 30.0
    # Continuous batching (serve.worker): at most this many requests decode in one step, each with its bits alone
    batch: int = 1
    # The bytes of prompt-cache chunks the store may hold (store.eviction: least recently used chains go first); None:
    # unbounded
    cache_max: int | None = DEFAULT_CACHE_MAX
    # The requests log keeps each body (False: its hash only; `kvgraft replay --served` cannot compute those again)
    log_bodies: bool = True


@dataclass
class Answer:
    """A computed request: the text and ids, why it ended, what was grafted, its ledger line."""

    text: str
    ids: list[int]
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    hit: str  # exact | related | none | plain (not a library question)
    artifacts: list[str] = field(default_factory=list)  # library entries grafted
    chain: list[str] = field(default_factory=list)  # library artifacts restored (root, then links)
    grafted_tokens: int = 0  # from the library
    cached_tokens: int = 0  # from the prompt cache
    cache_chunks: list[str] = field(default_factory=list)
    deposited_chunks: list[str] = field(default_factory=list)
    refused_chunks: list[str] = field(default_factory=list)  # cached chunks that failed their check (not used)
    first_logits_sha256: str | None = None
    prompt_ids: list[int] = field(default_factory=list)  # every token of the context, grafted or computed
    timings: dict[str, float] = field(default_factory=dict)
    cancelled: bool = False  # the client went away: the decode stopped (the ledger line says "cancelled")
    # A replica's answer (not recorded where it was computed): the index rows of the prompt chunks it deposited, for
    # the front that records it (Recorder.record adopts them; on another node they are in no index the front reads)
    index_rows: list[dict] = field(default_factory=list)
    ledger_seq: int | None = None
    ledger_sha256: str | None = None

    def kvgraft(self) -> dict[str, Any]:
        """The ``kvgraft`` object of a response: what was grafted and the ledger line that records it."""
        return {
            "hit": self.hit,
            "artifacts": self.artifacts,
            "chain": self.chain,
            "grafted_tokens": self.grafted_tokens,
            "cached_tokens": self.cached_tokens,
            "prompt_cache": {"chunks": self.cache_chunks, "deposited": self.deposited_chunks},
            "first_logits_sha256": self.first_logits_sha256,
            "generated_ids_sha256": token_ids_sha256(self.ids),
            "ledger": {"seq": self.ledger_seq, "line_sha256": self.ledger_sha256},
        }

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids),
            "total_tokens": self.prompt_tokens + len(self.ids),
            "prompt_tokens_details": {"cached_tokens": self.grafted_tokens + self.cached_tokens},
            "grafted_tokens": self.grafted_tokens,
        }


@dataclass
class Decoding:
    """A request between :meth:`Server.begin` and :meth:`Server.finish`: its answer so far and its decode."""

    request: Request
    answer: Answer
    prefix: str  # the text the answer starts with (the exact hit's answer prefix)
    chain: list  # the prompt cache's chunks of its prompt (a plain request's; kept as the slot when it finishes)
    queued_s: float
    t0: float
    record: bool
    stream: Stream = field(init=False)
    cancelled: bool = False  # the client went away: the decode stopped


@dataclass
class CacheBound:
    """The prompt cache's bound (``--cache-max``, None: unbounded), its chunks' bytes at the last upkeep, and what
    this server evicted (shown by /health and /metrics)."""

    max: int | None
    bytes: int = 0
    evicted_chunks: int = 0
    evicted_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "max_bytes": self.max,
            "bytes": self.bytes,
            "evicted_chunks": self.evicted_chunks,
            "evicted_bytes": self.evicted_bytes,
        }


class Server:
    """A loaded engine, its store and ledger: answers requests (the caller serializes the calls: one thread)."""

    def __init__(self, ctx: RunContext, engine: Engine, options: Options):
        self.ctx = ctx
        self.engine = engine
        self.options = options
        m = ctx.manifest
        self.model_id: str = m.name or "kvgraft"
        self.chunk = promptcache.chunk_of(engine, options.chunk) if options.prompt_cache else None
        self.store: Store | None = None
        self.library = False
        self.facts = engine_facts(engine)
        self.limit = engine.max_positions or context_window(m.model_dir)
        self.requests_log = options.requests_log or default_requests_log(ctx.ledger)
        self.recorder = Recorder(ctx, self.facts, options, self.chunk, self.requests_log)
        self.warmed = promptcache.Warmed()  # what open() read into the verified cache
        self.slot: promptcache.Slot | None = None  # the last plain request's cache (promptcache.prefill)
        self.pool = BufferPool() if enabled(engine.device) else None  # caches' memory, recycled request to request
        self.batch = 1  # requests decoding together at most (open(): options.batch where the engine's check passes)
        self.batch_note: str | None = None  # why a server asked to batch decodes one request at a time
        # The prompt cache's bound (store.eviction): chunk entries this server used since its last upkeep (key ->
        # parent's key, time), written after the answers left; the chunks' bytes and what was evicted
        self._used: dict[str, tuple[str | None, float]] = {}
        self.cache = CacheBound(options.cache_max)

    def open(self) -> None:
        """Open the store in the thread that will use it (SQLite connections stay in their thread)."""
        self.store = self.ctx.open_store()
        if self.options.batch > 1:  # the batched step checked on this machine before the first request
            self.batch_note = self.engine.batch_refusal
            self.batch = 1 if self.batch_note else self.options.batch
        if self.pool is not None and self.limit:  # one request's cache at the window's length, faulted in now
            self.pool.reserve(*self.engine.cache_buffers(self.limit))
        if self.chunk is not None:  # a lowered --cache-max applies before the warm-up reads what it keeps
            sync(lambda _: self._bound(), 0, "bound the prompt cache")
        if self.chunk is not None and self.options.warm_bytes:
            self.warmed = promptcache.warm(self.store, self.engine, self.options.warm_bytes)
        self.library = (
            self.store.library_size(self.ctx.manifest.machine_compute_sha256) > 0
        )  # at start (shown by /health)

    def _take_slot(self) -> promptcache.Slot | None:
        """The kept slot, given up (the request cuts it back and extends it, or lets it go)."""
        slot, self.slot = self.slot, None
        return slot

    def upkeep(self) -> None:
        """After an answer has left: publish what this server recorded, when a period has passed (a remote store's
        rows, Options.sync_every; a folder store's index needs nothing). A failure is said and retried next time:
        the rows stay queued, and the store publishes them when it closes."""
        if self.store is not None:
            sync(self.store.publish_due, self.options.sync_every, "publish the prompt cache's index rows")
            if self.chunk is not None and (self._used or self.cache.max is not None):
                sync(lambda _: self._bound(), 0, "bound the prompt cache")

    def _bound(self) -> None:
        """Note the chunks used since the last upkeep, then evict down to ``--cache-max`` (store.eviction)."""
        from ..store import eviction

        assert self.store is not None
        used, self._used = self._used, {}
        eviction.touch(self.store, used)
        if self.cache.max is None:
            self.cache.bytes = eviction.cache_bytes(self.store)
            return
        gone = eviction.evict(self.store, self.cache.max)
        self.cache.bytes = gone.remaining
        self.cache.evicted_chunks += gone.chunks
        self.cache.evicted_bytes += gone.bytes

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    # -- the prompt -----------------------------------------------------------------------------------------------
    def _is_question(self, req: Request) -> bool:
        """Whether a chat is exactly the manifest's conversation for one question (what the library was built on)."""
        if req.endpoint != "chat":
            return False
        system = self.engine.manifest.prompt.system
        head = [{"role": "system", "content": system}] if system is not None else []
        return req.messages[:-1] == head and len(req.messages) == len(head) + 1

    def _with_bos(self, ids: list[int]) -> list[int]:
        return self.engine.manifest.prompt.with_bos(ids, self.engine.tokenizer.bos_token_id)

    def plain_ids(self, req: Request) -> list[int]:
        """The token ids of a prompt run plainly (nothing grafted from the library)."""
        prompts = self.engine.prompts
        if req.endpoint == "completion":
            text = req.prompt
        elif self._is_question(req):
            text = prompts.question_text(req.question or "", first=True)
        elif prompts.chat:
            text = prompts.render(req.messages, generation=True)
        else:
            raise RequestError(
                f"model {self.model_id}'s manifest has no chat template (prompt.format: text): a chat must be one "
                "user turn, or use /v1/completions",
                "messages",
            )
        return self._with_bos(self._encode(text))

    def _encode(self, text: str) -> list[int]:
        try:
            return self.engine.encode(text, where="the prompt")
        except InputError as e:
            raise RequestError(e.message, "messages", code="context_length_exceeded") from None

    def _budget(self, req: Request, prompt_tokens: int, exact: bool) -> int:
        default = self.engine.manifest.decode.budget(exact)
        budget = min(req.max_tokens, default) if exact and req.max_tokens else (req.max_tokens or default)
        room = (self.limit or 0) - prompt_tokens
        if self.limit and (room < 1 or (req.max_tokens and budget > room)):
            raise RequestError(
                f"this model's context is {self.limit} tokens; the prompt has {prompt_tokens} and "
                f"{budget} more were asked for",
                "messages" if req.endpoint == "chat" else "prompt",
                code="context_length_exceeded",
            )
        return min(budget, room) if self.limit else budget

    # -- one request ------------------------------------------------------------------------------------------------
    def pooled(self):
        """The scope a request's cache buffers are made in: memory earlier requests used (growcache.pooled: no page
        faults), given back once nothing holds it."""
        return pooled(self.pool)

    def answer(
        self,
        req: Request,
        on_ids: Callable[[list[int], str], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        queued_s: float = 0.0,
        record: bool = True,
    ) -> Answer:
        """Compute one request alone and append its ledger line (``record`` False: neither the line nor the
        requests log: a replay). ``on_ids(ids, prefix)`` sees the ids decoded so far (the text starts with
        ``prefix``); ``cancelled`` is asked after each token and stops the decode. :meth:`begin`, the decode's steps,
        :meth:`finish`: what serve.worker does for several requests at once, a step of each together."""
        with self.pooled():
            begun = self.begin(req, on_ids, cancelled, queued_s, record)
            if isinstance(begun, Answer):
                return begun
            while not begun.stream.done:
                step(self.engine, [begun.stream])
            return self.finish(begun)

    def begin(
        self,
        req: Request,
        on_ids: Callable[[list[int], str], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        queued_s: float = 0.0,
        record: bool = True,
    ) -> Decoding | Answer:
        """A request up to its first token: the library's graft or the prompt cache's prefill, the first token's
        logits, and its decode (``Decoding.stream``) fed them, to be stepped alone or beside others' and then
        :meth:`finish`-ed. A request cancelled while it waited is answered (and recorded) here: nothing computed."""
        assert self.store is not None, "Server.open() first"
        engine = self.engine
        t0 = time.perf_counter()
        # What other servers (or replicas on other nodes) deposited since: their prompt chunks and library entries
        sync(self.store.refresh_due, self.options.sync_every, "read the store's new index batches")
        question = req.question if self._is_question(req) else None
        # Looked up even when the library was empty at start: entries deposited meanwhile count (an indexed query).
        found = self._find(question) if question is not None else Found("none")
        grafted = None
        if found.hits:
            try:
                grafted = self._graft_library(req, question or "", found)
            except UnsupportedModel:  # a template that renders the turn otherwise in context: ask it plainly
                grafted = None
        pre = None
        if grafted is not None:
            ans, ids, budget, cache, last = grafted
        else:
            ids = self.plain_ids(req)
            budget = self._budget(req, len(ids), exact=False)
            ans = Answer("", [], "length", len(ids), "none" if question is not None else "plain")
            ans.prompt_ids = ids
            if cancelled():  # cancelled while queued: nothing computed
                ans.cancelled = True
                return self._record(req, ans, queued_s, t0) if record else ans
            scope = tenants.scope(req.tenant, req.cache_salt)
            pre = promptcache.prefill(engine, self.store, ids, self.chunk, self._take_slot(), scope)
            cache, last = pre.cache, pre.last_logits
            now = time.time()
            for i, key in enumerate(pre.keys):  # noted in memory; written after the answer leaves (upkeep)
                self._used[key] = (pre.keys[i - 1] if i else None, now)
            ans.cached_tokens, ans.cache_chunks, ans.deposited_chunks = pre.restored_tokens, pre.restored, pre.deposited
            ans.refused_chunks = pre.refused
        ans.first_logits_sha256 = tensor_sha256(last)
        ans.timings["first_token_s"] = time.perf_counter() - t0
        ans.prompt_ids = ids
        prefix = engine.prompts.answer_prefix(ans.hit == "exact")
        stop = list(engine.manifest.decode.stop) + req.stop
        d = Decoding(req, ans, prefix, pre.chain if pre is not None else [], queued_s, t0, record)

        def on_token(so_far: list[int]) -> bool:
            if on_ids is not None:
                on_ids(so_far, prefix)
            d.cancelled = cancelled()
            return d.cancelled

        d.stream = engine.stream(cache, budget, stop_at_eos=True, stop=stop, on_token=on_token)
        d.stream.feed(last)
        return d

    def finish(self, d: Decoding) -> Answer:
        """A request whose decode has stopped: its text, why it ended, its ledger line (when ``record``)."""
        engine, ans, gen = self.engine, d.answer, d.stream.ids
        if d.chain:  # the next prompt that starts with these chunks continues this cache
            self.slot = promptcache.Slot(d.chain, d.stream.cache)
        ans.ids = gen
        text, hit_stop = cut_at_stop(engine.decode_text(gen, skip_special=True), d.stream.stop)
        eos = bool(gen) and gen[-1] == engine.tokenizer.eos_token_id
        ans.text = d.prefix + text
        ans.finish_reason = "stop" if (eos or hit_stop) else "length"
        ans.cancelled = d.cancelled
        if not d.record:
            assert self.store is not None  # (open: begin needed it)
            if ans.deposited_chunks:  # their rows, for the front that records this answer (Answer.index_rows)
                ans.index_rows = export_rows(self.store, ans.deposited_chunks)
            return ans
        return self._record(d.request, ans, d.queued_s, d.t0)

    def _find(self, question: str) -> Found:
        """The library's answer for a question: exact only, or with ``k`` related hits."""
        assert self.store is not None
        manifest_sha = self.ctx.manifest.machine_compute_sha256
        if self.options.k < 1:
            exact = self.store.library_exact(problem_key(manifest_sha, normalize_key(question)))
            return Found("exact", [exact]) if exact is not None else Found("none")
        return find(self.store, question, manifest_sha, self.options.k, self.options.min_score)

    def _graft_library(self, req: Request, question: str, found: Found):
        """solve's graft: the hits (most relevant nearest the question) restored as a chain, then the question."""
        assert self.store is not None
        engine, prompts = self.engine, self.engine.prompts
        exact = found.kind == "exact"
        query = engine.encode(prompts.question_text(question, exact=exact, first=False))
        hits = list(reversed(found.hits))
        want = engine.manifest.decode.budget(exact)
        while hits and self.limit and sum(h.num_tokens for h in hits) + len(query) + want > self.limit:
            hits.pop(0)
        if not hits:
            return None
        chain, query, cache, logits = graft_question(engine, self.store, hits, question, exact)
        last = logits[-1]  # solve's very call: a row's bits may depend on the rows computed beside it
        budget = self._budget(req, chain.num_tokens + len(query), exact)
        ans = Answer("", [], "length", chain.num_tokens + len(query), found.kind)
        ans.artifacts = [h.artifact for h in hits]
        ans.chain = chain.shas
        ans.grafted_tokens = chain.num_tokens - chain.prefilled_tokens
        ids = [t for a in chain.artifacts for t in a.token_ids] + query
        return ans, ids, budget, cache, last

    # -- the ledger ---------------------------------------------------------------------------------------------------
    def _record(self, req: Request, ans: Answer, queued_s: float, t0: float) -> Answer:
        assert self.store is not None
        return self.recorder.record(self.store, req, ans, queued_s, t0)


class Recorder:
    """What writes a request's ledger line: a Server's, or the front of replicas (serve.replicas), which records
    every replica's answers into one ledger as a single server would. ``facts`` are the engine's ledger facts."""

    def __init__(self, ctx: RunContext, facts: dict[str, Any], options: Options, chunk: int | None, log: Path):
        self.ctx, self.facts, self.options, self.chunk, self.requests_log = ctx, facts, options, chunk, log

    def record(self, store: Store, req: Request, ans: Answer, queued_s: float, t0: float) -> Answer:
        """Log the request's body, then append its ledger line (fsynced): the response may leave after this. The
        artifacts it names are marked recorded in ``store`` once the line is written."""
        ids = ans.prompt_ids
        if ans.cancelled:
            ans.finish_reason = "cancelled"
        ans.timings["wall_s"] = time.perf_counter() - t0
        ans.timings["queue_s"] = queued_s
        log_request(self.requests_log, req, self.options.log_bodies)
        if ans.index_rows:  # a replica's deposits, indexed here unrecorded: the line below records them
            # (a failure only leaves them unindexed here, to be computed again elsewhere: the answer stands)
            sync(lambda _: adopt_rows(store, ans.index_rows), 0, "index a replica's prompt chunks")
            ans.index_rows = []
        entry = ServeEntry(
            manifest=self.ctx.manifest_ref(),
            **self.facts,
            request=Digest.of(
                req.sha256,
                endpoint=req.endpoint,
                log=self.ctx.rel(self.requests_log),
                **({"tenant": req.tenant} if req.tenant is not None else {}),
            ),
            prompt_ids=Digest.of(token_ids_sha256(ids), count=len(ids)),
            library={"hit": ans.hit, "artifacts": ans.artifacts, "chain": ans.chain},
            prompt_cache={
                # where the chunks are (verify counts them there: cache, evicted or not, never records)
                "store": self.ctx.remote or self.ctx.rel(self.ctx.store),
                "chunk": self.chunk,
                "chunks": ans.cache_chunks,
                "deposited": ans.deposited_chunks,
                "refused": ans.refused_chunks,
            },
            settings={
                "k": self.options.k,
                "min_score": repr(self.options.min_score) if self.options.min_score is not None else None,
                "max_tokens": req.max_tokens,
                "stop": req.stop,
            },
            first_logits=Digest(ans.first_logits_sha256) if ans.first_logits_sha256 else None,
            generated_ids=Digest.of(token_ids_sha256(ans.ids), count=len(ans.ids)),
            output=Digest(sha256_bytes(ans.text.encode())),
            finish_reason=ans.finish_reason,
            costs={
                "prompt_tokens": ans.prompt_tokens,
                "grafted_tokens": ans.grafted_tokens,
                "cached_tokens": ans.cached_tokens,
                "prefill_tokens": ans.prompt_tokens - ans.grafted_tokens - ans.cached_tokens,
                "decode_tokens": len(ans.ids),
                **ans.timings,
            },
        )
        named = ans.chain + ans.cache_chunks + ans.deposited_chunks

        def after(_: ServeEntry) -> None:
            if named:
                store.mark_recorded(named)

        written = entries.write(self.ctx.ledger, entry, after=after)
        ans.ledger_seq = written.seq
        ans.ledger_sha256 = sha256_bytes(canonical_json(written.to_json()))
        return ans


def sync(step: Callable[[float], object], every_s: float, doing: str) -> None:
    """A remote store's periodic publish or refresh (Server.upkeep, Server._answer, the front of replicas): a store
    that fails is said on stderr and tried again a period later; the request goes on with the index it has. Upkeep
    never ends the thread that runs it (an engine's, or a replica's relay): any failure is caught here."""
    try:
        step(every_s)
    except Exception as e:  # noqa: BLE001  (a SQLite or S3 failure of upkeep is a warning, not a dead engine)
        why = e.message if isinstance(e, KvgraftError) else f"{type(e).__name__}: {str(e)[:200]}"
        print(f"kvgraft serve: warning: could not {doing}: {why}", file=sys.stderr, flush=True)


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """The text before the first stop string (which, with all after it, is not part of the answer), and whether one
    was there."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def default_requests_log(ledger_path: Path) -> Path:
    """Where a server logs request bodies by default: beside the ledger, ``<ledger name>.requests.jsonl``."""
    p = Path(ledger_path)
    return p.with_name(p.name.removesuffix(".jsonl") + ".requests.jsonl")


def log_request(path: Path, req: Request, body: bool = True) -> None:
    """Append a request's canonical body (one line, fsynced): `kvgraft replay --served` computes it again. ``body``
    False keeps its hash and endpoint only (a prompt is then in no file: the replay cannot compute it). The log is
    the owner's alone (0600): it holds every prompt in clear."""
    row = {"sha256": req.sha256, "endpoint": req.endpoint, **({"body": req.body} if body else {"body_kept": False})}
    line = canonical_json(row) + b"\n"
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:  # a log made before (0644): made the owner's now
            os.fchmod(fd, 0o600)
        end = os.lseek(fd, 0, os.SEEK_END)
        if end and os.pread(fd, 1, end - 1) != b"\n":  # a line torn by kill -9 (its request never answered)
            line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
