"""An independent reader written from docs/FORMAT.md (zstandard, json, struct, hashlib, numpy: no kvgraft, no
safetensors, no torch) agrees with kvgraft on a real artifact."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import zstandard


def read_kvg(path):
    data = path.read_bytes()
    if data[:8] == b"\x89KVG\r\n\x1a\n":  # the v2 container: the payload stored raw at its offset
        (h,) = struct.unpack("<I", data[8:12])
        container = json.loads(data[12:12 + h])
        assert container["version"] == 2 and container["codec"] == "raw"
        assert not any(data[12 + h:container["payload_offset"]])
        payload = data[container["payload_offset"]:]
        assert len(payload) == container["payload_bytes"]
    else:  # a bare zstd frame (v1 files; 16-bit dtypes)
        payload = zstandard.ZstdDecompressor().decompress(data)
    assert hashlib.sha256(payload).hexdigest() == path.stem
    (n,) = struct.unpack("<Q", payload[:8])
    assert n % 8 == 0
    header = json.loads(payload[8 : 8 + n])
    meta = header.pop("__metadata__")
    body = payload[8 + n :]
    offset, tensors = 0, {}
    for name, h in header.items():  # header order is data order, no gaps
        b, e = h["data_offsets"]
        assert b == offset
        offset = e
        dt = {"I64": "<i8", "F32": "<f4", "F16": "<f2"}[h["dtype"]]
        tensors[name] = np.frombuffer(body[b:e], dtype=dt).reshape(h["shape"])
    assert offset == len(body)
    return meta, tensors


def test_independent_reader_reads_both_codecs(deposited, tmp_path):
    from kvgraft_cli.artifacts import format as kvg

    ctx, report = deposited
    r = next(r for r in report.results if r.id == "angle-1")
    path = ctx.store / "objects" / r.artifact[:2] / f"{r.artifact}.kvg"
    payload, _ = kvg.read_file(path, expected_sha256=r.artifact)
    got = {}
    for codec in ("raw", "zstd"):
        (tmp_path / codec).mkdir()
        p = tmp_path / codec / f"{r.artifact}.kvg"
        kvg.write_file(p, bytes(payload), codec=codec)
        got[codec] = read_kvg(p)
    assert got["raw"][0] == got["zstd"][0] and all(np.array_equal(got["raw"][1][k], v) for k, v in got["zstd"][1].items())


def test_independent_reader_agrees(deposited):
    ctx, report = deposited
    r = next(r for r in report.results if r.id == "angle-1")
    path = ctx.store / "objects" / r.artifact[:2] / f"{r.artifact}.kvg"
    meta, t = read_kvg(path)
    n = int(meta["num_tokens"])
    assert meta["format"] == "kvgraft.kvg" and meta["format_version"] == "1"
    assert t["token_ids"].shape == (n,) and n == r.num_tokens
    kinds = json.loads(meta["layer_types"])
    windows = json.loads(meta["sliding_windows"])
    cums = json.loads(meta["cumulative_lengths"])
    for i, (kind, w, c) in enumerate(zip(kinds, windows, cums)):
        k = t[f"layers.{i:03d}.keys"]
        kept = n if kind == "full" else min(n, w - 1)
        assert k.shape[2] == kept and t[f"layers.{i:03d}.values"].shape == k.shape
        assert c == (n if kind == "sliding" else None)
    # The token-id hash convention: int64 little-endian bytes.
    entry = next(e for e in __import__("kvgraft_cli.ledger.log").ledger.log.read(ctx.ledger)
                 if e["kind"] == "deposit" and e["outputs"]["artifact"]["sha256"] == r.artifact)
    assert hashlib.sha256(t["token_ids"].astype("<i8").tobytes()).hexdigest() == entry["inputs"]["token_ids"]["sha256"]
