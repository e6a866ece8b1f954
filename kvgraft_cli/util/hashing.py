"""Hashing and canonical JSON: the digests every other module records."""

from __future__ import annotations

import hashlib
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
