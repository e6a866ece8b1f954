"""The .kvg format: canonical bytes, round trips, identity, and refusal of damaged files."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
from conftest import EXAMPLES, run_cli

from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.errors import ArtifactError
from kvgraft_cli.util.hashing import sha256_bytes


@pytest.fixture(scope="module")
def sample(engine):
    """(token ids, captured layers, meta, payload) for a prefix longer than the sliding window."""
    from kvgraft_cli.engine.engine import tensor_sha256

    ids = engine.prefix_ids("Problem: what is 2+2?\nSolution: 2+2 = \\boxed{4}. " * 3)
    assert len(ids) > 32  # longer than the sliding window: sliding layers hold a trimmed state
    cache, last = engine.prefill(ids)
    layers = engine.capture(cache)
    meta = engine.artifact_meta(tensor_sha256(last))
    return ids, layers, meta, kvg.encode(ids, layers, meta)


def test_roundtrip_is_byte_equal(sample, tmp_path):
    import torch

    ids, layers, meta, payload = sample
    art = kvg.decode(payload, expected_sha256=sha256_bytes(payload))
    assert art.token_ids == ids
    for a, b in zip(art.layers, layers):
        assert a.kind == b.kind and a.sliding_window == b.sliding_window and a.cumulative_length == b.cumulative_length
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # decode -> encode gives the same bytes; the file round trip too, at any compression level.
    assert kvg.encode(art.token_ids, art.layers, {k: art.meta[k] for k in meta}) == payload
    for level in (1, 3, 19):
        kvg.write_file(tmp_path / f"a{level}.kvg", payload, level)
        got, _ = kvg.read_file(tmp_path / f"a{level}.kvg", expected_sha256=sha256_bytes(payload))
        assert got == payload


def test_sliding_state_is_recorded(sample):
    ids, layers, _, payload = sample
    kinds = [l.kind for l in layers]
    assert kinds == ["sliding", "sliding", "sliding", "full"]
    meta = kvg.read_header(payload)["__metadata__"]
    assert json.loads(meta["cumulative_lengths"]) == [len(ids)] * 3 + [None]
    assert json.loads(meta["sliding_windows"]) == [32, 32, 32, None]
    assert layers[0].keys.shape[2] == 31  # window - 1 tokens kept


def test_payload_is_canonical_safetensors(sample, tmp_path):
    """Header: 8-byte length, compact JSON, __metadata__ first with sorted keys, space padding to 8."""
    from safetensors import safe_open

    *_, payload = sample
    (n,) = struct.unpack("<Q", payload[:8])
    assert n % 8 == 0
    text = payload[8 : 8 + n].decode()
    header = json.loads(text)
    assert list(header)[0] == "__metadata__" and list(header)[1] == "token_ids"
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])
    assert text.rstrip(" ") == json.dumps(header, separators=(",", ":"))
    # A third party reads it with the safetensors library alone.
    (tmp_path / "p.safetensors").write_bytes(payload)
    with safe_open(tmp_path / "p.safetensors", framework="pt") as f:
        assert f.metadata()["format"] == "kvgraft.kvg"
        assert f.get_tensor("token_ids").tolist() == sample[0]


def test_metadata_order_does_not_change_bytes(sample):
    ids, layers, meta, payload = sample
    reversed_meta = dict(reversed(list(meta.items())))
    assert kvg.encode(ids, layers, reversed_meta) == payload


@pytest.mark.parametrize("where", [0, 9, 200, -1])
def test_flipped_byte_in_payload_is_refused(sample, where):
    *_, payload = sample
    bad = bytearray(payload)
    bad[where] ^= 0x01
    with pytest.raises(ArtifactError, match="does not match its identity"):
        kvg.decode(bytes(bad), "x.kvg", expected_sha256=sha256_bytes(payload))


def test_damaged_files_are_refused(sample, tmp_path):
    *_, payload = sample
    path = tmp_path / "a.kvg"
    kvg.write_file(path, payload)
    data = path.read_bytes()
    for _name, damaged in {
        "flipped": data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0x40]) + data[len(data) // 2 + 1 :],
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "garbage": b"not a zstd frame at all",
    }.items():
        path.write_bytes(damaged)
        with pytest.raises(ArtifactError):
            kvg.read_file(path, expected_sha256=sha256_bytes(payload))


def test_unknown_format_version_is_refused(sample):
    ids, layers, meta, _ = sample
    payload = kvg.canonical_safetensors(
        {"token_ids": __import__("torch").tensor(ids)}, {**meta, "format": "kvgraft.kvg", "format_version": "99"}
    )
    with pytest.raises(ArtifactError, match="format version"):
        kvg.decode(payload)


def test_inconsistent_sliding_state_is_refused(sample):
    ids, layers, meta, _ = sample
    import copy

    bad = copy.copy(layers)
    bad[0] = kvg.LayerState("sliding", layers[0].keys, layers[0].values, 32, len(ids) + 1)
    with pytest.raises(ArtifactError, match="inconsistent"):
        kvg.decode(kvg.encode(ids, bad, meta))


def test_two_processes_write_identical_bytes(tmp_path):
    """Depositing the same problems in two separate processes gives identical artifact files."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        run_cli("deposit", str(EXAMPLES), "--limit", "2", cwd=tmp_path / d, check_rc=0)
    files_a = sorted((tmp_path / "a" / "kvgraft-store" / "objects").rglob("*.kvg"))
    files_b = sorted((tmp_path / "b" / "kvgraft-store" / "objects").rglob("*.kvg"))
    assert len(files_a) == 2
    assert [f.name for f in files_a] == [f.name for f in files_b]
    for fa, fb in zip(files_a, files_b):
        assert fa.read_bytes() == fb.read_bytes()
        payload, _ = kvg.read_file(fa)
        assert sha256_bytes(payload) == fa.stem  # file name is the payload identity


def _frames(payload: bytes) -> dict[str, bytes]:
    import zstandard

    good = kvg.compress(payload)
    return {
        "truncated": good[:-7],
        "checksum cut": good[:-2],
        "trailing bytes": good + kvg.compress(b"more"),
        "no content size": zstandard.ZstdCompressor(write_content_size=False).compress(payload),
        "not zstd": b"plain bytes, not a frame",
    }


@pytest.mark.parametrize("case", ["truncated", "checksum cut", "trailing bytes", "no content size", "not zstd"])
def test_both_frame_readers_apply_the_same_rules(tmp_path, case):
    """The in-memory reader (graft) and the streamed hasher (verify) refuse the same damaged frames."""
    from kvgraft_cli.artifacts.payload import decompress, kvg_payload_sha256

    data = _frames(b"x" * 100_000)[case]
    path = tmp_path / "a.kvg"
    path.write_bytes(data)
    with pytest.raises(ArtifactError):
        decompress(data, str(path))
    with pytest.raises(ArtifactError):
        kvg_payload_sha256(path)


def test_frame_readers_agree_on_a_good_frame(tmp_path):
    from kvgraft_cli.artifacts.payload import decompress, kvg_payload_sha256

    payload = bytes(range(256)) * 40_000  # several read chunks
    path = tmp_path / "a.kvg"
    path.write_bytes(kvg.compress(payload))
    assert decompress(path.read_bytes(), "a") == payload
    assert kvg_payload_sha256(path) == hashlib.sha256(payload).hexdigest()
