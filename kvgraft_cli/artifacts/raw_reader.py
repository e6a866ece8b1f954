"""A raw ``.kvg`` file read for a graft (format.open_file's fast path, which orders these steps): every tensor read
once into memory of its own (a full layer's into a buffer with room to grow, when asked), while another thread hashes
the bytes read against the artifact's identity. Nothing is returned before the digest matches.

What makes it fast (each measured against the reader before it, on SmolLM2-135M's 16-bit cache with a blake3
identity, read into reserved memory: docs/PERFORMANCE.md, "Graft: Python first, then a staged read"):

- Python first, then the read. Everything Python does for a graft (the header's checks, every tensor's memory, its
  typed view, the artifact's layers) is done before the first byte of tensor data is read; only the token ids, a few
  hundred bytes, are looked at once the digest is known. The read and the hash both release the GIL while they
  work, but need it back between calls: Python work between two reads held it away from the hasher for as long as it
  ran, so the hasher thread waited whenever the main thread planned between reads.
- Large chunks for a one-stream identity (sha256, blake3): the file is read a chunk at a time into two staging
  buffers in turn, and BLAKE3 hashes each chunk over every core while it is copied to its pieces
  (:func:`_read_staged`). Hashed piece by piece, one per KV head, BLAKE3 ran on one core and the hasher thread paid a
  GIL hand-off a piece. A sha256-tree identity hashes its leaves on a pool, so its pieces are read in place by
  ``readv`` (:func:`_read_pieces`).
- One header parse (payload_rules.parse_header), the scheme named to the hasher, and a cache made by copying a
  template (engine._empty_cache) instead of from the config.

Together they cut the time to open and restore an artifact, graft after graft in one process; what is left is the
read, the hash and the copy, and the Python around them (benchmarks/graft_steps.py times each step;
benchmarks/bench_peers.py compares the graft with llama.cpp's restore; docs/PERFORMANCE.md has both)."""

from __future__ import annotations

import json
import os

from ..errors import ArtifactError, IntegrityError
from ..util.memory import cache_memory
from . import container
from .identity import PayloadHasher
from .layout import TORCH_DTYPES as _TORCH_DTYPES
from .payload_rules import REFETCH as _REFETCH

_IOV = 1024  # buffers a readv fills at most (IOV_MAX on Linux)
_READ_BATCH = 2 << 20  # bytes a readv asks for at most, so the hash runs while the next batch is read
_STAGE_MIN, _STAGE_MAX = 1 << 20, 8 << 20  # a staging buffer's size (_read_staged)


def _full_layers(meta: dict) -> set[str]:
    """Names of the full layers' keys and values tensors (layout.check_header has checked the header)."""
    kinds = json.loads(meta["layer_types"])
    return {f"layers.{i:03d}.{part}" for i, kind in enumerate(kinds) if kind == "full" for part in ("keys", "values")}


def _with_room(torch, t: dict, room: int):
    """A typed buffer for a full layer's [1, heads, tokens, head_dim] tensor with ``room`` more positions (the pool's
    when a server reserved one), and the pieces of it the file's bytes go to: a head's tokens are contiguous in the
    file and in the buffer. Returns (the kept tokens, the whole buffer; the pieces)."""
    dtype = getattr(torch, _TORCH_DTYPES[t["dtype"]])
    b, heads, tokens, dim = t["shape"]
    row = dim * dtype.itemsize  # bytes a token takes in a head
    stride = (tokens + room) * row
    mem = cache_memory(b * heads * stride)
    buf = torch.frombuffer(mem, dtype=dtype, count=b * heads * (tokens + room) * dim).view(b, heads, tokens + room, dim)
    view, kept = memoryview(mem), tokens * row
    return buf[:, :, :tokens], buf, [view[h : h + kept] for h in range(0, b * heads * stride, stride)]


def _plain(torch, t: dict):
    """A typed tensor of its own for a tensor read without room, and the piece of memory the file's bytes go to.
    Not torch.empty: under deterministic algorithms (every pinned manifest) it fills new memory with a torch kernel
    first. A bytearray is zeroed by one memset, cheap on heap memory a previous restore gave back; fresh anonymous
    maps (util.memory) pay page faults at every restore, so repeated restores into them were slower
    (docs/PERFORMANCE.md, "Restore speed")."""
    dtype = getattr(torch, _TORCH_DTYPES[t["dtype"]])
    begin, end = t["data_offsets"]
    if end == begin:
        return torch.empty(t["shape"], dtype=dtype), []
    mem = bytearray(end - begin)
    return torch.frombuffer(mem, dtype=dtype).view(t["shape"]), [memoryview(mem)]


def _read_pieces(f, pieces: list, hasher: PayloadHasher, source: str) -> None:
    """Fill ``pieces`` (writable byte views, back to back in the file from its position) with as few system calls as
    the OS allows (readv over a batch of them), handing each batch to ``hasher`` once it is whole, in file order. An
    artifact's KV arrives as one piece per head (64 KiB for SmolLM2-135M at 512 tokens in 16 bits): a read per piece
    was 180 system calls and as many hand-offs to the hasher for 11.8 MB."""
    if not hasattr(os, "readv"):  # (Windows) a read a piece
        for piece in pieces:
            container.read_hashed(f, piece, hasher, source)
        return
    fd, i = f.fileno(), 0
    while i < len(pieces):
        if len(pieces[i]) > _READ_BATCH:  # a large piece alone, in the reader's chunks (readv caps one at 2 GiB)
            container.read_hashed(f, pieces[i], hasher, source)
            i += 1
            continue
        batch: list = []
        size = 0
        while i + len(batch) < len(pieces) and len(batch) < _IOV and size + len(pieces[i + len(batch)]) <= _READ_BATCH:
            batch.append(pieces[i + len(batch)])
            size += len(batch[-1])
        got = os.readv(fd, batch)
        whole = []
        for piece in batch:
            if got < len(piece):  # a short read: finish this piece alone (or find the file truncated), then go on
                container.read_hashed(f, piece[got:], None, source)
            got = max(0, got - len(piece))
            whole.append(piece)
            if got == 0 and piece is not batch[-1]:
                break  # the rest of the batch was not read: batch it again
        hasher.add_batch(whole)
        i += len(whole)


def _read_staged(f, pieces: list, hasher: PayloadHasher, source: str) -> None:
    """Fill ``pieces`` (as _read_pieces) through two private staging buffers in turn: a chunk of about an eighth of
    the bytes (1-8 MiB) is read into one by one system call and handed to the hasher thread, and while BLAKE3
    hashes it over every core, it is copied to its pieces and the next chunk is read into the other buffer. For a
    one-stream identity (sha256, blake3): hashed piece by piece as read, 64 KiB at a time, BLAKE3 ran on one core
    and the hasher thread paid a GIL hand-off a piece (the module doc). The copy costs less than the hash gains:
    read, hash and copy together are faster than the piece-by-piece read (docs/PERFORMANCE.md, "Graft: Python first,
    then a staged read")."""
    total = sum(len(p) for p in pieces)
    if not total:
        return
    size = min(_STAGE_MAX, max(_STAGE_MIN, total // 8), total)
    stages = [memoryview(bytearray(size)) for _ in range(min(2, -(-total // size)))]
    ends: list[int] = []  # the payload offset each chunk handed over ends at
    i, filled, k = 0, 0, 0  # the next piece, the bytes of it already copied, the chunk count
    while total:
        if k >= len(stages):  # the buffer's last chunk hashed before it is read into again (short reads: more chunks)
            hasher.wait_hashed(ends[k - len(stages)])
        stage = stages[k % len(stages)]
        got = f.readinto(stage[: min(size, total)])
        if not got:
            raise IntegrityError(f"{source}: truncated .kvg container", _REFETCH)
        chunk = stage[:got]
        hasher.add(chunk)
        ends.append(hasher.added)
        pos = 0
        while pos < got:
            piece = pieces[i]
            take = min(len(piece) - filled, got - pos)
            piece[filled : filled + take] = chunk[pos : pos + take]
            pos, filled = pos + take, filled + take
            if filled == len(piece):
                i, filled = i + 1, 0
        total -= got
        k += 1


def plan(torch, header: dict, room: int, source: str) -> tuple[dict, dict, list]:
    """Every tensor of a checked payload header (layout.check_header) with memory of its own, before anything is
    read: (typed tensors by name, the full layers' buffers with ``room`` by name, the byte pieces the file's tensor
    data goes to, in file order). Room only for a root artifact's full layers, at most as many tokens as each holds
    (at most 2x address space); a chain link's layers are joined with its parents' anyway (engine.restore_chain)."""
    meta = header["__metadata__"]
    grows = _full_layers(meta) if room > 0 and "parent_sha256" not in meta else set()
    typed, rooms, pieces = {}, {}, []
    try:
        # Data order is offset order and has no gaps (parse_header checked it).
        for name, t in sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
        ):
            if name in grows and t["data_offsets"][1] > t["data_offsets"][0]:
                typed[name], rooms[name], parts = _with_room(torch, t, min(room, t["shape"][2]))
            else:
                typed[name], parts = _plain(torch, t)
            pieces += parts
    except (KeyError, RuntimeError) as e:
        raise ArtifactError(f"{source}: unreadable tensors ({str(e)[:200]})") from None
    return typed, rooms, pieces


def read_tensor_data(f, head: bytes, scheme: str, pieces: list, source: str) -> str:
    """Fill ``pieces`` from ``f`` (positioned at the tensor data) and return the identity of ``head`` (the payload's
    header bytes) and the bytes read, in ``scheme`` (the one the header names, identity.scheme_of_meta): a tree's
    leaves are hashed on the pool as the pieces fill (_read_pieces), a stream is staged (_read_staged)."""
    hasher = PayloadHasher(source, large_chunks=True, scheme=scheme)
    hasher.add(head)
    try:
        (_read_pieces if hasher.scheme == "sha256-tree" else _read_staged)(f, pieces, hasher, source)
    finally:
        digest = hasher.digest()
    return digest
