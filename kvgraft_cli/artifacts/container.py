"""The ``.kvg`` file's codecs: a bare zstd frame (``zstd``, the v1 file, payload.py), or the v2 container holding the
payload either as it is (``raw``), page-aligned so it can be read straight into place, or byte-plane shuffled and
compressed in independent chunks (``shuffle-zstd``), for archives and transfers.

A v2 file (docs/FORMAT.md)::

    bytes 0-7     magic 89 4B 56 47 0D 0A 1A 0A ("\\x89KVG\\r\\n\\x1a\\n"; a zstd frame starts 28 B5 2F FD)
    bytes 8-11    H, unsigned 32-bit little-endian: the length of the container header (at most 8 MiB)
    next H bytes  the container header: compact JSON, sorted keys, ASCII, e.g.
                  {"codec":"raw","payload_bytes":N,"payload_offset":4096,"version":2}
    zero bytes up to payload_offset (12 + H rounded up to a multiple of 4096), then the codec's data; the file ends
    exactly where that data ends

raw: the N payload bytes. shuffle-zstd adds ``chunk_bytes`` (C), ``element_bytes`` (E) and ``chunks`` (one
``[stored bytes, SHA-256 of the stored bytes]`` per C bytes of payload, the last one shorter): each chunk of the
payload is byte-plane shuffled (plane i = byte i of every E-byte element, planes in order, a tail shorter than E kept
as is at the end) and stored as one zstd frame, the frames back to back from payload_offset.

The identity never depends on the codec: it is the payload's (identity.py: its SHA-256, or the sha256-tree its
header names) in every case. The codec is chosen by
:func:`default_codec` (raw: see there for the measurements) and overridable.

A raw payload is read into one private buffer in chunks while other threads hash each chunk already read (both
release the GIL), so the identity check overlaps the read, and the bytes hashed are exactly the bytes used: the hash
runs over the private buffer, never over the file a second time. A shuffle-zstd payload is checked chunk by chunk
(its stored SHA-256, then a frame that declares exactly the chunk's size) and decompressed by a few threads into one
private buffer, each chunk handed to the hasher once in place. Nothing is returned before the digest matches.
Torch-free, numpy-free (the shuffle is bytes slicing with a step, a C loop).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArtifactError, InputError, IntegrityError
from .identity import PayloadHasher
from .payload_rules import MAX_HEADER, identity_mismatch, max_frame_bytes, parse_header, too_large
from .payload_rules import REFETCH as _REFETCH

MAGIC = b"\x89KVG\r\n\x1a\n"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PAGE = 4096
PAYLOAD_OFFSET = 4096  # a raw file's (its container header is a few dozen bytes)
MAX_CONTAINER_HEADER = 8 << 20  # a shuffle-zstd chunk table takes ~80 bytes a chunk: ~10 KB a GiB of payload
CODECS = ("raw", "zstd", "shuffle-zstd")  # what this kvgraft writes; "auto" picks by dtype
CONTAINER_CODECS = ("raw", "shuffle-zstd")
CHUNK = 8 << 20  # raw reads
SHUFFLE_CHUNK = 8 << 20  # shuffle-zstd: payload bytes per chunk (one zstd frame each) that this kvgraft writes
MIN_SHUFFLE_CHUNK, MAX_SHUFFLE_CHUNK = 64 << 10, 64 << 20  # what a reader accepts
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the shuffle's element size for a KV dtype
EAGER = 256 << 20  # see read_container: a larger payload that is over 8x its file is hashed before it is allocated


def default_codec(dtype: str) -> str:
    """The codec for a payload of this KV dtype: raw, for every dtype. Restore time is what kvgraft optimizes, and
    neither compressed codec restores as fast as raw: decompression is slower than reading the page cache, and KV's
    mantissa noise leaves zstd little to save. shuffle-zstd makes the smallest files and restores about as fast as
    zstd or faster (its chunks decompress in parallel), but still slower than raw; so ``auto`` stays raw, and
    ``--codec shuffle-zstd`` is the one for archives and transfers. ``benchmarks/bench_restore.py --tokens 2048 8192
    --no-prefill`` measures the three side by side (docs/PERFORMANCE.md, "Restore speed", the codec table)."""
    return "raw"


def pick_codec(codec: str, dtype: str) -> str:
    """``codec`` as given, or for "auto" the dtype's default; InputError for an unknown one."""
    if codec == "auto":
        return default_codec(dtype)
    if codec not in CODECS:
        raise InputError(f"unknown codec {codec!r}", f"choose one of auto, {', '.join(CODECS)}")
    return codec


def element_bytes(dtype: str) -> int:
    """The byte-plane shuffle's element size for a payload of this KV dtype (1: no shuffle, for an unknown one)."""
    return ELEMENT_BYTES.get(dtype, 1)


def _payload_offset(header_bytes: int) -> int:
    """Where a container's data starts: the first page boundary after its header."""
    return -(-(12 + header_bytes) // PAGE) * PAGE


def _container(meta: dict) -> bytes:
    header = json.dumps(meta, separators=(",", ":"), sort_keys=True, ensure_ascii=True).encode()
    if len(header) > MAX_CONTAINER_HEADER:
        raise ValueError(f"container header of {len(header):,} bytes is over {MAX_CONTAINER_HEADER:,}")
    offset = _payload_offset(len(header))
    if meta["payload_offset"] != offset:
        return _container({**meta, "payload_offset": offset})
    head = MAGIC + struct.pack("<I", len(header)) + header
    return head + b"\0" * (offset - len(head))


def raw_file(payload: bytes) -> bytes:
    """The bytes of a v2 file holding ``payload`` raw."""
    return (
        _container({"codec": "raw", "payload_bytes": len(payload), "payload_offset": PAYLOAD_OFFSET, "version": 2})
        + payload
    )


# --- the byte-plane shuffle (bytes slicing with a step, a C loop; numpy only where it is already loaded) ---


def shuffle(chunk: bytes, size: int) -> bytes:
    """Byte planes of ``chunk`` taken as ``size``-byte elements: byte 0 of every element, then byte 1, ...; a tail
    shorter than ``size`` stays at the end as it is."""
    whole = len(chunk) // size * size
    if size == 1 or not whole:
        return bytes(chunk)
    return b"".join([chunk[i:whole:size] for i in range(size)] + [chunk[whole:]])


def unshuffle_into(dst: bytearray, pos: int, planes: bytes, size: int) -> None:
    """Write the inverse of :func:`shuffle` of ``planes`` into ``dst[pos:pos + len(planes)]``. With numpy already
    loaded (a graft: torch loads it) a column copy that releases the GIL, faster than slicing (docs/PERFORMANCE.md,
    "Restore speed"); else bytes slicing with a step (torch-free readers: `kvgraft verify` never imports numpy). Both
    give the same bytes (tests/test_codecs.py)."""
    m = len(planes) // size
    whole = m * size
    if size == 1 or not whole:
        dst[pos : pos + len(planes)] = planes
        return
    np = sys.modules.get("numpy")
    if np is not None:
        src = np.frombuffer(planes, dtype=np.uint8, count=whole).reshape(size, m)
        out = np.frombuffer(dst, dtype=np.uint8, count=whole, offset=pos).reshape(m, size)
        for i in range(size):
            out[:, i] = src[i]
    else:
        view = memoryview(planes)
        for i in range(size):
            dst[pos + i : pos + whole : size] = view[i * m : (i + 1) * m]
    dst[pos + whole : pos + len(planes)] = memoryview(planes)[whole:]


_local = threading.local()  # one zstd context per thread (they are not thread-safe; creating one costs a few MB)


def _compressor(level: int):
    import zstandard

    c = getattr(_local, "c", None)
    if c is None or _local.level != level:
        _local.c, _local.level = (
            zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True),
            level,
        )
    return _local.c


def _decompressor():
    import zstandard

    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def _workers() -> int:
    return max(2, min(4, os.cpu_count() or 1))


def shuffle_zstd_file(payload: bytes, element: int, level: int = 3, chunk_bytes: int = SHUFFLE_CHUNK) -> bytes:
    """The bytes of a v2 file holding ``payload`` as shuffle-zstd: ``chunk_bytes`` chunks, each shuffled in
    ``element``-byte elements and compressed as its own zstd frame (in a few threads: zstd releases the GIL)."""
    if (
        element not in (1, 2, 4, 8)
        or chunk_bytes % element
        or not (MIN_SHUFFLE_CHUNK <= chunk_bytes <= MAX_SHUFFLE_CHUNK)
    ):
        raise ValueError(f"shuffle-zstd: element {element}, chunk {chunk_bytes}")
    view = memoryview(payload)

    def one(pos: int) -> tuple[bytes, str]:
        frame = _compressor(level).compress(shuffle(view[pos : pos + chunk_bytes].tobytes(), element))
        return frame, hashlib.sha256(frame).hexdigest()

    with ThreadPoolExecutor(_workers()) as pool:
        frames = list(pool.map(one, range(0, len(payload), chunk_bytes)))
    meta = {
        "chunk_bytes": chunk_bytes,
        "chunks": [[len(b), sha] for b, sha in frames],
        "codec": "shuffle-zstd",
        "element_bytes": element,
        "payload_bytes": len(payload),
        "payload_offset": 0,
        "version": 2,
    }
    return b"".join([_container(meta), *(b for b, _ in frames)])


# --- reading a container ---


@dataclass(frozen=True)
class Container:
    """A v2 file's container header, checked against the file (:func:`parse_container`)."""

    codec: str
    offset: int
    payload_bytes: int
    chunk_bytes: int = 0
    element_bytes: int = 1
    chunks: tuple = ()  # shuffle-zstd: (stored bytes, SHA-256 hex) per chunk

    def spans(self, first: int = 0) -> Iterator[tuple[int, int, int, str, int, int]]:
        """(index, file offset, stored bytes, SHA-256, payload position, payload bytes) of each chunk from
        ``first`` on."""
        at = self.offset + sum(c[0] for c in self.chunks[:first])
        for i in range(first, len(self.chunks)):
            stored, sha = self.chunks[i]
            pos = i * self.chunk_bytes
            yield i, at, stored, sha, pos, min(self.chunk_bytes, self.payload_bytes - pos)
            at += stored


def is_container(head: bytes) -> bool:
    """Whether a file's first bytes are the v2 container's (else it must be a zstd frame)."""
    return head[:8] == MAGIC


def _corrupt(source: str, why: str) -> IntegrityError:
    return IntegrityError(f"{source}: corrupt .kvg container header ({why})", _REFETCH)


def parse_container(f, file_size: int, source: str, cap: int) -> Container:
    """Check a v2 file's container header against the file (every rule of docs/FORMAT.md that does not need the
    data itself) before anything it declares is allocated."""
    f.seek(0)
    head = f.read(12)
    if len(head) < 12 or head[:8] != MAGIC:
        raise IntegrityError(f"{source}: truncated .kvg container header", _REFETCH)
    (h,) = struct.unpack("<I", head[8:12])
    if h > MAX_CONTAINER_HEADER or 12 + h > file_size:
        raise _corrupt(source, f"length {h:,}, in a file of {file_size:,} bytes")
    text = f.read(h)
    if len(text) != h:
        raise IntegrityError(f"{source}: truncated .kvg container header", _REFETCH)
    try:
        meta = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(source, str(e)[:80]) from None
    if not isinstance(meta, dict) or meta.get("version") != 2:
        raise ArtifactError(
            f"{source}: .kvg container version {meta.get('version') if isinstance(meta, dict) else '?'!r}"
            "; this kvgraft reads 2",
            "upgrade kvgraft",
        )
    codec = meta.get("codec")
    if codec not in CONTAINER_CODECS:
        raise ArtifactError(f"{source}: unknown .kvg codec {str(codec)[:40]!r}", "upgrade kvgraft")
    n, offset = meta.get("payload_bytes"), meta.get("payload_offset")
    if type(n) is not int or type(offset) is not int or n <= 0 or offset != _payload_offset(h):
        raise _corrupt(source, f"payload_bytes {str(n)[:40]}, payload_offset {str(offset)[:40]}")
    pad = f.read(offset - 12 - h)
    if len(pad) != offset - 12 - h:
        raise IntegrityError(f"{source}: truncated .kvg container", _REFETCH)
    if any(pad):
        raise IntegrityError(f"{source}: corrupt .kvg container (padding is not zero)", _REFETCH)
    if n > cap:
        raise too_large(source, "container", n, cap)
    if codec == "raw":
        c, stored = Container("raw", offset, n), n
    else:
        c = _chunk_table(meta, n, offset, source)
        stored = sum(s for s, _ in c.chunks)
    if file_size != offset + stored:
        what = "truncated" if file_size < offset + stored else "bytes after the payload in"
        raise IntegrityError(
            f"{source}: {what} .kvg container ({file_size:,} bytes, header says {offset + stored:,})", _REFETCH
        )
    return c


def _chunk_table(meta: dict, n: int, offset: int, source: str) -> Container:
    size, element, chunks = meta.get("chunk_bytes"), meta.get("element_bytes"), meta.get("chunks")
    if not (
        type(size) is int
        and MIN_SHUFFLE_CHUNK <= size <= MAX_SHUFFLE_CHUNK
        and element in (1, 2, 4, 8)
        and type(element) is int
        and size % element == 0
    ):
        raise _corrupt(source, f"chunk_bytes {str(size)[:40]}, element_bytes {str(element)[:40]}")
    count = -(-n // size)
    if not isinstance(chunks, list) or len(chunks) != count:
        raise _corrupt(
            source,
            f"the chunk table has {len(chunks) if isinstance(chunks, list) else 'no'} entries, "
            f"a payload of {n:,} bytes in chunks of {size:,} needs {count:,}",
        )
    table = []
    for i, entry in enumerate(chunks):
        length = min(size, n - i * size)
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and type(entry[0]) is int
            and 1 <= entry[0] <= max_frame_bytes(length)
            and isinstance(entry[1], str)
            and len(entry[1]) == 64
            and all(ch in "0123456789abcdef" for ch in entry[1])
        ):
            raise _corrupt(source, f"chunk {i}: {str(entry)[:100]}")
        table.append((entry[0], entry[1]))
    return Container("shuffle-zstd", offset, n, size, element, tuple(table))


def check_container(f, file_size: int, source: str, cap: int) -> tuple[int, int]:
    """A raw v2 file's (payload offset, payload bytes), its container header checked against the file. A file of
    another container codec is refused here: read it with :func:`read_container` or :func:`open_payload`."""
    c = parse_container(f, file_size, source, cap)
    if c.codec != "raw":
        raise ArtifactError(
            f"{source}: a {c.codec} .kvg file is not stored in place (a reader of raw files was handed it)",
            "report this as a kvgraft bug",
        )
    return c.offset, c.payload_bytes


def read_payload_header(f, n: int, source: str) -> tuple[bytes, dict]:
    """From the payload's first byte (``f`` positioned there): its ``8 + N`` header bytes and the parsed header,
    checked before anything the header describes is allocated: a length the payload can hold, the exact size the
    container declares (``n``), and a consistent kvgraft artifact (layout.check_header)."""
    from . import layout

    head = f.read(min(n, 8))
    h = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 2 <= h <= MAX_HEADER or 8 + h > n:
        raise IntegrityError(f"{source}: truncated or corrupt safetensors header (length {h})", _REFETCH)
    head += f.read(h)
    if len(head) != 8 + h:
        raise IntegrityError(f"{source}: truncated payload header", _REFETCH)
    header, described = parse_header(head[8:], source)  # valid JSON, an object
    if described != n:
        raise IntegrityError(
            f"{source}: container declares {n:,} bytes, its payload's header describes {described:,}", _REFETCH
        )
    layout.check_header(header, source)
    return head, header


def read_hashed(f, view: memoryview, hasher: PayloadHasher | None, source: str) -> None:
    """Fill ``view`` from ``f`` in CHUNK reads, handing each chunk to ``hasher`` as soon as it is in memory: the
    bytes hashed are the bytes kept, never a second read of the file."""
    pos = 0
    while pos < len(view):
        got = f.readinto(view[pos : pos + CHUNK])
        if not got:
            raise IntegrityError(f"{source}: truncated .kvg container", _REFETCH)
        if hasher is not None:
            hasher.add(view[pos : pos + got])
        pos += got


def read_container(f, file_size: int, source: str, cap: int, expected_sha256: str | None) -> bytearray:
    """A v2 file's payload in a private buffer, its identity (when expected) checked over that very buffer."""
    c = parse_container(f, file_size, source, cap)
    if c.codec == "raw":
        return _read_raw(f, c, source, expected_sha256)
    return _read_shuffled(f, c, file_size, source, expected_sha256)


def _read_raw(f, c: Container, source: str, expected_sha256: str | None) -> bytearray:
    """A raw v2 file's payload in a private buffer, its identity checked while it is read (see the module doc)."""
    n = c.payload_bytes
    f.seek(c.offset)
    head, _ = read_payload_header(f, n, source)  # consistent before the payload's size is allocated
    buf = bytearray(n)  # at most the file's own size: a raw file cannot declare more than it holds
    view = memoryview(buf)
    view[: len(head)] = head
    hasher = PayloadHasher(source) if expected_sha256 is not None else None
    if hasher is not None:
        hasher.add(view[: len(head)])
    try:
        read_hashed(f, view[len(head) :], hasher, source)
    finally:
        digest = hasher.digest() if hasher is not None else None
    if expected_sha256 is not None and digest != expected_sha256:
        assert digest is not None  # (hashed whenever an identity is expected)
        raise identity_mismatch(source, digest, expected_sha256)
    return buf


def _inflate(frame: bytes, index: int, sha: str, length: int, source: str) -> bytes:
    """One stored chunk's shuffled bytes: its SHA-256 checked against the chunk table first, then a frame that
    declares exactly ``length`` bytes (zstd then allocates that and stops with an error at a byte more), one frame
    and nothing after it."""
    import zstandard

    if hashlib.sha256(frame).hexdigest() != sha:
        raise IntegrityError(
            f"{source}: chunk {index} is damaged (its SHA-256 is not the one in the .kvg chunk table)", _REFETCH
        )
    try:
        declared = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{source}: chunk {index}: corrupt zstd frame ({e})", _REFETCH) from None
    if declared != length:
        shown = "no size" if declared == zstandard.CONTENTSIZE_UNKNOWN else f"{declared:,} bytes"
        raise IntegrityError(
            f"{source}: chunk {index}: its zstd frame declares {shown}, the chunk holds {length:,}", _REFETCH
        )
    try:
        out = _decompressor().decompress(frame, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{source}: chunk {index}: corrupt zstd frame ({e})", _REFETCH) from None
    if len(out) != length:
        raise IntegrityError(f"{source}: chunk {index}: decompresses to {len(out):,} bytes, not {length:,}", _REFETCH)
    return out


def _frames(f, c: Container, source: str, first: int = 0) -> Iterator[tuple[int, bytes, str, int, int]]:
    """(index, stored bytes, SHA-256, payload position, payload bytes) of each chunk, read in file order."""
    for i, at, stored, sha, pos, length in c.spans(first):
        f.seek(at)
        frame = f.read(stored)
        if len(frame) != stored:
            raise IntegrityError(f"{source}: truncated .kvg container (in chunk {i})", _REFETCH)
        yield i, frame, sha, pos, length


def _in_order(jobs: Iterator, work: Callable) -> Iterator:
    """``work(*job)`` for each job in a few threads (zstd and SHA-256 release the GIL), results in job order; at
    most a few jobs in flight (memory: a few chunks)."""
    workers = _workers()
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        try:
            for job in jobs:
                pending.append(pool.submit(work, *job))
                if len(pending) > workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for p in pending:
                p.cancel()


def _iter_shuffled(f, c: Container, source: str, first: int = 0) -> Iterator[bytearray]:
    def work(i, frame, sha, pos, length) -> bytearray:
        out = bytearray(length)
        unshuffle_into(out, 0, _inflate(frame, i, sha, length, source), c.element_bytes)
        return out

    yield from _in_order(_frames(f, c, source, first), work)


class _ChunkReader:
    """A shuffle-zstd payload as a file-like ``read`` from its first byte, a chunk at a time (for its header)."""

    def __init__(self, f, c: Container, source: str):
        self.chunks = _iter_shuffled_serial(f, c, source)
        self.decoded: list[bytearray] = []
        self.pos = 0  # into the concatenation of decoded

    def read(self, k: int) -> bytes:
        have = sum(len(d) for d in self.decoded)
        while have < self.pos + k:
            nxt = next(self.chunks, None)
            if nxt is None:
                break
            self.decoded.append(nxt)
            have += len(nxt)
        out, start = [], 0
        for d in self.decoded:  # the bytes [pos, pos + k) of the decoded chunks, without joining them
            lo, hi = max(self.pos - start, 0), min(self.pos + k - start, len(d))
            if lo < hi:
                out.append(memoryview(d)[lo:hi])
            start += len(d)
        data = b"".join(out)
        self.pos += len(data)
        return data


def _iter_shuffled_serial(f, c: Container, source: str) -> Iterator[bytearray]:
    for i, frame, sha, _pos, length in _frames(f, c, source):
        out = bytearray(length)
        unshuffle_into(out, 0, _inflate(frame, i, sha, length, source), c.element_bytes)
        yield out


def _read_shuffled(f, c: Container, file_size: int, source: str, expected_sha256: str | None) -> bytearray:
    """A shuffle-zstd payload in one private buffer. Its safetensors header (in the first chunk) is checked before
    the payload's size is allocated; a payload over EAGER bytes that is also over 8x the file (far more than genuine
    KV compresses: docs/PERFORMANCE.md's codec table) is first re-hashed against ``expected_sha256`` in a streamed
    pass. Then the chunks are decompressed by a few threads straight into the buffer, each handed to the hasher once
    in place."""
    n = c.payload_bytes
    reader = _ChunkReader(f, c, source)
    read_payload_header(reader, n, source)
    if expected_sha256 is not None and n > EAGER and n > 8 * file_size:
        h = PayloadHasher(source)
        for d in reader.decoded:
            h.add(d)
        for d in _iter_shuffled(f, c, source, len(reader.decoded)):
            h.add(d)
        if (got := h.digest()) != expected_sha256:
            raise identity_mismatch(source, got, expected_sha256)
    buf = bytearray(n)
    view = memoryview(buf)
    hasher = PayloadHasher(source) if expected_sha256 is not None else None
    first = len(reader.decoded)
    try:
        pos = 0
        for d in reader.decoded:  # the first chunk(s), decompressed for the header check
            view[pos : pos + len(d)] = d
            if hasher is not None:
                hasher.add(view[pos : pos + len(d)])
            pos += len(d)
        reader.decoded.clear()

        def work(i, frame, sha, pos, length) -> tuple[int, int]:
            unshuffle_into(buf, pos, _inflate(frame, i, sha, length, source), c.element_bytes)
            return pos, length

        for pos, length in _in_order(_frames(f, c, source, first), work):
            if hasher is not None:
                hasher.add(view[pos : pos + length])
    finally:
        digest = hasher.digest() if hasher is not None else None
    if expected_sha256 is not None and digest != expected_sha256:
        assert digest is not None  # (hashed whenever an identity is expected)
        raise identity_mismatch(source, digest, expected_sha256)
    return buf


def iter_container(f, file_size: int, source: str, cap: int) -> Iterator[bytes | bytearray]:
    """A v2 file's payload in chunks (for a streamed hash: memory is a few chunks)."""
    c = parse_container(f, file_size, source, cap)
    if c.codec == "shuffle-zstd":
        yield from _iter_shuffled(f, c, source)
        return
    f.seek(c.offset)
    pos = 0
    while pos < c.payload_bytes:
        chunk = f.read(min(CHUNK, c.payload_bytes - pos))
        if not chunk:
            raise IntegrityError(f"{source}: truncated .kvg container", _REFETCH)
        pos += len(chunk)
        yield chunk


def open_payload(f, file_size: int, source: str, cap: int) -> tuple[object, int, str]:
    """(reader, payload bytes, codec) of a v2 file: ``reader.read(k)`` gives the payload from its first byte (for
    a payload's header: kvgraft inspect)."""
    c = parse_container(f, file_size, source, cap)
    if c.codec == "raw":
        f.seek(c.offset)
        return f, c.payload_bytes, "raw"
    return _ChunkReader(f, c, source), c.payload_bytes, c.codec


def peek_codec(f) -> str:
    """A file's codec by its first bytes and (a container's) header: "zstd", "raw" or "shuffle-zstd". Lenient: a
    container whose header cannot be read is reported "raw", for the raw reader to refuse with its reason."""
    f.seek(0)
    head = f.read(12)
    if not is_container(head):
        return "zstd"
    try:
        (h,) = struct.unpack("<I", head[8:12])
        if h <= MAX_CONTAINER_HEADER:
            codec = json.loads(f.read(h)).get("codec")
            if codec in CONTAINER_CODECS:
                return codec
    except (struct.error, UnicodeDecodeError, ValueError, RecursionError, AttributeError):
        pass
    return "raw"


def file_codec(path: Path) -> str:
    """The codec of a .kvg file: "raw" or "shuffle-zstd" (v2 container) or "zstd" (a bare frame, v1)."""
    with open(path, "rb") as f:
        return peek_codec(f)


def file_size(f) -> int:
    return os.fstat(f.fileno()).st_size
