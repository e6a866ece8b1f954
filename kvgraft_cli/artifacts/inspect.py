"""What ``kvgraft inspect`` shows: a ``.kvg`` file's header, read without decoding (or even decompressing) the
tensor data. Torch-free.

Only the container or zstd frame header and the first ``8 + N`` payload bytes (the safetensors header length and
JSON) are read (through a streaming decompressor for zstd), so inspecting a multi-gigabyte artifact costs a few
kilobytes. What is refused:

- not an artifact (exit 2, :class:`ArtifactError`): a file that is neither the raw container nor a zstd frame, or
  whose payload is not a kvgraft payload (no ``__metadata__``, another ``format``), a format version this kvgraft
  does not read, or a header that does not describe a consistent artifact (layout.check_header, as graft refuses);
- a damaged one (exit 1, :class:`IntegrityError`): a zstd frame whose header is corrupt or declares no size, a
  payload that ends inside its own header, a header length beyond the payload, a header that is not JSON;
- a payload declared larger than ``KVGRAFT_MAX_PAYLOAD`` (exit 2, :class:`PayloadTooLarge`), as every reader;
- with an identity to check against (a store object, a file named by its hash), any refusal but the limit is
  judged by artifacts.verdict: bytes that do not hash to it are damage (exit 1), whatever the header shows.

The payload is not hashed unless asked (:func:`payload_sha256`): the identity check streams every byte.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, IntegrityError
from . import container, layout
from .format import LAYER_KINDS, MAX_HEADER, REQUIRED_META
from .payload_rules import ZSTD_MAGIC, max_payload, not_an_artifact, too_large
from .verdict import judged

_REFETCH = "re-fetch or re-deposit it"
# Bytes of tensor data per element, by safetensors dtype.
_ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}


@dataclass
class LayerInfo:
    """One cache layer as the header describes it."""

    index: int
    kind: str  # full, sliding or empty
    window: int | None = None  # sliding layers: the window w
    seen: int | None = None  # sliding layers: the cumulative length (tokens the layer has seen)
    kv_heads: int | None = None
    kept: int | None = None  # tokens the layer keeps
    head_dim: int | None = None
    tensor_bytes: int = 0  # keys + values


@dataclass
class ArtifactInfo:
    """An artifact's header: sizes, pins, chain link, layers. Nothing here needed the tensor data."""

    path: str
    file_bytes: int
    payload_bytes: int
    codec: str  # "raw" (v2 container) or "zstd" (a bare frame)
    header_bytes: int
    format_version: str
    num_tokens: int
    num_layers: int
    start_position: int
    parent_sha256: str | None
    dtype: str
    device: str | None
    prefill: Any
    model_sha256: str | None
    tokenizer_sha256: str | None
    compute_sha256: str | None  # the manifest's compute pin (metadata key manifest_sha256)
    logits_sha256: str | None
    logits_dtype: str | None
    kv_dtype: str | None = None  # the keys' and values' width when narrower than dtype (model.kv_dtype)
    layers: list[LayerInfo] = field(default_factory=list)
    other_metadata: dict[str, str] = field(default_factory=dict)
    sha256: str | None = None  # the identity, once hashed (or taken from a store that re-hashes on load)

    @property
    def compression_ratio(self) -> float | None:
        return self.payload_bytes / self.file_bytes if self.file_bytes else None

    @property
    def link(self) -> str:
        return "root" if self.parent_sha256 is None else "chain link"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["compression_ratio"] = None if self.compression_ratio is None else round(self.compression_ratio, 4)
        d["link"] = self.link
        d["layer_counts"] = {k: sum(l.kind == k for l in self.layers) for k in LAYER_KINDS}
        return d


def _frame_size(head: bytes, source: str, cap: int) -> int:
    """The payload size a zstd frame header declares, held to the payload limit ``cap`` as every reader holds it."""
    import zstandard

    if head[:4] != ZSTD_MAGIC:
        raise not_an_artifact(source)
    try:
        params = zstandard.get_frame_parameters(head)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{source}: corrupt zstd frame header ({e})", _REFETCH) from None
    if params.content_size <= 0:
        raise IntegrityError(f"{source}: zstd frame declares no content size (kvgraft always writes it)", _REFETCH)
    if params.content_size > cap:
        raise too_large(source, "zstd frame", params.content_size, cap)
    return params.content_size


def _read_exact(reader, n: int, source: str, what: str) -> bytes:
    import zstandard

    chunks, got = [], 0
    try:
        while got < n:
            b = reader.read(n - got)
            if not b:
                break
            chunks.append(b)
            got += len(b)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{source}: corrupt zstd data in the {what} ({e})", _REFETCH) from None
    data = b"".join(chunks)
    if len(data) < n:
        raise IntegrityError(f"{source}: the file ends inside the {what} ({len(data)} of {n} bytes)", _REFETCH)
    return data


def read_info(path: Path, expected_sha256: str | None = None) -> ArtifactInfo:
    """The header of the ``.kvg`` file at ``path`` (see the module docstring for what is refused). With
    ``expected_sha256`` (the identity the store or the file's name records it under) a refusal is judged against
    it (artifacts.verdict): a damaged artifact is an IntegrityError, as the full read and `kvgraft verify` say."""
    with judged(path, expected_sha256):
        return _read_info(Path(path))


def _read_info(path: Path) -> ArtifactInfo:
    import zstandard

    source = str(path)
    if path.is_dir():
        raise ArtifactError(f"{source} is a directory, not a .kvg file")
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ArtifactError(f"artifact not found: {source}") from None
    except OSError as e:
        raise ArtifactError(f"cannot read {source}: {e.strerror or e}") from None
    with f:
        file_bytes = path.stat().st_size
        head = f.read(18)  # the longest zstd frame header
        if not head:
            raise IntegrityError(f"{source}: empty file (a .kvg file is one zstd frame)", _REFETCH)
        # The payload limit as the full read holds it (PayloadTooLarge, exit 2, before any other size rule), so a
        # header over it gets the same verdict here as from graft's reader.
        cap = max_payload()
        if container.is_container(head):  # the v2 container: raw in place, shuffle-zstd through its chunk reader
            reader, size, codec = container.open_payload(f, file_bytes, source, cap)
        else:
            size = _frame_size(head, source, cap)
            f.seek(0)
            reader, codec = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=False), "zstd"
        if size < 8:
            raise IntegrityError(f"{source}: payload of {size} bytes is too short for a safetensors header", _REFETCH)
        (n,) = struct.unpack("<Q", _read_exact(reader, 8, source, "payload's header length"))
        if n > min(MAX_HEADER, size - 8):
            raise IntegrityError(
                f"{source}: damaged header: it declares {n} header bytes in a payload of {size}", _REFETCH
            )
        raw = _read_exact(reader, n, source, "payload's header")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{source}: damaged header: not JSON ({str(e)[:120]})", _REFETCH) from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ArtifactError(f"{source}: not a kvgraft artifact (a safetensors payload without kvgraft metadata)")
    layout.check_header(header, source)  # what graft would refuse, inspect refuses too (nothing inconsistent shown)
    meta = header.pop("__metadata__")
    try:
        return _info(path, header, meta, file_bytes, size, n, codec)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ArtifactError(f"{source}: inconsistent artifact header ({type(e).__name__}: {e})") from None


def _info(path: Path, header: dict, meta: dict, file_bytes: int, size: int, n: int, codec: str) -> ArtifactInfo:
    kinds = json.loads(meta["layer_types"])
    windows = json.loads(meta["sliding_windows"])
    seen = json.loads(meta["cumulative_lengths"])
    num_layers = int(meta["num_layers"])
    if not (len(kinds) == len(windows) == len(seen) == num_layers):
        raise ValueError("layer lists disagree with num_layers")
    layers = []
    for i, kind in enumerate(kinds):
        layer = LayerInfo(i, str(kind), windows[i], seen[i])
        keys, values = header.get(f"layers.{i:03d}.keys"), header.get(f"layers.{i:03d}.values")
        if isinstance(keys, dict) and len(keys.get("shape", ())) == 4:
            _, layer.kv_heads, layer.kept, layer.head_dim = (int(x) for x in keys["shape"])
        for t in (keys, values):
            if isinstance(t, dict):
                begin, end = t["data_offsets"]
                layer.tensor_bytes += int(end) - int(begin)
        layers.append(layer)
    try:
        prefill = json.loads(meta["prefill"])
    except ValueError:
        prefill = meta["prefill"]
    known = set(REQUIRED_META) | {"parent_sha256", "device", "kv_dtype"}
    return ArtifactInfo(
        path=str(path),
        file_bytes=file_bytes,
        payload_bytes=size,
        codec=codec,
        header_bytes=n,
        format_version=meta["format_version"],
        num_tokens=int(meta["num_tokens"]),
        num_layers=num_layers,
        start_position=int(meta["start_position"]),
        parent_sha256=meta.get("parent_sha256"),
        dtype=meta["dtype"],
        device=meta.get("device"),
        prefill=prefill,
        model_sha256=meta.get("model_sha256"),
        tokenizer_sha256=meta.get("tokenizer_sha256"),
        compute_sha256=meta.get("manifest_sha256"),
        logits_sha256=meta.get("logits_sha256"),
        logits_dtype=meta.get("logits_dtype"),
        kv_dtype=meta.get("kv_dtype"),
        layers=layers,
        other_metadata={k: v for k, v in sorted(meta.items()) if k not in known and k not in ("format",)},
    )


def payload_sha256(path: Path) -> str:
    """The artifact's identity: SHA-256 of its whole payload, streamed (the frame rules of payload.py apply)."""
    from .payload import kvg_payload_sha256

    return kvg_payload_sha256(Path(path))
