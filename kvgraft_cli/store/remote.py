"""A remote store: a local cache store plus an S3-compatible object store (docs/REMOTE.md has the layout).

A :class:`RemoteStore` *is* a :class:`~.local.Store`: a normal store folder that caches the remote
(``$XDG_CACHE_HOME/kvgraft/remote/<sha256(url, endpoint)[:16]>/``), so every reader works unchanged on it (the
SQLite index, the library and its FTS5 search, resolve, stats) and every object is re-hashed before use exactly as
from disk. What it adds:

- **Objects** go up as the very bytes of the local object file under the same key, ``objects/ab/<sha256>.kvg``
  (PUT only where absent), and come down into the cache on first use: to a temporary file, re-hashed against the
  identity, and only then renamed into place. A tampered remote object is refused (IntegrityError, exit 1) and
  never kept.
- **Index rows** (artifact, entry and library rows) travel as immutable JSON Lines batches,
  ``index/<utc-time>-<random>.jsonl``, written once and never rewritten, so concurrent writers never overwrite one
  another. A writer publishes the rows of the artifacts a ledger line has recorded (:meth:`RemoteStore.mark_recorded`,
  which the ledger append calls afterwards), in one batch per command (or every :data:`FLUSH_EVERY` artifacts).
  A reader lists all of ``index/`` on open and merges the batches it has not merged yet into the cache's SQLite,
  noting their names in the ``remote_batches`` table. Every name is listed every time (no window from the newest
  name merged), so no batch name, however it is dated, can hide another batch. A malformed batch, or one with a
  row type this kvgraft does not know, is skipped and not noted as merged (a later kvgraft reads it), and is listed
  in :attr:`RemoteStore.skipped_batches`.

The rows are only an index, and whoever can write to the bucket can write a batch: merging never changes a row the
cache already holds (first row wins; a later row restating a key, artifact or library row differently is refused
and counted in ``remote_conflicts``), and the bytes used are always the ones that re-hash to the identity.
docs/REMOTE.md states the trust model.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sqlite3
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from ..artifacts import format as kvg
from ..errors import ArtifactError, InputError, IntegrityError, KvgraftError, StoreError
from ..util.fsio import atomic_write_bytes
from .local import HEX64, VERIFIED, Store, _store_errors
from .s3 import S3Remote, endpoint_hint, is_remote, parse_url

MARKER = "remote.json"  # in a cache folder: which remote it caches (RunContext.open_store reads it)
INDEX = "index/"
FLUSH_EVERY = 256  # recorded artifacts per index batch at most (a command's batch is usually one)
MAX_BATCH_BYTES = 256 * 1024**2
# remote_batches: the batches merged into the cache. remote_conflicts: how many rows of a merged batch were refused
# because they restate a key, artifact or library row the cache already held differently (first row wins).
# remote_unpublished: artifacts a ledger line recorded whose rows no batch has carried yet (a process killed before
# its flush leaves them here, and the next open queues them again).
BATCH_SCHEMA = """
CREATE TABLE IF NOT EXISTS remote_batches (name TEXT PRIMARY KEY, merged TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS remote_conflicts (name TEXT PRIMARY KEY, rows INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS remote_unpublished (sha256 TEXT PRIMARY KEY);
"""

__all__ = [
    "RemoteStore",
    "is_remote",
    "cache_dir",
    "remote_of",
    "export_rows",
    "merge_rows",
    "adopt_rows",
    "missing_rows",
]


def _user_cache() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "kvgraft"


def normalize(url: str) -> str:
    """The canonical spelling of a remote store URL (``s3://bucket/prefix``, no trailing slash)."""
    return str(parse_url(url))


def cache_dir(url: str) -> Path:
    """The local cache folder of a remote store: one per URL and endpoint (the same bucket and prefix on two
    servers are two stores)."""
    key = hashlib.sha256(f"{normalize(url)}\n{endpoint_hint()}".encode()).hexdigest()[:16]
    return _user_cache() / "remote" / key


def remote_of(folder: Path) -> str | None:
    """The URL a cache folder caches (its marker file), or None for a plain local store."""
    try:
        data = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    url = data.get("url") if isinstance(data, dict) else None
    return url if is_remote(url) else None


def object_key(sha256: str) -> str:
    return f"objects/{sha256[:2]}/{sha256}.kvg"


class RemoteStore(Store):
    """A store at ``s3://bucket/prefix`` (see the module doc). ``create=False``: refuse a remote that holds no
    store (no index batch and no object). ``cache``: the cache folder (default :func:`cache_dir`)."""

    def __init__(self, url: str, create: bool = True, codec: str = "auto", cache: Path | None = None):
        self.url = normalize(url)
        self.remote = S3Remote(self.url)
        root = Path(cache) if cache else cache_dir(self.url)
        made = _missing_folders(root)  # what this open creates, so a failed open can take it away again
        self._pending: set[str] = set()
        self._published_at = self._refreshed_at = time.monotonic()  # (publish_due, refresh_due)
        self.skipped_batches: list[dict] = []  # {"batch": URL, "reason": ...}: not merged this open (see refresh)
        try:
            super().__init__(root, create=True, codec=codec)
        except BaseException:
            _remove_made(made, root)
            raise
        try:
            with _store_errors(self.root, "open"):
                self._db.executescript(BATCH_SCHEMA)
                if remote_of(self.root) != self.url:
                    atomic_write_bytes(self.root / MARKER, json.dumps({"url": self.url}).encode() + b"\n")
            merged = self.refresh()
            # what an earlier process recorded and did not publish (killed before its flush): published with ours
            self._pending.update(r[0] for r in self._db.execute("SELECT sha256 FROM remote_unpublished"))
            if (
                not create
                and not merged
                and not self._has_batches()
                and not self.skipped_batches
                and not self._remote_has_objects()
            ):
                raise InputError(
                    f"no store at {self.url}", f"deposit with --store {self.url}, or `kvgraft store push {self.url}`"
                )
        except BaseException:
            empty = made and self._is_empty()
            super().close()
            if empty:  # a cache folder this failed open created and nothing was merged into: leave nothing behind
                _remove_made(made, root)
            raise

    def __str__(self) -> str:
        return self.url

    # -- the index ---------------------------------------------------------------------------------------------

    def refresh(self) -> int:
        """Merge the index batches not merged yet into the cache, in name order; returns how many were merged.

        The whole of ``index/`` is listed every time (one LIST request per 1,000 batches) and the names merged
        already are skipped: a window starting from the newest name merged would let one batch dated in the
        future hide every later one. A malformed batch (or one holding a row type this kvgraft does not know) is
        skipped, not noted as merged, and listed in :attr:`skipped_batches`; the other batches still merge."""
        merged = 0
        self.skipped_batches = []
        self._refreshed_at = time.monotonic()
        known = {r[0] for r in self._db.execute("SELECT name FROM remote_batches")}
        for rel, size in self.remote.list(INDEX):
            name = rel[len(INDEX) :]
            if name in known or not name.endswith(".jsonl"):
                continue
            where = self.remote.where.url(rel)
            if size > MAX_BATCH_BYTES:
                self._skip(where, f"{size} bytes, more than an index batch may be ({MAX_BATCH_BYTES})")
                continue
            try:
                data = self.remote.get_bytes(rel, MAX_BATCH_BYTES)
                rows = parse_batch(data, where)
            except FileNotFoundError:  # listed, then gone: someone cleaned up; nothing to merge
                continue
            except MalformedBatch as e:
                self._skip(where, e.reason)
                continue
            self._merge(name, rows)
            merged += 1
        return merged

    def _skip(self, where: str, reason: str) -> None:
        self.skipped_batches.append({"batch": where, "reason": reason})

    def _merge(self, name: str, rows: list[dict]) -> None:
        """Merge one batch's rows and note the batch (and the rows refused, if any) in one transaction."""
        with _store_errors(self.root, "write to"), self._db:
            self._db.execute("BEGIN IMMEDIATE")
            if self._db.execute("SELECT 1 FROM remote_batches WHERE name = ?", (name,)).fetchone():
                return  # another process on this cache merged it meanwhile
            refused = merge_rows(self, rows)
            self._db.execute("INSERT OR IGNORE INTO remote_batches VALUES (?, ?)", (name, _now()))
            if refused:
                self._db.execute("INSERT OR IGNORE INTO remote_conflicts VALUES (?, ?)", (name, refused))

    @property
    def conflicts(self) -> list[dict]:
        """The merged batches some of whose rows were refused ({"batch": URL, "rows": how many}): rows restating a
        key, artifact or library row the cache already held differently (the first row stands)."""
        return [
            {"batch": self.remote.where.url(INDEX + name), "rows": n}
            for name, n in self._db.execute("SELECT name, rows FROM remote_conflicts ORDER BY name")
        ]

    def _has_batches(self) -> bool:
        return self._db.execute("SELECT 1 FROM remote_batches LIMIT 1").fetchone() is not None

    def _is_empty(self) -> bool:
        """No batch merged and no object cached: a cache folder holding nothing worth keeping."""
        try:
            return not self._has_batches() and not any((self.root / "objects").iterdir())
        except (OSError, sqlite3.Error):
            return False

    def _remote_has_objects(self) -> bool:
        return next(iter(self.remote.list("objects/")), None) is not None

    def mark_recorded(self, sha256s: list[str]) -> None:
        """Note the recording locally, then queue the artifacts' rows for the next index batch (published when the
        store closes, or every :data:`FLUSH_EVERY` artifacts): only what a ledger line records is published."""
        new = [s for s in sha256s if not self.is_recorded(s)]
        super().mark_recorded(sha256s)
        if new:  # noted on disk too, until a batch carries them: a kill before the flush loses none
            with _store_errors(self.root, "write to"), self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("INSERT OR IGNORE INTO remote_unpublished VALUES (?)", [(s,) for s in new])
        self._pending.update(new)
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> str | None:
        """Publish the queued rows as one new index batch; returns its name (None when nothing was queued)."""
        if not self._pending:
            return None
        done = sorted(self._pending)
        name = self.publish(export_rows(self, done))
        with _store_errors(self.root, "write to"), self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("DELETE FROM remote_unpublished WHERE sha256 = ?", [(s,) for s in done])
        self._pending.clear()
        self._published_at = time.monotonic()
        return name

    def publish_due(self, every_s: float) -> str | None:
        """:meth:`flush` when rows are queued and ``every_s`` seconds have passed since the last batch (0: whenever
        rows are queued): a long-running writer (`kvgraft serve`) shares what it records while it runs, in batches
        of a period's rows rather than one per request, not only when it closes."""
        if self._pending and time.monotonic() - self._published_at >= every_s:
            self._published_at = time.monotonic()  # a failed attempt waits a period too, not the next answer
            return self.flush()
        return None

    def refresh_due(self, every_s: float) -> int:
        """:meth:`refresh` when ``every_s`` seconds have passed since the last one (0: every call): a long-running
        reader sees what other writers published meanwhile, at one LIST request a period."""
        if time.monotonic() - self._refreshed_at >= every_s:
            return self.refresh()
        return 0

    def publish(self, rows: list[dict]) -> str | None:
        """Write rows as a new, uniquely named index batch (never overwriting one), merge them into the cache and
        note the batch as merged here."""
        if not rows:
            return None
        name = new_batch_name()
        body = b"".join(json.dumps(r, sort_keys=True, separators=(",", ":")).encode() + b"\n" for r in rows)
        self.remote.put_bytes(INDEX + name, body)
        self._merge(name, rows)  # the cache holds what it published (rows from elsewhere: a push)
        return name

    def close(self) -> None:
        try:
            self.flush()
        finally:
            super().close()

    def __exit__(self, typ, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:  # a failing command still publishes what its ledger lines recorded; its own error is the one shown
            self.close()
        except KvgraftError:
            pass

    def resolve(self, ref: str | None, manifest_sha256: str | None = None) -> str:
        """As :meth:`Store.resolve`; its messages name the remote URL rather than the cache folder."""
        try:
            return super().resolve(ref, manifest_sha256)
        except InputError as e:
            raise type(e)(e.message.replace(str(self.root), self.url), e.hint) from None

    # -- objects -----------------------------------------------------------------------------------------------

    def object_url(self, sha256: str) -> str:
        return self.remote.where.url(object_key(sha256))

    def has_object(self, sha256: str) -> bool:
        return super().has_object(sha256) or self.remote.head(object_key(sha256)) is not None

    def put_object(self, sha256: str, payload: bytes, level: int = 3) -> bool:
        """Write the object into the cache (as a local store does) and upload that very file unless the remote has
        it; returns whether the cache got a new file."""
        created = super().put_object(sha256, payload, level)
        self.upload(sha256)
        return created

    def upload(self, sha256: str, source: Path | None = None) -> bool:
        """Upload an object file (default: the cache's) unless the remote has it, then check what arrived: its size
        and recorded file SHA-256 (the server itself checked the body's SHA-256 and MD5 on the way in).
        Returns whether this call uploaded it."""
        path = Path(source) if source else self.object_path(sha256)
        rel = object_key(sha256)
        if self.remote.head(rel) is not None:
            return False
        want = self.remote.put_file(rel, path, {"kvg-sha256": sha256})  # the file's SHA-256, hashed for the PUT
        uploaded = want is not None
        if uploaded:
            head = self.remote.head(rel)
            if (
                head is None
                or head["ContentLength"] != path.stat().st_size
                or head.get("Metadata", {}).get("file-sha256") != want
            ):
                raise StoreError(
                    f"upload of {self.object_url(sha256)} did not arrive as sent (size or SHA-256 differs)",
                    "run the command again; the object is content-addressed",
                )
        return uploaded

    def local_object(self, sha256: str) -> Path:
        """The object's file in the cache, fetched (and re-hashed, torch-free) first when the cache lacks it."""
        path = self.object_path(sha256)
        if not path.is_file():
            self.fetch(sha256, path)
        return path

    def load(self, sha256: str, remember: bool = True, device: str = "cpu", room: int = 0) -> tuple[str, kvg.Artifact]:
        """As :meth:`Store.load`; an object the cache lacks is fetched first, re-hashed while it is read, and kept
        only when it matches its identity (in host memory: the engine copies it to its device)."""
        hit = VERIFIED.get(sha256)
        if hit is not None:
            return hit
        if super().has_object(sha256):
            return super().load(sha256, remember, device, room)
        if not HEX64.match(sha256):
            raise ArtifactError(f"not an artifact identity: {sha256!r}")
        path = self.object_path(sha256)
        loaded = self._keep_if_verified(
            sha256, self._download(sha256), path, lambda tmp: kvg.open_file(tmp, sha256, 0 if remember else room)
        )
        if remember:
            VERIFIED.put(sha256, loaded)
        return loaded

    def fetch(self, sha256: str, dest: Path) -> int:
        """Copy an object into ``dest`` (a path in some store's objects folder), re-hashed before it is renamed
        into place (torch-free: the streamed payload hash); returns its size. Refused (IntegrityError) and not kept
        when its payload does not hash to ``sha256``."""
        from ..artifacts.payload import kvg_payload_sha256
        from ..artifacts.verdict import judged

        if super().has_object(sha256):  # the cache has it: no network, still re-hashed on arrival
            tmp = _tmp_beside(dest)
            with _store_errors(dest.parent, "write to"):
                shutil.copyfile(self.object_path(sha256), tmp)
        else:
            tmp = self._download(sha256, dest)

        def check(path: Path) -> int:
            with judged(path, sha256):  # a file that cannot be hashed as an artifact is damage too (exit 1)
                got = kvg_payload_sha256(path)
            if got != sha256:
                raise IntegrityError(
                    f"{self.object_url(sha256)}: payload hashes to {got[:16]}..., not its identity "
                    f"{sha256[:16]}...: the remote object was altered; not copied"
                )
            return path.stat().st_size

        return self._keep_if_verified(sha256, tmp, dest, check)

    def _keep_if_verified(self, sha256: str, tmp: Path, dest: Path, check):
        """Run ``check`` on a downloaded temporary file and rename it to ``dest`` only when it passes; otherwise
        delete it and re-raise, naming the remote object rather than the temporary file. Returns what ``check``
        returned."""
        try:
            result = check(tmp)
        except ArtifactError as e:
            tmp.unlink(missing_ok=True)
            raise type(e)(e.message.replace(str(tmp), self.object_url(sha256)), e.hint) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, dest)
        return result

    def _download(self, sha256: str, dest: Path | None = None) -> Path:
        """Download an object to a temporary file beside ``dest`` (default: its cache path); nothing re-hashed yet."""
        dest = dest or self.object_path(sha256)
        tmp = _tmp_beside(dest)
        try:
            with _store_errors(dest.parent, "write to"), open(tmp, "wb") as f:
                self.remote.get_to(object_key(sha256), f)
        except FileNotFoundError:
            tmp.unlink(missing_ok=True)
            raise ArtifactError(
                f"artifact {sha256[:16]}... is not in store {self.url} (no {self.object_url(sha256)})",
                f"`kvgraft store push {self.url}` uploads a local store's objects",
            ) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp


def _missing_folders(root: Path) -> list[Path]:
    """``root`` and those of its parents that do not exist yet, deepest first."""
    missing, p = [], Path(root).absolute()
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    return missing


def _remove_made(made: list[Path], root: Path) -> None:
    """Take away a cache folder a failed open created: the files an open writes (the SQLite index, the marker, the
    empty objects folder), then each folder it made, only while empty (rmdir never removes anyone else's files)."""
    if not made:
        return
    root = Path(root).absolute()
    for name in ("index.sqlite", "index.sqlite-journal", "index.sqlite-wal", "index.sqlite-shm", MARKER):
        try:
            (root / name).unlink(missing_ok=True)
        except OSError:
            pass
    for folder in [root / "objects", *made]:
        try:
            folder.rmdir()
        except OSError:
            return


def _tmp_beside(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest.with_name(f"{dest.name}.{secrets.token_hex(6)}.tmp")  # store gc removes leftovers (*.tmp)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def new_batch_name() -> str:
    """``<utc-time>-<random>.jsonl``: sorts by time; the random part keeps two writers' names apart."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ") + f"-{secrets.token_hex(8)}.jsonl"


# -- index rows: the wire format of a batch, shared with store.sync ---------------------------------------------
# One JSON object a line, "t" naming the table. Column values are checked on the way in: a batch is data from
# the network.
_COLUMNS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "artifact": {
        "sha256": str,
        "file_bytes": int,
        "payload_bytes": int,
        "num_tokens": int,
        "model_sha256": str,
        "manifest_sha256": str,
        "created": str,
    },
    "entry": {"key": str, "problem_id": str, "artifact": str, "manifest_sha256": str, "verified": int, "created": str},
    "library": {
        "artifact": str,
        "problem_id": str,
        "problem_key": str,
        "manifest_sha256": str,
        "problem": str,
        "solution": str,
        "answer": (str, type(None)),
        "num_tokens": int,
    },
}
_HASHES = ("sha256", "artifact", "model_sha256", "manifest_sha256", "key", "problem_key")


def export_rows(store: Store, sha256s: Iterable[str]) -> list[dict]:
    """The index rows of these artifacts (artifact row, their entries, their library row), as batch lines.
    Reads the store's SQLite directly: the rows are the store's own (this module and local.py share a package)."""
    db, rows = store._db, []
    for sha in sha256s:
        a = db.execute(
            "SELECT sha256, file_bytes, payload_bytes, num_tokens, model_sha256, manifest_sha256, created "
            "FROM artifacts WHERE sha256 = ?",
            (sha,),
        ).fetchone()
        if a is None:
            continue
        rows.append({"t": "artifact", **dict(zip(_COLUMNS["artifact"], a))})
        for e in db.execute(
            "SELECT key, problem_id, artifact, manifest_sha256, verified, created FROM entries "
            "WHERE artifact = ? ORDER BY rowid",
            (sha,),
        ):
            rows.append({"t": "entry", **dict(zip(_COLUMNS["entry"], e))})
        lib = db.execute(
            "SELECT artifact, problem_id, problem_key, manifest_sha256, problem, solution, answer, "
            "num_tokens FROM library WHERE artifact = ?",
            (sha,),
        ).fetchone()
        if lib is not None:
            rows.append({"t": "library", **dict(zip(_COLUMNS["library"], lib))})
    return rows


class MalformedBatch(StoreError):
    """An index batch that is not (or not yet: a row type from a newer kvgraft) kvgraft's; ``reason`` names the
    line and what is wrong with it."""

    def __init__(self, source: str, reason: str):
        super().__init__(f"index batch {source}: {reason}", "remove or repair that batch; the objects are unaffected")
        self.reason = reason


def parse_batch(data: bytes, source: str) -> list[dict]:
    """The rows of an index batch, each checked (table, columns, types, hex hashes); a malformed batch is refused
    whole (:class:`MalformedBatch`, naming it and the line), as is one with a row type this kvgraft does not know."""
    rows = []
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "t" not in row:
                raise ValueError('not a JSON object with a row type "t"')
            if row["t"] not in _COLUMNS:
                raise ValueError(f"unknown row type {str(row['t'])[:40]!r} (a newer kvgraft's?)")
            cols = _COLUMNS[row["t"]]
            if set(row) != {"t", *cols}:
                raise ValueError(f"columns {sorted(set(row) - {'t'})}")
            for c, typ in cols.items():
                if not isinstance(row[c], typ) or isinstance(row[c], bool):
                    raise ValueError(f"{c} is {type(row[c]).__name__}")
                if c in _HASHES and not HEX64.match(row[c]):
                    raise ValueError(f"{c} is not a SHA-256")
        except (ValueError, KeyError, TypeError) as e:
            raise MalformedBatch(source, f"line {n}: not a kvgraft index row ({str(e)[:120]})") from None
        rows.append(row)
    return rows


# The columns two honest rows for the same artifact (or library row) agree on: what the artifact's bytes fix. Not
# compared: `created` (each writer's own clock), an artifact's `file_bytes` (the codec it was written with), a library
# row's `problem_id` and `answer` (labels from the input file: one problem deposited under two ids or references).
_SAME_ARTIFACT = ("payload_bytes", "num_tokens", "model_sha256", "manifest_sha256")
_SAME_LIBRARY = ("problem_key", "manifest_sha256", "problem", "solution", "num_tokens")


def merge_rows(store: Store, rows: list[dict], recorded: bool = True) -> int:
    """Add batch rows to a store's index, inside the caller's transaction; returns how many rows were refused.

    A row never changes what the index holds already (first row wins): an entry whose key is indexed is kept as
    it is (an entry key is fixed by the prefix's content, so an honest second row names the same artifact), and a
    row for an artifact or library row already indexed adds nothing but, for an artifact, that it is recorded
    (every row that travels is a recorded one: a ledger line names it). A row that restates a key with another
    artifact, or an artifact or library row with other content, is refused and counted. New artifacts merge as
    recorded, entries as :meth:`Store.index` writes them, library rows with their full-text rows
    (:meth:`Store._add_library`); artifact rows first, as the index's references need. ``recorded`` False: rows no
    ledger line names yet (:func:`adopt_rows`), merged unrecorded, leaving a held row's recording as it was."""
    db, refused = store._db, 0
    for r in sorted(rows, key=lambda r: r["t"] != "artifact"):
        if r["t"] == "artifact":
            have = db.execute(
                "SELECT " + ", ".join(_SAME_ARTIFACT) + " FROM artifacts WHERE sha256 = ?", (r["sha256"],)
            ).fetchone()
            if have is None:
                db.execute(
                    "INSERT INTO artifacts (sha256, file_bytes, payload_bytes, num_tokens, model_sha256, "
                    "manifest_sha256, created, recorded) VALUES (?,?,?,?,?,?,?,?)",
                    (*(r[c] for c in _COLUMNS["artifact"]), int(recorded)),
                )
            elif have != tuple(r[c] for c in _SAME_ARTIFACT):
                refused += 1
            elif recorded and store._tracks_recording:
                db.execute("UPDATE artifacts SET recorded = 1 WHERE sha256 = ? AND recorded = 0", (r["sha256"],))
        elif r["t"] == "entry":
            have = db.execute("SELECT artifact FROM entries WHERE key = ?", (r["key"],)).fetchone()
            if have is None:
                db.execute("INSERT INTO entries VALUES (?,?,?,?,?,?)", tuple(r[c] for c in _COLUMNS["entry"]))
            elif have[0] != r["artifact"]:
                refused += 1
        else:
            have = db.execute(
                "SELECT " + ", ".join(_SAME_LIBRARY) + " FROM library WHERE artifact = ?", (r["artifact"],)
            ).fetchone()
            if have is None:
                store._add_library(
                    r["artifact"],
                    r["problem_id"],
                    r["manifest_sha256"],
                    r["num_tokens"],
                    {k: r[k] for k in ("problem_key", "problem", "solution", "answer")},
                )
            elif have != tuple(r[c] for c in _SAME_LIBRARY):
                refused += 1
    return refused


def adopt_rows(store: Store, rows: list[dict]) -> int:
    """Index the rows another process exported (:func:`export_rows`) of objects it wrote to a store both reach, in
    one transaction, as :meth:`Store.index` would have indexed them here: unrecorded, so the ledger line that names
    them marks them recorded (and a remote store publishes them then). What `kvgraft serve --replicas` does with a
    replica's prompt chunks: on another node the replica indexes them in its own node's cache, where the front,
    which writes the ledger, would never see them. Returns how many rows were refused (first row wins)."""
    if not rows:
        return 0
    with _store_errors(store.root, "write to"), store._db:
        store._db.execute("BEGIN IMMEDIATE")
        return merge_rows(store, rows, recorded=False)


def missing_rows(rows: list[dict], target: Store) -> list[dict]:
    """The rows ``target``'s index lacks, as :func:`merge_rows` would add them (an artifact absent or not recorded
    there, an entry key absent, a library row absent): what a push or pull must still send. A row restating
    differently what ``target`` holds is not sent: no reader would take it."""
    db, out = target._db, []
    for r in rows:
        if r["t"] == "artifact":
            have = db.execute("SELECT recorded FROM artifacts WHERE sha256 = ?", (r["sha256"],)).fetchone()
            lacking = not have or not have[0]
        elif r["t"] == "entry":
            lacking = db.execute("SELECT 1 FROM entries WHERE key = ?", (r["key"],)).fetchone() is None
        else:
            lacking = db.execute("SELECT 1 FROM library WHERE artifact = ?", (r["artifact"],)).fetchone() is None
        if lacking:
            out.append(r)
    return out
