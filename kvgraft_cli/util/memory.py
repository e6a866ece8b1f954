"""Memory for a graft: fresh maps straight from the OS for buffers that grow and are given up whole (a graft's
cache), and malloc settings that let a forward's temporaries reuse freed memory."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform


def zeroed(nbytes: int) -> mmap.mmap:
    """A writable buffer of ``nbytes`` (> 0) zero bytes: an anonymous memory map. Pages never written are never
    resident (a cache's room to grow), there is no fill pass (``torch.empty`` fills under deterministic algorithms,
    ``bytearray(n)`` writes every byte), and the map goes back to the OS the moment its last user lets go, where a
    heap block could be kept by malloc and count against the process. The raw reader's plain path keeps heap memory:
    recycled from the last restore, it made repeated restores 1.06-2.3x faster than fresh maps (bench_restore, 2,048
    tokens, separate runs); a graft's own read (format.open_file's ``room``) uses maps, whose room stays unresident."""
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
    freed) and trims freed heap beyond twice that, so op after op pays page faults and zeroing again. A graft as
    `kvgraft graft -n 16` runs it over 2,048 cached float32 tokens (SmolLM-135M shape) took 3.48 s and 1,236,214 page
    faults with glibc's defaults, 1.75 s and 14,098 under these settings (bench_restore.py's memory children; docs/PERFORMANCE.md,
    "Restore speed"). The settings are what glibc's dynamic threshold reaches after its first 32 MiB free, set once
    up front. Results do not change: torch aligns every tensor to 64 bytes either way, and the suite's
    byte-equality tests run under these settings. The price: up to 64
    MiB of freed memory can stay resident per malloc arena (each thread that allocates may have one), which a
    long-lived process with many allocating threads (a Ray worker) pays; a graft's peak rose by 17 MB in one
    bench run and 3 MB in another (float32, 2,048 tokens; bfloat16: none)."""
    if os.environ.get("KVGRAFT_KEEP_FREED", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_UP_TO)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREED))
