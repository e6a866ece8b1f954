"""What every reader of a ``.kvg`` payload holds it to, whichever frame it came in (the zstd frame of
artifacts.payload, the v2 container of artifacts.container): the payload size limit, the safetensors header's rules
(how long a payload it describes), and the errors that name a file. Both readers import it; neither imports the
other for it. Torch-free."""

from __future__ import annotations

import json
import math

from ..errors import ArtifactError, IntegrityError, PayloadTooLarge
from ..util.limits import size_setting

MAX_HEADER = 8 << 20  # a payload's safetensors header; a kvgraft header takes about 250 bytes a layer
ENV_MAX_PAYLOAD = "KVGRAFT_MAX_PAYLOAD"
DEFAULT_MAX_PAYLOAD = 32 << 30
REFETCH = "re-fetch or re-deposit it"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Bytes per element of every safetensors dtype (a .kvg uses I64, F32, BF16 and F16; the others only get a size).
ST_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def max_payload() -> int:
    """The largest payload a reader accepts: ``KVGRAFT_MAX_PAYLOAD`` (bytes, or ``64G``-style), default 32 GiB."""
    return size_setting(ENV_MAX_PAYLOAD, DEFAULT_MAX_PAYLOAD, allow_zero=False)


def max_frame_bytes(n: int) -> int:
    """The most bytes a frame of ``n`` content bytes may take here: zstd's one-shot bound is n + n/256; a streaming
    writer that ends a block every few dozen bytes adds more, so allow n/8 and 64 KiB. Bounds what is read into
    memory and how many block headers are walked."""
    return n + (n >> 3) + (1 << 16)


def too_large(source: str, what: str, size: int, cap: int) -> PayloadTooLarge:
    """The error for a payload declared larger than the reader's limit (bad input, exit 2; never a mismatch)."""
    return PayloadTooLarge(
        f"{source}: {what} declares a payload of {size:,} bytes, more than this reader's limit of {cap:,} bytes",
        f"if the artifact is genuine, raise {ENV_MAX_PAYLOAD} (bytes, or e.g. 64G)",
    )


def not_an_artifact(source: str) -> ArtifactError:
    """The error for a file that is neither the v2 container nor a zstd frame: bad input (exit 2) when nothing
    names an identity for it, damage when something does (artifacts.verdict decides)."""
    return ArtifactError(
        f"{source}: not a .kvg artifact (neither the raw container nor a zstd frame)",
        "a .kvg file is a kvgraft payload in the raw container or in one zstd frame (docs/FORMAT.md)",
    )


def described_size(header: bytes, source: str) -> int:
    """The payload length a safetensors header (the ``N`` JSON bytes after the 8-byte length) describes:
    ``8 + N`` plus its tensors' bytes, which must be contiguous from offset 0. IntegrityError if it describes none."""
    return parse_header(header, source)[1]


def parse_header(header: bytes, source: str) -> tuple[dict, int]:
    """The safetensors header parsed, and the payload length it describes (:func:`described_size`)."""

    def corrupt(why: str) -> IntegrityError:
        return IntegrityError(f"{source}: corrupt safetensors header ({why})", REFETCH)

    try:
        parsed = json.loads(header)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise corrupt(str(e)[:120]) from None
    if not isinstance(parsed, dict):
        raise corrupt("not a JSON object")
    spans = []
    for name, t in parsed.items():
        if name == "__metadata__":
            continue
        shape, offsets = (t.get("shape"), t.get("data_offsets")) if isinstance(t, dict) else (None, None)
        if not (
            isinstance(t, dict)
            and t.get("dtype") in ST_SIZES
            and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise corrupt(f"tensor {name[:60]!r} lacks a dtype, shape or offsets")
        if offsets[1] - offsets[0] != math.prod(shape) * ST_SIZES[t["dtype"]]:
            raise corrupt(f"tensor {name[:60]!r}: offsets disagree with dtype and shape")
        spans.append(offsets)
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise corrupt("tensor data has gaps or overlaps")
        end = stop
    return parsed, 8 + len(header) + end


def identity_mismatch(source: str, got: str, expected: str) -> IntegrityError:
    """The error for a payload whose SHA-256 is not the identity it is stored or named under."""
    return IntegrityError(
        f"{source}: content hash {got[:16]}... does not match its identity {expected[:16]}... (tampered or corrupt)",
        "delete it and re-deposit, or re-import it from a good copy",
    )
