"""The prompt cache of `kvgraft serve`: a prompt's prefix kept in the store as a chain of chunks.

**Why chunks, and why a response never depends on the cache.** A prompt is always computed the same way, cold or
warm: forwards of ``chunk`` tokens from position 0 (the last one shorter), each on the cache of all before it, and
with the manifest's ``prefill.cut_before`` a chunk also ends before each cut token (a chat's turn start:
engine.chunk_spans). A chunk that is closed (full, or followed by a cut token) is deposited as an artifact whose
parent is the chunk before it, so a later prompt with the same first k chunks restores them and computes chunk k+1
onwards: the very forwards a cold request runs from there, on the same cache bytes, hence the same bits. A cache
that split a prompt at an arbitrary point (where the last request happened to end) would change the forwards'
shapes, and with them the logits' bits. With cuts at turns, a shared system prompt ends a chunk of its own, and the
cache keeps it whole.

Under the manifest's ``chunked`` schedule the chunk is its ``chunk_size`` (part of the compute pin); under
``invariant`` any split gives the same bits and the chunk is the server's choice; under ``single`` (the whole
prompt in one forward) no split is exact, so nothing is cached and every prompt is computed whole.

Chunks are indexed by (compute pin, parent chunk, token ids): :func:`~..store.local.prompt_key`, a namespace of its
own. Every chunk restored from disk is re-hashed against its identity (store.load); the verified ones stay in the
process's memory LRU (``KVGRAFT_VERIFIED_CACHE``). A chunk that fails its check is not used: the prompt is computed
from there, exactly as cold, and the ledger line names the refused chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..artifacts import format as kvg
from ..engine.engine import Engine, chunk_spans, closed_span, tensor_sha256, token_ids_sha256
from ..errors import IntegrityError, KvgraftError
from ..store.local import PROMPT_CHUNK_ID, VERIFIED, Store, prompt_key

DEFAULT_CHUNK = 256  # under the invariant schedule (a chunked manifest pins its own)


def chunk_of(engine: Engine, invariant_chunk: int = DEFAULT_CHUNK) -> int | None:
    """The cache's chunk under the manifest's schedule; None under ``single`` (no exact split: nothing cached)."""
    prefill = engine.manifest.prefill
    if prefill.schedule == "chunked":
        return prefill.chunk_size  # (validation requires it of a chunked schedule)
    if prefill.schedule == "invariant":
        return invariant_chunk
    return None


@dataclass
class Prefilled:
    """A prompt computed on the cache: the cache, the last position's logits, what was restored and deposited."""

    cache: object
    last_logits: object
    restored: list[str] = field(default_factory=list)  # chunk artifacts restored, root first
    restored_tokens: int = 0
    deposited: list[str] = field(default_factory=list)  # chunk artifacts this prompt added to the store
    refused: list[str] = field(default_factory=list)  # a cached chunk that failed its check (not used)
    chain: list[str] = field(default_factory=list)  # the chunks the cache's first positions hold, root first
    keys: list[str] = field(default_factory=list)  # the index key of each chunk of ``chain`` (the bound's use rows)
    from_slot: bool = False  # the restored chunks were the slot's own positions (no copy)


@dataclass
class Slot:
    """The last request's cache and the chunks its first positions hold (root first): a server keeps it, and a next
    prompt that starts with the same chunks continues it instead of joining them again (:func:`prefill`)."""

    chain: list[str]
    cache: object


def _continue_slot(engine: Engine, slot: Slot | None, links: list[tuple[str, kvg.Artifact]]):
    """The slot's cache holding ``links`` (the cached chunks a prompt starts with), when it already holds their first
    ones and every layer grows in place (growcache): cut back to the chunks it shares with them, then the rest of
    the links written after them; else None. Its positions hold the very bytes those chunks hold (a chunk artifact
    is a capture of those positions, or was restored into them), so the forwards after it compute what they compute
    after a restore."""
    from ..engine.growcache import cut_back

    if slot is None or not links:
        return None
    shared = 0
    while shared < min(len(links), len(slot.chain)) and slot.chain[shared] == links[shared][0]:
        shared += 1
    if not shared or not cut_back(slot.cache, sum(len(art.token_ids) for _, art in links[:shared])):
        return None
    import torch

    layers, rest = slot.cache.layers, [art for _, art in links[shared:]]  # type: ignore[attr-defined]
    with engine._infer():  # the buffers a forward grew are inference tensors: written in inference mode
        # Written after them, in place (GrowingLayer.update), as a restore joins them: the links' states of a layer
        # joined first, so a layer takes one update, not one a link (each update pays Python's overhead again, and one
        # a link a layer added up to a visible part of a request: docs/SERVE.md, "Less overhead a request";
        # docs/PERFORMANCE.md, "A request's overhead in kvgraft serve"). The same bytes land in the same places either
        # way.
        for i, layer in enumerate(layers):
            states = [art.layers[i] for art in rest]
            if len(states) == 1:
                layer.update(states[0].keys, states[0].values)
            elif states:
                layer.update(
                    torch.cat([st.keys for st in states], dim=-2), torch.cat([st.values for st in states], dim=-2)
                )
    return slot.cache


def spans(engine: Engine, ids: list[int], chunk: int) -> list[tuple[int, int]]:
    """The chunks ``ids`` is computed in, cold or warm: engine.chunk_spans with the manifest's prefill.cut_before."""
    return chunk_spans(ids, chunk, engine.prefill_cuts)


def lookup(
    store: Store,
    engine: Engine,
    ids: list[int],
    chunk: int,
    split: list[tuple[int, int]] | None = None,
    scope: str | None = None,
    keys: list[str] | None = None,
) -> tuple[list[tuple[str, kvg.Artifact]], list[str]]:
    """The longest run of cached chunks ``ids`` starts with, root first, each re-hashed, leaving at least one token
    to compute (its logits are the first token's): every chunk but the last may be cached (each ends where a full
    chunk or a cut does, the same in every prompt that goes on past it). ``split``: :func:`spans` of ``ids``, when the
    caller has them; ``scope``: a tenant's (prompt_key); ``keys``, when given, gets each link's index key. A chunk
    whose file is gone (evicted: store.eviction) is a miss. Returns (links, refused identities)."""
    manifest_sha = engine.manifest.machine_compute_sha256
    want = engine.compatibility()  # computed once: only the start position changes from chunk to chunk
    links: list[tuple[str, kvg.Artifact]] = []
    parent: str | None = None
    for start, end in (split if split is not None else spans(engine, ids, chunk))[:-1]:
        segment = ids[start:end]
        key = prompt_key(manifest_sha, parent, token_ids_sha256(segment), scope)
        entry = store.lookup_key(key)
        # A chunk this process holds verified needs no look at the disk (a stat a chunk adds up over a long prompt's
        # lookup: docs/SERVE.md, "Less overhead a request"): its bytes are the ones its identity names, whatever
        # became of its file since.
        if entry is None or (VERIFIED.get(entry.artifact) is None and not store.has_object(entry.artifact)):
            break
        try:
            _, art = store.load(entry.artifact)  # re-hashed unless this process verified it already
            # The index row is only a label: the bytes must be this chunk, after this parent, at this position.
            if art.token_ids != segment or art.parent != parent or art.meta.get("prompt_scope") != scope:
                raise IntegrityError(f"prompt chunk {entry.artifact[:16]}... holds other tokens than its key")
            kvg.check_compatible(art.meta, {**want, "start_position": str(start)}, entry.artifact)
        except KvgraftError:
            if VERIFIED.get(entry.artifact) is None and not store.has_object(entry.artifact):
                break  # evicted between the look and the read (another server's eviction): a miss, not damage
            return links, [entry.artifact]
        links.append((entry.artifact, art))
        if keys is not None:
            keys.append(key)
        parent = entry.artifact
    return links, []


def prefill(
    engine: Engine,
    store: Store | None,
    ids: list[int],
    chunk: int | None,
    slot: Slot | None = None,
    scope: str | None = None,
) -> Prefilled:
    """Compute ``ids`` from position 0 by the cache's chunks, restoring the cached ones and depositing each new full
    chunk (``store`` None or ``chunk`` None: nothing cached, the prompt computed whole by the manifest's schedule).
    With ``slot`` (the last request's, which this call may cut back and extend: the caller gives it up), cached
    chunks its cache already holds are continued there instead of joined again. ``scope``: the tenant's
    (prompt_key): its chunks are found and deposited under its own keys only."""
    if store is None or chunk is None:
        cache, last = engine.prefill(ids)
        return Prefilled(cache, last)
    split = spans(engine, ids, chunk)  # once: the lookup walks them, the forwards below compute the rest
    keys: list[str] = []
    links, refused = lookup(store, engine, ids, chunk, split, scope, keys)
    done = sum(len(art.token_ids) for _, art in links)
    shas = [s for s, _ in links]
    cache = _continue_slot(engine, slot, links)
    del slot  # (a slot not continued is let go before the restore: the pool can lend its memory again)
    from_slot = cache is not None
    if cache is None:
        cache = engine.restore_chain([a for _, a in links]) if links else engine.new_cache()
    out = Prefilled(cache, None, shas, done, refused=refused, chain=list(shas), keys=keys, from_slot=from_slot)
    parent = links[-1][0] if links else None
    manifest_sha = engine.manifest.machine_compute_sha256
    deposit = not refused  # past a refused chunk the chain is not this store's to extend
    logits = None
    cuts = engine.prefill_cuts
    for span in split:
        start, end = span
        if start < done:
            continue
        segment = ids[start:end]
        logits = engine.forward(cache, segment, last_only=True)
        if not deposit or not closed_span(ids, span, chunk, cuts):
            continue
        key = prompt_key(manifest_sha, parent, token_ids_sha256(segment), scope)
        entry = store.lookup_key(key)
        if entry is not None and store.has_object(entry.artifact):
            parent = entry.artifact  # another request (or server) deposited it since the lookup
            out.chain.append(parent)
            out.keys.append(key)
            continue
        meta = engine.artifact_meta(tensor_sha256(logits[-1]), start, parent)
        if scope is not None:
            # A scope's chunks are objects of its own: two tenants' identical chunks share no file and no place in
            # the verified memory, so a tenant's warm request is never faster for another's having read the chunk
            meta["prompt_scope"] = scope
        payload = kvg.encode(segment, engine.capture(cache, start), meta)
        sha = kvg.payload_identity(payload)
        store.put(
            sha,
            payload,
            key=key,
            problem_id=PROMPT_CHUNK_ID,
            num_tokens=len(segment),
            model_sha256=engine.hashes.model_sha256,
            manifest_sha256=manifest_sha,
            verified=False,
        )
        out.deposited.append(sha)
        out.chain.append(sha)
        out.keys.append(key)
        parent = sha
    assert logits is not None  # (lookup leaves at least one token to compute)
    out.last_logits = logits[-1]
    return out


@dataclass
class Warmed:
    """What a server read into its verified cache at start: chunks and bytes re-hashed, chunks refused, seconds."""

    chunks: int = 0
    bytes: int = 0
    refused: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"chunks": self.chunks, "bytes": self.bytes, "refused": self.refused, "seconds": round(self.seconds, 3)}


def warm(store: Store, engine: Engine, budget: int) -> Warmed:
    """Read the newest prompt chains of this compute pin into the process's verified cache (store.load_chain: each
    chunk re-hashed, then kept in memory), whole chains, newest first, until ``budget`` bytes of tensors are read
    (the last chain may pass it): after a restart the prompts the server saw last are restored from memory, as before
    it stopped. A chain that fails its check is skipped (a request meeting it refuses the damaged chunk and names it
    in its ledger line)."""
    import time

    from ..store.local import artifact_bytes

    t0 = time.perf_counter()
    out = Warmed()
    read: set[str] = set()
    for sha in store.prompt_chunks(engine.manifest.machine_compute_sha256):
        if out.bytes >= budget:
            break
        if sha in read:
            continue
        try:
            chain = store.load_chain(sha)
        except KvgraftError:
            out.refused += 1
            continue
        for s, art in chain:
            if s not in read:
                read.add(s)
                out.bytes += artifact_bytes(art)
    out.chunks = len(read)
    out.seconds = time.perf_counter() - t0
    return out
