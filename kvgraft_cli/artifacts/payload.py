"""The ``.kvg`` file frame: the only place its rules live. A ``.kvg`` file is exactly one zstd frame that declares
its content size (and carries zstd's checksum); its decompressed bytes are the canonical payload, whose SHA-256 is
the artifact's identity. A frame that ends early, declares no size, decompresses to another size, or has bytes
after it is refused with :class:`IntegrityError` (an :class:`ArtifactError`, exit 1) naming the file.

Bounded resources on any input (a 30 KB file can declare, or decompress to, 64 GiB):

- The frame's structure (header, block headers, checksum, end of file) is checked before anything is
  decompressed, and a frame that declares more than the payload limit is refused at once (:class:`ArtifactError`,
  exit 2). The limit is ``KVGRAFT_MAX_PAYLOAD`` (bytes, or with a K/M/G/T suffix, binary: ``64G``), default 32 GiB.
- A payload is a safetensors file, so its first ``8 + N`` bytes (length, then a JSON header of at most
  :data:`MAX_HEADER` bytes) describe every tensor's dtype, shape and offsets: exactly how long the payload is. Only
  that header is decompressed first; the frame must declare exactly the size it describes, else the file is refused
  before the rest is decompressed.
- Decompression is streamed in chunks of at most :data:`CHUNK` bytes and stops at the first byte past the declared
  size.

Three readers share these rules: :func:`read_payload` (a ``.kvg`` file into memory, for a graft: the whole payload is
allocated only after the checks above, and past :data:`EAGER` bytes only after its identity has been re-hashed in a
streamed pass), :func:`decompress` (bytes held in memory) and :func:`kvg_payload_sha256` (streamed through zstd
while a second thread hashes the output, for `kvgraft verify`: both release the GIL, so on two cores the cost is
close to the larger of the two, not their sum; its memory is a few chunks whatever the file declares). Torch-free.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ArtifactError, IntegrityError, PayloadTooLarge
from ..util.limits import size_setting  # noqa: F401  re-exported: readers and tests name it here
from . import container, layout
from .identity import PayloadHasher

# The rules every reader shares (the v2 container too); re-exported, since readers and tests name them here.
from .payload_rules import (  # noqa: F401
    DEFAULT_MAX_PAYLOAD,
    ENV_MAX_PAYLOAD,
    MAX_HEADER,
    ST_SIZES,
    ZSTD_MAGIC,
    described_size,
    identity_mismatch,
    max_payload,
    not_an_artifact,
    too_large,
)
from .payload_rules import REFETCH as _REFETCH
from .payload_rules import max_frame_bytes as _max_frame_bytes

CHUNK = 1 << 22
EAGER = 256 << 20  # read_payload re-hashes a larger payload in a streamed pass before it allocates it
BLOCK_MAX = 1 << 17  # zstd's largest block (RFC 8878 Block_Maximum_Size)
_FRAME_HEADER_MAX = 18


def compress(payload: bytes, level: int = 3) -> bytes:
    """One zstd frame of the payload, with content size and checksum in the frame header."""
    import zstandard

    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(payload)


def check_declared_size(path: Path) -> None:
    """Hold a ``.kvg`` file to the payload limit by its header alone (the zstd frame header, or the container
    header): PayloadTooLarge when it declares more. What `verify` applies to a file it takes from its cache unread.
    A header that cannot be read is left to the full read (this raises nothing else)."""
    import zstandard

    source, cap = str(path), max_payload()
    try:
        with _open(Path(path)) as f:
            head = f.read(_FRAME_HEADER_MAX)
            if container.is_container(head):
                container.parse_container(f, os.fstat(f.fileno()).st_size, source, cap)
                return
            size = zstandard.get_frame_parameters(head).content_size
    except PayloadTooLarge:
        raise
    except (ArtifactError, zstandard.ZstdError):
        return
    if size not in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) and size > cap:
        raise too_large(source, "zstd frame", size, cap)


def _frame_size(read_at: Callable[[int, int], bytes], file_size: int, source: str, cap: int) -> int:
    """Check a frame's structure without decompressing anything (its header, every block header, the checksum, the
    end of the file) and return the content size it declares, refused above ``cap``."""
    import zstandard

    head = read_at(0, _FRAME_HEADER_MAX)
    if not head:
        raise IntegrityError(f"{source}: empty file, not a .kvg frame", _REFETCH)
    if head[:4] != ZSTD_MAGIC:  # what inspect.read_info says of it too: not an artifact (artifacts.verdict)
        raise not_an_artifact(source)
    try:
        params = zstandard.get_frame_parameters(head)
        pos = zstandard.frame_header_size(head)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{source}: truncated or corrupt zstd frame ({e})", _REFETCH) from None
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) or size <= 0:
        raise IntegrityError(f"{source}: zstd frame has no usable content size (a .kvg frame declares it)")
    if size > cap:
        raise too_large(source, "zstd frame", size, cap)
    if file_size > _max_frame_bytes(size):
        raise IntegrityError(
            f"{source}: {file_size:,} bytes is more than any zstd frame of {size:,} bytes takes", _REFETCH
        )
    while True:  # the blocks: 3-byte headers (last flag, type, size), then their bytes
        b = read_at(pos, 3)
        if len(b) < 3:
            raise IntegrityError(f"{source}: truncated zstd frame", _REFETCH)
        v = int.from_bytes(b, "little")
        kind, n = (v >> 1) & 3, v >> 3
        if kind == 3 or n > BLOCK_MAX:
            raise IntegrityError(f"{source}: corrupt zstd frame (block at byte {pos})", _REFETCH)
        pos += 3 + (1 if kind == 1 else n)
        if v & 1:
            break
        if pos >= file_size:
            raise IntegrityError(f"{source}: truncated zstd frame", _REFETCH)
    pos += 4 if params.has_checksum else 0
    if pos > file_size:
        raise IntegrityError(f"{source}: truncated zstd frame", _REFETCH)
    if pos < file_size:
        raise IntegrityError(f"{source}: bytes after the zstd frame (a .kvg file is exactly one frame)")
    return size


def _checked(chunks: Iterator[bytes], size: int, source: str, strict: bool) -> Iterator[bytes]:
    """Pass decompressed chunks on, refusing the first byte past ``size`` and a payload whose safetensors header
    describes another size (the header is held back until it is checked). Without ``strict`` a payload that does not
    begin with a safetensors header is passed on as opaque bytes (the frame rules alone apply)."""
    produced, need = 0, None  # need: 8 + N once the length is read
    head: bytearray | None = bytearray()
    for out in chunks:
        produced += len(out)
        if produced > size:
            raise IntegrityError(
                f"{source}: zstd frame decompresses to more than the {size:,} bytes it declares", _REFETCH
            )
        if head is not None:
            head += out
            if need is None and len(head) >= 8:
                (n,) = struct.unpack("<Q", head[:8])
                if 2 <= n <= MAX_HEADER and 8 + n <= size:  # the smallest JSON object is "{}"
                    need = 8 + n
                elif strict:
                    raise IntegrityError(f"{source}: truncated or corrupt safetensors header (length {n})", _REFETCH)
                else:
                    need = 0  # not a safetensors payload: opaque bytes
            if need is None or len(head) < need:
                continue
            if need:
                try:
                    described = described_size(bytes(head[8:need]), source)
                    if strict:  # a kvgraft payload: its header must describe a consistent artifact
                        layout.check_header(json.loads(bytes(head[8:need])), source)
                except IntegrityError:
                    if strict:
                        raise
                    described = size
                if described != size:
                    raise IntegrityError(
                        f"{source}: zstd frame declares {size:,} bytes, its payload's header describes {described:,}",
                        _REFETCH,
                    )
            out, head = bytes(head), None
        yield out
    if produced != size:
        raise IntegrityError(f"{source}: truncated zstd frame", _REFETCH)
    if head is not None:
        if strict:
            raise IntegrityError(f"{source}: truncated payload ({size} bytes)", _REFETCH)
        yield bytes(head)


def _stream(f, source: str) -> Iterator[bytes]:
    """The frame's decompressed bytes in chunks of at most CHUNK (zstd checks its checksum at the end)."""
    import zstandard

    try:
        yield from zstandard.ZstdDecompressor().read_to_iter(f, read_size=CHUNK, write_size=CHUNK)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{source}: truncated or corrupt zstd frame ({e})", _REFETCH) from None


def _one_shot(data: bytes, size: int, source: str) -> bytes:
    """Decompress a frame already checked by _frame_size: zstd allocates the declared size and not a byte more."""
    import zstandard

    try:
        out = zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{source}: truncated or corrupt zstd frame ({e})", _REFETCH) from None
    if len(out) != size:
        raise IntegrityError(f"{source}: truncated zstd frame", _REFETCH)
    return out


def _check_header_only(chunks: Iterator[bytes]) -> None:
    """Run the checks of _checked up to the payload's header (its first chunk), then stop decompressing."""
    for _ in chunks:
        break


def decompress(data: bytes, source: str, max_size: int | None = None, strict: bool = False) -> bytes:
    """The payload of a whole ``.kvg`` file held in memory (``strict``: it must be a safetensors payload)."""
    import io

    cap = max_payload() if max_size is None else max_size
    if container.is_container(data[:8]):
        return bytes(container.read_container(io.BytesIO(data), len(data), source, cap, None))
    size = _frame_size(lambda o, n: data[o : o + n], len(data), source, cap)
    _check_header_only(_checked(_stream(io.BytesIO(data), source), size, source, strict))
    return _one_shot(data, size, source)


def _open(path: Path):
    try:
        return open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise ArtifactError(f"artifact not found: {path}") from None
    except IsADirectoryError:
        raise ArtifactError(f"{path} is a directory, expected a .kvg file") from None
    except OSError as e:
        raise ArtifactError(f"cannot read {path}: {e.strerror or e}") from None


def read_payload(path: Path, expected_sha256: str | None = None, max_size: int | None = None) -> bytearray:
    """A ``.kvg`` file's payload in a private buffer, its frame (or container) and safetensors header checked first
    (see the module docstring); with ``expected_sha256`` its identity is checked too, over the very bytes returned
    (hashed in other threads while they are read), and for a zstd payload larger than EAGER also in a streamed
    pass before it is allocated."""
    source = str(path)
    cap = max_payload() if max_size is None else max_size
    with _open(Path(path)) as f:
        if container.is_container(f.read(8)):  # the v2 container (raw, shuffle-zstd): hashed while it is read
            return container.read_container(f, os.fstat(f.fileno()).st_size, source, cap, expected_sha256)

        def read_at(offset: int, n: int) -> bytes:
            f.seek(offset)
            return f.read(n)

        size = _frame_size(read_at, os.fstat(f.fileno()).st_size, source, cap)
        if expected_sha256 is not None and size > EAGER:
            # Large: its identity is checked in a streamed pass before its size is allocated.
            f.seek(0)
            h = PayloadHasher(source)
            for chunk in _checked(_stream(f, source), size, source, strict=True):
                h.add(chunk)
            if (got := h.digest()) != expected_sha256:
                raise identity_mismatch(source, got, expected_sha256)
        # Decompressed in chunks into one buffer of the checked size while other threads hash each chunk: the
        # bytes hashed are the bytes returned (never a second read of the file), and zstd and SHA-256 overlap.
        f.seek(0)
        buf: bytearray | None = None
        view: memoryview | None = None
        hasher = PayloadHasher(source) if expected_sha256 is not None else None
        pos = 0
        try:
            for chunk in _checked(_stream(f, source), size, source, strict=True):
                if view is None:  # the first chunk comes once the payload's header matches the declared size
                    buf = bytearray(size)
                    view = memoryview(buf)
                view[pos : pos + len(chunk)] = chunk
                if hasher is not None:
                    hasher.add(view[pos : pos + len(chunk)])
                pos += len(chunk)
        finally:
            digest = hasher.digest() if hasher is not None else None
    if digest is not None and digest != expected_sha256:
        assert expected_sha256 is not None  # (hashed only when an identity is expected)
        raise identity_mismatch(source, digest, expected_sha256)
    assert buf is not None  # _frame_size refuses a frame that declares no bytes: _checked passed at least one chunk
    return buf


def iter_payload(path: Path, max_size: int | None = None, strict: bool = False) -> Iterator[bytes | bytearray]:
    """The payload of a ``.kvg`` file in chunks of at most CHUNK bytes, read and decompressed a block at a time."""
    source = str(path)
    cap = max_payload() if max_size is None else max_size
    with _open(Path(path)) as f:
        if container.is_container(f.read(8)):
            yield from container.iter_container(f, os.fstat(f.fileno()).st_size, source, cap)
            return

        def read_at(offset: int, n: int) -> bytes:
            f.seek(offset)
            return f.read(n)

        size = _frame_size(read_at, os.fstat(f.fileno()).st_size, source, cap)
        f.seek(0)
        yield from _checked(_stream(f, source), size, source, strict)


def kvg_payload_sha256(path: Path) -> str:
    """A ``.kvg`` file's identity (the SHA-256 of its payload, or the sha256-tree or BLAKE3 its header names:
    identity.py),
    decompressing and hashing in parallel.
    Raises IntegrityError for a frame that breaks the rules above (even one whose data is whole but whose checksum
    is cut off), ArtifactError for one larger than the payload limit."""
    h = PayloadHasher(str(path))
    chunks: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()

    def produce() -> None:
        try:
            for out in iter_payload(path):
                if stop.is_set():
                    return
                chunks.put(out)
            chunks.put(b"")
        except Exception as e:  # handed to the consumer, which re-raises it
            chunks.put(e)

    worker = threading.Thread(target=produce, daemon=True)
    worker.start()
    try:
        while True:
            chunk = chunks.get()
            if isinstance(chunk, Exception):
                raise chunk
            if not chunk:
                break
            h.add(chunk)
    finally:
        stop.set()
        while worker.is_alive():  # unblock a producer waiting on a full queue
            try:
                chunks.get_nowait()
            except queue.Empty:
                pass
            worker.join(0.01)
    return h.digest()
