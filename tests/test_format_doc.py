"""An independent reader written from docs/FORMAT.md (zstandard, json, struct, hashlib, numpy: no kvgraft, no
safetensors, no torch) agrees with kvgraft on a real artifact, in every codec."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import zstandard


def read_kvg(path):
    data = path.read_bytes()
    if data[:8] == b"\x89KVG\r\n\x1a\n":  # the v2 container
        (h,) = struct.unpack("<I", data[8:12])
        container = json.loads(data[12 : 12 + h])
        assert container["version"] == 2 and not any(data[12 + h : container["payload_offset"]])
        assert container["payload_offset"] == -(-(12 + h) // 4096) * 4096
        pos = container["payload_offset"]
        if container["codec"] == "raw":  # the payload stored as it is
            payload = data[pos:]
        else:  # shuffle-zstd: chunks, each byte-plane shuffled and one zstd frame
            assert container["codec"] == "shuffle-zstd"
            payload, e, size = bytearray(), container["element_bytes"], container["chunk_bytes"]
            assert len(container["chunks"]) == -(-container["payload_bytes"] // size)
            for stored, sha in container["chunks"]:
                frame = data[pos : pos + stored]
                pos += stored
                assert hashlib.sha256(frame).hexdigest() == sha
                planes = zstandard.ZstdDecompressor().decompress(frame)
                m = len(planes) // e
                chunk = bytearray(planes)
                for j in range(e):
                    chunk[j : m * e : e] = planes[j * m : (j + 1) * m]
                payload += chunk
            assert pos == len(data)
        assert len(payload) == container["payload_bytes"]
    else:  # a bare zstd frame (v1 files)
        payload = zstandard.ZstdDecompressor().decompress(data)
    (n,) = struct.unpack("<Q", payload[:8])
    assert n % 8 == 0
    header = json.loads(payload[8 : 8 + n])
    meta = header.pop("__metadata__")
    assert identity(payload, meta.get("identity", "sha256")) == path.stem
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


def identity(payload: bytes, scheme: str) -> str:
    """The identity by the document's words: SHA-256 of the payload, or of the tag, the length and the 1 MiB
    leaves' digests."""
    if scheme == "sha256":
        return hashlib.sha256(payload).hexdigest()
    if scheme == "blake3":
        import blake3

        return blake3.blake3(payload).hexdigest()
    assert scheme == "sha256-tree"
    leaves = [hashlib.sha256(payload[i : i + 1048576]).digest() for i in range(0, len(payload), 1048576)]
    return hashlib.sha256(
        b"kvgraft/sha256-tree/v1\n" + len(payload).to_bytes(8, "little") + b"".join(leaves)
    ).hexdigest()


def payload_in(deposited, scheme: str) -> tuple[bytes, str]:
    """The deposited angle-1 artifact's payload (sha256: as deposited; sha256-tree: re-encoded with the key that
    names the tree, over 1 MiB so it has several leaves) and its identity as kvgraft computes it."""
    from kvgraft_cli.artifacts import format as kvg

    ctx, report = deposited
    r = next(r for r in report.results if r.id == "angle-1")
    payload, a = kvg.read_file(ctx.store / "objects" / r.artifact[:2] / f"{r.artifact}.kvg", expected_sha256=r.artifact)
    if scheme == "sha256":
        return bytes(payload), r.artifact
    import torch

    # 20x the kv heads (same tokens, same layout): a payload of several leaves, the last one short.
    wide = [
        kvg.LayerState(
            st.kind,
            torch.cat([st.keys] * 20, 1),
            torch.cat([st.values] * 20, 1),
            st.sliding_window,
            st.cumulative_length,
        )
        if st.kind != "empty"
        else st
        for st in a.layers
    ]
    payload = kvg.encode(a.token_ids, wide, {**a.meta, "identity": scheme})
    assert len(payload) > 1 << 20 and len(payload) % (1 << 20), len(payload)  # several leaves, the last one short
    return payload, kvg.payload_identity(payload)


@pytest.mark.parametrize("scheme", ["sha256", "sha256-tree", "blake3"])
def test_independent_reader_reads_every_codec(deposited, tmp_path, scheme):
    from kvgraft_cli.artifacts import container
    from kvgraft_cli.artifacts import format as kvg

    payload, sha = payload_in(deposited, scheme)
    assert identity(payload, scheme) == sha
    got = {}
    for codec in ("raw", "zstd", "shuffle-zstd", "shuffle-zstd in small chunks"):
        (tmp_path / codec).mkdir()
        p = tmp_path / codec / f"{sha}.kvg"
        if codec == "shuffle-zstd in small chunks":  # several chunks, the last one shorter
            p.write_bytes(container.shuffle_zstd_file(bytes(payload), 4, chunk_bytes=64 << 10))
            head = p.read_bytes()
            assert len(json.loads(head[12 : 12 + struct.unpack("<I", head[8:12])[0]])["chunks"]) >= 2
            assert len(payload) % (64 << 10)
        else:
            kvg.write_file(p, bytes(payload), codec=codec)
        got[codec] = read_kvg(p)
    for codec in got:
        assert got[codec][0] == got["zstd"][0] and all(
            np.array_equal(got[codec][1][k], v) for k, v in got["zstd"][1].items()
        )


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
    entry = next(
        e
        for e in __import__("kvgraft_cli.ledger.log").ledger.log.read(ctx.ledger)
        if e["kind"] == "deposit" and e["outputs"]["artifact"]["sha256"] == r.artifact
    )
    assert hashlib.sha256(t["token_ids"].astype("<i8").tobytes()).hexdigest() == entry["inputs"]["token_ids"]["sha256"]


@pytest.mark.parametrize("scheme", ["sha256", "sha256-tree", "blake3"])
def test_the_documented_reader_runs(deposited, tmp_path, scheme):
    """docs/FORMAT.md's "Reading one by hand" code, run as it is written on a file in every codec, in both
    identity schemes (and it refuses the other scheme's digest)."""
    import re

    from kvgraft_cli.artifacts import format as kvg

    doc = (Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md").read_text()
    section = doc[doc.index("## Reading one by hand") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    payload, sha = payload_in(deposited, scheme)
    other = identity(payload, "sha256" if scheme == "sha256-tree" else "sha256-tree")
    for codec in ("raw", "zstd", "shuffle-zstd"):
        p = tmp_path / f"{codec}.kvg"
        kvg.write_file(p, bytes(payload), codec=codec)
        with pytest.raises(AssertionError):
            exec(
                compile(
                    code.replace('"objects/ab/ab12....kvg"', repr(str(p))).replace('"ab12..."', repr(other)),
                    "FORMAT.md",
                    "exec",
                ),
                {},
            )
        run = code.replace('"objects/ab/ab12....kvg"', repr(str(p))).replace('"ab12..."', repr(sha))
        scope: dict = {}
        exec(compile(run, "FORMAT.md", "exec"), scope)
        assert bytes(scope["payload"]) == bytes(payload) and scope["meta"]["format"] == "kvgraft.kvg"
        assert list(scope["ids"]) == list(scope["tensor"]("token_ids"))
