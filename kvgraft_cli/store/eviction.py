"""The prompt cache's bound: its chunks' use, kept in the store's index, and their eviction, least recently used first.

`kvgraft serve --cache-max` bounds the bytes of prompt-cache chunks (index rows under
:data:`~.local.PROMPT_CHUNK_ID`) a store holds. Only those are ever evicted: library entries, deposits, chain links
and checks are other rows, and an object any other row (or the library) names stays on disk.

**Use.** ``prompt_use`` (made with the store's other tables, store.local.SCHEMA) has a row per chunk entry a server used (restored or deposited): its parent chunk's entry
key and when it was last used. A server notes its requests' chunks in memory and writes them after the response
has left (:func:`touch`, from serve's upkeep), so the bound costs a first token nothing. A chunk with no use row
(deposited by a process killed before it noted it) counts as the oldest.

**Eviction** (:func:`evict`) runs in one write transaction (``BEGIN IMMEDIATE``: concurrent servers on one store
take turns): while the chunks' bytes are over the budget, the least recently used chunk goes with every chunk that
continues it (a child whose parent is gone is unreachable: a lookup walks a chain from its root), its index rows
deleted and its object file unlinked when no other row names it. A reader that found a chunk's row before it went
and opens the file after it went meets a missing file, which serve's lookup counts as a miss (the prompt is
computed from there, as cold). Killed mid-eviction, the transaction rolls back: rows may then name files already
unlinked, which are misses too, deposited again by the next request that computes them
(:meth:`~.local.Store.put` writes an object whose file is gone), and evicted again in turn.

The ledger is not touched: a served line names the chunks it restored or deposited by hash, as cache, never as a
record (`kvgraft verify` counts them apart: audit.verify), and `kvgraft replay --served` computes every prompt with
the cache off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .local import PROMPT_CHUNK_ID, Store, _store_errors


@dataclass
class Evicted:
    """What one :func:`evict` did: chunk entries dropped, object files deleted, their bytes, the chunks' bytes after."""

    chunks: int = 0
    files: int = 0
    bytes: int = 0
    remaining: int = 0
    keys: list[str] = field(default_factory=list)


def cache_bytes(store: Store) -> int:
    """The bytes of the prompt-cache chunks the store's index names (each entry's object file, as stored)."""
    row = store._db.execute(
        "SELECT coalesce(sum(a.file_bytes), 0) FROM entries e JOIN artifacts a ON a.sha256 = e.artifact "
        "WHERE e.problem_id = ?",
        (PROMPT_CHUNK_ID,),
    ).fetchone()
    return int(row[0])


def touch(store: Store, used: dict[str, tuple[str | None, float]]) -> None:
    """Note chunk entries as used: key -> (parent chunk's key, time). A key whose entry is gone (evicted meanwhile)
    gets no row; a time never moves back (two servers noting the same chunk)."""
    if not used:
        return
    with _store_errors(store.root, "write to"), store._db:
        store._db.execute("BEGIN IMMEDIATE")
        store._db.executemany(
            "INSERT INTO prompt_use (key, parent, used) SELECT ?, ?, ? WHERE EXISTS "
            "(SELECT 1 FROM entries WHERE key = ? AND problem_id = ?) "
            "ON CONFLICT(key) DO UPDATE SET used = max(used, excluded.used), parent = excluded.parent",
            [(k, parent, t, k, PROMPT_CHUNK_ID) for k, (parent, t) in used.items()],
        )


def evict(store: Store, budget: int) -> Evicted:
    """Evict prompt-cache chunks, least recently used first with all that continue them, until their bytes are at
    most ``budget`` (see the module docstring). Returns what went."""
    out = Evicted()
    db = store._db
    with _store_errors(store.root, "evict prompt chunks from"), db:
        db.execute("BEGIN IMMEDIATE")
        total = cache_bytes(store)
        out.remaining = total
        if total <= budget:
            return out
        # Oldest first; among equal times (one request's chain is noted at once) the later deposit first: a child
        # before its parent.
        order = db.execute(
            "SELECT e.key, e.artifact, a.file_bytes FROM entries e JOIN artifacts a ON a.sha256 = e.artifact "
            "LEFT JOIN prompt_use u ON u.key = e.key WHERE e.problem_id = ? "
            "ORDER BY coalesce(u.used, 0), e.rowid DESC",
            (PROMPT_CHUNK_ID,),
        )
        candidates = order.fetchall()
        gone: set[str] = set()
        for key, artifact, size in candidates:
            if total <= budget:
                break
            if key in gone:
                continue
            for k, sha, n in [(key, artifact, size), *_descendants(store, key, gone)]:
                gone.add(k)
                total -= n
                out.chunks += 1
                out.keys.append(k)
                out.files += _drop(store, k, sha)
                out.bytes += n
        out.remaining = total
    return out


def _descendants(store: Store, key: str, gone: set[str]) -> list[tuple[str, str, int]]:
    """The chunk entries that continue ``key`` (children, theirs, ...), not already gone: (key, artifact, bytes)."""
    found: list[tuple[str, str, int]] = []
    todo = [key]
    while todo:
        parent = todo.pop()
        for k, sha, n in store._db.execute(
            "SELECT u.key, e.artifact, a.file_bytes FROM prompt_use u JOIN entries e ON e.key = u.key "
            "JOIN artifacts a ON a.sha256 = e.artifact WHERE u.parent = ? AND e.problem_id = ?",
            (parent, PROMPT_CHUNK_ID),
        ):
            if k not in gone:
                gone.add(k)
                found.append((k, sha, n))
                todo.append(k)
    return found


def _drop(store: Store, key: str, artifact: str) -> int:
    """Inside evict's transaction: one chunk entry's rows, and its object (row and file) when nothing else names it.
    Returns 1 when the file was deleted."""
    db = store._db
    db.execute("DELETE FROM entries WHERE key = ?", (key,))
    db.execute("DELETE FROM prompt_use WHERE key = ?", (key,))
    named = db.execute(
        "SELECT 1 FROM entries WHERE artifact = ? UNION ALL SELECT 1 FROM library WHERE artifact = ? LIMIT 1",
        (artifact, artifact),
    ).fetchone()
    if named:
        return 0
    db.execute("DELETE FROM artifacts WHERE sha256 = ?", (artifact,))
    # Unlinked while this transaction holds the write lock: no writer can index the object meanwhile (one that
    # found the file just before writes it again: Store.put).
    path = store.object_path(artifact)
    try:
        path.unlink()
        return 1
    except FileNotFoundError:
        return 0
