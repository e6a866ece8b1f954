"""The content-addressed artifact store: ``objects/ab/<sha256>.kvg`` plus an SQLite index.

The index maps a prefix key (compute pin + token ids) and a problem id to an artifact, with token counts and
sizes. SQLite keeps lookups logarithmic at millions of entries and makes each index update one atomic transaction;
an object is written (atomically) before the index row that names it, so a crash leaves at most an unindexed,
complete object, never an index row pointing at a half-written file.

Nothing a writer puts in the store is ever deleted by another writer's failure. A run whose ledger append fails
leaves its (complete, verified) object and index rows in place, marked as not yet recorded; a concurrent run may
already have named that artifact in its own ledger line, so deleting it would leave a ledger line pointing at
nothing. The next run that records the artifact writes it as ``deposited``. Only ``kvgraft store gc`` deletes,
and only what no index row and no given ledger line names (objects written by a crash before their index row, and
temporary files), after a grace period that protects a writer still at work.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

from ..artifacts import format as kvg
from ..errors import ArtifactError, InputError, StoreError
from ..util.hashing import sha256_json
from . import search, writers

SCHEMA = """
CREATE TABLE IF NOT EXISTS artifacts (
    sha256 TEXT PRIMARY KEY,
    file_bytes INTEGER NOT NULL,
    payload_bytes INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    model_sha256 TEXT NOT NULL,
    manifest_sha256 TEXT NOT NULL,
    created TEXT NOT NULL,
    recorded INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    problem_id TEXT NOT NULL,
    artifact TEXT NOT NULL REFERENCES artifacts(sha256),
    manifest_sha256 TEXT NOT NULL,
    verified INTEGER NOT NULL,
    created TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_by_problem ON entries(problem_id, manifest_sha256);
CREATE TABLE IF NOT EXISTS library (
    artifact TEXT PRIMARY KEY REFERENCES artifacts(sha256),
    problem_id TEXT NOT NULL,
    problem_key TEXT NOT NULL,
    manifest_sha256 TEXT NOT NULL,
    problem TEXT NOT NULL,
    solution TEXT NOT NULL,
    answer TEXT,
    num_tokens INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS library_by_key ON library(problem_key);
CREATE VIRTUAL TABLE IF NOT EXISTS library_fts USING fts5(problem, solution, content='library',
    content_rowid='rowid', tokenize='unicode61');
CREATE TABLE IF NOT EXISTS prompt_use (
    key TEXT PRIMARY KEY,
    parent TEXT,
    used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS prompt_use_by_parent ON prompt_use(parent);
"""
GRAMS_SCHEMA = """
CREATE TABLE IF NOT EXISTS library_grams (
    gram INTEGER NOT NULL,
    size INTEGER NOT NULL,
    entry INTEGER NOT NULL,
    PRIMARY KEY (gram, size, entry)
) WITHOUT ROWID;
"""
# library_grams: each library problem's four-word sequences (numbers and single letters masked, hashed:
# store/search.py), the postings that find a problem with bounded work among a million made of the same words; size
# is how many distinct sequences the problem has, so a sequence's problems are read shortest first.
# The library is the verified part of the store that `kvgraft solve` reads: one row per verified root artifact,
# with its problem and solution text. library_fts is an external-content FTS5 index over those rows, written in the
# same transaction as the row itself (no triggers: a reader never sees one without the other).
# artifacts.recorded: 1 once a ledger line has recorded the artifact (0: stored by a run whose append failed).
# prompt_use: each prompt-cache chunk entry's parent entry key and last use (store/eviction.py, kvgraft serve
# --cache-max). Made here, at open, not in an eviction's transaction: sqlite3's executescript commits the transaction
# it runs in.
HEX64 = re.compile(r"^[0-9a-f]{64}$")
MIN_PREFIX = 6  # the shortest artifact hash prefix resolve() accepts
# The problem id a chain link is indexed under (library/chain.py): the id of the hit whose solution it holds, "@",
# and the first 12 hex digits of its parent artifact. Nothing else in a store is named so by kvgraft.
LINK_PARENT = re.compile(r"@([0-9a-f]{12})$")
# The problem id every prompt-cache chunk of `kvgraft serve` is indexed under (serve/promptcache.py): a cached piece of
# somebody's prompt, never a deposit a user would graft by default.
PROMPT_CHUNK_ID = "serve-prompt-chunk"


@dataclass(frozen=True)
class Entry:
    """An index row: which artifact holds a problem's prefix under a compute pin."""

    key: str
    problem_id: str
    artifact: str
    manifest_sha256: str
    verified: bool
    num_tokens: int
    file_bytes: int


def prefix_key(manifest_sha256: str, token_ids_sha256: str) -> str:
    """The index key of a prefix: its token ids under one compute pin."""
    return sha256_json({"manifest_sha256": manifest_sha256, "token_ids_sha256": token_ids_sha256})


def link_key(manifest_sha256: str, parent_sha256: str, token_ids_sha256: str) -> str:
    """The index key of a chain link: its segment's token ids after one parent artifact, under one compute pin."""
    return sha256_json(
        {"manifest_sha256": manifest_sha256, "parent_sha256": parent_sha256, "token_ids_sha256": token_ids_sha256}
    )


def prompt_key(manifest_sha256: str, parent_sha256: str | None, token_ids_sha256: str, scope: str | None = None) -> str:
    """The index key of a prompt-cache chunk (`kvgraft serve`, serve/promptcache.py): its token ids after one
    parent chunk (None: the prompt's first chunk, at position 0), under one compute pin. A namespace of its own, so a
    chunk is never mistaken for a deposit or a library chain link with the same tokens. ``scope`` (64 hex: a
    tenant's, serve.tenants) makes every key of a chain that tenant's own: another tenant's lookup never meets it
    (and its chunks name the scope, so they are objects of its own). None: the keys of a server without tenants, as
    they always were."""
    key = {
        "manifest_sha256": manifest_sha256,
        "prompt_parent_sha256": parent_sha256,
        "token_ids_sha256": token_ids_sha256,
    }
    if scope is not None:
        key["prompt_scope"] = scope
    if all(v is None or HEX64.fullmatch(v) for v in key.values()):
        # Hex strings and null: the standard library's sorted compact JSON is the RFC 8785 form (the ledger
        # verifier's fast path, audit.verify.canonical_line, is the same construction). A server derives a key per
        # chunk of every prompt (125 for 2,000 tokens), and the general serializer was a measurable part of a
        # request's overhead (docs/SERVE.md, "Less overhead a request"). tests/test_jcs.py checks the keys against
        # the general serializer.
        return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return sha256_json(key)


def problem_key(manifest_sha256: str, normalized_problem: str) -> str:
    """The library key of a problem: its normalized text under one compute pin (an exact hit matches it)."""
    return sha256_json({"manifest_sha256": manifest_sha256, "problem": normalized_problem})


@dataclass(frozen=True)
class LibraryHit:
    """A verified library entry found for a problem: exact (same normalized problem) or related (bm25 score)."""

    artifact: str
    problem_id: str
    problem: str
    solution: str
    answer: str | None
    num_tokens: int
    score: float | None  # -relevance (lower is better, as FTS5's bm25; store/search.py); None for an exact hit


class Store:
    """A store directory. Opening creates it unless ``create`` is False (readers never create one). ``codec``: how
    new objects are written (artifacts.container; ``auto`` is raw); the identity never depends on it."""

    def __init__(self, root: Path, create: bool = True, codec: str = "auto"):
        self.root = Path(root)
        self.codec = codec
        if self.root.exists() and not self.root.is_dir():
            raise InputError(f"store path {self.root} exists and is not a directory")
        if not create and not (self.root / "index.sqlite").is_file():
            raise InputError(f"no store at {self.root}", "run `kvgraft deposit FILE.jsonl` first, or pass --store")
        with _store_errors(self.root, "open"):
            (self.root / "objects").mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.root / "index.sqlite", timeout=60, isolation_level=None)
            self._db.executescript(SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(artifacts)")}
            self._tracks_recording = "recorded" in columns
        if not self._tracks_recording and create:
            # A store from before `recorded`: its artifacts were all recorded (failed runs deleted theirs). A store
            # this process cannot write stays as it is, and reads as all recorded.
            try:
                self._db.execute("ALTER TABLE artifacts ADD COLUMN recorded INTEGER NOT NULL DEFAULT 1")
                self._tracks_recording = True
            except sqlite3.OperationalError:
                pass
        self._has_grams = self._add_grams_table()

    def _add_grams_table(self) -> bool:
        """Whether the store has library_grams; a store from before it gets it, filled from its library rows in one
        transaction (a one-off migration; the same fill is part of bench_retrieval.py's build of 1,000,000 entries,
        timed in docs/RETRIEVAL.md). A store this process cannot write keeps searching without it, by words only
        (docs/RETRIEVAL.md)."""
        have = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'library_grams'"
        if self._db.execute(have).fetchone():
            return True
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                if not self._db.execute(have).fetchone():  # another process may have added it meanwhile
                    self._db.execute(GRAMS_SCHEMA.strip().rstrip(";"))
                    self._fill_grams()
            return True
        except sqlite3.OperationalError:
            return False

    def _fill_grams(self) -> None:
        """Inside the caller's transaction: library_grams filled from every library row, loaded unsorted into a
        temporary table and copied in key order (appended, not scattered: minutes, not hours, for a million rows)."""
        self._db.execute("CREATE TEMP TABLE IF NOT EXISTS grams_load (gram INTEGER, size INTEGER, entry INTEGER)")
        self._db.executemany(
            "INSERT INTO grams_load VALUES (?,?,?)",
            (
                (g, len(gs), rowid)
                for rowid, problem in self._db.execute("SELECT rowid, problem FROM library")
                for gs in (search.grams(problem),)
                for g in gs
            ),
        )
        self._db.execute("INSERT OR IGNORE INTO library_grams SELECT * FROM grams_load ORDER BY gram, size, entry")
        self._db.execute("DROP TABLE grams_load")

    def _add_grams(self, rowid: int, problem: str) -> None:
        gs = search.grams(problem)
        self._db.executemany("INSERT OR IGNORE INTO library_grams VALUES (?,?,?)", [(g, len(gs), rowid) for g in gs])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256[:2] / f"{sha256}.kvg"

    def has_object(self, sha256: str) -> bool:
        return self.object_path(sha256).is_file()

    def prompt_chunks(self, manifest_sha256: str) -> Iterator[str]:
        """The prompt-cache chunks deposited under a compute pin, newest first, read lazily (what kvgraft serve
        warms its verified cache with at start)."""
        rows = self._db.execute(
            "SELECT artifact FROM entries WHERE problem_id = ? AND manifest_sha256 = ? ORDER BY rowid DESC",
            (PROMPT_CHUNK_ID, manifest_sha256),
        )
        return (sha for (sha,) in rows)

    def lookup_key(self, key: str) -> Entry | None:
        row = self._db.execute(_SELECT + " WHERE e.key = ?", (key,)).fetchone()
        return _entry(row) if row else None

    def put(
        self,
        sha256: str,
        payload: bytes,
        *,
        key: str,
        problem_id: str,
        num_tokens: int,
        model_sha256: str,
        manifest_sha256: str,
        verified: bool,
        level: int = 3,
        library: dict | None = None,
    ) -> tuple[Entry, bool]:
        """Store an artifact payload under its identity and index it. Returns (entry, whether a new object was written).

        ``library`` (problem_key, problem, solution, answer) adds a verified root to the library and its full-text
        index, in the same transaction as the index rows."""
        rows = dict(
            payload_bytes=len(payload),
            key=key,
            problem_id=problem_id,
            num_tokens=num_tokens,
            model_sha256=model_sha256,
            manifest_sha256=manifest_sha256,
            verified=verified,
            library=library,
        )
        created = self.put_object(sha256, payload, level)
        try:
            return self.index(sha256, **rows), created  # type: ignore[arg-type]
        except ObjectGone:  # evicted (store.eviction) between the look for its file and the index: written again
            created = self.put_object(sha256, payload, level)
            return self.index(sha256, **rows), created  # type: ignore[arg-type]

    def put_object(self, sha256: str, payload: bytes, level: int = 3) -> bool:
        """Write an artifact's object file (atomically) unless the store has it; returns whether it was written.
        The object is not indexed: :meth:`index` does that (a sharded run's workers write objects, its driver
        indexes them in input order)."""
        path = self.object_path(sha256)
        if path.is_file():
            return False
        with _store_errors(self.root, "write to"):
            kvg.write_file(path, payload, level, self.codec)
        return True

    def index(
        self,
        sha256: str,
        *,
        payload_bytes: int,
        key: str,
        problem_id: str,
        num_tokens: int,
        model_sha256: str,
        manifest_sha256: str,
        verified: bool,
        library: dict | None = None,
    ) -> Entry:
        """Index an object already in the store (see :meth:`put`); both rows land in one transaction."""
        path = self.object_path(sha256)
        with _store_errors(self.root, "write to"):
            now = datetime.now(UTC).isoformat(timespec="seconds")
            with self._db:  # one transaction: both rows or neither
                self._db.execute("BEGIN IMMEDIATE")
                # Looked at under the write lock: an eviction (store.eviction) unlinks only while it holds it, so a
                # file here now is still here when the rows naming it land.
                try:
                    file_bytes = path.stat().st_size
                except FileNotFoundError:
                    raise ObjectGone(sha256) from None
                self._db.execute(
                    "INSERT OR IGNORE INTO artifacts (sha256, file_bytes, payload_bytes, num_tokens, model_sha256, "
                    "manifest_sha256, created, recorded) VALUES (?,?,?,?,?,?,?,0)",
                    (sha256, file_bytes, payload_bytes, num_tokens, model_sha256, manifest_sha256, now),
                )
                self._db.execute(
                    "INSERT INTO entries VALUES (?,?,?,?,?,?) ON CONFLICT(key) DO UPDATE SET problem_id="
                    "excluded.problem_id, artifact=excluded.artifact, verified=max(verified, excluded.verified)",
                    (key, problem_id, sha256, manifest_sha256, int(verified), now),
                )
                if library is not None and verified:
                    self._add_library(sha256, problem_id, manifest_sha256, num_tokens, library)
                # Read in the transaction: once it ends, another server's eviction may take the row at once
                entry = self.lookup_key(key)
        assert entry is not None  # (its row was just written)
        return entry

    def publish_due(self, every_s: float) -> str | None:
        """Nothing to publish: a folder store's index is every reader's the moment it is written (a remote store
        publishes its queued rows, :meth:`.remote.RemoteStore.publish_due`)."""
        return None

    def refresh_due(self, every_s: float) -> int:
        """Nothing to read: a folder store's index is current (:meth:`.remote.RemoteStore.refresh_due`)."""
        return 0

    def is_recorded(self, sha256: str) -> bool:
        """Whether a ledger line has recorded this artifact (False: stored by a run whose ledger append failed)."""
        if not self._tracks_recording:
            return True
        row = self._db.execute("SELECT recorded FROM artifacts WHERE sha256 = ?", (sha256,)).fetchone()
        return bool(row and row[0])

    def mark_recorded(self, sha256s: list[str]) -> None:
        """Note that a ledger line now records these artifacts."""
        sha256s = [s for s in sha256s if not self.is_recorded(s)]  # a reader of a read-only store writes nothing
        if not sha256s:
            return
        with _store_errors(self.root, "write to"), self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("UPDATE artifacts SET recorded = 1 WHERE sha256 = ?", [(s,) for s in sha256s])

    def add_to_library(
        self, sha256: str, problem_id: str, manifest_sha256: str, num_tokens: int, library: dict
    ) -> None:
        """Add an already stored, verified root artifact to the library (a store made before the library existed)."""
        with _store_errors(self.root, "write to"), self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._add_library(sha256, problem_id, manifest_sha256, num_tokens, library)

    def _add_library(
        self, sha256: str, problem_id: str, manifest_sha256: str, num_tokens: int, library: dict, grams: bool = True
    ) -> None:
        # Inside the caller's transaction: the library row, its full-text row and its sequences land together or not
        # at all. ``grams`` False: the caller fills library_grams itself (_fill_grams).
        cur = self._db.execute(
            "INSERT OR IGNORE INTO library VALUES (?,?,?,?,?,?,?,?)",
            (
                sha256,
                problem_id,
                library["problem_key"],
                manifest_sha256,
                library["problem"],
                library["solution"],
                library.get("answer"),
                num_tokens,
            ),
        )
        if cur.rowcount:
            self._db.execute(
                "INSERT INTO library_fts(rowid, problem, solution) VALUES (?,?,?)",
                (cur.lastrowid, library["problem"], library["solution"]),
            )
            if self._has_grams and grams:
                assert cur.lastrowid is not None  # (a row was inserted)
                self._add_grams(cur.lastrowid, library["problem"])

    def _index_library_rows(self, manifest_sha256: str, rows: list[dict], grams: bool = True) -> None:
        """Measurement only (tests, benchmarks/bench_retrieval.py): library rows (``problem``, its ``problem_key``,
        ``solution``, optional ``answer`` and ``problem_id``) indexed as recorded, verified entries in one
        transaction, with artifact rows whose identities are made up and whose objects do not exist. Retrieval
        reads only these index rows, so it can be measured at any size without a model; grafting one of them would
        fail (no object). Without ``grams`` the rows' sequences are left out of library_grams: a bulk load then
        fills it once, with :meth:`_fill_grams`."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            start = self._db.execute("SELECT coalesce(max(rowid), 0) FROM artifacts").fetchone()[0]
            for i, row in enumerate(rows, start=start + 1):
                sha = sha256_json({"made_up_row": i, "problem": row["problem"]})
                self._db.execute("INSERT INTO artifacts VALUES (?,0,0,1,?,?,'',1)", (sha, "0" * 64, manifest_sha256))
                self._add_library(
                    sha,
                    row.get("problem_id", f"row-{i}"),
                    manifest_sha256,
                    1,
                    {
                        "problem_key": row["problem_key"],
                        "problem": row["problem"],
                        "solution": row["solution"],
                        "answer": row.get("answer"),
                    },
                    grams,
                )

    def garbage(self, keep: set[str], grace_s: float = 3600.0) -> Garbage:
        """What ``kvgraft store gc`` may delete: temporary files left by an interrupted write, and objects that no
        index row names and whose hash is not in ``keep`` (the digests the ledgers name), each untouched for at
        least ``grace_s`` seconds (a writer at work writes its object before its index row) and older than the
        oldest running writer registered here (store.writers), whatever the grace."""
        found = Garbage()
        cutoff = time.time() - grace_s
        running = writers.oldest_running(self.root)
        if running is not None:  # a second of slack: file times and the clock may round differently
            cutoff = min(cutoff, running - 1)
        indexed = {row[0] for row in self._db.execute("SELECT sha256 FROM artifacts")}
        for sub in sorted((self.root / "objects").iterdir()):
            if not sub.is_dir():
                continue
            for f in sorted(sub.iterdir()):
                try:
                    st = f.lstat()
                except FileNotFoundError:  # removed meanwhile
                    continue
                if st.st_mtime > cutoff or not stat.S_ISREG(st.st_mode):  # never a folder, link or device
                    continue
                if f.name.endswith(".tmp"):
                    found.temporary.append((f, st.st_size))
                elif f.suffix == ".kvg" and HEX64.match(f.stem):
                    if f.stem in indexed:
                        continue
                    if f.stem in keep:
                        found.kept.append(f.stem)
                    else:
                        found.unindexed.append((f, st.st_size))
        return found

    def collect(self, garbage: Garbage) -> int:
        """Delete what :meth:`garbage` found, re-checking each object under the index's write lock (a run may have
        indexed it since); returns the bytes freed."""
        freed = 0
        with _store_errors(self.root, "clean"):
            for f, size in garbage.temporary:
                f.unlink(missing_ok=True)
                freed += size
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")  # no put can index an object while we look
                for f, size in garbage.unindexed:
                    if self._db.execute("SELECT 1 FROM artifacts WHERE sha256 = ?", (f.stem,)).fetchone():
                        continue
                    f.unlink(missing_ok=True)
                    freed += size
        return freed

    def resolve(self, ref: str | None, manifest_sha256: str | None = None) -> str:
        """The artifact identity a reference names: full hash, unique hash prefix (>= 6 hex), or problem id.
        ``None`` names the most recently deposited artifact (under ``manifest_sha256`` when given)."""
        db = self._db
        if ref is None:
            latest = self.latest_deposit(manifest_sha256)
            if latest is None:
                raise InputError(
                    f"store {self.root} holds no deposited artifacts for this manifest"
                    + (
                        " (only chain links, which continue other artifacts)"
                        if self._has_entries(manifest_sha256)
                        else ""
                    ),
                    "run `kvgraft deposit FILE.jsonl` first, or name an artifact (hash, prefix or problem id)",
                )
            return latest
        if HEX64.match(ref):
            return ref
        if HEX64.match(ref.lower()) and not self._is_problem_id(ref):
            return ref.lower()  # hashes print in lower case; one copied in upper case names the same artifact
        rows = db.execute(
            "SELECT artifact FROM entries WHERE problem_id = ? ORDER BY (manifest_sha256 = ?) DESC, rowid DESC",
            (ref, manifest_sha256 or ""),
        ).fetchall()
        if rows:
            return rows[0][0]
        if re.fullmatch(rf"[0-9a-f]{{{MIN_PREFIX},63}}", ref.lower()):
            ref = ref.lower()
            hits = [r[0] for r in db.execute("SELECT sha256 FROM artifacts WHERE sha256 LIKE ? LIMIT 3", (ref + "%",))]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                raise InputError(
                    f"artifact prefix {ref} is ambiguous ({', '.join(h[:12] for h in hits)}, ...)",
                    "give more hex digits",
                )
        if re.fullmatch(rf"[0-9a-f]{{1,{MIN_PREFIX - 1}}}", ref.lower()):
            raise InputError(
                f"artifact hash prefix {ref!r} is too short (need >= {MIN_PREFIX} hex characters)",
                "give more of the hash; `kvgraft store list` shows them",
            )
        raise InputError(
            f"no artifact {ref!r} in store {self.root} (neither a problem id nor an artifact hash)",
            "list what is there with `kvgraft store list`",
        )

    def latest_deposit(self, manifest_sha256: str | None = None) -> str | None:
        """The most recently deposited artifact (under ``manifest_sha256`` when given), or None: the newest index
        entry that is not a chain link. What `graft` and `probe` take when no REF is given (runs.graft.open_artifact). A link made by
        `solve` (library/chain.py) continues another artifact: grafted alone it is a fragment, with its parents a
        chain nobody asked for, so it is never the default (name it to graft or probe it)."""
        q = "SELECT problem_id, artifact FROM entries" + (" WHERE manifest_sha256 = ?" if manifest_sha256 else "")
        # Newest first, read lazily: the links a solve just made are the newest rows, the deposit a few rows back.
        rows = self._db.execute(q + " ORDER BY rowid DESC", (manifest_sha256,) if manifest_sha256 else ())
        for problem_id, artifact in rows:
            if problem_id != PROMPT_CHUNK_ID and not self._is_link_entry(problem_id, artifact):
                return artifact
        return None

    def _is_link_entry(self, problem_id: str, artifact: str) -> bool:
        """Whether an entry is a chain link's: named ``<hit id>@<parent prefix>`` (LINK_PARENT) with a parent of that
        prefix in the store. The index records no parent, and this needs no object read (a remote store's objects
        may not be here): a deposited problem whose own id ends so is mistaken for a link only if the store also
        holds an artifact whose hash starts with those 12 hex digits."""
        m = LINK_PARENT.search(problem_id)
        if m is None:
            return False
        lo = m.group(1)
        row = self._db.execute(
            "SELECT 1 FROM artifacts WHERE sha256 >= ? AND sha256 < ? AND sha256 != ? LIMIT 1", (lo, lo + "g", artifact)
        ).fetchone()  # a range on the primary key: hex digits sort before "g"
        return row is not None

    def _has_entries(self, manifest_sha256: str | None) -> bool:
        q = "SELECT 1 FROM entries" + (" WHERE manifest_sha256 = ?" if manifest_sha256 else "")
        return self._db.execute(q + " LIMIT 1", (manifest_sha256,) if manifest_sha256 else ()).fetchone() is not None

    def _is_problem_id(self, ref: str) -> bool:
        return self._db.execute("SELECT 1 FROM entries WHERE problem_id = ? LIMIT 1", (ref,)).fetchone() is not None

    def load(self, sha256: str, remember: bool = True, device: str = "cpu", room: int = 0) -> tuple[str, kvg.Artifact]:
        """(identity, artifact) of an object, read and re-hashed against its identity (kvg.open_file). With
        ``remember`` the verified artifact stays in this process's memory (:data:`VERIFIED`, LRU within
        ``KVGRAFT_VERIFIED_CACHE`` bytes, default 1 GiB; 0 turns it off), so an artifact grafted again (`solve` over
        a library) is neither read nor hashed again; a process that restores it once (`graft`) does not remember
        it, so its memory is the cache's alone. Its tensors are shared: nobody writes to them (engine.restore
        shares them with the cache, whose updates write into buffers of the cache's own). On a ``device`` other than
        the CPU a raw object goes straight to device memory through pinned staging, verified on the way
        (artifacts.device_restore), and is not remembered (the cache budgets host memory). ``room`` (not
        remembered only): full layers are read with room for that many more tokens, which the first cache restored
        from them grows into (kvg.open_file)."""
        hit = VERIFIED.get(sha256)
        if hit is not None:
            return hit
        path = self.object_path(sha256)
        if not path.is_file():
            raise ArtifactError(f"artifact {sha256[:16]}... is not in store {self.root} (no {path})")
        if device != "cpu":
            from ..artifacts.device_restore import open_file_on_device

            return open_file_on_device(path, device, expected_sha256=sha256)
        loaded = kvg.open_file(path, sha256, 0 if remember else room)  # a remembered artifact is shared: no room
        if remember:
            VERIFIED.put(sha256, loaded)
        return loaded

    def load_chain(
        self, sha256: str, max_links: int = 256, remember: bool = True, device: str = "cpu", room: int = 0
    ) -> list[tuple[str, kvg.Artifact]]:
        """An artifact and the parents it continues, root first, each re-hashed (``remember``, ``room``: as
        :meth:`load`; room for the artifact asked for, whose cache it becomes when it has no parents); refuses a
        broken chain (a missing parent, a link that does not start where its parent chain ends)."""
        links: list[tuple[str, kvg.Artifact]] = []
        sha: str | None = sha256
        while sha is not None:
            if len(links) >= max_links:
                raise ArtifactError(f"artifact {sha256[:16]}...: chain longer than {max_links} links")
            _, art = self.load(sha, remember, device, 0 if links else room)
            links.append((sha, art))
            sha = art.parent
        links.reverse()
        check_chain(links, str(self.root))
        return links

    def library_exact(self, key: str) -> LibraryHit | None:
        """The verified library entry for a problem key (the newest, if several solutions were deposited)."""
        row = self._db.execute(
            _LIB
            + self._recorded_join
            + " WHERE l.problem_key = ?"
            + self._recorded_only
            + " ORDER BY l.rowid DESC LIMIT 1",
            (key,),
        ).fetchone()
        # (mypy reads a starred row of unknown length as filling every field, then one argument too many)
        return LibraryHit(*row, None) if row else None  # type: ignore[call-arg]

    def library_search(
        self, text: str, manifest_sha256: str, k: int, min_score: float | None = None, work: search.Work | None = None
    ) -> list[LibraryHit]:
        """The ``k`` verified entries under this compute pin whose problems are most related to ``text``, by bm25
        with bounded work whatever the library's size (store/search.py; ``work`` counts it). ``min_score`` keeps
        hits whose relevance (-bm25, higher is better) is at least that."""
        if k <= 0:
            return []
        fetch = (
            "SELECT l.rowid, l.problem, l.artifact, l.problem_id, l.problem, l.solution, l.answer, l.num_tokens "
            "FROM library l"
            + self._recorded_join
            + " WHERE l.rowid IN ({ids}) AND l.manifest_sha256 = ?"
            + self._recorded_only
        )
        ranked = search.search(self._db, text, fetch, (manifest_sha256,), work, self._has_grams)
        hits = [
            LibraryHit(*row[2:], score)  # type: ignore[call-arg]  # (as in library_exact)
            for score, row in ranked
            if min_score is None or -score >= min_score
        ]
        return hits[:k]

    @property
    def _recorded_join(self) -> str:
        # The library serves only artifacts a ledger line has recorded: one whose deposit's append failed stays in
        # the store (see the module doc) but is not a verified solution anyone can trace until a run records it.
        return " JOIN artifacts ra ON ra.sha256 = l.artifact" if self._tracks_recording else ""

    @property
    def _recorded_only(self) -> str:
        return " AND ra.recorded = 1" if self._tracks_recording else ""

    def library_size(self, manifest_sha256: str | None = None) -> int:
        q = "SELECT count(*) FROM library" + (" WHERE manifest_sha256 = ?" if manifest_sha256 else "")
        return self._db.execute(q, (manifest_sha256,) if manifest_sha256 else ()).fetchone()[0]

    def entries(self, limit: int | None = None) -> list[Entry]:
        q = _SELECT + " ORDER BY e.rowid" + (f" LIMIT {int(limit)}" if limit else "")
        return [_entry(r) for r in self._db.execute(q)]

    def stats(self) -> dict[str, int]:
        n_obj, n_bytes, n_tok = self._db.execute(
            "SELECT count(*), coalesce(sum(file_bytes),0), coalesce(sum(num_tokens),0) FROM artifacts"
        ).fetchone()
        n_ent, n_ver = self._db.execute("SELECT count(*), coalesce(sum(verified),0) FROM entries").fetchone()
        n_lib, lib_tok = self._db.execute("SELECT count(*), coalesce(sum(num_tokens),0) FROM library").fetchone()
        unrecorded = (
            self._db.execute("SELECT count(*) FROM artifacts WHERE recorded = 0").fetchone()[0]
            if self._tracks_recording
            else 0
        )
        return {
            "objects": n_obj,
            "entries": n_ent,
            "verified_entries": n_ver,
            "file_bytes": n_bytes,
            "tokens": n_tok,
            "library_entries": n_lib,
            "library_tokens": lib_tok,
            "unrecorded": unrecorded,
        }


_LIB = "SELECT l.artifact, l.problem_id, l.problem, l.solution, l.answer, l.num_tokens FROM library l"


def check_chain(links: list[tuple[str, kvg.Artifact]], source: str) -> None:
    """Refuse links that do not follow each other: each names the previous one and starts where it ends."""
    pos = 0
    for i, (sha, art) in enumerate(links):
        want_parent = links[i - 1][0] if i else None
        if art.parent != want_parent or art.start != pos:
            raise ArtifactError(
                f"{source}: artifact {sha[:16]}... does not continue its chain (parent "
                f"{(art.parent or 'none')[:16]}, start {art.start}; expected parent "
                f"{(want_parent or 'none')[:16]}, start {pos})"
            )
        pos += art.num_tokens


_SELECT = (
    "SELECT e.key, e.problem_id, e.artifact, e.manifest_sha256, e.verified, a.num_tokens, a.file_bytes "
    "FROM entries e JOIN artifacts a ON a.sha256 = e.artifact"
)


class VerifiedCache:
    """Identity -> (identity, artifact) already re-hashed in this process, least recently used first out, within a
    byte budget. Content-addressed, so an entry can never go stale: the bytes are the ones the identity names."""

    def __init__(self):
        from collections import OrderedDict

        self._items: OrderedDict[str, tuple] = OrderedDict()
        self.bytes = 0

    @staticmethod
    def budget() -> int:
        from ..artifacts.payload import size_setting

        return size_setting("KVGRAFT_VERIFIED_CACHE", 1 << 30)

    def get(self, sha256: str):
        item = self._items.get(sha256)
        if item is not None:
            self._items.move_to_end(sha256)
        return item

    def put(self, sha256: str, item: tuple) -> None:
        budget, size = self.budget(), artifact_bytes(item[1])
        if size > budget or sha256 in self._items:
            return
        self._items[sha256] = item
        self.bytes += size
        while self.bytes > budget:
            _, (_, old) = self._items.popitem(last=False)
            self.bytes -= artifact_bytes(old)

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


VERIFIED = VerifiedCache()


def artifact_bytes(art: kvg.Artifact) -> int:
    """The bytes of an artifact's tensors (what the verified cache counts)."""
    return sum(t.numel() * t.element_size() for st in art.layers for t in (st.keys, st.values) if t is not None)


@dataclass
class Garbage:
    """What the store holds that nothing names: temporary files and unindexed objects (path, bytes), and the
    unindexed objects kept because a ledger names them."""

    temporary: list[tuple[Path, int]] = field(default_factory=list)
    unindexed: list[tuple[Path, int]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.temporary) + sum(n for _, n in self.unindexed)


class ObjectGone(StoreError):
    """An object file to be indexed is not there (evicted since it was looked for: Store.put writes it again)."""

    def __init__(self, sha256: str):
        super().__init__(f"artifact {sha256[:16]}... is not in the store's objects (removed while it was indexed)")


class _store_errors:
    """Turn the operating system's and SQLite's refusals (read-only, disk full, permissions) into one StoreError."""

    def __init__(self, root: Path, doing: str):
        self.root, self.doing = root, doing

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if isinstance(exc, (OSError, sqlite3.Error)):
            reason = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else str(exc)
            raise StoreError(
                f"cannot {self.doing} store {self.root}: {reason}",
                "check free space and permissions; a failed write leaves nothing half-written, and "
                "`kvgraft store gc` removes what it left unindexed",
            ) from exc
        return False


def _entry(row) -> Entry:
    return Entry(row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6])
