"""Fresh memory straight from the OS, for buffers that grow and are given up whole (a graft's cache)."""

from __future__ import annotations

import mmap


def zeroed(nbytes: int) -> mmap.mmap:
    """A writable buffer of ``nbytes`` (> 0) zero bytes: an anonymous memory map. Pages never written are never
    resident (a cache's room to grow), there is no fill pass (``torch.empty`` fills under deterministic algorithms,
    ``bytearray(n)`` writes every byte), and the map goes back to the OS the moment its last user lets go, where a
    heap block could be kept by malloc and count against the process. Not for the raw reader: there, heap memory
    recycled from the last restore made repeated restores 1.06-2.3x faster than fresh maps (bench_restore, 2,048
    tokens, separate runs)."""
    if nbytes <= 0:
        raise ValueError(f"zeroed({nbytes}): a map needs at least one byte")
    return mmap.mmap(-1, nbytes)
