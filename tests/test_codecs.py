"""The .kvg codecs: raw (v2 container) and zstd (a bare frame, v1). The identity is the payload's SHA-256 whatever
the codec; both read back byte-identical; every damaged raw file is refused before its bytes are used."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from kvgraft_cli.artifacts import container
from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.artifacts import payload as pl
from kvgraft_cli.errors import ArtifactError, InputError, IntegrityError


def _payload(dtype=torch.float32, tokens=300) -> bytes:
    layers = [kvg.LayerState("full", torch.randn(1, 2, tokens, 16).to(dtype), torch.randn(1, 2, tokens, 16).to(dtype))
              for _ in range(3)]
    meta = {k: "x" for k in kvg.REQUIRED_META}
    meta.update(dtype=str(dtype).removeprefix("torch."), start_position="0", prefill="{}")
    return kvg.encode(list(range(tokens)), layers, meta)


@pytest.mark.parametrize("dtype,auto", [(torch.float32, "raw"), (torch.bfloat16, "raw"), (torch.float16, "raw")])
def test_both_codecs_read_back_the_same_payload_and_auto_picks_raw(tmp_path, dtype, auto):
    payload = _payload(dtype)
    sha = hashlib.sha256(payload).hexdigest()
    arts = {}
    for codec in ("raw", "zstd", "auto"):
        path = tmp_path / f"{codec}.kvg"
        assert kvg.write_file(path, payload, codec=codec) == (auto if codec == "auto" else codec)
        assert container.file_codec(path) == (auto if codec == "auto" else codec)
        got, arts[codec] = kvg.read_file(path, expected_sha256=sha)
        assert bytes(got) == payload and pl.kvg_payload_sha256(path) == sha
        ident, opened = kvg.open_file(path)  # no expected identity: it says which one it computed
        assert ident == sha and kvg.encode(opened.token_ids, opened.layers, opened.meta) == payload
        assert b"".join(pl.iter_payload(path)) == payload
    for a, b in zip(arts["raw"].layers, arts["zstd"].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and a.keys.dtype == dtype
    raw = (tmp_path / "raw.kvg").read_bytes()
    assert raw[:8] == container.MAGIC and len(raw) == container.PAYLOAD_OFFSET + len(payload)
    assert pl.decompress(raw, "raw") == payload


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
    meta = json.loads(b[12:12 + h])
    meta.update(changes)
    text = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    b[8:12 + h] = struct.pack("<I", len(text)) + text
    return b[:12 + len(text)] + b"\0" * (container.PAYLOAD_OFFSET - 12 - len(text)) + b[container.PAYLOAD_OFFSET:]


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


def test_unknown_codec_is_an_input_error(tmp_path):
    with pytest.raises(InputError):
        kvg.write_file(tmp_path / "a.kvg", _payload(), codec="lz9")


def test_deposit_writes_raw_and_codec_is_overridable(tmp_path):
    from conftest import EXAMPLES, run_cli

    (tmp_path / "p.jsonl").write_text(EXAMPLES.read_text().splitlines()[0] + "\n")
    for codec, want in (("auto", "raw"), ("zstd", "zstd")):
        r = run_cli("deposit", "p.jsonl", "--store", f"s-{codec}", "--ledger", f"l-{codec}.jsonl", "--codec", codec,
                    "--json", cwd=tmp_path, check_rc=0)
        (res,) = json.loads(r.stdout)["results"]
        path = tmp_path / f"s-{codec}" / "objects" / res["artifact"][:2] / f"{res['artifact']}.kvg"
        assert container.file_codec(path) == want
        run_cli("verify", f"l-{codec}.jsonl", "--full", "--require-files", cwd=tmp_path, check_rc=0)
    shas = {json.loads(line)["outputs"]["artifact"]["sha256"] for c in ("auto", "zstd")
            for line in (tmp_path / f"l-{c}.jsonl").read_text().splitlines()}
    assert len(shas) == 1  # one identity, two codecs


def test_the_verified_cache_restores_from_memory_within_its_budget(tmp_path, monkeypatch):
    from kvgraft_cli.store.local import VERIFIED, Store

    VERIFIED.clear()
    payloads = [_payload(tokens=200 + i) for i in range(3)]
    with Store(tmp_path / "s") as s:
        shas = []
        for i, p in enumerate(payloads):
            sha = hashlib.sha256(p).hexdigest()
            s.put(sha, p, key=f"k{i}", problem_id=f"p{i}", num_tokens=1, model_sha256="m", manifest_sha256="c",
                  verified=True)
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
    logits = engine.forward(kept, engine.encode(ctx.manifest.data["prompt"]["query"].format(query="What is 2 + 2?")))
    assert engine.greedy(kept, logits[-1], 4, stop_at_eos=True)[0] == first.generated_ids
