"""Memory for a graft: fresh maps straight from the OS for buffers that grow and are given up whole (a graft's
cache), the pool a long-lived process recycles such maps through (kvgraft serve; an artifact's read fills them), and
malloc settings that let a forward's temporaries reuse freed memory."""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import platform
from contextlib import contextmanager
from contextvars import ContextVar


def zeroed(nbytes: int) -> mmap.mmap:
    """A writable buffer of ``nbytes`` (> 0) zero bytes: an anonymous memory map. Pages never written are never
    resident (a cache's room to grow), there is no fill pass (``torch.empty`` fills under deterministic algorithms,
    ``bytearray(n)`` writes every byte), and the map goes back to the OS the moment its last user lets go, where a
    heap block could be kept by malloc and count against the process. The raw reader's plain path keeps heap memory:
    recycled from the last restore, it faults in no pages, so repeated restores are faster than into fresh maps
    (benchmarks/bench_restore.py; docs/PERFORMANCE.md, "Restore speed"); a graft's own read (format.open_file's
    ``room``) uses maps, whose room stays unresident."""
    if nbytes <= 0:
        raise ValueError(f"zeroed({nbytes}): a map needs at least one byte")
    return mmap.mmap(-1, nbytes)


# glibc's mallopt parameters (malloc.h) and the values set: glibc's own ceiling for its dynamic mmap threshold
# (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit) and the trim threshold its dynamic scheme pairs with it (twice that).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_UP_TO = 32 << 20
KEEP_FREED = 64 << 20


def keep_freed_memory() -> bool:
    """Serve allocations up to 32 MiB from malloc's heap and keep up to 64 MiB freed at its top, instead of mapping
    them fresh from the OS and giving them back at every free (glibc only; ``KVGRAFT_KEEP_FREED=0`` leaves the
    allocator as it is). Returns whether the settings were applied.

    Why: a forward's temporaries (attention weights, keys and values expanded for grouped heads, logits) are 0.1-32
    MiB each. glibc maps an allocation above its mmap threshold (128 KiB at start, raised only when such a map is
    freed) and trims freed heap beyond twice that, so op after op pays page faults and zeroing again; kept, the
    freed blocks serve the next op's temporaries without either (benchmarks/bench_restore.py's memory children
    graft with and without these settings; docs/PERFORMANCE.md, "Restore speed", "Freed memory kept for reuse").
    The settings are what glibc's dynamic threshold reaches after its first 32 MiB free, set once up front. Results
    do not change: torch aligns every tensor to 64 bytes either way, and the suite's byte-equality tests run under
    these settings. The price: up to 64 MiB of freed memory can stay resident per malloc arena (each thread that
    allocates may have one), which a long-lived process with many allocating threads (a Ray worker) pays; a graft's
    peak rises by what malloc keeps (the same section of docs/PERFORMANCE.md)."""
    if os.environ.get("KVGRAFT_KEEP_FREED", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_UP_TO)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREED))


def cache_memory(nbytes: int):
    """A writable map of at least ``nbytes`` (> 0) for a cache's buffer: inside :func:`pooled`, one the pool recycled
    (resident already: no page faults; its bytes are stale, so write before reading), else a fresh zero map
    (util.memory.zeroed). A graft's own read (format.open_file's ``room``) reads the artifact's layers into these, so a
    process that reserved its cache's memory beforehand, as llama.cpp creates its context, reads into resident
    memory (benchmarks/peers' graft): a fresh map's first write pays a page fault for every page, which costs more than
    the read itself (docs/PERFORMANCE.md, "Graft at memory speed"). kvgraft serve's own reads are shared by its verified
    cache, so they are read without room, into the heap; its caches grow in the pool's maps."""
    pool = _POOL.get()
    return pool.take(nbytes) if pool is not None else zeroed(nbytes)


class BufferPool:
    """Maps a long-lived process hands its caches one request after another (kvgraft serve: one request at a time),
    so a request's cache is written into memory the last one faulted in, not into fresh pages. A fresh map pays
    page faults on its first write, which for a long prompt's cache cost more than the copy into it
    (docs/PERFORMANCE.md, "Graft at memory speed"); a recycled one costs the copy alone.

    A map is lent inside :func:`pooled` and taken back when a scope ends if nothing holds it any more (its reference
    count says so: a cache or a view kept past the request keeps its map lent until it is let go). At most
    ``keep`` bytes are kept free; the rest go back to the OS. The bytes a cache computes do not depend on where its
    buffers live: each buffer is a contiguous tensor of the size a fresh map would have had (tests/test_serve.py's
    cold, warm and restarted responses compare them)."""

    def __init__(self, keep: int = 1 << 30):
        self.keep = keep
        self.free: list = []  # smallest first (a graft's read takes 60 maps in a row: found by bisection)
        self.lent: list = []

    def take(self, nbytes: int):
        """A map of at least ``nbytes``: the smallest free one that fits, else a new one."""
        i = bisect.bisect_left(self.free, nbytes, key=len)
        if i == len(self.free):
            self.reclaim()
            i = bisect.bisect_left(self.free, nbytes, key=len)
        m = self.free.pop(i) if i < len(self.free) else zeroed(-(-nbytes // _PAGE) * _PAGE)
        self.lent.append(m)
        return m

    def reserve(self, count: int, nbytes: int) -> None:
        """Fault in ``count`` maps of ``nbytes`` now (a server at start: its first request, after a restart, then
        writes its cache into resident memory), within ``keep`` bytes in all."""
        import numpy as np

        size = -(-nbytes // _PAGE) * _PAGE
        for _ in range(min(count, (self.keep - self.free_bytes) // size if size else 0)):
            m = zeroed(size)
            np.frombuffer(m, dtype=np.uint8)[::4096] = 0  # a write to every page faults it in
            bisect.insort(self.free, m, key=len)

    def reclaim(self) -> None:
        """Take back the lent maps nobody holds any more (a cache that moved to larger buffers dropped its last)."""
        import sys

        held: list = []
        for m in self.lent:
            # references: the list, the loop's name and getrefcount's argument; a tensor on it adds its own
            if sys.getrefcount(m) <= 3:
                bisect.insort(self.free, m, key=len)
            else:
                held.append(m)
        self.lent = held

    def settle(self) -> None:
        """Take back every lent map nobody holds any more (one still held, by a cache a server keeps, stays lent
        until it is let go); keep at most ``keep`` bytes free, the largest first."""
        self.reclaim()
        total = 0
        for i in range(len(self.free) - 1, -1, -1):  # from the largest
            total += len(self.free[i])
            if total > self.keep:
                self.free = self.free[i + 1 :]
                break

    @property
    def free_bytes(self) -> int:
        return sum(len(m) for m in self.free)


@contextmanager
def pooled(pool: BufferPool | None):
    """Cache buffers made inside come from ``pool`` (None: fresh maps, as outside), and go back when it ends."""
    if pool is None:
        yield
        return
    token = _POOL.set(pool)
    try:
        yield
    finally:
        _POOL.reset(token)
        pool.settle()


_PAGE = 1 << 16
_POOL: ContextVar[BufferPool | None] = ContextVar("kvgraft_cache_pool", default=None)
