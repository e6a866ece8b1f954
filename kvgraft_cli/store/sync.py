"""``kvgraft store push`` / ``pull``: copy the recorded artifacts of a store to or from a remote store.

Only recorded artifacts travel (those a ledger line names; an artifact left by a failed append stays where it is),
with their index rows: the artifact row, its entries and its library row. Objects go first and index rows last, so
whoever reads the other side never finds a row before its object. What the other side already has is skipped: an
object by its key, a row when the other index already holds it. Rows merge as a remote store's batches do
(:func:`.remote.merge_rows`): a row never changes one the other index holds already; one that restates a key or an
artifact differently is not sent, or, pulled, is refused and counted (``conflicts``).

Every copied object is re-hashed on arrival. ``pull`` streams each downloaded object through the payload hash
(torch-free) and renames it into the local store only when it matches its identity. ``push`` re-hashes the local
object before sending it (a damaged local copy never reaches the remote), sends the file's SHA-256 and MD5 so the
server refuses a body altered on the way (S3 and SeaweedFS check both), and then HEADs the object to compare its
size and recorded file SHA-256; reading the whole object back would double the traffic for what the server's
checksum already proved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..artifacts.payload import kvg_payload_sha256
from ..artifacts.verdict import judged
from ..errors import IntegrityError, StoreError
from .local import Store, _store_errors
from .remote import RemoteStore, export_rows, merge_rows, missing_rows

Progress = Callable[[str, bool, int], None]  # (artifact, copied, bytes)


@dataclass
class SyncReport:
    """What a push or pull did: objects copied and skipped, bytes sent, index rows and the batch written."""

    direction: str  # push | pull
    source: str
    dest: str
    copied: int = 0
    skipped: int = 0
    bytes: int = 0
    index_rows: int = 0
    batch: str | None = None
    missing: list[str] = field(default_factory=list)  # recorded in the source's index, but no object there
    conflicts: int = 0  # rows refused: they restate a key or artifact the destination indexes differently

    def to_json(self) -> dict:
        return asdict(self)


def recorded(store: Store) -> list[str]:
    """The artifacts of a store a ledger line has recorded, in the order they were indexed."""
    q = "SELECT sha256 FROM artifacts" + (" WHERE recorded = 1" if store._tracks_recording else "") + " ORDER BY rowid"
    return [r[0] for r in store._db.execute(q)]


def push(
    local: Store,
    remote: RemoteStore,
    on_start: Callable[[int], None] | None = None,
    on_progress: Progress | None = None,
) -> SyncReport:
    """Copy a local store's recorded artifacts and their index rows to a remote store (see the module doc)."""
    report = SyncReport("push", str(local.root), remote.url)
    shas = recorded(local)
    if on_start:
        on_start(len(shas))
    sent = []
    for sha in shas:
        path = local.object_path(sha)
        if not path.is_file():
            report.missing.append(sha)
            continue
        copied = False
        if remote.remote.head(f"objects/{sha[:2]}/{sha}.kvg") is None:
            with judged(path, sha):  # a file that cannot be hashed as an artifact is damage too (exit 1)
                got = kvg_payload_sha256(path)
            if got != sha:
                raise IntegrityError(
                    f"{path}: payload hashes to {got[:16]}..., not its identity {sha[:16]}...: the "
                    "local object is damaged; nothing of it was sent",
                    "re-deposit it, or pull a good copy",
                )
            copied = remote.upload(sha, source=path)
        size = path.stat().st_size
        report.copied += copied
        report.skipped += not copied
        report.bytes += size if copied else 0
        sent.append(sha)
        if on_progress:
            on_progress(sha, copied, size if copied else 0)
    rows = missing_rows(export_rows(local, sent), remote)
    report.index_rows = len(rows)
    report.batch = remote.publish(rows)
    return report


def pull(
    remote: RemoteStore,
    local: Store,
    on_start: Callable[[int], None] | None = None,
    on_progress: Progress | None = None,
) -> SyncReport:
    """Copy a remote store's recorded artifacts (every index batch, merged when it opened) and their index rows
    into a local store, each object re-hashed before it is renamed into place (see the module doc)."""
    if isinstance(local, RemoteStore):
        raise StoreError(f"pull copies into a local store, not into {local.url}")
    report = SyncReport("pull", remote.url, str(local.root))
    shas = recorded(remote)
    if on_start:
        on_start(len(shas))
    got = []
    for sha in shas:
        if local.has_object(sha):
            report.skipped += 1
            got.append(sha)
            if on_progress:
                on_progress(sha, False, 0)
            continue
        size = remote.fetch(sha, local.object_path(sha))
        report.copied += 1
        report.bytes += size
        got.append(sha)
        if on_progress:
            on_progress(sha, True, size)
    rows = missing_rows(export_rows(remote, got), local)
    report.index_rows = len(rows)
    if rows:
        with _store_errors(local.root, "write to"), local._db:
            local._db.execute("BEGIN IMMEDIATE")
            report.conflicts = merge_rows(local, rows)
    return report
