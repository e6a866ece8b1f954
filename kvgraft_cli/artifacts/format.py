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

from ..errors import ArtifactError, IntegrityError, KernelMismatch, ModelMismatch, engine_not_installed
from ..util.fsio import atomic_write_bytes
from . import container, layout
from . import payload as _payload
from .identity import SCHEMES, payload_identity, scheme_of_meta
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
        if not isinstance(t, dict) or t.get("dtype") not in layout.TORCH_DTYPES:
            raise ValueError(f"tensor {name[:60]!r}: unsupported dtype")
        dtype = getattr(torch, layout.TORCH_DTYPES[t["dtype"]])
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


def _assemble(tensors: dict, meta: dict[str, str], source: str, read_ids: bool = True) -> Artifact:
    """The artifact of typed tensors and their metadata, checked for consistency (ValueError and friends say what
    disagrees). ``read_ids`` False: the token ids' bytes are not read yet (raw_reader makes the artifact before its
    read); its ``token_ids`` are then left empty for the caller to fill."""
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
    return Artifact(token_ids=ids.tolist() if read_ids else [], layers=layers, meta=dict(meta))


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


def _open_raw(path: Path, expected_sha256: str | None, room: int) -> tuple[str, Artifact]:
    """A raw file: every tensor's memory and the artifact are made first, then the tensor data is read into them and
    hashed (raw_reader's module doc says why in that order); nothing is returned before the digest matches."""
    try:
        import torch
    except ImportError as e:
        raise engine_not_installed(e) from None
    from . import raw_reader

    source = str(path)
    with _payload._open(path) as f:
        offset, n = container.check_container(f, container.file_size(f), source, _payload.max_payload())
        f.seek(offset)
        head, header = container.read_payload_header(f, n, source)  # consistent before any tensor is made
        meta = header["__metadata__"]
        scheme = scheme_of_meta(meta, source)  # one this kvgraft does not know: refused before any memory is made
        typed, rooms, pieces = raw_reader.plan(torch, header, room, source)
        ids = typed["token_ids"]
        try:
            art = _assemble(typed, meta, source, read_ids=False)  # the token ids are read below: looked at after
        except (KeyError, ValueError, TypeError, RecursionError) as e:
            raise ArtifactError(f"{source}: inconsistent artifact ({str(e)[:200]})") from None
        digest = raw_reader.read_tensor_data(f, head, scheme, pieces, source)
    if expected_sha256 is not None and digest != expected_sha256:
        raise _payload.identity_mismatch(source, digest, expected_sha256)
    art.token_ids = ids.tolist()
    for i, layer in enumerate(art.layers):
        kb, vb = rooms.get(f"layers.{i:03d}.keys"), rooms.get(f"layers.{i:03d}.values")
        if kb is not None and vb is not None:
            layer.room = (kb, vb)
    return digest, art


def check_compatible(meta: dict[str, str], want: dict[str, str | None], source: str) -> None:
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
    ours, theirs = want.get("kernels"), meta.get("kernels")
    if ours is not None and theirs != ours and meta.get("model_sha256") == want.get("model_sha256"):
        # Under kernels left to the machine: made on another CPU (it names its own), or before identities were
        # recorded (none named, the bare compute pin this manifest has).
        if theirs is not None or meta.get("manifest_sha256") == want.get("compute_pin_sha256"):
            raise kernel_mismatch(source, theirs, ours)
    for key, label in labels.items():
        if key in want and meta.get(key) != want[key]:
            raise ModelMismatch(
                f"{source}: artifact was made for another {label}: artifact {key}={_short(meta.get(key))}, "
                f"this run {key}={_short(want[key])}",
                "graft it with the manifest it was deposited under (its model, dtype and kernel flags)",
            )


def kernel_mismatch(source: str, theirs: str | None, ours: str) -> KernelMismatch:
    """The refusal of an artifact computed on other kernels: one line naming both (config.kernels.short_identity)
    and what to do."""
    from ..config.kernels import short_identity

    there = short_identity(theirs) if theirs else "unrecorded kernels (made before kvgraft named them)"
    return KernelMismatch(
        f"{source}: computed on other kernels ({short_identity(ours)} here, {there} there): its bits are not what "
        "this machine computes under this manifest",
        "recompute it here (`kvgraft deposit` again), or deposit and graft under the avx2 profile, whose bits every "
        "AVX2 machine reproduces (`kvgraft manifest init MODEL --profile avx2`)",
    )


def _short(v: str | None) -> str | None:
    return v if v is None or len(v) <= 24 else v[:16] + "..."


def _is_hex64(v: str) -> bool:
    return len(v) == 64 and all(c in "0123456789abcdef" for c in v)
