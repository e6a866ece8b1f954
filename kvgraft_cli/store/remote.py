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
  A reader lists ``index/`` on open and merges the batches it has not merged yet into the cache's SQLite, noting
  their names in the ``remote_batches`` table. The listing starts a safety window (:data:`LIST_OVERLAP`) before
  the newest batch already merged, so a batch that lands late (a slow writer, a skewed clock) is still found.

The rows are only an index: a row can at worst point at an object the remote lacks or describe it wrongly; the
bytes used are always the ones that re-hash to the identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterable

from ..artifacts import format as kvg
from ..errors import ArtifactError, InputError, IntegrityError, KvgraftError, StoreError
from ..util.fsio import atomic_write_bytes
from .local import HEX64, VERIFIED, Store, _store_errors
from .s3 import S3Remote, endpoint_hint, is_remote, parse_url

MARKER = "remote.json"  # in a cache folder: which remote it caches (RunContext.open_store reads it)
INDEX = "index/"
FLUSH_EVERY = 256  # recorded artifacts per index batch at most (a command's batch is usually one)
LIST_OVERLAP = timedelta(hours=1)  # how far before the newest merged batch a reader lists again
MAX_BATCH_BYTES = 256 * 1024**2
BATCH_SCHEMA = "CREATE TABLE IF NOT EXISTS remote_batches (name TEXT PRIMARY KEY, merged TEXT NOT NULL);"

__all__ = ["RemoteStore", "is_remote", "cache_dir", "remote_of", "export_rows", "merge_rows", "missing_rows"]


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
        super().__init__(Path(cache) if cache else cache_dir(self.url), create=True, codec=codec)
        self._pending: set[str] = set()
        with _store_errors(self.root, "open"):
            self._db.executescript(BATCH_SCHEMA)
            if remote_of(self.root) != self.url:
                atomic_write_bytes(self.root / MARKER, json.dumps({"url": self.url}).encode() + b"\n")
        try:
            merged = self.refresh()
            if not create and not merged and not self._has_batches() and not self._remote_has_objects():
                raise InputError(f"no store at {self.url}",
                                 f"deposit with --store {self.url}, or `kvgraft store push {self.url}`")
        except BaseException:
            super().close()
            raise

    def __str__(self) -> str:
        return self.url

    # -- the index ---------------------------------------------------------------------------------------------

    def refresh(self) -> int:
        """Merge the index batches not merged yet into the cache; returns how many were merged."""
        merged = 0
        known = {r[0] for r in self._db.execute("SELECT name FROM remote_batches")}
        for rel, _ in self.remote.list(INDEX, self._list_from()):
            name = rel[len(INDEX):]
            if name in known or not name.endswith(".jsonl"):
                continue
            try:
                data = self.remote.get_bytes(rel, MAX_BATCH_BYTES)
            except FileNotFoundError:  # listed, then gone: someone cleaned up; nothing to merge
                continue
            rows = parse_batch(data, self.remote.where.url(rel))
            with _store_errors(self.root, "write to"), self._db:
                self._db.execute("BEGIN IMMEDIATE")
                merge_rows(self, rows)
                self._db.execute("INSERT OR IGNORE INTO remote_batches VALUES (?, ?)", (name, _now()))
            merged += 1
        return merged

    def _list_from(self) -> str:
        """Where the listing of ``index/`` starts: :data:`LIST_OVERLAP` before the newest batch merged (batch names
        begin with their UTC time, so key order is time order)."""
        row = self._db.execute("SELECT max(name) FROM remote_batches").fetchone()
        if not row or not row[0]:
            return ""
        try:
            newest = datetime.strptime(row[0].split("-", 1)[0], "%Y%m%dT%H%M%S.%fZ")
        except ValueError:
            return ""
        return INDEX + (newest - LIST_OVERLAP).strftime("%Y%m%dT%H%M%S")

    def _has_batches(self) -> bool:
        return self._db.execute("SELECT 1 FROM remote_batches LIMIT 1").fetchone() is not None

    def _remote_has_objects(self) -> bool:
        return next(iter(self.remote.list("objects/")), None) is not None

    def mark_recorded(self, sha256s: list[str]) -> None:
        """Note the recording locally, then queue the artifacts' rows for the next index batch (published when the
        store closes, or every :data:`FLUSH_EVERY` artifacts): only what a ledger line records is published."""
        new = [s for s in sha256s if not self.is_recorded(s)]
        super().mark_recorded(sha256s)
        self._pending.update(new)
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> str | None:
        """Publish the queued rows as one new index batch; returns its name (None when nothing was queued)."""
        if not self._pending:
            return None
        rows = export_rows(self, sorted(self._pending))
        name = self.publish(rows)
        self._pending.clear()
        return name

    def publish(self, rows: list[dict]) -> str | None:
        """Write rows as a new, uniquely named index batch (never overwriting one), merge them into the cache and
        note the batch as merged here."""
        if not rows:
            return None
        name = new_batch_name()
        body = b"".join(json.dumps(r, sort_keys=True, separators=(",", ":")).encode() + b"\n" for r in rows)
        self.remote.put_bytes(INDEX + name, body)
        with _store_errors(self.root, "write to"), self._db:
            self._db.execute("BEGIN IMMEDIATE")
            merge_rows(self, rows)  # the cache holds what it published (rows from elsewhere: a push)
            self._db.execute("INSERT OR IGNORE INTO remote_batches VALUES (?, ?)", (name, _now()))
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
        uploaded = self.remote.put_file(rel, path, {"kvg-sha256": sha256})
        if uploaded:
            head = self.remote.head(rel)
            want = _file_sha256(path)
            if head is None or head["ContentLength"] != path.stat().st_size or \
                    head.get("Metadata", {}).get("file-sha256") != want:
                raise StoreError(f"upload of {self.object_url(sha256)} did not arrive as sent (size or SHA-256 "
                                 "differs)", "run the command again; the object is content-addressed")
        return uploaded

    def local_object(self, sha256: str) -> Path:
        """The object's file in the cache, fetched (and re-hashed, torch-free) first when the cache lacks it."""
        path = self.object_path(sha256)
        if not path.is_file():
            self.fetch(sha256, path)
        return path

    def load(self, sha256: str, remember: bool = True) -> tuple[str, kvg.Artifact]:
        """As :meth:`Store.load`; an object the cache lacks is fetched first, re-hashed while it is read, and kept
        only when it matches its identity."""
        hit = VERIFIED.get(sha256)
        if hit is not None:
            return hit
        if super().has_object(sha256):
            return super().load(sha256, remember)
        if not HEX64.match(sha256):
            raise ArtifactError(f"not an artifact identity: {sha256!r}")
        tmp = self._download(sha256)
        try:
            loaded = kvg.open_file(tmp, expected_sha256=sha256)
        except ArtifactError as e:
            tmp.unlink(missing_ok=True)
            raise type(e)(e.message.replace(str(tmp), self.object_url(sha256)), e.hint) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.object_path(sha256))
        if remember:
            VERIFIED.put(sha256, loaded)
        return loaded

    def fetch(self, sha256: str, dest: Path) -> int:
        """Copy an object into ``dest`` (a path in some store's objects folder), re-hashed before it is renamed
        into place (torch-free: the streamed payload hash); returns its size. Refused (IntegrityError) and not kept
        when its payload does not hash to ``sha256``."""
        from ..artifacts.payload import kvg_payload_sha256

        if super().has_object(sha256):  # the cache has it: no network, still re-hashed on arrival
            src = self.object_path(sha256)
            tmp = _tmp_beside(dest)
            with _store_errors(dest.parent, "write to"):
                with open(src, "rb") as a, open(tmp, "wb") as b:
                    while chunk := a.read(8 << 20):
                        b.write(chunk)
        else:
            tmp = self._download(sha256, dest)
        try:
            got = kvg_payload_sha256(tmp)
            if got != sha256:
                raise IntegrityError(f"{self.object_url(sha256)}: payload hashes to {got[:16]}..., not its identity "
                                     f"{sha256[:16]}...: the remote object was altered; not copied")
        except ArtifactError as e:
            tmp.unlink(missing_ok=True)
            raise type(e)(e.message.replace(str(tmp), self.object_url(sha256)), e.hint) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        size = tmp.stat().st_size
        os.replace(tmp, dest)
        return size

    def _download(self, sha256: str, dest: Path | None = None) -> Path:
        """Download an object to a temporary file beside ``dest`` (default: its cache path); nothing re-hashed yet."""
        dest = dest or self.object_path(sha256)
        tmp = _tmp_beside(dest)
        try:
            with _store_errors(dest.parent, "write to"), open(tmp, "wb") as f:
                self.remote.get_to(object_key(sha256), f)
        except FileNotFoundError:
            tmp.unlink(missing_ok=True)
            raise ArtifactError(f"artifact {sha256[:16]}... is not in store {self.url} (no {self.object_url(sha256)})",
                                f"`kvgraft store push {self.url}` uploads a local store's objects") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp


def _tmp_beside(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest.with_name(f"{dest.name}.{secrets.token_hex(6)}.tmp")  # store gc removes leftovers (*.tmp)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_batch_name() -> str:
    """``<utc-time>-<random>.jsonl``: sorts by time; the random part keeps two writers' names apart."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ") + f"-{secrets.token_hex(8)}.jsonl"


# -- index rows: the wire format of a batch, shared with store.sync ---------------------------------------------
# One JSON object a line, "t" naming the table. Column values are checked on the way in: a batch is data from
# the network.
_COLUMNS = {
    "artifact": {"sha256": str, "file_bytes": int, "payload_bytes": int, "num_tokens": int, "model_sha256": str,
                 "manifest_sha256": str, "created": str},
    "entry": {"key": str, "problem_id": str, "artifact": str, "manifest_sha256": str, "verified": int,
              "created": str},
    "library": {"artifact": str, "problem_id": str, "problem_key": str, "manifest_sha256": str, "problem": str,
                "solution": str, "answer": (str, type(None)), "num_tokens": int},
}
_HASHES = ("sha256", "artifact", "model_sha256", "manifest_sha256", "key", "problem_key")


def export_rows(store: Store, sha256s: Iterable[str]) -> list[dict]:
    """The index rows of these artifacts (artifact row, their entries, their library row), as batch lines.
    Reads the store's SQLite directly: the rows are the store's own (this module and local.py share a package)."""
    db, rows = store._db, []
    for sha in sha256s:
        a = db.execute("SELECT sha256, file_bytes, payload_bytes, num_tokens, model_sha256, manifest_sha256, created "
                       "FROM artifacts WHERE sha256 = ?", (sha,)).fetchone()
        if a is None:
            continue
        rows.append({"t": "artifact", **dict(zip(_COLUMNS["artifact"], a))})
        for e in db.execute("SELECT key, problem_id, artifact, manifest_sha256, verified, created FROM entries "
                            "WHERE artifact = ? ORDER BY rowid", (sha,)):
            rows.append({"t": "entry", **dict(zip(_COLUMNS["entry"], e))})
        lib = db.execute("SELECT artifact, problem_id, problem_key, manifest_sha256, problem, solution, answer, "
                         "num_tokens FROM library WHERE artifact = ?", (sha,)).fetchone()
        if lib is not None:
            rows.append({"t": "library", **dict(zip(_COLUMNS["library"], lib))})
    return rows


def parse_batch(data: bytes, source: str) -> list[dict]:
    """The rows of an index batch, each checked (table, columns, types, hex hashes); a malformed batch is refused
    whole with a StoreError naming it."""
    rows = []
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            cols = _COLUMNS[row["t"]]
            if set(row) != {"t", *cols}:
                raise ValueError(f"columns {sorted(set(row) - {'t'})}")
            for c, typ in cols.items():
                if not isinstance(row[c], typ) or isinstance(row[c], bool):
                    raise ValueError(f"{c} is {type(row[c]).__name__}")
                if c in _HASHES and not HEX64.match(row[c]):
                    raise ValueError(f"{c} is not a SHA-256")
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"index batch {source}, line {n}: not a kvgraft index row ({str(e)[:120]})",
                             "remove or repair that batch; the objects are unaffected") from None
        rows.append(row)
    return rows


def merge_rows(store: Store, rows: list[dict]) -> None:
    """Add batch rows to a store's index, inside the caller's transaction. Rows that travel are recorded ones
    (a ledger line names each), so artifacts merge as recorded; entries merge as :meth:`Store.index` writes them;
    library rows with their full-text rows (:meth:`Store._add_library`). An artifact row first, as the index's
    references need."""
    db = store._db
    for r in sorted(rows, key=lambda r: r["t"] != "artifact"):
        if r["t"] == "artifact":
            db.execute("INSERT INTO artifacts (sha256, file_bytes, payload_bytes, num_tokens, model_sha256, "
                       "manifest_sha256, created, recorded) VALUES (?,?,?,?,?,?,?,1) "
                       "ON CONFLICT(sha256) DO UPDATE SET recorded = 1",
                       tuple(r[c] for c in _COLUMNS["artifact"]))
        elif r["t"] == "entry":
            db.execute("INSERT INTO entries VALUES (?,?,?,?,?,?) ON CONFLICT(key) DO UPDATE SET problem_id="
                       "excluded.problem_id, artifact=excluded.artifact, verified=max(verified, excluded.verified)",
                       tuple(r[c] for c in _COLUMNS["entry"]))
        else:
            store._add_library(r["artifact"], r["problem_id"], r["manifest_sha256"], r["num_tokens"],
                               {k: r[k] for k in ("problem_key", "problem", "solution", "answer")})


def missing_rows(rows: list[dict], target: Store) -> list[dict]:
    """The rows ``target``'s index lacks (an artifact not recorded there, an entry key naming another artifact or
    absent, a library row absent): what a push or pull must still send."""
    db, out = target._db, []
    for r in rows:
        if r["t"] == "artifact":
            have = db.execute("SELECT recorded FROM artifacts WHERE sha256 = ?", (r["sha256"],)).fetchone()
            lacking = not have or not have[0]
        elif r["t"] == "entry":
            have = db.execute("SELECT artifact, verified FROM entries WHERE key = ?", (r["key"],)).fetchone()
            lacking = not have or have[0] != r["artifact"] or have[1] < r["verified"]
        else:
            lacking = db.execute("SELECT 1 FROM library WHERE artifact = ?", (r["artifact"],)).fetchone() is None
        if lacking:
            out.append(r)
    return out
