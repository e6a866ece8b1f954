"""What a kvgraft payload's header must say, checked from the header alone (no tensor data, no torch).

Every reader runs :func:`check_header` before it allocates or trusts anything the header describes: the readers of
payload.py and container.py (so a small file whose header describes a huge but inconsistent artifact is refused
before its size is allocated), ``kvgraft inspect`` (which shows only what passes), and format.decode (which then
checks the same again on the tensors themselves).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ArtifactError

FORMAT = "kvgraft.kvg"
FORMAT_VERSION = "1"
LAYER_KINDS = ("full", "sliding", "empty")
# Metadata keys every v1 artifact has (values are strings; lists and objects are compact JSON).
REQUIRED_META = (
    "cumulative_lengths",
    "dtype",
    "format",
    "format_version",
    "layer_types",
    "logits_dtype",
    "logits_sha256",
    "manifest_sha256",
    "model_sha256",
    "num_layers",
    "num_tokens",
    "prefill",
    "sliding_windows",
    "start_position",
    "tokenizer_sha256",
)
KV_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64"}  # safetensors code -> torch


def kv_dtype_of(meta: dict) -> str:
    """The width of an artifact's keys and values: its ``kv_dtype`` (a 16-bit cache of a float32 model, manifest
    key model.kv_dtype), else its ``dtype`` (every artifact before the key)."""
    kv = meta.get("kv_dtype", meta["dtype"])
    return kv if isinstance(kv, str) else ""


def check_meta(meta: Any, source: str) -> None:
    """The metadata names this format and version and has every required key (ArtifactError otherwise)."""
    if not isinstance(meta, dict):
        raise ArtifactError(f"{source}: not a kvgraft artifact (no metadata)")
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{source}: not a kvgraft artifact (format={str(meta.get('format'))[:40]!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{source}: artifact format version {str(meta.get('format_version'))[:20]!r}; this "
            f"kvgraft reads {FORMAT_VERSION}",
            "upgrade kvgraft",
        )
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ArtifactError(f"{source}: metadata lacks {', '.join(missing)}")


def check_header(header: Any, source: str) -> None:
    """A payload's safetensors header (``__metadata__`` and the tensor entries) describes a consistent kvgraft
    artifact: token ids of ``num_tokens``, one keys/values pair per non-empty layer in the metadata's dtype and of the
    shape its kind implies, a chain link's start and parent, nothing else. ArtifactError (exit 2) naming what."""
    if not isinstance(header, dict):
        raise ArtifactError(f"{source}: not a kvgraft artifact (the header is not an object)")
    meta = header.get("__metadata__")
    check_meta(meta, source)
    assert isinstance(meta, dict)  # (check_meta refuses anything else)
    try:
        _check(header, meta)
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise ArtifactError(f"{source}: inconsistent artifact header ({str(e)[:200]})") from None


def _int(meta: dict, key: str) -> int:
    v = meta[key]
    if not isinstance(v, str) or not v.lstrip("-").isdigit() or len(v) > 19:
        raise ValueError(f"{key} {v[:40]!r} is not an integer")
    return int(v)


def _check(header: dict, meta: dict) -> None:
    n_tok, n_layers, start = _int(meta, "num_tokens"), _int(meta, "num_layers"), _int(meta, "start_position")
    kinds, windows, cums = (json.loads(meta[k]) for k in ("layer_types", "sliding_windows", "cumulative_lengths"))
    if not (isinstance(kinds, list) and isinstance(windows, list) and isinstance(cums, list)):
        raise ValueError("layer lists are not lists")
    if n_tok < 0 or n_layers < 0 or not (len(kinds) == len(windows) == len(cums) == n_layers):
        raise ValueError("layer lists disagree with num_layers")
    parent = meta.get("parent_sha256")
    if start < 0 or (start > 0) != (parent is not None):
        raise ValueError(f"start_position {start} and parent_sha256 disagree (a link needs both)")
    for key in ("dtype", "kv_dtype"):
        if key in meta and meta[key] not in KV_DTYPES:
            raise ValueError(f"{key} {str(meta[key])[:20]!r} is not one kvgraft writes")
    if "kv_dtype" in meta and (meta["kv_dtype"] == "float32" or meta["dtype"] != "float32"):
        raise ValueError(f"kv_dtype {meta['kv_dtype']} under dtype {meta['dtype']}: only a float32 model's is narrower")
    want = KV_DTYPES[kv_dtype_of(meta)]
    ids = header.get("token_ids")
    if not isinstance(ids, dict) or ids.get("dtype") != "I64" or ids.get("shape") != [n_tok]:
        raise ValueError("token_ids must be int64 of length num_tokens")
    expected = {"__metadata__", "token_ids"}
    for i, (kind, win, cum) in enumerate(zip(kinds, windows, cums)):
        if kind not in LAYER_KINDS:
            raise ValueError(f"layer {i}: unknown kind {str(kind)[:20]!r}")
        if kind == "empty":
            continue
        k, v = header.get(f"layers.{i:03d}.keys"), header.get(f"layers.{i:03d}.values")
        expected |= {f"layers.{i:03d}.keys", f"layers.{i:03d}.values"}
        if not (
            isinstance(k, dict)
            and isinstance(v, dict)
            and k.get("dtype") == v.get("dtype") == want
            and isinstance(k.get("shape"), list)
            and len(k["shape"]) == 4
            and isinstance(v.get("shape"), list)
            and len(v["shape"]) == 4
            and k["shape"][:3] == v["shape"][:3]
            and k["shape"][0] == 1
        ):
            raise ValueError(f"layer {i}: keys/values have the wrong dtype or shape")
        kept = k["shape"][2]
        if kind == "full" and kept != n_tok:
            raise ValueError(f"layer {i}: full layer keeps {kept} tokens, expected {n_tok}")
        if kind == "sliding" and (
            not isinstance(win, int) or cum != start + n_tok or kept != min(start + n_tok, win - 1)
        ):
            raise ValueError(f"layer {i}: sliding layer state (kept {kept}, seen {cum}, window {win}) is inconsistent")
    extra = set(header) - expected
    if extra:
        raise ValueError(f"unexpected tensors {sorted(extra)[:3]}")
