"""The content-addressed artifact store: ``objects/ab/<sha256>.kvg`` plus an SQLite index.

The index maps a prefix key (compute pin + token ids) and a problem id to an artifact, with token counts and
sizes. SQLite keeps lookups logarithmic at millions of entries and makes each index update one atomic transaction;
an object is written (atomically) before the index row that names it, so a crash leaves at most an unindexed,
complete object, never an index row pointing at a half-written file.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..artifacts import format as kvg
from ..errors import ArtifactError, InputError
from ..util.hashing import sha256_json

SCHEMA = """
CREATE TABLE IF NOT EXISTS artifacts (
    sha256 TEXT PRIMARY KEY,
    file_bytes INTEGER NOT NULL,
    payload_bytes INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    model_sha256 TEXT NOT NULL,
    manifest_sha256 TEXT NOT NULL,
    created TEXT NOT NULL
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
"""
HEX64 = re.compile(r"^[0-9a-f]{64}$")


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


class Store:
    """A store directory. Opening creates it unless ``create`` is False (readers never create one)."""

    def __init__(self, root: Path, create: bool = True):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise InputError(f"store path {self.root} exists and is not a directory")
        if not create and not (self.root / "index.sqlite").is_file():
            raise InputError(f"no store at {self.root}", "run `kvgraft deposit FILE.jsonl` first, or pass --store")
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.root / "index.sqlite", timeout=60, isolation_level=None)
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256[:2] / f"{sha256}.kvg"

    def has_object(self, sha256: str) -> bool:
        return self.object_path(sha256).is_file()

    def lookup_key(self, key: str) -> Entry | None:
        row = self._db.execute(_SELECT + " WHERE e.key = ?", (key,)).fetchone()
        return _entry(row) if row else None

    def put(self, sha256: str, payload: bytes, *, key: str, problem_id: str, num_tokens: int, model_sha256: str,
            manifest_sha256: str, verified: bool, level: int = 3) -> tuple[Entry, bool]:
        """Store an artifact payload under its identity and index it. Returns (entry, whether a new object was written)."""
        path = self.object_path(sha256)
        created = not path.is_file()
        if created:
            kvg.write_file(path, payload, level)
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with self._db:  # one transaction: both rows or neither
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT OR IGNORE INTO artifacts VALUES (?,?,?,?,?,?,?)",
                (sha256, path.stat().st_size, len(payload), num_tokens, model_sha256, manifest_sha256, now),
            )
            self._db.execute(
                "INSERT INTO entries VALUES (?,?,?,?,?,?) ON CONFLICT(key) DO UPDATE SET "
                "problem_id=excluded.problem_id, artifact=excluded.artifact, verified=max(verified, excluded.verified)",
                (key, problem_id, sha256, manifest_sha256, int(verified), now),
            )
        return self.lookup_key(key), created

    def forget(self, key: str, sha256: str | None) -> None:
        """Undo a put whose ledger entry could not be written: drop the index row, and the object if it was new."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM entries WHERE key = ?", (key,))
            if sha256 is not None:
                self._db.execute("DELETE FROM artifacts WHERE sha256 = ? AND NOT EXISTS "
                                 "(SELECT 1 FROM entries WHERE artifact = ?)", (sha256, sha256))
        if sha256 is not None:
            self.object_path(sha256).unlink(missing_ok=True)

    def resolve(self, ref: str | None, manifest_sha256: str | None = None) -> str:
        """The artifact identity a reference names: full hash, unique hash prefix (>= 6 hex), or problem id.
        ``None`` names the most recently deposited artifact (under ``manifest_sha256`` when given)."""
        db = self._db
        if ref is None:
            q = "SELECT artifact FROM entries" + (" WHERE manifest_sha256 = ?" if manifest_sha256 else "")
            row = db.execute(q + " ORDER BY rowid DESC LIMIT 1", (manifest_sha256,) if manifest_sha256 else ()).fetchone()
            if not row:
                raise InputError(f"store {self.root} holds no artifacts for this manifest", "run `kvgraft deposit FILE.jsonl` first")
            return row[0]
        if HEX64.match(ref):
            return ref
        rows = db.execute(
            "SELECT artifact FROM entries WHERE problem_id = ? ORDER BY (manifest_sha256 = ?) DESC, rowid DESC",
            (ref, manifest_sha256 or ""),
        ).fetchall()
        if rows:
            return rows[0][0]
        if re.fullmatch(r"[0-9a-f]{6,63}", ref):
            hits = [r[0] for r in db.execute("SELECT sha256 FROM artifacts WHERE sha256 LIKE ? LIMIT 3", (ref + "%",))]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                raise InputError(f"artifact prefix {ref} is ambiguous ({', '.join(h[:12] for h in hits)}, ...)", "give more hex digits")
        raise InputError(f"no artifact {ref!r} in store {self.root} (neither a problem id nor an artifact hash)",
                         "list what is there with `kvgraft store list`")

    def load(self, sha256: str) -> tuple[bytes, kvg.Artifact]:
        """Read an object, re-hash it against its identity and decode it."""
        path = self.object_path(sha256)
        if not path.is_file():
            raise ArtifactError(f"artifact {sha256[:16]}... is not in store {self.root} (no {path})")
        return kvg.read_file(path, expected_sha256=sha256)

    def entries(self, limit: int | None = None) -> list[Entry]:
        q = _SELECT + " ORDER BY e.rowid" + (f" LIMIT {int(limit)}" if limit else "")
        return [_entry(r) for r in self._db.execute(q)]

    def stats(self) -> dict[str, int]:
        n_obj, n_bytes, n_tok = self._db.execute(
            "SELECT count(*), coalesce(sum(file_bytes),0), coalesce(sum(num_tokens),0) FROM artifacts").fetchone()
        (n_ent,) = self._db.execute("SELECT count(*) FROM entries").fetchone()
        return {"objects": n_obj, "entries": n_ent, "file_bytes": n_bytes, "tokens": n_tok}


_SELECT = (
    "SELECT e.key, e.problem_id, e.artifact, e.manifest_sha256, e.verified, a.num_tokens, a.file_bytes "
    "FROM entries e JOIN artifacts a ON a.sha256 = e.artifact"
)


def _entry(row) -> Entry:
    return Entry(row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6])
