"""The ``.kvg`` file frame: the only place its rules live. A ``.kvg`` file is exactly one zstd frame that declares
its content size (and carries zstd's checksum); its decompressed bytes are the canonical payload, whose SHA-256 is
the artifact's identity. A frame that ends early, declares no size, decompresses to another size, or has bytes
after it is refused with :class:`IntegrityError` (an :class:`ArtifactError`, exit 1) naming the file.

Two readers share these rules: :func:`decompress` (a whole file in memory, for a graft) and
:func:`kvg_payload_sha256` (streamed through zstd while a second thread hashes the output, for `kvgraft verify`:
both release the GIL, so on two cores the cost is close to the larger of the two, not their sum). Torch-free.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path
from typing import Iterator

from ..errors import IntegrityError

CHUNK = 1 << 22
MAX_PAYLOAD = 1 << 40
_REFETCH = "re-fetch or re-deposit it"


def compress(payload: bytes, level: int = 3) -> bytes:
    """One zstd frame of the payload, with content size and checksum in the frame header."""
    import zstandard

    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(payload)


def _content_size(head: bytes, source: str, max_size: int) -> int:
    """The payload size a frame header declares (refused unless it is one it can hold)."""
    import zstandard

    try:
        params = zstandard.get_frame_parameters(head)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{source}: truncated or corrupt zstd frame ({e})", _REFETCH) from None
    if params.content_size <= 0 or params.content_size > max_size:
        raise IntegrityError(f"{source}: zstd frame has no usable content size")
    return params.content_size


def _check_end(dobj, produced: int, size: int, source: str) -> None:
    """After the last input byte: the frame is complete, gave its declared size, and nothing follows it."""
    if not dobj.eof or produced != size:
        raise IntegrityError(f"{source}: truncated zstd frame", _REFETCH)
    if dobj.unused_data:
        raise IntegrityError(f"{source}: bytes after the zstd frame (a .kvg file is exactly one frame)")


def decompress(data: bytes, source: str, max_size: int = MAX_PAYLOAD) -> bytes:
    """The payload of a whole ``.kvg`` file held in memory."""
    import zstandard

    size = _content_size(data, source, max_size)
    dobj = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = dobj.decompress(data)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{source}: truncated or corrupt zstd frame ({e})", _REFETCH) from None
    _check_end(dobj, len(out), size, source)
    return out


def iter_payload(path: Path, max_size: int = MAX_PAYLOAD) -> Iterator[bytes]:
    """The payload of a ``.kvg`` file in chunks, read and decompressed a block at a time."""
    import zstandard

    source = str(path)
    dobj = zstandard.ZstdDecompressor().decompressobj()
    size = produced = None
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            if size is None:
                size, produced = _content_size(block, source, max_size), 0
            try:
                out = dobj.decompress(block)
            except zstandard.ZstdError as e:
                raise IntegrityError(f"{source}: truncated or corrupt zstd frame ({e})", _REFETCH) from None
            if out:
                produced += len(out)
                yield out
    if size is None:
        raise IntegrityError(f"{source}: empty file, not a .kvg frame", _REFETCH)
    _check_end(dobj, produced, size, source)


def kvg_payload_sha256(path: Path) -> str:
    """SHA-256 of a ``.kvg`` file's payload (its identity), decompressing and hashing in parallel.
    Raises IntegrityError for a frame that breaks the rules above (even one whose data is whole but whose checksum
    is cut off)."""
    h = hashlib.sha256()
    chunks: queue.Queue = queue.Queue(maxsize=4)

    def produce() -> None:
        try:
            for out in iter_payload(path):
                chunks.put(out)
            chunks.put(b"")
        except Exception as e:  # handed to the consumer, which re-raises it
            chunks.put(e)

    worker = threading.Thread(target=produce, daemon=True)
    worker.start()
    while True:
        chunk = chunks.get()
        if isinstance(chunk, Exception):
            worker.join()
            raise chunk
        if not chunk:
            break
        h.update(chunk)
    worker.join()
    return h.hexdigest()
