"""An artifact's identity: the digest a store names it by, the ledger records and a restore checks every byte against.

Three schemes, named by the payload itself (its metadata key ``identity``; docs/FORMAT.md):

``sha256`` (no ``identity`` key: every artifact deposited before the tree existed, and the default)
    SHA-256 of the whole payload, one stream: what ``sha256sum`` of the payload prints. One core computes it, so a
    restore can never verify faster than SHA-256 runs on one core (docs/PERFORMANCE.md, "Restore speed").

``sha256-tree`` (``identity: sha256-tree``; a manifest's ``artifact.identity``)
    The payload is cut into leaves of LEAF = 1 MiB (the last one may be shorter), and
    ::

        identity = SHA-256( TREE_TAG || u64le(payload length) || SHA-256(leaf 0) || SHA-256(leaf 1) || ... )

    Leaves hash independently, so every core verifies (``PayloadHasher`` hashes them on a thread pool while the
    payload is still being read), and a third party needs hashlib alone. TREE_TAG's first 8 bytes, read as a
    little-endian length, exceed any payload header (payload.MAX_HEADER): the bytes that a tree identity is the
    stream SHA-256 of are never a readable payload, so neither scheme's digest can pass for the other's.

``blake3`` (``identity: blake3``)
    BLAKE3 (its default 256-bit output) of the whole payload: what ``b3sum`` of the payload prints. BLAKE3 is a tree
    hash inside (1 KiB chunks), so one core hashes it faster than SHA-256 (``hashlib``), and the ``blake3`` package
    (the BLAKE3 team's Rust implementation, a wheel on PyPI) spreads a large input over every core. A restore spends
    less CPU on the hash than under sha256-tree (docs/PERFORMANCE.md, "Graft at memory speed"), and a third party
    needs ``b3sum`` or that package. A digest of one function cannot pass for another's (that would be a cross-function
    collision).

The scheme is read from the payload's own header, which the identity covers: changing it changes the digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import ArtifactError

SCHEMES = ("sha256", "sha256-tree", "blake3")
DEFAULT_SCHEME = "sha256"
LEAF = 1 << 20
TREE_TAG = b"kvgraft/sha256-tree/v1\n"
assert struct.unpack("<Q", TREE_TAG[:8])[0] > 1 << 32  # never a payload's header length (see the module doc)
_MAX_HEAD = 8 + (8 << 20)  # a payload's length field and its largest header (payload.MAX_HEADER)


def scheme_of_meta(meta: dict[str, Any], source: str = "artifact") -> str:
    """The identity scheme an artifact's metadata names ("sha256" when it names none)."""
    scheme = meta.get("identity", DEFAULT_SCHEME)
    if scheme not in SCHEMES:
        raise ArtifactError(
            f"{source}: unknown identity scheme {str(scheme)[:40]!r}; this kvgraft knows {', '.join(SCHEMES)}",
            "upgrade kvgraft",
        )
    return scheme


def scheme_of_head(head: bytes | bytearray | memoryview, source: str = "artifact") -> str | None:
    """The scheme named by a payload's first bytes, or None while they do not yet hold its whole header. Bytes
    that are no readable header (a length over the cap, no JSON object, no metadata) are "sha256": the decoder
    refuses such a payload anyway, and the digest it is checked against then simply does not match."""
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", bytes(head[:8]))
    if n > _MAX_HEAD - 8:
        return DEFAULT_SCHEME
    if len(head) < 8 + n:
        return None
    try:
        meta = json.loads(bytes(head[8 : 8 + n])).get("__metadata__")
    except (ValueError, UnicodeDecodeError, RecursionError, AttributeError):
        return DEFAULT_SCHEME
    return scheme_of_meta(meta, source) if isinstance(meta, dict) else DEFAULT_SCHEME


def tree_root(leaf_digests: list[bytes], size: int) -> str:
    """The sha256-tree identity from the leaves' digests (in order) and the payload's length."""
    return hashlib.sha256(TREE_TAG + struct.pack("<Q", size) + b"".join(leaf_digests)).hexdigest()


def payload_identity(payload: bytes | bytearray | memoryview, source: str = "artifact") -> str:
    """The identity of a payload held whole in memory, in the scheme its header names (leaves on every core)."""
    view = memoryview(payload).cast("B")
    scheme = scheme_of_head(view[:_MAX_HEAD], source)
    if scheme == "blake3":
        return blake3_hasher(source)(view, max_threads=workers()).hexdigest()
    if scheme != "sha256-tree":
        return hashlib.sha256(view).hexdigest()
    leaves = [view[i : i + LEAF] for i in range(0, len(view), LEAF)]
    return tree_root(list(_pool().map(_leaf, leaves)), len(view))


def blake3_hasher(source: str = "artifact"):
    """The ``blake3`` package's hasher class (a core dependency; an installation without it cannot name or verify a
    blake3 artifact, and says so)."""
    try:
        from blake3 import blake3
    except ImportError:
        raise ArtifactError(
            f"{source}: is named by its BLAKE3 identity, and the blake3 package is not installed",
            "pip install blake3 (or reinstall kvgraft, which depends on it)",
        ) from None
    return blake3


def _leaf(data) -> bytes:
    return hashlib.sha256(data).digest()


def _hash_parts(parts: list) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.digest()


_POOL: ThreadPoolExecutor | None = None
_POOL_PID = 0
_POOL_LOCK = threading.Lock()


def workers() -> int:
    """Threads that hash tree leaves: every core (hashlib releases the GIL over large buffers);
    KVGRAFT_HASH_THREADS overrides."""
    env = os.environ.get("KVGRAFT_HASH_THREADS", "")
    return max(1, int(env)) if env.isdigit() else max(1, os.cpu_count() or 1)


def _pool() -> ThreadPoolExecutor:
    """One pool per process for every tree hash (its jobs never wait on each other, so sharing cannot deadlock). A
    forked child gets a pool of its own: the parent's threads do not exist there, and jobs sent to them never run."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():
            _POOL, _POOL_PID = ThreadPoolExecutor(workers(), thread_name_prefix="kvgraft-hash"), os.getpid()
        return _POOL


class _Stream:
    """One digest of the chunks (SHA-256, or BLAKE3 with ``h`` given) in one second thread, in the order they are
    handed over. At most 4 hand-offs wait (``add`` blocks beyond that), so a fast producer of transient chunks (a
    zstd stream) cannot pile up memory. ``add_batch`` hands over several chunks at once: a graft's read fills one
    piece per KV head (64 KiB for SmolLM2-135M at 512 tokens in 16 bits), and a hand-off per piece cost more than
    hashing them (docs/PERFORMANCE.md, "Graft at memory speed")."""

    def __init__(self, h: Any = None, name: str = "sha256"):
        self.h = h if h is not None else hashlib.sha256()
        self.q: queue.Queue = queue.Queue(maxsize=4)
        self.done = 0  # bytes hashed so far (or passed over after a failure)
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.t = threading.Thread(target=self._run, daemon=True, name=f"kvgraft-{name}")
        self.t.start()

    def _run(self) -> None:
        # A failed update is kept for digest() to raise, and the thread goes on taking chunks without hashing them:
        # a reader waiting in add() or wait_hashed() is never left blocked on a thread that is gone.
        while (batch := self.q.get()) is not None:
            if self.error is None:
                try:
                    for chunk in batch:
                        self.h.update(chunk)
                except BaseException as e:
                    self.error = e
            with self.cond:
                self.done += sum(len(c) for c in batch)
                self.cond.notify_all()

    def add(self, chunk: memoryview) -> None:
        self.q.put((chunk,))

    def add_batch(self, chunks: list) -> None:
        self.q.put(chunks)

    def wait_hashed(self, upto: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.done >= upto)

    def digest(self) -> str:
        self.q.put(None)
        self.t.join()
        if self.error is not None:
            raise self.error
        return self.h.hexdigest()


class _Tree:
    """sha256-tree leaves on the shared pool as soon as each is whole; a leaf that spans two chunks is hashed from
    both parts in place (no copy). At most ``4 x workers`` leaves wait at once, so a fast reader cannot pile up
    memory ahead of the hashing."""

    def __init__(self):
        self.futures: list[Future] = []
        self.waited = 0  # leaves before this one are known hashed (wait_hashed never re-checks them)
        self.parts: list = []
        self.filled = 0
        self.size = 0
        self.slots = threading.BoundedSemaphore(4 * workers())

    def add(self, chunk: memoryview) -> None:
        self.size += len(chunk)
        pos = 0
        while pos < len(chunk):
            take = min(LEAF - self.filled, len(chunk) - pos)
            self.parts.append(chunk[pos : pos + take])
            self.filled += take
            pos += take
            if self.filled == LEAF:
                self._submit()

    def _submit(self) -> None:
        parts, self.parts, self.filled = self.parts, [], 0
        self.slots.acquire()
        fut = _pool().submit(_hash_parts, parts)
        fut.add_done_callback(lambda _f: self.slots.release())
        self.futures.append(fut)

    def wait_hashed(self, upto: int) -> None:
        if upto <= 0:
            return
        last = (upto - 1) // LEAF  # the leaf holding byte upto-1
        if last >= len(self.futures):  # not whole yet: only later bytes (or digest, at the end) complete it
            raise RuntimeError(f"wait_hashed({upto}): leaf {last} is not whole yet; hand over the bytes after it first")
        for f in self.futures[self.waited : last + 1]:
            f.result()
        self.waited = max(self.waited, last + 1)

    def digest(self) -> str:
        if self.parts:
            self._submit()
        return tree_root([f.result() for f in self.futures], self.size)


class PayloadHasher:
    """A payload's identity computed while it is read: ``add`` each chunk in payload order (the hasher keeps a
    reference until the chunk is hashed: do not overwrite it before ``wait_hashed`` says so), then ``digest``.
    The scheme is read from the payload's header as it arrives (scheme_of_head); until then the first bytes are
    held in a copy (a header is a few KB). ``large_chunks``: the chunks after the header are large (raw_reader's
    staging buffers, 1-8 MiB but for the last one or a short read), so BLAKE3 spreads each over every core
    (workers()). ``scheme``: the one the header to come names, when the caller has parsed it already."""

    def __init__(self, source: str = "artifact", large_chunks: bool = False, scheme: str | None = None):
        self.source = source
        self.large_chunks = large_chunks
        self.head = bytearray()
        self.impl: _Stream | _Tree | None = None
        self.added = 0
        self.scheme: str | None = None
        if scheme is not None:  # named by a header the caller has parsed already (scheme_of_meta)
            self._start(scheme)

    def add(self, chunk) -> None:
        """Hand over the next bytes of the payload (hashed in other threads)."""
        view = memoryview(chunk).cast("B") if not isinstance(chunk, memoryview) or chunk.format != "B" else chunk
        self.added += len(view)
        impl = self.impl
        if impl is None:
            self.head += view
            scheme = scheme_of_head(self.head, self.source)
            if scheme is None:
                return
            impl = self._start(scheme)
            view, self.head = memoryview(self.head), bytearray()
        impl.add(view)

    def add_batch(self, chunks: list) -> None:
        """Hand over several next chunks at once (each a byte view kept by reference, as ``add``'s)."""
        chunks = [c if isinstance(c, memoryview) and c.format == "B" else memoryview(c).cast("B") for c in chunks]
        if self.impl is None or not isinstance(self.impl, _Stream):
            for c in chunks:
                self.add(c)
            return
        self.added += sum(len(c) for c in chunks)
        self.impl.add_batch(chunks)

    def _start(self, scheme: str) -> _Stream | _Tree:
        self.scheme = scheme
        if scheme == "sha256-tree":
            self.impl = _Tree()
        elif scheme == "blake3":
            # One thread unless the chunks are large: a read hands over pieces of 64 KiB-1 MiB, and the package's own
            # threads over pieces that small took longer than one (docs/PERFORMANCE.md, "Graft at memory speed").
            threads = workers() if self.large_chunks else 1
            self.impl = _Stream(blake3_hasher(self.source)(max_threads=threads), "blake3")
        else:
            self.impl = _Stream()
        return self.impl

    def wait_hashed(self, upto: int) -> None:
        """Block until every payload byte before offset ``upto`` has been hashed, so the buffer that held them can
        be reused (a tree leaf is hashed once whole: hand over the bytes after it, or everything, first)."""
        if upto > self.added:
            raise RuntimeError(f"wait_hashed({upto}): only {self.added} bytes were handed over")
        if self.impl is None:
            return  # nothing handed over has been kept by reference: the head is a copy
        self.impl.wait_hashed(upto)

    def digest(self) -> str:
        """The identity (hex) of everything handed over. A payload too short to hold its header is hashed as one
        SHA-256 stream (no such payload is readable; its digest simply will not match)."""
        impl = self.impl
        if impl is None:
            impl = self._start(DEFAULT_SCHEME)
            impl.add(memoryview(self.head))
        return impl.digest()
