"""The ``.kvg`` file's codecs: a bare zstd frame (``zstd``, the v1 file, payload.py) or the v2 container with the
payload stored as it is (``raw``), page-aligned so it can be read straight into place or mapped.

A v2 file (docs/FORMAT.md)::

    bytes 0-7     magic 89 4B 56 47 0D 0A 1A 0A ("\\x89KVG\\r\\n\\x1a\\n"; a zstd frame starts 28 B5 2F FD)
    bytes 8-11    H, unsigned 32-bit little-endian: the length of the container header
    next H bytes  the container header: compact JSON, sorted keys, ASCII:
                  {"codec":"raw","payload_bytes":N,"payload_offset":4096,"version":2}
    zero bytes up to payload_offset, then the N payload bytes; the file ends there

The identity never depends on the codec: it is the SHA-256 of the payload in every case. The codec is chosen by
:func:`default_codec` (raw: zstd's decompression is slower than the page cache, see there) and overridable.

A raw payload is read into one private buffer in chunks while a second thread hashes each chunk already read (both
release the GIL), so the identity check overlaps the read, and the bytes hashed are exactly the bytes used: the hash
runs over the private buffer, never over the file a second time. Nothing is returned before the digest matches.
Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from pathlib import Path
from typing import Iterator

from ..errors import ArtifactError, InputError, IntegrityError

MAGIC = b"\x89KVG\r\n\x1a\n"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PAYLOAD_OFFSET = 4096
MAX_CONTAINER_HEADER = 4096 - 12
CODECS = ("raw", "zstd")  # what this kvgraft writes; "auto" picks by dtype
CHUNK = 8 << 20
_REFETCH = "re-fetch or re-deposit it"


def default_codec(dtype: str) -> str:
    """The codec for a payload of this KV dtype. Measured here (scripts/bench_restore.py, 2,048 tokens of a 135M
    model, 2,048 and 8,176 tokens): zstd buys 1.08x of disk on float32 and 1.28x on bfloat16, and costs 1.5x to 5.2x
    of restore time, because decompression (0.6-0.9 GB/s) is slower than reading the page cache. A graft's restore time is
    what kvgraft optimizes, so every dtype is stored raw by default; ``--codec zstd`` keeps files smaller (for
    archives and transfers)."""
    return "raw"


def pick_codec(codec: str, dtype: str) -> str:
    """``codec`` as given, or for "auto" the dtype's default; InputError for an unknown one."""
    if codec == "auto":
        return default_codec(dtype)
    if codec not in CODECS:
        raise InputError(f"unknown codec {codec!r}", f"choose one of auto, {', '.join(CODECS)}")
    return codec


def raw_file(payload: bytes) -> bytes:
    """The bytes of a v2 file holding ``payload`` raw."""
    header = json.dumps({"codec": "raw", "payload_bytes": len(payload), "payload_offset": PAYLOAD_OFFSET,
                         "version": 2}, separators=(",", ":"), sort_keys=True).encode()
    head = MAGIC + struct.pack("<I", len(header)) + header
    return head + b"\0" * (PAYLOAD_OFFSET - len(head)) + payload


def is_container(head: bytes) -> bool:
    """Whether a file's first bytes are the v2 container's (else it must be a zstd frame)."""
    return head[:8] == MAGIC


def check_container(f, file_size: int, source: str, cap: int) -> tuple[int, int]:
    """Check a v2 file's container header against the file; returns (payload offset, payload bytes)."""
    f.seek(0)
    head = f.read(PAYLOAD_OFFSET)
    if len(head) < 12 or head[:8] != MAGIC:
        raise IntegrityError(f"{source}: truncated .kvg container header", _REFETCH)
    (h,) = struct.unpack("<I", head[8:12])
    if h > MAX_CONTAINER_HEADER or 12 + h > len(head):
        raise IntegrityError(f"{source}: corrupt .kvg container header (length {h})", _REFETCH)
    try:
        meta = json.loads(head[12:12 + h])
    except (UnicodeDecodeError, ValueError) as e:
        raise IntegrityError(f"{source}: corrupt .kvg container header ({str(e)[:80]})", _REFETCH) from None
    if not isinstance(meta, dict) or meta.get("version") != 2:
        raise ArtifactError(f"{source}: .kvg container version {meta.get('version') if isinstance(meta, dict) else '?'!r}"
                            "; this kvgraft reads 2", "upgrade kvgraft")
    if meta.get("codec") != "raw":
        raise ArtifactError(f"{source}: unknown .kvg codec {str(meta.get('codec'))[:40]!r}", "upgrade kvgraft")
    n, offset = meta.get("payload_bytes"), meta.get("payload_offset")
    if type(n) is not int or type(offset) is not int or n <= 0 or offset != PAYLOAD_OFFSET:
        raise IntegrityError(f"{source}: corrupt .kvg container header (payload_bytes {n!r}, payload_offset "
                             f"{offset!r})", _REFETCH)
    if any(head[12 + h:offset]):
        raise IntegrityError(f"{source}: corrupt .kvg container (padding is not zero)", _REFETCH)
    if n > cap:
        from .payload import ENV_MAX_PAYLOAD

        raise ArtifactError(f"{source}: container declares a payload of {n:,} bytes, more than this reader's limit "
                            f"of {cap:,} bytes", f"if the artifact is genuine, raise {ENV_MAX_PAYLOAD} (e.g. 64G)")
    if file_size != offset + n:
        what = "truncated" if file_size < offset + n else "bytes after the payload in"
        raise IntegrityError(f"{source}: {what} .kvg container ({file_size:,} bytes, header says "
                             f"{offset + n:,})", _REFETCH)
    return offset, n


def read_payload_header(f, n: int, source: str) -> tuple[bytes, dict]:
    """From the payload's first byte (``f`` positioned there): its ``8 + N`` header bytes and the parsed header,
    checked before anything the header describes is allocated: a length the payload can hold, the exact size the
    container declares (``n``), and a consistent kvgraft artifact (layout.check_header)."""
    from . import layout
    from .payload import MAX_HEADER, described_size

    head = f.read(min(n, 8))
    h = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 2 <= h <= MAX_HEADER or 8 + h > n:
        raise IntegrityError(f"{source}: truncated or corrupt safetensors header (length {h})", _REFETCH)
    head += f.read(h)
    if len(head) != 8 + h:
        raise IntegrityError(f"{source}: truncated payload header", _REFETCH)
    described = described_size(head[8:], source)  # parses it: valid JSON, an object
    if described != n:
        raise IntegrityError(f"{source}: container declares {n:,} bytes, its payload's header describes "
                             f"{described:,}", _REFETCH)
    header = json.loads(head[8:])
    layout.check_header(header, source)
    return head, header


def read_hashed(f, view: memoryview, hasher: "Hasher | None", source: str) -> None:
    """Fill ``view`` from ``f`` in CHUNK reads, handing each chunk to ``hasher`` as soon as it is in memory: the
    bytes hashed are the bytes kept, never a second read of the file."""
    pos = 0
    while pos < len(view):
        got = f.readinto(view[pos:pos + CHUNK])
        if not got:
            raise IntegrityError(f"{source}: truncated .kvg container", _REFETCH)
        if hasher is not None:
            hasher.add(view[pos:pos + got])
        pos += got


class Hasher:
    """SHA-256 of a buffer's chunks in a second thread, in the order they are handed over."""

    def __init__(self):
        self.h = hashlib.sha256()
        self.q: queue.Queue = queue.Queue()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while (chunk := self.q.get()) is not None:
            self.h.update(chunk)

    def add(self, chunk) -> None:
        self.q.put(chunk)

    def digest(self) -> str:
        self.q.put(None)
        self.t.join()
        return self.h.hexdigest()


def read_raw(f, file_size: int, source: str, cap: int, expected_sha256: str | None) -> bytearray:
    """A raw v2 file's payload in a private buffer, its identity checked while it is read (see the module doc)."""
    from .payload import identity_mismatch

    offset, n = check_container(f, file_size, source, cap)
    f.seek(offset)
    head, _ = read_payload_header(f, n, source)  # consistent before the payload's size is allocated
    buf = bytearray(n)  # at most the file's own size: a raw file cannot declare more than it holds
    view = memoryview(buf)
    view[:len(head)] = head
    hasher = Hasher() if expected_sha256 is not None else None
    if hasher is not None:
        hasher.add(view[:len(head)])
    try:
        read_hashed(f, view[len(head):], hasher, source)
    finally:
        digest = hasher.digest() if hasher is not None else None
    if expected_sha256 is not None and digest != expected_sha256:
        raise identity_mismatch(source, digest, expected_sha256)
    return buf


def iter_raw(f, file_size: int, source: str, cap: int) -> Iterator[bytes]:
    """A raw v2 file's payload in chunks (for a streamed hash: memory is one chunk)."""
    offset, n = check_container(f, file_size, source, cap)
    f.seek(offset)
    pos = 0
    while pos < n:
        chunk = f.read(min(CHUNK, n - pos))
        if not chunk:
            raise IntegrityError(f"{source}: truncated .kvg container", _REFETCH)
        pos += len(chunk)
        yield chunk


def file_codec(path: Path) -> str:
    """The codec of a .kvg file by its first bytes: "raw" (v2 container) or "zstd" (a bare frame, v1)."""
    with open(path, "rb") as f:
        return "raw" if is_container(f.read(8)) else "zstd"


def file_size(f) -> int:
    return os.fstat(f.fileno()).st_size
