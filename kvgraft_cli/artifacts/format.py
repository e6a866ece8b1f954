"""The ``.kvg`` artifact, format v1: one prefix's KV cache, its token ids and sorted string metadata.

Payload = safetensors bytes (tensors ``token_ids`` and ``layers.NNN.keys`` / ``layers.NNN.values``) written by
:func:`canonical_safetensors`, so equal content gives equal bytes. (``safetensors.torch.save`` does not: it keeps
``__metadata__`` in a hash map whose order changes from call to call.) Identity = SHA-256 of the payload, the
sha256-tree of its 1 MiB leaves when its metadata says ``identity: sha256-tree``, or its BLAKE3 under ``identity:
blake3`` (identity.py). File = the
payload in one of three codecs (artifacts.container: raw or shuffle-zstd in the v2 container, or one zstd frame);
neither the codec nor the compression level ever changes the identity. docs/FORMAT.md specifies it for third parties.
No pickle: tensors are parsed by safetensors, metadata by ``json``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, IntegrityError, ModelMismatch, engine_not_installed
from ..util.fsio import atomic_write_bytes
from . import container, layout
from . import payload as _payload
from .identity import SCHEMES, PayloadHasher, payload_identity
from .layout import FORMAT, FORMAT_VERSION, LAYER_KINDS, REQUIRED_META, kv_dtype_of  # noqa: F401  (defined in layout.py)
from .payload import compress, decompress, read_payload  # noqa: F401  (the frame rules live in payload.py)
from .verdict import judged

MAX_HEADER = _payload.MAX_HEADER  # the largest safetensors header a reader accepts (payload.py, docs/FORMAT.md)


@dataclass
class LayerState:
    """One cache layer: ``full`` keeps every token; ``sliding`` keeps the last window-1 tokens and the count seen;
    ``empty`` is a layer that holds no KV (a KV-sharing consumer)."""

    kind: str
    keys: Any = None  # torch.Tensor [batch=1, kv_heads, tokens_kept, head_dim]
    values: Any = None
    sliding_window: int | None = None
    cumulative_length: int | None = None
    # (keys, values) buffers with room past the kept tokens, of which ``keys`` and ``values`` are views: set by a
    # reader asked for room (open_file's ``room``: a graft's own read), so the first cache restored from this state
    # writes its next tokens into place instead of copying the layer (engine.restore takes them, once).
    room: Any = None


@dataclass
class Artifact:
    """A decoded artifact: token ids, per-layer state and metadata."""

    token_ids: list[int]
    layers: list[LayerState]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def start(self) -> int:
        """Position of this artifact's first token: 0 for a root, the parent chain's length for a chain link."""
        return int(self.meta.get("start_position", "0"))

    @property
    def parent(self) -> str | None:
        """Identity of the artifact this one continues (a chain link), or None for a root."""
        return self.meta.get("parent_sha256")


def _json(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"), sort_keys=True)


ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64"}


def canonical_safetensors(tensors: dict, metadata: dict[str, str]) -> bytes:
    """Safetensors bytes with one canonical layout (docs/FORMAT.md): header JSON with ``__metadata__`` first (keys
    sorted), then ``token_ids``, then the other tensors sorted by name; compact separators, ASCII escapes; padded
    with spaces to a multiple of 8; tensor data in header order, row-major little-endian, no gaps."""
    import torch

    order = sorted(tensors, key=lambda name: (name != "token_ids", name))
    header: dict = {"__metadata__": {k: metadata[k] for k in sorted(metadata)}}
    blobs, offset = [], 0
    for name in order:
        t = tensors[name].detach().to("cpu").contiguous()
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": ST_DTYPES[str(t.dtype).removeprefix("torch.")],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def encode(token_ids: list[int], layers: list[LayerState], meta: dict[str, str]) -> bytes:
    """Canonical payload bytes. ``meta`` holds the caller's fields; layer layout fields are derived here."""
    import torch

    tensors: dict[str, torch.Tensor] = {"token_ids": torch.tensor(token_ids, dtype=torch.int64)}
    for i, layer in enumerate(layers):
        if layer.kind == "empty":
            continue
        tensors[f"layers.{i:03d}.keys"] = layer.keys
        tensors[f"layers.{i:03d}.values"] = layer.values
    full_meta = dict(meta)
    full_meta.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        num_layers=str(len(layers)),
        num_tokens=str(len(token_ids)),
        layer_types=_json([l.kind for l in layers]),
        sliding_windows=_json([l.sliding_window for l in layers]),
        cumulative_lengths=_json([l.cumulative_length for l in layers]),
    )
    missing = [k for k in REQUIRED_META if k not in full_meta]
    if missing:
        raise ValueError(f"artifact metadata lacks {missing}")
    return canonical_safetensors(tensors, {k: str(v) for k, v in full_meta.items()})


def with_scheme(payload: bytes | bytearray, scheme: str) -> bytes:
    """The same artifact named in another identity scheme: only the metadata's ``identity`` key changes (absent for
    sha256), in the canonical header form; the tensor bytes are copied as they are. What lets a check compare a
    re-deposit with an artifact named the other way (the scheme is no part of the compute pin)."""
    header = read_header(payload)
    n = struct.unpack("<Q", payload[:8])[0]
    meta = {k: v for k, v in header["__metadata__"].items() if k != "identity"}
    if scheme != "sha256":
        meta["identity"] = scheme
    header["__metadata__"] = {k: meta[k] for k in sorted(meta)}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(payload[8 + n :])


def same_cache(payload: bytes | bytearray, identity: str) -> bool:
    """Whether ``payload`` is the artifact named ``identity`` in any scheme (same bytes, whatever the name)."""
    if payload_identity(payload) == identity:
        return True
    named = read_header(payload)["__metadata__"].get("identity", "sha256")
    return any(payload_identity(with_scheme(payload, s)) == identity for s in SCHEMES if s != named)


def read_header(payload: bytes | bytearray, source: str = "artifact") -> dict[str, Any]:
    """Parse the safetensors JSON header of a payload (no tensor is touched)."""
    if len(payload) < 8:
        raise IntegrityError(f"{source}: truncated payload ({len(payload)} bytes)", "re-fetch or re-deposit it")
    (n,) = struct.unpack("<Q", payload[:8])
    if n > MAX_HEADER or 8 + n > len(payload):
        raise IntegrityError(
            f"{source}: truncated or corrupt safetensors header (length {n})", "re-fetch or re-deposit it"
        )
    try:
        header = json.loads(payload[8 : 8 + n])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested 100,000 deep
        raise IntegrityError(f"{source}: corrupt safetensors header ({str(e)[:120]})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ArtifactError(f"{source}: not a kvgraft artifact (no metadata)")
    return header


def decode(payload: bytes | bytearray, source: str = "artifact", expected_sha256: str | None = None) -> Artifact:
    """Check the identity (when expected), parse and validate a payload. Raises ArtifactError with the reason."""
    if expected_sha256 is not None:
        got = payload_identity(payload, source)
        if got != expected_sha256:
            raise IntegrityError(
                f"{source}: content hash {got[:16]}... does not match its identity {expected_sha256[:16]}... "
                "(tampered or corrupt)",
                "delete it and re-deposit, or re-import it from a good copy",
            )
    header = read_header(payload, source)
    meta = header["__metadata__"]
    layout.check_header(header, source)
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load
    except ImportError as e:
        raise engine_not_installed(e) from None

    try:
        # A private, writable buffer (a freshly read payload) is viewed in place: no copy. Bytes are parsed (and
        # copied) by safetensors.
        tensors = _views(payload, header) if isinstance(payload, bytearray) else load(bytes(payload))
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{source}: unreadable tensors ({e})") from None
    try:
        return _assemble(tensors, meta, source)
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise ArtifactError(f"{source}: inconsistent artifact ({str(e)[:200]})") from None


_TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64"}


def _views(buf: bytearray, header: dict) -> dict:
    """The payload's tensors as views into ``buf`` (which they keep alive), with safetensors' own checks: known
    dtype, offsets inside the data and matching dtype x shape. Little-endian hosts only (as every payload is)."""
    import math
    import sys

    import torch

    if sys.byteorder != "little":
        raise ValueError("zero-copy views need a little-endian host")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    base, end = 8 + n, len(buf)
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict) or t.get("dtype") not in _TORCH_DTYPES:
            raise ValueError(f"tensor {name[:60]!r}: unsupported dtype")
        dtype = getattr(torch, _TORCH_DTYPES[t["dtype"]])
        shape, (begin, stop) = t["shape"], t["data_offsets"]
        count = math.prod(shape)
        if not 0 <= begin <= stop <= end - base or stop - begin != count * dtype.itemsize:
            raise ValueError(f"tensor {name[:60]!r}: offsets disagree with dtype, shape or the payload's size")
        flat = (
            torch.frombuffer(buf, dtype=dtype, count=count, offset=base + begin)
            if count
            else torch.empty(0, dtype=dtype)
        )
        out[name] = flat.view(shape)
    return out


def _assemble(tensors: dict, meta: dict[str, str], source: str) -> Artifact:
    import torch

    n_layers = int(meta["num_layers"])
    kinds = json.loads(meta["layer_types"])
    windows = json.loads(meta["sliding_windows"])
    cums = json.loads(meta["cumulative_lengths"])
    n_tok = int(meta["num_tokens"])
    start = int(meta["start_position"])
    parent = meta.get("parent_sha256")
    # A chain link (docs/FORMAT.md) starts where its parent chain ends and names that parent; a root starts at 0.
    if start < 0 or (start > 0) != (parent is not None) or (parent is not None and not _is_hex64(parent)):
        raise ValueError(f"start_position {start} and parent_sha256 {parent!r} disagree (a link needs both)")
    if not (len(kinds) == len(windows) == len(cums) == n_layers):
        raise ValueError("layer lists disagree with num_layers")
    ids = tensors.pop("token_ids")
    if ids.dtype != torch.int64 or ids.ndim != 1 or ids.numel() != n_tok:
        raise ValueError("token_ids must be int64 of length num_tokens")
    kv = kv_dtype_of(meta)
    for name in (meta["dtype"], kv):
        if name not in ST_DTYPES or name == "int64":
            raise ValueError(f"unknown dtype {name[:40]!r} (float32, bfloat16 or float16)")
    want_dtype = getattr(torch, kv)
    layers = []
    for i, (kind, win, cum) in enumerate(zip(kinds, windows, cums)):
        if kind not in LAYER_KINDS:
            raise ValueError(f"layer {i}: unknown kind {kind!r}")
        if kind == "empty":
            layers.append(LayerState("empty"))
            continue
        k, v = tensors.pop(f"layers.{i:03d}.keys"), tensors.pop(f"layers.{i:03d}.values")
        if k.dtype != want_dtype or v.dtype != want_dtype or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"layer {i}: keys/values have the wrong dtype or shape")
        kept = k.shape[2]
        if kind == "full" and kept != n_tok:
            raise ValueError(f"layer {i}: full layer keeps {kept} tokens, expected {n_tok}")
        # A full layer holds this artifact's own tokens; a sliding layer holds the window's state after them (for a
        # link, possibly including the parent's last tokens), so restoring a chain takes the last link's state.
        if kind == "sliding" and (cum != start + n_tok or kept != min(start + n_tok, win - 1)):
            raise ValueError(f"layer {i}: sliding layer state (kept {kept}, seen {cum}, window {win}) is inconsistent")
        layers.append(LayerState(kind, k, v, win, cum))
    if tensors:
        raise ValueError(f"unexpected tensors {sorted(tensors)[:3]}")
    return Artifact(token_ids=ids.tolist(), layers=layers, meta=dict(meta))


def write_file(path: Path, payload: bytes, level: int = 3, codec: str = "auto") -> str:
    """Write a ``.kvg`` file atomically in ``codec`` (``auto``: by the payload's dtype, container.default_codec);
    returns the codec written. The identity (identity.py) is the same whatever the codec."""
    # the tensors' width (a 16-bit cache of a float32 model: kv_dtype), what a shuffle's byte planes follow
    meta = read_header(payload)["__metadata__"] if codec in ("auto", "shuffle-zstd") else {}
    dtype = kv_dtype_of(meta) if "dtype" in meta else ""
    codec = container.pick_codec(codec, dtype)
    if codec == "raw":
        data = container.raw_file(payload)
    elif codec == "shuffle-zstd":
        data = container.shuffle_zstd_file(payload, container.element_bytes(dtype), level)
    else:
        data = compress(payload, level)
    atomic_write_bytes(path, data)
    return codec


def read_file(path: Path, expected_sha256: str | None = None) -> tuple[bytearray, Artifact]:
    """Read, decompress, re-hash and decode a ``.kvg`` file. Returns (payload, artifact). Memory is bounded by the
    size the payload's own header describes (payload.read_payload), checked before the payload is allocated."""
    path = Path(path)
    payload = read_payload(path, expected_sha256)  # frame, header and identity checked there
    return payload, decode(payload, str(path))


def open_file(path: Path, expected_sha256: str | None = None, room: int = 0) -> tuple[str, Artifact]:
    """(identity, artifact) of a ``.kvg`` file, re-hashed (against ``expected_sha256`` when given), the fastest way
    its codec allows. A raw file's tensors are each read once into memory of their own while other threads hash
    what was read (the header first, then the tensors in data order: exactly the payload's bytes), so the bytes
    hashed are the bytes used, the file is read once, and nothing is returned before the digest matches. A zstd or
    shuffle-zstd file is decompressed into one buffer while its chunks are hashed (payload.read_payload) and viewed
    in place.

    ``room`` > 0 (a raw root artifact read for one graft alone, never one that a cache of verified artifacts shares):
    each full layer's keys and values are read into buffers with room for that many more tokens (at most as many as the layer
    holds), whose unwritten pages are not resident (util.memory.zeroed), and the layer's ``room`` names them, so the
    cache restored from it grows into them without a copy: a graft's peak is then about one KV above the model, where
    the first step's copy made it two. Other codecs ignore it (their payload is one decompressed buffer).

    With ``expected_sha256``, a refusal is judged against it (artifacts.verdict): bytes that are not that artifact
    are an IntegrityError (exit 1) whether the frame, the header or the identity gave them away."""
    path = Path(path)
    with judged(path, expected_sha256):
        return _open_file(path, expected_sha256, room)


def _open_file(path: Path, expected_sha256: str | None, room: int) -> tuple[str, Artifact]:
    with _payload._open(path) as f:
        codec = container.peek_codec(f)
    if codec != "raw":  # zstd, shuffle-zstd: decompressed into one buffer while a thread hashes, viewed in place
        payload = read_payload(path, expected_sha256)
        sha = expected_sha256 or payload_identity(payload, str(path))
        return sha, decode(payload, str(path))
    return _open_raw(path, expected_sha256, room)


def _full_layers(meta: dict) -> set[str]:
    """Names of the full layers' keys and values tensors (layout.check_header has checked the header)."""
    kinds = json.loads(meta["layer_types"])
    return {f"layers.{i:03d}.{part}" for i, kind in enumerate(kinds) if kind == "full" for part in ("keys", "values")}


def _with_room(t: dict, room: int):
    """A buffer for a full layer's [1, heads, tokens, head_dim] tensor with ``room`` more positions (the pool's when a
    server reserved one), and the pieces of it the file's bytes go to: a head's tokens are contiguous in the file and
    in the buffer. Returns (the kept tokens, the whole buffer, both raw bytes [1, heads, -, row]; the pieces)."""
    import torch

    from ..util.memory import cache_memory

    b, heads, tokens, _ = t["shape"]
    row = (t["data_offsets"][1] - t["data_offsets"][0]) // (b * heads * tokens)  # bytes a token takes in a head
    n = b * heads * (tokens + room) * row
    mem = cache_memory(n)
    buf = torch.frombuffer(mem, dtype=torch.uint8, count=n).view(b, heads, tokens + room, row)
    view, stride = memoryview(mem), (tokens + room) * row
    pieces = [view[h * stride : h * stride + tokens * row] for h in range(b * heads)]
    return buf[:, :, :tokens], buf, pieces


_IOV = 1024  # buffers a readv fills at most (IOV_MAX on Linux)
_READ_BATCH = 2 << 20  # bytes a readv asks for at most, so the hash runs while the next batch is read


def _read_pieces(f, pieces: list, hasher: PayloadHasher, source: str) -> None:
    """Fill ``pieces`` (writable byte views, back to back in the file from its position) with as few system calls as
    the OS allows (readv over a batch of them), handing each piece to ``hasher`` once it is whole, in file order. An
    artifact's KV arrives as one piece per head (64 KiB for SmolLM2-135M at 512 tokens in 16 bits): a read per piece
    was 180 system calls and as many hand-offs to the hasher for 11.8 MB."""
    import os

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


def _open_raw(path: Path, expected_sha256: str | None, room: int = 0) -> tuple[str, Artifact]:
    try:
        import torch
    except ImportError as e:
        raise engine_not_installed(e) from None

    source = str(path)
    with _payload._open(path) as f:
        offset, n = container.check_container(f, container.file_size(f), source, _payload.max_payload())
        f.seek(offset)
        head, header = container.read_payload_header(f, n, source)  # consistent before any tensor is read
        hasher = PayloadHasher(source)
        hasher.add(head)
        tensors, rooms, pieces = {}, {}, []
        # A chain link's layers are joined with its parents' into new buffers (engine.restore_chain): no room.
        grows = (
            _full_layers(header["__metadata__"])
            if room > 0 and "parent_sha256" not in header["__metadata__"]
            else set()
        )
        try:
            # Data order is offset order and has no gaps (described_size checked it): every tensor gets memory of
            # its own, and the file is read straight into it a batch at a time, each batch hashed (another thread)
            # while the next tensors' memory is made and read: the hash starts with the first batch, not the last.
            planned = 0
            for name, t in sorted(
                ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
            ):
                begin, end = t["data_offsets"]
                if name in grows and end > begin:  # room at most the layer's own tokens: at most 2x address space
                    own, rooms[name], parts = _with_room(t, min(room, t["shape"][2]))
                    pieces += parts
                else:
                    # Not torch.empty: under deterministic algorithms (every pinned manifest) it fills new memory
                    # with a torch kernel first. A bytearray is zeroed by one memset, cheap on heap memory a previous
                    # restore gave back; fresh anonymous maps (util.memory) measured 1.06-2.3x slower over repeated
                    # restores.
                    own = (
                        torch.frombuffer(bytearray(end - begin), dtype=torch.uint8)
                        if end > begin
                        else torch.empty(0, dtype=torch.uint8)
                    )
                    if end > begin:
                        pieces.append(memoryview(own.numpy()))
                tensors[name] = (own, t)
                planned += end - begin
                if planned >= _READ_BATCH:
                    _read_pieces(f, pieces, hasher, source)
                    pieces, planned = [], 0
            _read_pieces(f, pieces, hasher, source)
        finally:
            digest = hasher.digest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise _payload.identity_mismatch(source, digest, expected_sha256)
    meta = header["__metadata__"]
    try:
        typed = {
            name: own.view(getattr(torch, _TORCH_DTYPES[t["dtype"]])).view(t["shape"])
            for name, (own, t) in tensors.items()
        }
        grown = {name: buf.view(getattr(torch, _TORCH_DTYPES[header[name]["dtype"]])) for name, buf in rooms.items()}
    except (KeyError, RuntimeError) as e:
        raise ArtifactError(f"{source}: unreadable tensors ({str(e)[:200]})") from None
    try:
        art = _assemble(typed, meta, source)
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise ArtifactError(f"{source}: inconsistent artifact ({str(e)[:200]})") from None
    for i, layer in enumerate(art.layers):
        kb, vb = grown.get(f"layers.{i:03d}.keys"), grown.get(f"layers.{i:03d}.values")
        if kb is not None and vb is not None:
            layer.room = (kb, vb)
    return digest, art


def check_compatible(meta: dict[str, str], want: dict[str, str], source: str) -> None:
    """Refuse an artifact whose model, tokenizer, dtype, layer layout or compute pin differs from the engine's."""
    labels = {
        "model_sha256": "model",
        "tokenizer_sha256": "tokenizer",
        "dtype": "dtype",
        "kv_dtype": "KV cache width (model.kv_dtype)",
        "layer_types": "layer layout",
        "sliding_windows": "sliding windows",
        "manifest_sha256": "compute pin (model/runtime/kernel flags/prefill schedule/prefix template)",
        "start_position": "start position",
    }
    for key, label in labels.items():
        if key in want and meta.get(key) != want[key]:
            raise ModelMismatch(
                f"{source}: artifact was made for another {label}: artifact {key}={_short(meta.get(key))}, "
                f"this run {key}={_short(want[key])}",
                "graft it with the manifest it was deposited under (its model, dtype and kernel flags)",
            )


def _short(v: str | None) -> str | None:
    return v if v is None or len(v) <= 24 else v[:16] + "..."


def _is_hex64(v: str) -> bool:
    return len(v) == 64 and all(c in "0123456789abcdef" for c in v)
