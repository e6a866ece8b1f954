"""Restore a ``.kvg`` file straight into device (CUDA) memory, its identity checked while the bytes travel.

A raw v2 file's tensor data is streamed through a ring of host staging buffers (pinned on CUDA, so the copies are
true DMA and asynchronous)::

    file --readinto--> staging[i] --hasher.add--> identity.PayloadHasher (other threads)
                                  --copy_(non_blocking) on a side stream, event[i] recorded--> one device buffer

A staging buffer is refilled only once BOTH its copy (event[i]) and the hash over it (``wait_hashed``) are done, so
the bytes hashed are exactly the bytes copied, read once from the file. Nothing is returned, and no tensor handed
out, before the digest matches ``expected_sha256`` and the copies are complete. ``device="cpu"`` runs the same
pipeline (pageable staging, synchronous copies): the logic is tested on machines without a GPU.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, DeviceError, InputError, IntegrityError, engine_not_installed
from . import container, identity, layout
from . import format as _format
from . import payload as _payload
from .verdict import judged

CHUNK_BYTES = 16 << 20  # staging buffer size: large enough to amortize a copy launch, small enough to overlap well
RING = 4  # staging buffers: one being read into, one being copied out, the rest waiting on the hash

# Pinned memory is slow to allocate (cudaHostAlloc maps and locks pages; under deterministic algorithms torch.empty
# also fills it), so each process allocates its staging once and reuses it for every restore. One restore at a time
# uses a set (the lock is held for the whole restore): restores share one PCIe link, so running two at once would
# not make either faster. At most one pinned and one pageable set is kept.
_STAGING: dict[tuple[int, int, bool], list] = {}
_STAGING_LOCK = threading.Lock()


def open_file_on_device(
    path, device, expected_sha256: str | None = None, *, chunk_bytes: int = CHUNK_BYTES, ring: int = RING
) -> tuple[str, _format.Artifact]:
    """(identity, artifact) of a ``.kvg`` file with every tensor on ``device`` ("cuda", "cuda:1", "cpu", a
    torch.device), re-hashed against ``expected_sha256`` when given, exactly as :func:`format.open_file` checks it
    (same refusals, same exception types).

    A raw file is streamed through ``ring`` host staging buffers of ``chunk_bytes`` each (see the module doc); the
    tensors are typed views into one device buffer. A zstd or shuffle-zstd file is opened by format.open_file and
    its tensors then copied to the device: its decompressor already writes every byte into private host memory,
    which is then verified whole, so staging it a second time would only add a copy. CUDA asked for where torch
    sees none is refused (DeviceError), never quietly served from the CPU."""
    try:
        import torch
    except ImportError as e:
        raise engine_not_installed(e) from None
    device = _device(torch, device)
    # The tree hash can release a staging buffer only once its last 1 MiB leaf is whole, which needs the bytes
    # after it handed over: with ring >= 2 buffers of >= one leaf, the ring-1 newer buffers always hold them.
    if chunk_bytes < identity.LEAF or ring < 2:
        raise ValueError(f"chunk_bytes {chunk_bytes} must be >= {identity.LEAF} and ring {ring} >= 2")
    path = Path(path)
    with judged(path, expected_sha256), _payload._open(path) as f:  # refusals judged as format.open_file's are
        raw = container.peek_codec(f) == "raw"
        if raw and device.type in ("cpu", "cuda"):
            return _open_raw_on_device(torch, f, str(path), device, expected_sha256, chunk_bytes, ring)
    # A compressed codec (or a device other than CPU/CUDA): verified in host memory, then moved.
    digest, art = _format.open_file(path, expected_sha256)
    return digest, _moved(art, device)


def _device(torch, device):
    """``device`` as a torch.device with its index, refusing a CUDA device this process cannot reach."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"unknown device {str(device)[:40]!r} ({str(e)[:120]})", "use cpu, cuda or cuda:N") from None
    if dev.type != "cuda":
        return dev
    hint = (
        "restore on the CPU (a manifest with runtime.device: cpu), or install a CUDA build of torch "
        "(scripts/gpu_wheels.sh) on a machine whose GPU nvidia-smi lists and CUDA_VISIBLE_DEVICES does not hide"
    )
    if not torch.cuda.is_available():
        why = (
            f"torch {torch.__version__} built without CUDA"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}): no GPU visible"
        )
        raise DeviceError(f"no CUDA device: {device} was asked for ({why})", hint)
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise DeviceError(f"no CUDA device: {device} was asked for ({count} GPU(s) visible)", hint)
    return torch.device("cuda", index)


def _open_raw_on_device(torch, f, source: str, device, expected_sha256: str | None, chunk_bytes: int, ring: int):
    # The same checks, in the same order, as format._open_raw: container, then payload header, before allocating.
    offset, n = container.check_container(f, container.file_size(f), source, _payload.max_payload())
    f.seek(offset)
    head, header = container.read_payload_header(f, n, source)
    size = n - len(head)  # the tensor data: contiguous, in offset order, no gaps (parse_header checked it)
    stream = None
    if device.type == "cuda":
        # torch.empty (no host-side cost); under deterministic algorithms it queues a fill on the current stream,
        # so the side stream waits for that before its copies land.
        dst = torch.empty(size, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
    else:  # no fill (torch.empty fills under deterministic algorithms); the same memory as the raw reader's
        dst = torch.frombuffer(bytearray(size), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    with _STAGING_LOCK:
        staging = _staging(torch, chunk_bytes, ring, pinned=stream is not None)
        hasher = identity.PayloadHasher(source)
        hasher.add(head)  # copied by the hasher until it knows the scheme; then payload offsets continue from here
        try:
            _pump(torch, f, dst, staging, hasher, stream, len(head), source)
        finally:
            # Before the lock is released, even on an error: no hashing thread and no copy still reads staging.
            digest = hasher.digest()
            if stream is not None:
                stream.synchronize()
    if expected_sha256 is not None and digest != expected_sha256:
        raise _payload.identity_mismatch(source, digest, expected_sha256)
    return digest, _assembled(torch, dst, header, source)


def _staging(torch, chunk_bytes: int, ring: int, pinned: bool) -> list:
    """``ring`` (tensor, memoryview) staging buffers, allocated once per process (the caller holds the lock)."""
    key = (chunk_bytes, ring, pinned)
    if key not in _STAGING:
        for other in [k for k in _STAGING if k[2] == pinned]:  # keep the cache small: one set of each kind
            del _STAGING[other]
        bufs = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(ring)]
        _STAGING[key] = [(b, memoryview(b.numpy())) for b in bufs]
    return _STAGING[key]


def _pump(torch, f, dst, staging: list, hasher, stream, base: int, source: str) -> None:
    """Stream ``dst.numel()`` bytes of ``f`` into ``dst`` through the staging ring, handing each chunk to ``hasher``
    (``base``: the payload offset of the first byte)."""
    # A torch.cuda.Event per buffer with a stream, else None each (torch is read as Any: so is a list of either).
    events: list[Any] = [torch.cuda.Event() for _ in staging] if stream is not None else [None] * len(staging)
    ends = [0] * len(staging)  # payload offset just after the bytes each buffer last held (0: not used yet)
    pos, k, size = 0, 0, dst.numel()
    # On the CPU a numpy copy (one memcpy, GIL released): torch's copy_ runs on its intra-op OpenMP pool, whose
    # workers spin after each chunk on the cores the hashing needs, which slows the restore where cores are few
    # (docs/PERFORMANCE.md, "Restore speed").
    host = dst.numpy() if stream is None else None
    while pos < size:
        slot = k % len(staging)
        buf, view = staging[slot]
        if ends[slot]:  # reuse: its copy must be done, and the hash over it (the hasher keeps a reference)
            if events[slot] is not None:
                events[slot].synchronize()
            hasher.wait_hashed(ends[slot])
        take = min(len(view), size - pos)
        _read_exact(f, view[:take], source)
        hasher.add(view[:take])
        if stream is None:
            assert host is not None  # (dst's numpy view whenever there is no stream)
            host[pos : pos + take] = buf.numpy()[:take]
        else:
            with torch.cuda.stream(stream):
                dst[pos : pos + take].copy_(buf[:take], non_blocking=True)
                events[slot].record(stream)
        pos += take
        k += 1
        ends[slot] = base + pos


def _read_exact(f, view: memoryview, source: str) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:  # the file shrank after its container was checked
            raise IntegrityError(f"{source}: truncated .kvg container", "re-fetch or re-deposit it")
        got += n


def _assembled(torch, dst, header: dict, source: str) -> _format.Artifact:
    """The artifact, its tensors typed views into ``dst`` (as format._open_raw wraps the same errors)."""
    try:
        typed = {}
        for name, t in header.items():
            if name == "__metadata__":
                continue
            dtype = getattr(torch, layout.TORCH_DTYPES[t["dtype"]])
            begin, end = t["data_offsets"]
            seg = dst[begin:end]
            if begin % dtype.itemsize:  # a valid but non-canonical layout: .view(dtype) needs an aligned offset
                seg = seg.clone()
            typed[name] = seg.view(dtype).view(t["shape"])
    except (KeyError, RuntimeError) as e:
        raise ArtifactError(f"{source}: unreadable tensors ({str(e)[:200]})") from None
    try:
        return _format._assemble(typed, header["__metadata__"], source)
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise ArtifactError(f"{source}: inconsistent artifact ({str(e)[:200]})") from None


def _moved(art: _format.Artifact, device) -> _format.Artifact:
    """``art`` with its tensors copied to ``device`` (the artifact itself when they are there already)."""
    if device.type == "cpu":
        return art
    layers = [
        dataclasses.replace(
            l,
            keys=None if l.keys is None else l.keys.to(device),
            values=None if l.values is None else l.values.to(device),
        )
        for l in art.layers
    ]
    return dataclasses.replace(art, layers=layers)
