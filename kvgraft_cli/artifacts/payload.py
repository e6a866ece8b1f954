"""A ``.kvg`` file's identity without decoding it: the SHA-256 of its payload, streamed through zstd while a second
thread hashes the output (both release the GIL: on two cores the cost is close to the larger of the two, not their
sum). Torch-free, for `kvgraft verify`."""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path

CHUNK = 1 << 22


def kvg_payload_sha256(path: Path) -> str:
    """SHA-256 of a .kvg file's decompressed payload (its identity), decompressing and hashing in parallel.
    Raises ValueError for a frame that ends early (even one whose data is whole but whose checksum is cut off)."""
    import zstandard

    h = hashlib.sha256()
    chunks: queue.Queue = queue.Queue(maxsize=4)

    def produce() -> None:
        try:
            dobj = zstandard.ZstdDecompressor().decompressobj()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(CHUNK), b""):
                    out = dobj.decompress(block)
                    if out:
                        chunks.put(out)
            if not dobj.eof:
                raise ValueError("zstd frame ends early (truncated file)")
            if dobj.unused_data:
                raise ValueError("bytes after the zstd frame (a .kvg file is exactly one frame)")
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
