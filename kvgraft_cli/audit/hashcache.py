"""Re-hashing referenced files for `kvgraft verify`, fast, with a cache of files already verified.

An artifact (``*.kvg``) is identified by the SHA-256 of its *payload*, so it is streamed through zstd while a second
thread hashes the output (both release the GIL: on two cores the cost is close to the larger of the two, not their
sum). Any other file is hashed as bytes, exactly as ``sha256sum`` does.

The cache maps (resolved path, size, mtime_ns, inode) to the digest computed last time. It cannot notice a
change that keeps size, mtime and inode (deliberate tampering can); ``--full`` ignores it.

``verify`` never writes into the ledger's folder: the cache lives in the user's cache directory
(``$XDG_CACHE_HOME/kvgraft/verify/``, else ``~/.cache/kvgraft/verify/``), one file per ledger, named by the SHA-256 of
the ledger's resolved path, so two ledgers never share (or overwrite) one cache file. ``--cache PATH`` picks the
file, ``--no-cache`` neither reads nor writes one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..artifacts.payload import check_declared_size, kvg_payload_sha256
from ..errors import ArtifactError, PayloadTooLarge
from ..util.fsio import atomic_write_bytes, user_cache_dir
from ..util.hashing import sha256_file

CACHE_NAME = (
    ".kvgraft-verify-cache.json"  # where earlier versions kept it, beside the ledger: no longer read or written
)


def default_cache_path(ledger: Path) -> Path | None:
    """The verified-file cache of one ledger: ``<user cache dir>/verify/<sha256 of the resolved ledger path>.json``."""
    base = user_cache_dir()
    if base is None:
        return None
    key = hashlib.sha256(str(Path(ledger).resolve()).encode("utf-8", "surrogateescape")).hexdigest()
    return base / "verify" / f"{key}.json"


def raw_digest(path: Path) -> str:
    """The digest the ledger records for a file: payload SHA-256 for .kvg, byte SHA-256 otherwise.
    A damaged artifact gives ``unreadable: ...`` (never equal to a recorded hash)."""
    if path.suffix == ".kvg":
        try:
            return kvg_payload_sha256(path)
        except PayloadTooLarge:  # bad input (exit 2, docs/LEDGER.md), not a mismatch
            raise
        except ArtifactError as e:  # the frame breaks the .kvg rules: truncated, corrupt, trailing bytes
            return f"unreadable: {e.message}"
    return sha256_file(path)


class HashCache:
    """(path, size, mtime_ns, inode) -> digest, kept in a JSON file (``path``; None: in memory only)."""

    def __init__(self, path: Path | None, enabled: bool = True):
        self.path, self.enabled, self.dirty = path, enabled, False
        self.hits = 0  # files whose digest this run took from the cache, unread
        self.entries: dict[str, list] = {}
        # Loaded even with --full (enabled=False: no lookups), so saving keeps the rows this run did not touch.
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text())
            except (ValueError, OSError):
                loaded = None
            # A damaged cache is only a lost speed-up: keep the well-formed rows, drop the rest.
            if isinstance(loaded, dict):
                self.entries = {
                    k: v for k, v in loaded.items() if isinstance(v, list) and len(v) == 4 and isinstance(v[3], str)
                }

    @classmethod
    def for_ledger(cls, ledger: Path, enabled: bool = True) -> HashCache:
        """The cache of a ledger in the user's cache directory (never in the ledger's folder)."""
        return cls(default_cache_path(ledger), enabled)

    def get(self, path: Path) -> tuple[str | None, list]:
        st = os.stat(path)
        key = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.entries.get(str(path.resolve())) if self.enabled else None
        return (hit[3] if hit and hit[:3] == key else None), key

    def put(self, path: Path, key: list, digest: str) -> None:
        if not digest.startswith("unreadable"):
            self.entries[str(path.resolve())] = key + [digest]
            self.dirty = True

    def save(self) -> None:
        # Written even after --full, so the next plain run profits from the fresh hashes.
        if self.dirty and self.path is not None:
            try:
                atomic_write_bytes(self.path, json.dumps(self.entries, sort_keys=True).encode())
            except OSError:
                pass  # a read-only or missing cache folder: verification works, only slower next time


def digest_of(path: Path, cache: HashCache) -> str:
    """The recorded-style digest of a file, from the cache when its stat is unchanged."""
    hit, key = cache.get(path)
    if hit is not None:
        if path.suffix == ".kvg":
            check_declared_size(path)  # the payload limit holds for a cached file too (its header only is read)
        cache.hits += 1
        return hit
    d = raw_digest(path)
    cache.put(path, key, d)
    return d
