"""The bundle format (docs/BUNDLE.md): artifacts moved between stores as one uncompressed POSIX tar.

Members, in this order: ``kvgraft-bundle.json`` (the listing), ``objects/ab/<sha256>.kvg`` (the store's object files,
byte for byte), ``provenance/checkpoint`` and ``provenance/ledger.jsonl``. The same content always gives the same
bytes: members sorted, mtime 0, uid/gid 0, no user or group names, mode 0644, the listing as RFC 8785 JSON.

Reading is the dangerous half, so :func:`read_bundle` never lets ``tarfile`` extract anything: it checks every
member's type (regular files only: no link, device, fifo, directory or GNU sparse entry), its name (only the exact
names the listing implies, each once) and its size against the listing before copying it, with its SHA-256 computed
on the way, into a staging folder the caller owns. :func:`check_objects` then re-hashes each staged object through
the artifact reader (whose limits refuse zstd bombs before anything large is allocated) and compares it with the
listing. What the ledger lines prove is for runs/bundle.py (the store does not read ledgers).
"""

from __future__ import annotations

import builtins
import hashlib
import io
import os
import re
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifacts import format as kvg
from ..artifacts.inspect import read_info
from ..errors import ArtifactError, InputError, IntegrityError
from ..util import jsonio
from ..util.fsio import fsync_dir
from ..util.hashing import canonical_json, sha256_bytes, sha256_file
from .local import HEX64, Store

FORMAT = "kvgraft-bundle"
VERSION = 1
LISTING = "kvgraft-bundle.json"
CHECKPOINT = "provenance/checkpoint"
LINES = "provenance/ledger.jsonl"
# Bounds on what is read into memory (objects are streamed to disk): a listing row is about 1 KB plus its library
# text; a checkpoint at most 100 signature lines; the provenance lines about 2 KB per deposit.
MAX_LISTING = 256 << 20
MAX_CHECKPOINT = 64 << 10
MAX_LINES = 256 << 20
COPY_CHUNK = 4 << 20
_TYPES = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a fifo",
    tarfile.DIRTYPE: "a directory",
    tarfile.CONTTYPE: "a contiguous file",
    tarfile.GNUTYPE_SPARSE: "a GNU sparse file",
}
_HINT = "ask for a fresh export (`kvgraft store export`); a bundle holds exactly the members docs/BUNDLE.md lists"


def object_name(sha256: str) -> str:
    """The member name (and store-relative path) of an artifact's object file."""
    return f"objects/{sha256[:2]}/{sha256}.kvg"


# -- the store's rows, read for an export --------------------------------------------------------------------------
# Read-only SQL over the store's own tables, kept in this package so local.py (shared) stays as it is.


def recorded_artifacts(store: Store) -> list[str]:
    """Every artifact a ledger line has recorded, by identity."""
    q = "SELECT sha256 FROM artifacts" + (" WHERE recorded = 1" if store._tracks_recording else "")
    return sorted(r[0] for r in store._db.execute(q))


def index_rows(store: Store, sha256: str) -> tuple[list[dict], dict | None]:
    """(the index entries naming an artifact, sorted by key; its library row or None), as a listing holds them."""
    entries = [
        {"key": k, "problem_id": p, "verified": bool(v)}
        for k, p, v in store._db.execute(
            "SELECT key, problem_id, verified FROM entries WHERE artifact = ? ORDER BY key", (sha256,)
        )
    ]
    row = store._db.execute(
        "SELECT problem_id, problem_key, problem, solution, answer FROM library WHERE artifact = ?", (sha256,)
    ).fetchone()
    library = None if row is None else dict(zip(("problem_id", "problem_key", "problem", "solution", "answer"), row))
    return entries, library


def listing_row(store: Store, sha256: str, recorded_by: int) -> dict:
    """One artifact's listing row: hashes and sizes of its object file, what its header says, its index rows."""
    path = store.object_path(sha256)
    info = read_info(path)
    entries, library = index_rows(store, sha256)
    return {
        "sha256": sha256,
        "path": object_name(sha256),
        "file_sha256": sha256_file(path),
        "file_bytes": path.stat().st_size,
        "payload_bytes": info.payload_bytes,
        "num_tokens": info.num_tokens,
        "model_sha256": info.model_sha256,
        "manifest_sha256": info.compute_sha256,
        "parent_sha256": info.parent_sha256,
        "start_position": info.start_position,
        "entries": entries,
        "library": library,
        "recorded_by": recorded_by,
    }


# -- writing -------------------------------------------------------------------------------------------------------


def write_bundle(path: Path, listing: dict, objects: dict[str, Path], checkpoint: bytes, lines: bytes) -> str:
    """Write a bundle atomically (temporary file beside ``path``, fsync, rename); returns its SHA-256.

    ``listing`` holds format, version, artifacts and provenance.lines; the hashes and sizes of the two provenance
    members are filled in here. ``objects`` maps each listed identity to its object file."""
    listing = dict(
        listing,
        provenance=dict(
            listing["provenance"],
            checkpoint=_member_digest(CHECKPOINT, checkpoint),
            ledger=_member_digest(LINES, lines),
        ),
    )
    members: list[tuple[str, Any, int]] = [(LISTING, canonical_json(listing), 0)]
    for a in sorted(listing["artifacts"], key=lambda a: a["path"]):
        members.append((a["path"], objects[a["sha256"]], a["file_bytes"]))
    members += [(CHECKPOINT, checkpoint, 0), (LINES, lines, 0)]
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as raw:
            out = _HashingWriter(raw, h)
            # PAX: identical to ustar for these short ASCII names and integer fields, and still right for an object
            # larger than ustar's 8 GiB size field (tarfile then adds a pax size record).
            # (typeshed's file object for tarfile.open also reads, seeks and closes; mode "w" only writes and tells)
            with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                for name, data, size in members:
                    info = tarfile.TarInfo(name)
                    info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
                    if isinstance(data, bytes):
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
                    else:
                        info.size = size
                        with open(data, "rb") as f:
                            tar.addfile(info, f)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return h.hexdigest()


def _member_digest(name: str, data: bytes) -> dict:
    return {"path": name, "sha256": sha256_bytes(data), "bytes": len(data)}


class _HashingWriter:
    """A write-only file object that hashes what passes through (the bundle's digest without a second read)."""

    def __init__(self, f, h):
        self.f, self.h = f, h

    def write(self, data) -> int:
        self.h.update(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()


# -- reading -------------------------------------------------------------------------------------------------------


@dataclass
class Staged:
    """A bundle read into a staging folder: every member's type, name, size and SHA-256 checked against the listing
    (objects not yet re-hashed as artifacts: :func:`check_objects`)."""

    source: str
    sha256: str  # of the bundle file
    bytes: int
    listing: dict
    listing_sha256: str
    objects: dict[str, Path] = field(default_factory=dict)  # identity -> staged object file
    checkpoint: builtins.bytes = b""  # (builtins: the field ``bytes`` above shadows the type in this class body)
    lines: builtins.bytes = b""
    provenance: dict[int, dict] = field(default_factory=dict)  # seq -> parsed provenance line (runs/bundle.py)

    @property
    def artifacts(self) -> list[dict]:
        return self.listing["artifacts"]


def read_bundle(path: Path, staging: Path) -> Staged:
    """Read the bundle at ``path``, copying its objects into ``staging`` (an empty folder the caller removes).
    Raises ArtifactError (bad input, exit 2) naming the offending member, IntegrityError (exit 1) for a member
    whose bytes differ from the listing's hash."""
    path = Path(path)
    source = str(path)
    try:
        st = path.stat()
    except OSError as e:
        raise InputError(f"cannot read bundle {source}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"bundle {source} is not a regular file")
    bundle_sha = sha256_file(path)
    try:
        tar = tarfile.open(path, mode="r:")  # "r:": an uncompressed tar and nothing else
    except (tarfile.TarError, OSError) as e:
        raise ArtifactError(f"{source}: not an uncompressed tar bundle ({e})", _HINT) from None
    with tar:
        try:
            return _read_members(tar, source, bundle_sha, st.st_size, Path(staging))
        except tarfile.TarError as e:  # a damaged header in the middle
            raise ArtifactError(f"{source}: damaged tar ({e})", _HINT) from None


def _read_members(tar: tarfile.TarFile, source: str, bundle_sha: str, size: int, staging: Path) -> Staged:
    first = tar.next()
    if first is None:
        raise ArtifactError(f"{source}: empty bundle (no {LISTING})", _HINT)
    _check_member(first, source)
    if first.name != LISTING:
        raise ArtifactError(f"{source}: entry {first.name!r}: the first member must be {LISTING}", _HINT)
    raw = _read_small(tar, first, MAX_LISTING, source)
    try:
        listing = jsonio.loads(raw)
    except ValueError as e:
        raise ArtifactError(f"{source}: entry {LISTING!r}: not JSON ({str(e)[:120]})", _HINT) from None
    check_listing(listing, f"{source}: entry {LISTING!r}")
    staged = Staged(source, bundle_sha, size, listing, sha256_bytes(raw))
    prov = listing["provenance"]
    expected: dict[str, tuple[str, dict]] = {a["path"]: ("object", a) for a in listing["artifacts"]}
    expected[CHECKPOINT] = ("checkpoint", prov["checkpoint"])
    expected[LINES] = ("lines", prov["ledger"])
    seen: set[str] = {LISTING}
    while (m := tar.next()) is not None:
        _check_member(m, source)
        if m.name in seen:
            raise ArtifactError(
                f"{source}: entry {m.name!r} appears twice (a later copy would replace the first)", _HINT
            )
        if m.name not in expected:
            raise ArtifactError(f"{source}: entry {m.name!r} is not in the listing", _HINT)
        seen.add(m.name)
        what, row = expected[m.name]
        want_bytes = row["file_bytes"] if what == "object" else row["bytes"]
        want_sha = row["file_sha256"] if what == "object" else row["sha256"]
        if m.size != want_bytes:
            raise ArtifactError(
                f"{source}: entry {m.name!r} holds {m.size:,} bytes, the listing says {want_bytes:,}", _HINT
            )
        if what == "object":
            dest = staging / f"{row['sha256']}.kvg"
            got = _copy_hashed(tar, m, dest)
            staged.objects[row["sha256"]] = dest
        else:
            data = _read_small(tar, m, MAX_CHECKPOINT if what == "checkpoint" else MAX_LINES, source)
            got = sha256_bytes(data)
            setattr(staged, what, data)
        if got != want_sha:
            raise IntegrityError(
                f"{source}: entry {m.name!r}: SHA-256 {got[:16]}... differs from the listing's "
                f"{want_sha[:16]}... (tampered or damaged in transit)",
                "fetch the bundle again from its source",
            )
    missing = sorted(set(expected) - seen)
    if missing:
        raise ArtifactError(
            f"{source}: entry {missing[0]!r} is in the listing but not in the bundle"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            _HINT,
        )
    return staged


def _check_member(m: tarfile.TarInfo, source: str) -> None:
    """Refuse a member that is not a plain regular file with a plain relative name."""
    name = m.name
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or ".." in parts:
        raise ArtifactError(f"{source}: entry {name!r}: path escapes the store (absolute or with '..')", _HINT)
    if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or m.issparse():
        what = _TYPES.get(m.type, f"of tar type {m.type!r}")
        link = f" to {m.linkname!r}" if m.issym() or m.islnk() else ""
        raise ArtifactError(f"{source}: entry {name!r} is {what}{link}; a bundle holds regular files only", _HINT)
    if m.size < 0:  # a pax "size" record may say anything
        raise ArtifactError(f"{source}: entry {name!r} declares a negative size ({m.size:,} bytes)", _HINT)


def _read_small(tar: tarfile.TarFile, m: tarfile.TarInfo, limit: int, source: str) -> bytes:
    if m.size > limit:
        raise ArtifactError(
            f"{source}: entry {m.name!r} is {m.size:,} bytes, more than the {limit:,} a reader accepts", _HINT
        )
    f = tar.extractfile(m)
    data = f.read() if f is not None else b""
    if len(data) != m.size:
        raise ArtifactError(f"{source}: entry {m.name!r}: the bundle ends inside it", _HINT)
    return data


def _copy_hashed(tar: tarfile.TarFile, m: tarfile.TarInfo, dest: Path) -> str:
    """Copy a member's bytes (never more than its declared size) to ``dest``, fsynced; returns their SHA-256."""
    h, left = hashlib.sha256(), m.size
    src = tar.extractfile(m)
    with open(dest, "xb") as out:
        while left:
            chunk = src.read(min(COPY_CHUNK, left)) if src is not None else b""
            if not chunk:
                # (tar.name: a str, the absolute path read_bundle opened the tar by)
                raise ArtifactError(f"{tar.name!s}: entry {m.name!r}: the bundle ends inside it", _HINT)
            h.update(chunk)
            out.write(chunk)
            left -= len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return h.hexdigest()


# -- the listing ---------------------------------------------------------------------------------------------------

_ROW: dict[str, type[Any]] = {
    "sha256": str,
    "path": str,
    "file_sha256": str,
    "file_bytes": int,
    "payload_bytes": int,
    "num_tokens": int,
    "model_sha256": str,
    "manifest_sha256": str,
    "start_position": int,
    "entries": list,
    "recorded_by": int,
}


def check_listing(listing: Any, where: str) -> None:
    """Refuse a listing that is not what docs/BUNDLE.md describes (types, hex digests, names derived from hashes,
    no identity twice), naming the first bad field."""

    def bad(msg: str) -> ArtifactError:
        return ArtifactError(f"{where}: {msg}", _HINT)

    def hex64(v: Any) -> bool:
        return isinstance(v, str) and HEX64.match(v) is not None

    if not isinstance(listing, dict) or listing.get("format") != FORMAT:
        raise bad(f"not a kvgraft bundle listing (format must be {FORMAT!r})")
    if listing.get("version") != VERSION:
        raise bad(f"bundle version {listing.get('version')!r}; this kvgraft reads version {VERSION}")
    arts, prov = listing.get("artifacts"), listing.get("provenance")
    if not isinstance(arts, list) or not isinstance(prov, dict):
        raise bad("artifacts must be a list and provenance an object")
    seen: set[str] = set()
    for i, a in enumerate(arts):
        at = f"artifacts[{i}]"
        if not isinstance(a, dict):
            raise bad(f"{at} is not an object")
        for k, t in _ROW.items():
            v = a.get(k)
            if not isinstance(v, t) or isinstance(v, bool) or (t is int and v < 0):
                raise bad(f"{at}.{k} must be a{' non-negative integer' if t is int else ' ' + t.__name__}")
        for k in ("sha256", "file_sha256", "model_sha256", "manifest_sha256"):
            if not hex64(a[k]):
                raise bad(f"{at}.{k} is not 64 lowercase hex digits")
        if a["parent_sha256"] is not None and not hex64(a["parent_sha256"]):
            raise bad(f"{at}.parent_sha256 is neither null nor 64 lowercase hex digits")
        if a["path"] != object_name(a["sha256"]):
            raise bad(f"{at}.path {a['path'][:100]!r} is not {object_name(a['sha256'])!r}")
        if a["sha256"] in seen:
            raise bad(f"{at}: artifact {a['sha256'][:16]}... is listed twice")
        seen.add(a["sha256"])
        for j, e in enumerate(a["entries"]):
            if not (
                isinstance(e, dict)
                and isinstance(e.get("key"), str)
                and hex64(e["key"])
                and isinstance(e.get("problem_id"), str)
                and isinstance(e.get("verified"), bool)
            ):
                raise bad(f"{at}.entries[{j}] needs key (64 hex), problem_id (string) and verified (boolean)")
        lib = a.get("library")
        if lib is not None and not (
            isinstance(lib, dict)
            and all(isinstance(lib.get(k), str) for k in ("problem_id", "problem_key", "problem", "solution"))
            and hex64(lib["problem_key"])
            and isinstance(lib.get("answer"), (str, type(None)))
        ):
            raise bad(f"{at}.library needs problem_id, problem_key (64 hex), problem, solution and answer")
    for name, member in (("checkpoint", CHECKPOINT), ("ledger", LINES)):
        d = prov.get(name)
        if not (
            isinstance(d, dict)
            and d.get("path") == member
            and hex64(d.get("sha256"))
            and type(d.get("bytes")) is int
            and d["bytes"] >= 0
        ):
            raise bad(f"provenance.{name} needs path {member!r}, sha256 (64 hex) and bytes")
    lines = prov.get("lines")
    if not isinstance(lines, list):
        raise bad("provenance.lines must be a list")
    for i, ln in enumerate(lines):
        if not (
            isinstance(ln, dict)
            and type(ln.get("seq")) is int
            and ln["seq"] >= 0
            and isinstance(ln.get("proof"), list)
            and all(hex64(p) for p in ln["proof"])
        ):
            raise bad(f"provenance.lines[{i}] needs seq (integer) and proof (list of 64-hex hashes)")
        if i and ln["seq"] <= lines[i - 1]["seq"]:
            raise bad(f"provenance.lines[{i}]: seq {ln['seq']} does not follow {lines[i - 1]['seq']} (ascending)")


# -- the objects ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectFacts:
    """What a re-hashed staged object holds, beyond its listing row: the SHA-256 of its token ids, and its links."""

    sha256: str
    token_ids: list[int]
    parent: str | None
    start: int
    num_tokens: int


def check_objects(staged: Staged) -> dict[str, ObjectFacts]:
    """Re-hash every staged object as an artifact against its listed identity (kvg.open_file: the reader limits
    refuse a zstd bomb before allocating its declared size) and compare what its header says with its listing row.
    IntegrityError for bytes that do not hash to the identity, ArtifactError for a row that disagrees."""
    facts = {}
    for a in staged.artifacts:
        name, path = a["path"], staged.objects[a["sha256"]]
        where = f"{staged.source}: entry {name!r}"
        try:
            info = read_info(path)  # header only: a lying size is refused before anything is decompressed
            if info.payload_bytes > a["payload_bytes"]:
                raise IntegrityError(
                    f"declares a payload of {info.payload_bytes:,} bytes, the listing says {a['payload_bytes']:,}"
                )
            sha, art = kvg.open_file(path, expected_sha256=a["sha256"])
        except ArtifactError as e:
            raise type(e)(f"{where}: {e.message.replace(str(path) + ': ', '')}", e.hint) from None
        got = {
            "payload_bytes": info.payload_bytes,
            "num_tokens": art.num_tokens,
            "model_sha256": art.meta.get("model_sha256"),
            "manifest_sha256": art.meta.get("manifest_sha256"),
            "parent_sha256": art.parent,
            "start_position": art.start,
        }
        for k, v in got.items():
            if a.get(k) != v:
                raise ArtifactError(
                    f"{where}: the listing says {k} {str(a.get(k))[:64]}, the artifact holds {str(v)[:64]}", _HINT
                )
        facts[sha] = ObjectFacts(sha, art.token_ids, art.parent, art.start, art.num_tokens)
        del art  # one artifact's tensors in memory at a time
    return facts


def place(staged_file: Path, dest: Path) -> None:
    """Move a verified staged object to its place in the store atomically (a rename within the store's file
    system; a copy, fsync and rename when the staging folder lies on another one)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(staged_file, dest)
    except OSError as e:
        import errno
        import shutil

        if e.errno != errno.EXDEV:
            raise
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        shutil.copyfile(staged_file, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    fsync_dir(dest.parent)
