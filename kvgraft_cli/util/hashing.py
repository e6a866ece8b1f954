"""Hashing, canonical JSON and atomic file writes: the small primitives every other module uses."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import rfc8785

def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, streamed (what ``sha256sum`` prints)."""
    with open(path, "rb") as f:
        # file_digest reads with a large buffer and releases the GIL: fast on multi-GB weights.
        return hashlib.file_digest(f, "sha256").hexdigest()


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) canonical JSON bytes of ``value``.

    We use the ``rfc8785`` package rather than ``json.dumps(sort_keys=True)``: JCS fixes number formatting
    (ECMAScript shortest round-trip) and UTF-16 key ordering, which the standard library does not.
    """
    return rfc8785.dumps(value)


def sha256_json(value: Any) -> str:
    """Hex SHA-256 of the canonical JSON of ``value``."""
    return sha256_bytes(canonical_json(value))


def digest(hex_sha256: str) -> dict[str, str]:
    """A self-describing digest, as the ledger records every input and output."""
    return {"sha256": hex_sha256}


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one, never a part.

    Temporary file in the same directory, fsync, rename, fsync of the directory. ``mode`` defaults to what a plain
    open() would give (0666 less the umask); mkstemp's own 0600 would make shared files unreadable to others.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    if mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where the OS does not allow it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
