"""The .kvg codecs: raw and shuffle-zstd (v2 container) and zstd (a bare frame, v1). The identity is the payload's
SHA-256 whatever the codec; all read back byte-identical; files written before shuffle-zstd existed still read; every
damaged container file is refused before its bytes are used."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import sys
import zlib

import pytest
import torch

from kvgraft_cli.artifacts import container
from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.artifacts import payload as pl
from kvgraft_cli.errors import ArtifactError, InputError, IntegrityError


def _payload(dtype=torch.float32, tokens=300, heads=2, dim=16) -> bytes:
    layers = [
        kvg.LayerState(
            "full", torch.randn(1, heads, tokens, dim).to(dtype), torch.randn(1, heads, tokens, dim).to(dtype)
        )
        for _ in range(3)
    ]
    meta = {k: "x" for k in kvg.REQUIRED_META}
    meta.update(dtype=str(dtype).removeprefix("torch."), start_position="0", prefill="{}")
    return kvg.encode(list(range(tokens)), layers, meta)


@pytest.mark.parametrize("dtype,auto", [(torch.float32, "raw"), (torch.bfloat16, "raw"), (torch.float16, "raw")])
def test_every_codec_reads_back_the_same_payload_and_auto_picks_raw(tmp_path, dtype, auto):
    payload = _payload(dtype)
    sha = hashlib.sha256(payload).hexdigest()
    arts = {}
    for codec in ("raw", "zstd", "shuffle-zstd", "auto"):
        path = tmp_path / f"{codec}.kvg"
        assert kvg.write_file(path, payload, codec=codec) == (auto if codec == "auto" else codec)
        assert container.file_codec(path) == (auto if codec == "auto" else codec)
        got, arts[codec] = kvg.read_file(path, expected_sha256=sha)
        assert bytes(got) == payload and pl.kvg_payload_sha256(path) == sha
        assert hashlib.sha256(got).hexdigest() == sha
        ident, opened = kvg.open_file(path)  # no expected identity: it says which one it computed
        assert ident == sha and kvg.encode(opened.token_ids, opened.layers, opened.meta) == payload
        assert b"".join(pl.iter_payload(path)) == payload
        assert pl.decompress(path.read_bytes(), codec) == payload
    for codec in ("zstd", "shuffle-zstd"):
        for a, b in zip(arts["raw"].layers, arts[codec].layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and b.keys.dtype == dtype
    raw = (tmp_path / "raw.kvg").read_bytes()
    assert raw[:8] == container.MAGIC and len(raw) == container.PAYLOAD_OFFSET + len(payload)
    shuffled = (tmp_path / "shuffle-zstd.kvg").read_bytes()
    head = _header(shuffled)
    assert shuffled[:8] == container.MAGIC and head["codec"] == "shuffle-zstd" and head["version"] == 2
    assert head["element_bytes"] == {torch.float32: 4}.get(dtype, 2) and head["payload_bytes"] == len(payload)
    assert head["chunk_bytes"] == 8 << 20 and len(head["chunks"]) == 1 and head["payload_offset"] == 4096
    assert len(shuffled) == 4096 + head["chunks"][0][0] < len(payload)  # random KV still compresses a little


def _header(data: bytes) -> dict:
    (h,) = struct.unpack("<I", data[8:12])
    return json.loads(data[12 : 12 + h])


def _chunked(payload: bytes, element: int = 4, chunk: int = 64 << 10) -> bytes:
    """A shuffle-zstd file of ``payload`` in small chunks (several of them, the last one shorter)."""
    return container.shuffle_zstd_file(payload, element, chunk_bytes=chunk)


@pytest.mark.parametrize("numpy_loaded", [True, False])
def test_shuffle_zstd_in_chunks_reads_back_with_or_without_numpy(tmp_path, monkeypatch, numpy_loaded):
    """Many chunks, a last chunk shorter than the others and a tail shorter than an element: the same payload,
    byte for byte, from the torch-free unshuffle (bytes slicing) and from numpy's (a graft's)."""
    payload = _payload(torch.bfloat16, tokens=901, heads=3, dim=15)  # odd-sized tensors
    sha = hashlib.sha256(payload).hexdigest()
    for element in (1, 2, 4, 8):
        path = tmp_path / f"{element}.kvg"
        path.write_bytes(_chunked(payload, element, chunk=(64 << 10) + 8))
        head = _header(path.read_bytes())
        assert len(head["chunks"]) >= 3 and len(payload) % head["chunk_bytes"]  # the last chunk is shorter
        assert len(payload) % head["chunk_bytes"] % element == (4 if element == 8 else 0)  # 8: a 4-byte tail
        if not numpy_loaded:
            monkeypatch.setitem(sys.modules, "numpy", None)  # what `kvgraft verify` runs: no numpy imported
        assert bytes(pl.read_payload(path, expected_sha256=sha)) == payload
        assert b"".join(pl.iter_payload(path)) == payload and pl.kvg_payload_sha256(path) == sha
        monkeypatch.undo()
        _, art = kvg.read_file(path, expected_sha256=sha)
        assert torch.equal(art.layers[0].keys, kvg.decode(bytearray(payload)).layers[0].keys)


def test_shuffle_is_byte_planes():
    data = bytes(range(11))
    assert container.shuffle(data, 4) == bytes([0, 4, 1, 5, 2, 6, 3, 7, 8, 9, 10])  # planes, then the 3-byte tail
    assert container.shuffle(data, 2) == bytes([0, 2, 4, 6, 8, 1, 3, 5, 7, 9, 10])
    out = bytearray(13)
    container.unshuffle_into(out, 1, container.shuffle(data, 4), 4)
    assert bytes(out) == b"\0" + data + b"\0"


# Files written by kvgraft before shuffle-zstd existed (zlib, base64): a v1 file (one zstd frame, float32) and a
# v2 raw file (bfloat16), each one full layer of keys arange(12)/7 and values -arange(12)/3 in [1, 1, 3, 4], tokens
# 5, 6, 7. They must read forever.
V1_ZSTD = (
    "afedf3429b5205d28b1c2d67e5384a159647f4adb9ab25710616d89dbe0e090c",
    torch.float32,
    "zstd",
    "eNoBrAFT/ii1L/1kqAH1DAB2l1E0YEniBsCQWdCiM1yfgyxhEBL9+EObJPyy3B7ytDLFAm6E+jHHbiq8km3/RiONhM7oY4lOCkAAQABD"
    "ABqjmqw0C7HrxCrN+uf3vLBcHz7T7Jlv/ecpo7Gphz/dm2Hpn9eLXWF6JdXsnje7sgTveF7KuSc1N72kfIcnFAjaIVPYOsgKW8pe/fA3"
    "xz9/r60UYzz8BlMrby2vDF9K5a1ptXheCQPMXOgFUm9b5fsN92b1GyRGG/M+/OWfx9kGAtw9gLsD2LZJYRbIMNDsTo1hgA7jwAYucEHQ"
    "oBZCURSE3iaHgYr0vN5U15ofTo00F04C0pSVG0YZ2IevbKszQ25s7p+CzvuiKPoOuH8LnfcNiKLP3SERogjSdR7k4Q5Z6LwHXec93D1C"
    "IMBFBxEcG3BQ5KAkPtyjdD3ERARHBShRRK4HBQclCgUo8SMgUCJxgkYPGAGCgAeBMUCBOrWz0029mUDOdQ+eo6S56GgN9GLza6R5ANWi"
    "xb17Jk818gTmg/+9h9IQv7xyW2LKJO/8kMvsO0aGG4xxoaFlS1XmKm4S0TVrVWXJgg==",
)
V2_RAW = (
    "1ee169a3525cbe590f581dea3ef18bc7a304866860e0793d45bf034ed975ad7a",
    torch.bfloat16,
    "raw",
    "eNrtmDFr20AUx0WgDQS6BLp0Km/NYWRZVRINVgg0oXRuF8ccF+tkHz7pjO5kVzECr13zHTrlA3SrtfYDdOqX6Z0sO3Wydepwv+VxP47/"
    "4z1uuq8fP1+/Onpz9N5xnCWMRExHEEJOFoBgRkouSIxvS0UlhIHvPjqRJJIqCH33PEAwp7lkIoPQqxyLxWKxWCwWi8VisVgs/xvuwaYu"
    "AeOUKhITRTCGcAmjIi04UWxOMafZWE0khDDICs6HgCBW5YxqcZtwQVQ30CoReUqUdtP5OCeJ6ui603j3RQBdLTkpaY5NRpN6A4nOvQGT"
    "zMWYKYm3Db48Kjkh3rugdSnJWEKlemJFTPm+yooUN+1k29sIJaY0M6Jn/jlymjDO9WlZ6aPkLGbZGC9YFovF3tRSkVzhmZBMbWZxtWyy"
    "2J2e56++Vesxi6XZ5nacD4FvcibEnAa9od6k2fjmO0XfHLjI84dVuyHZcV23M6XlXsblVbPvbUgXdVEP+c+jPB/5Z0+y5oQX9J/S/DN0"
    "6g2r6m3Di/b9vGzr4e5FHffv+7/7x9FpNIhW0X30Lfoe/Yyc1cOPk/Vq/bD+tXbq1/VJfVF/qqf1H/uK4eA=",
)


@pytest.mark.parametrize("fixture", [V1_ZSTD, V2_RAW], ids=["v1-zstd", "v2-raw"])
def test_files_written_before_shuffle_zstd_still_read(tmp_path, fixture):
    sha, dtype, codec, blob = fixture
    path = tmp_path / f"{sha}.kvg"
    path.write_bytes(zlib.decompress(base64.b64decode(blob)))
    assert container.file_codec(path) == codec
    payload, art = kvg.read_file(path, expected_sha256=sha)
    ident, opened = kvg.open_file(path, expected_sha256=sha)
    assert ident == sha and hashlib.sha256(payload).hexdigest() == sha and pl.kvg_payload_sha256(path) == sha
    assert b"".join(pl.iter_payload(path)) == bytes(payload)
    keys = (torch.arange(12, dtype=torch.float32).reshape(1, 1, 3, 4) / 7).to(dtype)
    values = (-torch.arange(12, dtype=torch.float32).reshape(1, 1, 3, 4) / 3).to(dtype)
    for a in (art, opened):
        assert a.token_ids == [5, 6, 7] and a.meta["dtype"] == str(dtype).removeprefix("torch.")
        assert torch.equal(a.layers[0].keys, keys) and torch.equal(a.layers[0].values, values)
    # Re-written in every codec: the same identity.
    for other in container.CODECS:
        kvg.write_file(tmp_path / f"{other}.kvg", bytes(payload), codec=other)
        assert kvg.open_file(tmp_path / f"{other}.kvg", expected_sha256=sha)[0] == sha


def test_raw_tensors_are_views_of_one_private_buffer(tmp_path):
    """The raw read allocates the payload once; the tensors view it (no second copy), and the buffer is private:
    changing the file afterwards changes nothing already read."""
    payload = _payload()
    path = tmp_path / "a.kvg"
    kvg.write_file(path, payload, codec="raw")
    buf, art = kvg.read_file(path, expected_sha256=hashlib.sha256(payload).hexdigest())
    assert isinstance(buf, bytearray)
    k = art.layers[0].keys
    assert k.untyped_storage().data_ptr() >= _address(buf) and k.untyped_storage().data_ptr() < _address(buf) + len(buf)
    before = k.clone()
    data = bytearray(path.read_bytes())
    data[-100:] = b"\0" * 100
    path.write_bytes(bytes(data))
    assert torch.equal(art.layers[0].keys, before)


def _address(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _damaged(tmp_path, name, edit):
    payload = _payload()
    good = bytearray(container.raw_file(payload))
    path = tmp_path / f"{name}.kvg"
    path.write_bytes(bytes(edit(good)))
    return path, hashlib.sha256(payload).hexdigest()


def _set_header(b, **changes):
    (h,) = struct.unpack("<I", b[8:12])
    meta = json.loads(b[12 : 12 + h])
    meta.update(changes)
    text = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    b[8 : 12 + h] = struct.pack("<I", len(text)) + text
    return b[: 12 + len(text)] + b"\0" * (container.PAYLOAD_OFFSET - 12 - len(text)) + b[container.PAYLOAD_OFFSET :]


def _flip(i):
    def edit(b):
        b[i] ^= 1
        return b

    return edit


DAMAGE = {
    "tampered tensor byte": (_flip(-5), IntegrityError, "does not match its identity"),
    "tampered payload header": (_flip(container.PAYLOAD_OFFSET + 20), IntegrityError, ""),
    "truncated": (lambda b: b[:-10], IntegrityError, "truncated"),
    "bytes appended": (lambda b: b + b"x", IntegrityError, "bytes after"),
    "nonzero padding": (_flip(container.PAYLOAD_OFFSET - 1), IntegrityError, "padding"),
    "container header length": (lambda b: b[:8] + struct.pack("<I", 10**6) + b[12:], IntegrityError, "length"),
    "container header not JSON": (lambda b: b[:12] + b"\xff" + b[13:], IntegrityError, "container header"),
    "declares more than it holds": (lambda b: _set_header(b, payload_bytes=len(b)), IntegrityError, "truncated"),
    "declares past the limit": (lambda b: _set_header(b, payload_bytes=1 << 50), ArtifactError, "limit"),
    "unknown codec": (lambda b: _set_header(b, codec="lz9"), ArtifactError, "unknown .kvg codec"),
    "other version": (lambda b: _set_header(b, version=3), ArtifactError, "version"),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_damaged_raw_file_is_refused_by_every_reader(tmp_path, name):
    edit, exc, words = DAMAGE[name]
    path, sha = _damaged(tmp_path, name.replace(" ", "-"), edit)
    for read in (kvg.read_file, kvg.open_file):  # the buffer reader and the mapped reader (the store's)
        with pytest.raises(exc) as e:
            read(path, expected_sha256=sha)
        assert words in e.value.message, (read.__name__, e.value.message)
    if name.startswith("tampered"):  # whole and well-formed: the hash is what differs
        assert pl.kvg_payload_sha256(path) != sha
    else:
        with pytest.raises(exc):
            pl.kvg_payload_sha256(path)


def _shuffled_file(tmp_path, name, edit):
    """A float32 payload in a shuffle-zstd file of 64 KiB chunks (11 of them), edited."""
    payload = _payload(tokens=901)
    good = bytearray(_chunked(payload))
    assert len(_header(good)["chunks"]) == 11
    path = tmp_path / f"{name}.kvg"
    path.write_bytes(bytes(edit(good)))
    return path, hashlib.sha256(payload).hexdigest()


def _rewrite(b, edit_header=None, edit_frames=None):
    """A shuffle-zstd file with its container header and/or its frames edited (the header's length and padding and
    payload_offset follow, unless the edit sets payload_offset itself)."""
    (h,) = struct.unpack("<I", b[8:12])
    meta = json.loads(b[12 : 12 + h])
    at, frames = meta["payload_offset"], []
    for size, _ in meta["chunks"]:
        frames.append(bytes(b[at : at + size]))
        at += size
    if edit_frames:
        frames = edit_frames(frames)
        meta["chunks"] = [[len(f), hashlib.sha256(f).hexdigest()] for f in frames]  # a table that matches them
    given = dict(meta)
    if edit_header:
        edit_header(meta)
    text = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    new_offset = -(-(12 + len(text)) // 4096) * 4096
    if meta["payload_offset"] == given["payload_offset"]:
        meta["payload_offset"] = new_offset
        text = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    head = container.MAGIC + struct.pack("<I", len(text)) + text
    return bytearray(head + b"\0" * (new_offset - len(head)) + b"".join(frames) + b[at:])


def _header_edit(**changes):
    return lambda b: _rewrite(b, lambda m: m.update(changes))


def _table_edit(fn):
    return lambda b: _rewrite(b, fn)


def _frame_edit(fn):
    return lambda b: _rewrite(b, edit_frames=fn)


def _in_chunk(k, at):
    """Flip a byte ``at`` bytes into chunk ``k``'s stored frame."""

    def edit(b):
        meta = _header(b)
        b[meta["payload_offset"] + sum(c[0] for c in meta["chunks"][:k]) + at] ^= 1
        return b

    return edit


def _zstd(data: bytes, content_size=True) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(data)


def _lying_frame(data: bytes, declared: int) -> bytes:
    """A zstd frame of ``data`` whose header declares ``declared`` bytes of content instead (RFC 8878 3.1.1.1)."""
    f = bytearray(_zstd(data))
    fhd = f[4]
    fcs = [1 if fhd & 0x20 else 0, 2, 4, 8][fhd >> 6]
    at = 5 + (0 if fhd & 0x20 else 1) + [0, 1, 2, 4][fhd & 3]
    assert fcs == 4
    f[at : at + 4] = struct.pack("<I", declared)
    return bytes(f)


def _swap(frames, k, frame):
    frames[k] = frame
    return frames


def _sizes(fn):
    def edit(m):
        fn(m["chunks"])

    return edit


CHUNK = 64 << 10
SHUFFLE_DAMAGE = {
    "tampered compressed chunk": (_in_chunk(2, 40), IntegrityError, "chunk 2 is damaged"),
    "tampered first chunk": (_in_chunk(0, 9), IntegrityError, "chunk 0 is damaged"),
    "chunk table: a size larger": (
        _table_edit(_sizes(lambda c: c[3].__setitem__(0, c[3][0] + 1))),
        IntegrityError,
        "truncated",
    ),
    "chunk table: a size smaller": (
        _table_edit(_sizes(lambda c: c[3].__setitem__(0, c[3][0] - 1))),
        IntegrityError,
        "bytes after",
    ),
    "chunk table: sizes moved": (
        _table_edit(_sizes(lambda c: (c[3].__setitem__(0, c[3][0] + 5), c[4].__setitem__(0, c[4][0] - 5)))),
        IntegrityError,
        "chunk 3 is damaged",
    ),
    "chunk table: an entry missing": (_table_edit(_sizes(lambda c: c.pop())), IntegrityError, "chunk table has 10"),
    "chunk table: a size past any frame": (
        _table_edit(_sizes(lambda c: c[1].__setitem__(0, 10**9))),
        IntegrityError,
        "chunk 1",
    ),
    "chunk table: not a SHA-256": (
        _table_edit(_sizes(lambda c: c[1].__setitem__(1, "x" * 64))),
        IntegrityError,
        "chunk 1",
    ),
    "chunk_bytes lies": (_header_edit(chunk_bytes=CHUNK * 2), IntegrityError, "chunk table has 11"),
    "chunk_bytes too small": (_header_edit(chunk_bytes=16), IntegrityError, "chunk_bytes 16"),
    "element_bytes not a size": (_header_edit(element_bytes=3), IntegrityError, "element_bytes 3"),
    "payload_bytes lies": (
        _header_edit(payload_bytes=11 * CHUNK - 100),
        IntegrityError,
        "its payload's header describes 700,152",
    ),
    "declares past the limit": (_header_edit(payload_bytes=1 << 50), ArtifactError, "limit"),
    "payload_offset lies": (_header_edit(payload_offset=8192), IntegrityError, "payload_offset 8192"),
    "frame declares more than its chunk": (
        _frame_edit(lambda f: _swap(f, 5, _zstd(bytes(64 << 20)))),
        IntegrityError,
        "chunk 5: its zstd frame declares 67,108,864 bytes, the chunk holds 65,536",
    ),
    "frame inflates past what it declares": (
        _frame_edit(lambda f: _swap(f, 5, _lying_frame(bytes(CHUNK + 1000), CHUNK))),
        IntegrityError,
        "chunk 5: corrupt zstd frame",
    ),
    "frame without a content size": (
        _frame_edit(lambda f: _swap(f, 5, _zstd(bytes(CHUNK), content_size=False))),
        IntegrityError,
        "declares no size",
    ),
    "two frames in a chunk": (
        _frame_edit(lambda f: _swap(f, 5, f[5] + _zstd(b"x"))),
        IntegrityError,
        "chunk 5: corrupt zstd frame",
    ),
    "truncated": (lambda b: b[:-10], IntegrityError, "truncated"),
    "bytes appended": (lambda b: b + b"x", IntegrityError, "bytes after"),
    "nonzero padding": (_flip(4095), IntegrityError, "padding"),
    "container header length": (lambda b: b[:8] + struct.pack("<I", 10**7) + b[12:], IntegrityError, "length"),
    "unknown codec": (_header_edit(codec="shuffle-lz4"), ArtifactError, "unknown .kvg codec"),
    "other version": (_header_edit(version=3), ArtifactError, "version"),
}


@pytest.mark.parametrize("name", list(SHUFFLE_DAMAGE))
def test_a_damaged_shuffle_zstd_file_is_refused_by_every_reader_naming_it(tmp_path, name):
    """Every rule of docs/FORMAT.md's shuffle-zstd reader limits, broken once: each reader refuses the file, naming
    it (and the chunk, where one is to blame), before anything is returned."""
    edit, exc, words = SHUFFLE_DAMAGE[name]
    path, sha = _shuffled_file(tmp_path, name.replace(" ", "-").replace(":", ""), edit)
    for read in (kvg.read_file, kvg.open_file, lambda p, expected_sha256: pl.read_payload(p, expected_sha256)):
        with pytest.raises(exc) as e:
            read(path, expected_sha256=sha)
        assert words in e.value.message and str(path) in e.value.message, e.value.message
    with pytest.raises(exc) as e:  # `kvgraft verify`'s streamed hash
        pl.kvg_payload_sha256(path)
    if name == "payload_bytes lies":  # the streamed hash does not parse the payload: its last chunk is wrong
        words = "chunk 10: its zstd frame declares 44,792 bytes, the chunk holds 65,436"
    assert words in e.value.message, e.value.message


def _other_frame(frames):
    """Chunk 7 stored as another well-formed frame of the right size (its table entry updated to match)."""
    shuffled = bytearray(container.shuffle(bytes(CHUNK), 4))
    shuffled[100] = 1
    return _swap(frames, 7, _zstd(bytes(shuffled)))


@pytest.mark.parametrize(
    "edit",
    [_header_edit(element_bytes=2), _frame_edit(_other_frame)],
    ids=["element_bytes lies", "a chunk replaced, its table entry too"],
)
def test_a_shuffle_zstd_file_consistent_but_wrong_fails_its_identity(tmp_path, edit):
    """Well-formed, every chunk matching its table, yet not the payload: the identity, checked over the
    reconstructed payload before anything is returned, refuses it."""
    path, sha = _shuffled_file(tmp_path, "wrong", edit)
    for read in (kvg.read_file, kvg.open_file):
        with pytest.raises(IntegrityError) as e:
            read(path, expected_sha256=sha)
        assert str(path) in e.value.message
    assert pl.kvg_payload_sha256(path) != sha


def test_a_shuffle_zstd_bomb_is_refused_before_it_is_allocated(tmp_path):
    """A 64 KiB chunk whose frame (2 KB, its SHA-256 in the table) inflates to 64 MiB: refused from its frame header,
    the read's traced memory stays a few chunks."""
    import tracemalloc

    bomb = _zstd(bytes(64 << 20))
    assert len(bomb) < 4096
    path, sha = _shuffled_file(tmp_path, "bomb", _frame_edit(lambda f: _swap(f, 5, bomb)))
    for read in (kvg.read_file, kvg.open_file, lambda p, expected_sha256: pl.kvg_payload_sha256(p)):
        tracemalloc.start()
        try:
            with pytest.raises(IntegrityError, match="67,108,864"):
                read(path, expected_sha256=sha)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, peak


def test_a_small_shuffle_zstd_file_declaring_much_more_is_hashed_before_it_is_allocated(tmp_path, monkeypatch):
    """Past EAGER bytes and 8x its file (zeros compress ~1000x), a payload is first re-hashed in a streamed pass: a
    file that is not the artifact asked for is refused with a few chunks of memory, never the payload's size."""
    import tracemalloc

    monkeypatch.setattr(container, "EAGER", 1 << 20)
    layers = [kvg.LayerState("full", torch.zeros(1, 2, 3000, 16), torch.zeros(1, 2, 3000, 16)) for _ in range(3)]
    meta = {k: "x" for k in kvg.REQUIRED_META}
    meta.update(dtype="float32", start_position="0", prefill="{}")
    payload = kvg.encode(list(range(3000)), layers, meta)
    path = tmp_path / "zeros.kvg"
    path.write_bytes(_chunked(payload))
    assert len(payload) > 2 << 20 and len(payload) > 100 * path.stat().st_size
    tracemalloc.start()
    try:
        with pytest.raises(IntegrityError, match="does not match its identity"):
            kvg.read_file(path, expected_sha256="0" * 64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(payload) // 2, (peak, len(payload))
    assert bytes(kvg.read_file(path, expected_sha256=hashlib.sha256(payload).hexdigest())[0]) == payload


def test_unknown_codec_is_an_input_error(tmp_path):
    with pytest.raises(InputError):
        kvg.write_file(tmp_path / "a.kvg", _payload(), codec="lz9")


def test_deposit_writes_raw_and_codec_is_overridable(tmp_path):
    from conftest import EXAMPLES, run_cli, run_without_torch

    (tmp_path / "p.jsonl").write_text(EXAMPLES.read_text().splitlines()[0] + "\n")
    # auto (raw) and shuffle-zstd through the CLI; zstd differs from shuffle-zstd only below the flag, which the
    # in-process tests above write and read
    for codec, want in (("auto", "raw"), ("shuffle-zstd", "shuffle-zstd")):
        r = run_cli(
            "deposit",
            "p.jsonl",
            "--store",
            f"s-{codec}",
            "--ledger",
            f"l-{codec}.jsonl",
            "--codec",
            codec,
            "--json",
            cwd=tmp_path,
            check_rc=0,
        )
        (res,) = json.loads(r.stdout)["results"]
        path = tmp_path / f"s-{codec}" / "objects" / res["artifact"][:2] / f"{res['artifact']}.kvg"
        assert container.file_codec(path) == want
        run_cli("verify", f"l-{codec}.jsonl", "--full", "--require-files", cwd=tmp_path, check_rc=0)
    # A graft restores the shuffle-zstd artifact byte-exactly (against fresh computation), and verify refuses it
    # once a chunk is damaged.
    check = run_cli(
        "graft",
        res["artifact"],
        "--check",
        "--samples",
        "2",
        "--store",
        "s-shuffle-zstd",
        "--ledger",
        "l-shuffle-zstd.jsonl",
        "--json",
        cwd=tmp_path,
        check_rc=0,
    )
    r = json.loads(check.stdout)
    assert r["passed"] and (r["samples"], r["sha_equal"], r["max_kl"]) == (2, 2, 0.0)
    p = run_without_torch("verify", "l-shuffle-zstd.jsonl", "--full", "--require-files", cwd=tmp_path)
    assert p.returncode == 0, p.stderr  # verify reads shuffle-zstd without torch (and without numpy: see above)
    shown = json.loads(run_cli("inspect", str(path), "--hash", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert shown["sha256"] == res["artifact"] and shown["codec"] == "shuffle-zstd"  # inspect reads its header too
    data = bytearray(path.read_bytes())
    data[-50] ^= 1
    path.write_bytes(bytes(data))
    bad = run_cli("verify", "l-shuffle-zstd.jsonl", "--full", "--require-files", cwd=tmp_path, check_rc=1)
    assert "chunk" in bad.stdout + bad.stderr
    shas = {
        e["outputs"]["artifact"]["sha256"]
        for c in ("auto", "shuffle-zstd")
        for e in map(json.loads, (tmp_path / f"l-{c}.jsonl").read_text().splitlines())
        if e["kind"] == "deposit"
    }
    assert len(shas) == 1  # one identity, whatever the codec


def test_the_verified_cache_restores_from_memory_within_its_budget(tmp_path, monkeypatch):
    from kvgraft_cli.store.local import VERIFIED, Store

    VERIFIED.clear()
    payloads = [_payload(tokens=200 + i) for i in range(3)]
    with Store(tmp_path / "s") as s:
        shas = []
        for i, p in enumerate(payloads):
            sha = hashlib.sha256(p).hexdigest()
            s.put(
                sha,
                p,
                key=f"k{i}",
                problem_id=f"p{i}",
                num_tokens=1,
                model_sha256="m",
                manifest_sha256="c",
                verified=True,
            )
            shas.append(sha)
        first = s.load(shas[0])
        # Damage the file: the verified copy in memory is what a second graft in this process uses.
        path = s.object_path(shas[0])
        data = bytearray(path.read_bytes())
        data[-3] ^= 1
        path.write_bytes(bytes(data))
        assert s.load(shas[0]) is first and first[0] == shas[0]
        # A budget of two payloads keeps the two most recently used.
        monkeypatch.setenv("KVGRAFT_VERIFIED_CACHE", str(len(payloads[1]) + len(payloads[2]) + 10))
        s.load(shas[1])
        s.load(shas[2])
        assert VERIFIED.get(shas[0]) is None and VERIFIED.bytes <= len(payloads[1]) + len(payloads[2]) + 10
        with pytest.raises(IntegrityError):  # evicted: read again, re-hashed, refused
            s.load(shas[0])
        monkeypatch.setenv("KVGRAFT_VERIFIED_CACHE", "0")
        VERIFIED.clear()
        s.load(shas[1])
        assert VERIFIED.get(shas[1]) is None
    VERIFIED.clear()


def test_grafting_never_writes_into_the_artifact_it_restored(deposited, engine):
    """engine.restore shares the artifact's tensors (no copy on the CPU): decoding on a restored cache must leave
    them unchanged, and a second cache from the same artifact must graft exactly as the first did."""
    from kvgraft_cli.engine.engine import tensor_sha256
    from kvgraft_cli.store.local import Store

    ctx, report = deposited
    sha = next(r.artifact for r in report.results if r.artifact)
    with Store(ctx.store, create=False) as s:
        _, art = s.load(sha)
    before = [tensor_sha256(t) for st in art.layers for t in (st.keys, st.values) if t is not None]
    query = engine.encode("What is 2 + 2?")
    first = engine.restore(art.layers)
    logits1 = engine.forward(first, query)
    engine.greedy(first, logits1[-1], 8)
    after = [tensor_sha256(t) for st in art.layers for t in (st.keys, st.values) if t is not None]
    assert after == before
    assert torch.equal(engine.forward(engine.restore(art.layers), query), logits1)


def test_a_graft_hands_the_artifact_to_its_cache_alone(deposited, engine):
    """`graft` opens its artifact without remembering it (a process that restores once keeps no second copy) and,
    once the cache holds the tensors, drops its own references (Loaded.release), so the cache's first update frees
    each old layer as it goes: the artifact's tensors end up referenced by nothing but the cache, and the graft is
    unchanged (the same generated ids as a graft that keeps the artifact)."""
    import sys

    from kvgraft_cli.runs.graft import graft_generate, open_artifact
    from kvgraft_cli.store.local import VERIFIED

    ctx, report = deposited
    sha = next(r.artifact for r in report.results if r.artifact)
    VERIFIED.clear()
    loaded = open_artifact(ctx, sha)
    assert VERIFIED.get(sha) is None
    keys = loaded.artifact.layers[0].keys
    tokens = list(loaded.token_ids)
    kept = engine.restore(loaded.artifact.layers)
    before = sys.getrefcount(keys)
    first = graft_generate(ctx, engine, loaded, "What is 2 + 2?", 4)
    assert loaded.token_ids == tokens and loaded.artifact.layers == []
    assert sys.getrefcount(keys) == before - 1  # the Loaded's reference is gone; ours and `kept`'s remain
    logits = engine.forward(kept, engine.encode(ctx.manifest.prompt.query.format(query="What is 2 + 2?")))
    assert engine.greedy(kept, logits[-1], 4, stop_at_eos=True)[0] == first.generated_ids
