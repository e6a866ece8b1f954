"""An artifact's identity in its three schemes (artifacts/identity.py, docs/FORMAT.md): sha256 (one stream, every
artifact deposited before the tree), sha256-tree (1 MiB leaves, verified on every core) and blake3 (what b3sum
prints). The digests are checked against ones computed here from the document's words with hashlib, or the blake3
package checked against BLAKE3's published digest of the empty input."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import threading
import time

import pytest
import torch
from conftest import EXAMPLES, run_cli

from kvgraft_cli.artifacts import container
from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.artifacts import identity as ident
from kvgraft_cli.artifacts.payload import kvg_payload_sha256
from kvgraft_cli.errors import ArtifactError, IntegrityError

MIB = 1 << 20


def by_hand(payload: bytes) -> str:
    """docs/FORMAT.md's sha256-tree, written from the document."""
    leaves = b"".join(hashlib.sha256(payload[i : i + MIB]).digest() for i in range(0, len(payload), MIB))
    return hashlib.sha256(b"kvgraft/sha256-tree/v1\n" + struct.pack("<Q", len(payload)) + leaves).hexdigest()


def _payload(scheme: str | None, tokens: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    layers = [
        kvg.LayerState("full", torch.randn(1, 2, tokens, 64, generator=g), torch.randn(1, 2, tokens, 64, generator=g))
        for _ in range(2)
    ]
    meta = {k: "x" for k in kvg.REQUIRED_META}
    meta.update(dtype="float32", start_position="0", prefill="{}")
    if scheme is not None:
        meta["identity"] = scheme
    return kvg.encode(list(range(tokens)), layers, meta)


@pytest.mark.parametrize("tokens", [16, 512, 1111])  # one short leaf; about 2 MiB; several leaves, the last short
def test_the_tree_is_the_documented_one_however_the_payload_arrives(tokens):
    payload = _payload("sha256-tree", tokens)
    want = by_hand(payload)
    assert ident.payload_identity(payload) == want
    assert want != hashlib.sha256(payload).hexdigest()
    rng = random.Random(tokens)
    for _ in range(5):  # chunks of any size, a header split across them, leaves spanning chunks
        h, pos = ident.PayloadHasher(), 0
        while pos < len(payload):
            k = rng.choice([1, 7, 100, MIB - 1, MIB, MIB + 3, 3 * MIB])
            h.add(memoryview(payload)[pos : pos + k])
            pos += k
        assert h.digest() == want and h.scheme == "sha256-tree"


@pytest.mark.parametrize("scheme", [None, "sha256"])
def test_a_payload_that_names_no_tree_keeps_its_plain_sha256(scheme):
    payload = _payload(scheme, 600)
    want = hashlib.sha256(payload).hexdigest()
    assert ident.payload_identity(payload) == want
    h = ident.PayloadHasher()
    for i in range(0, len(payload), 3 * MIB + 1):
        h.add(payload[i : i + 3 * MIB + 1])
    assert h.digest() == want and h.scheme == "sha256"


def test_an_unknown_scheme_is_refused_by_every_reader(tmp_path):
    payload = _payload("blake9", 16)
    with pytest.raises(ArtifactError, match="unknown identity scheme 'blake9'"):
        ident.payload_identity(payload)
    for codec in container.CODECS:
        p = tmp_path / f"{codec}.kvg"
        kvg.write_file(p, payload, codec=codec)
        with pytest.raises(ArtifactError, match="unknown identity scheme"):
            kvg.open_file(p, expected_sha256="0" * 64)
        with pytest.raises(ArtifactError, match="unknown identity scheme"):
            kvg_payload_sha256(p)


def blake3_of(payload: bytes) -> str:
    import blake3

    # BLAKE3's published digest of the empty input (the BLAKE3 specification's test vectors): the package is BLAKE3
    assert blake3.blake3(b"").hexdigest() == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    return blake3.blake3(payload).hexdigest()


@pytest.mark.parametrize("tokens", [16, 1111])
def test_blake3_is_the_payloads_blake3_however_it_arrives(tokens):
    payload = _payload("blake3", tokens)
    want = blake3_of(payload)
    assert ident.payload_identity(payload) == want != hashlib.sha256(payload).hexdigest()
    rng = random.Random(tokens)
    for _ in range(3):  # chunks of any size, one at a time or in batches (a graft's read hands over batches)
        h, pos = ident.PayloadHasher(), 0
        while pos < len(payload):
            k = rng.choice([1, 7, 100, MIB - 1, MIB + 3])
            parts = [memoryview(payload)[p : p + k] for p in range(pos, min(pos + 4 * k, len(payload)), k)]
            (h.add_batch if rng.random() < 0.5 else lambda ps: [h.add(p) for p in ps])(parts)
            pos += sum(len(p) for p in parts)
        assert h.digest() == want and h.scheme == "blake3"


def test_a_hash_that_fails_midway_is_raised_and_never_leaves_the_reader_waiting(tmp_path, monkeypatch):
    """A stream hasher's update that raises (here on its second chunk) ends the open with that error: the staged read
    waits for each buffer's hash (wait_hashed) and hands over more chunks than the queue holds, and neither blocks
    on a hasher thread that stopped hashing."""
    from kvgraft_cli.artifacts import raw_reader

    payload = _payload("blake3", 1111)  # 2.3 MB: with 64 KiB chunks, far more than the queue's 4 hand-offs
    path = tmp_path / "a.kvg"
    kvg.write_file(path, payload, codec="raw")
    real = ident.blake3_hasher()

    class Failing:
        def __init__(self, *a, **k):
            self.h, self.calls = real(*a, **k), 0

        def update(self, data):
            self.calls += 1
            if self.calls == 2:
                raise MemoryError("hash failed midway")
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(ident, "blake3_hasher", lambda source="artifact": Failing)
    monkeypatch.setattr(raw_reader, "_STAGE_MIN", 64 << 10)
    monkeypatch.setattr(raw_reader, "_STAGE_MAX", 64 << 10)
    out: list = []

    def open_it():
        try:
            kvg.open_file(path, blake3_of(payload), room=4)
        except BaseException as e:  # what the caller sees
            out.append(e)

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the read hangs on a hasher that failed"
    assert len(out) == 1 and "hash failed midway" in str(out[0])


@pytest.mark.parametrize("scheme", ["sha256-tree", "blake3"])
@pytest.mark.parametrize("codec", container.CODECS)
def test_a_changed_byte_in_any_leaf_is_refused(tmp_path, codec, scheme):
    payload = _payload(scheme, 1111)
    sha = by_hand(payload) if scheme == "sha256-tree" else blake3_of(payload)
    good = tmp_path / f"{sha}.kvg"
    kvg.write_file(good, payload, codec=codec)
    assert kvg.open_file(good, expected_sha256=sha)[0] == sha == kvg_payload_sha256(good)
    for at in (len(payload) - 1, 2 * MIB + 5, MIB - 1):  # the last, short leaf; a middle one; a leaf's last byte
        bad = bytearray(payload)
        bad[at] ^= 1
        p = tmp_path / f"bad-{at}.kvg"
        kvg.write_file(p, bytes(bad), codec=codec)
        with pytest.raises(IntegrityError, match="does not match its identity"):
            kvg.open_file(p, expected_sha256=sha)
        assert kvg_payload_sha256(p) != sha


def test_one_schemes_digest_never_passes_for_the_others(tmp_path):
    """The bytes whose plain SHA-256 equals a payload's tree identity (the tag, the length, the leaves) are no
    readable payload: the tag's first 8 bytes are a header length far over the limit."""
    payload = _payload("sha256-tree", 1111)
    tree = by_hand(payload)
    forged = (
        b"kvgraft/sha256-tree/v1\n"
        + struct.pack("<Q", len(payload))
        + b"".join(hashlib.sha256(payload[i : i + MIB]).digest() for i in range(0, len(payload), MIB))
    )
    assert hashlib.sha256(forged).hexdigest() == tree  # the forgery does carry the digest ...
    assert ident.payload_identity(forged) == tree
    with pytest.raises(ArtifactError):  # ... but is refused as a payload, by every reader
        kvg.decode(forged, "forged", expected_sha256=tree)
    p = tmp_path / f"{tree}.kvg"
    p.write_bytes(container.raw_file(forged))
    with pytest.raises((ArtifactError, IntegrityError)):
        kvg.open_file(p, expected_sha256=tree)
    # a payload named blake3 does not pass for the SHA-256 or the tree of its bytes, nor one named sha256 for its
    # BLAKE3
    b3 = _payload("blake3", 1111)
    for other in (hashlib.sha256(b3).hexdigest(), by_hand(b3)):
        with pytest.raises(IntegrityError):
            kvg.decode(b3, "blake3", expected_sha256=other)
    # and a payload named sha256 does not pass for the tree digest of the same bytes, nor the other way round
    plain = _payload(None, 1111)
    with pytest.raises(IntegrityError):
        kvg.decode(plain, "plain", expected_sha256=blake3_of(plain))
    with pytest.raises(IntegrityError):
        kvg.decode(plain, "plain", expected_sha256=by_hand(plain))
    with pytest.raises(IntegrityError):
        kvg.decode(payload, "tree", expected_sha256=hashlib.sha256(payload).hexdigest())


def test_leaves_are_hashed_on_several_threads_while_chunks_arrive(monkeypatch):
    if ident.workers() < 2:
        pytest.skip("one core: one hashing thread")
    seen, real = set(), ident._hash_parts

    def slow(parts):
        seen.add(threading.get_ident())
        time.sleep(0.02)  # long enough that one thread cannot take every leaf
        return real(parts)

    monkeypatch.setattr(ident, "_hash_parts", slow)
    payload = _payload("sha256-tree", 2048)  # 4 MiB: 4 leaves
    h = ident.PayloadHasher()
    h.add(payload)
    assert h.digest() == by_hand(payload)
    assert len(seen) >= 2 and threading.get_ident() not in seen


def test_wait_hashed_says_when_a_buffer_may_be_reused():
    payload = _payload("sha256-tree", 2048)  # 4.2 MB: leaves 0-3 whole, leaf 4 short
    h = ident.PayloadHasher()
    h.add(memoryview(payload)[: 3 * MIB + 10])
    h.wait_hashed(3 * MIB)  # leaves 0-2 are whole
    with pytest.raises(RuntimeError, match="not whole"):
        h.wait_hashed(3 * MIB + 10)  # leaf 3 needs the bytes after it
    with pytest.raises(RuntimeError, match="handed over"):
        h.wait_hashed(4 * MIB)
    h.add(memoryview(payload)[3 * MIB + 10 :])
    assert h.digest() == by_hand(payload)
    s = ident.PayloadHasher()
    plain = _payload(None, 1111)
    s.add(plain)
    s.wait_hashed(len(plain))  # one stream: everything handed over can be waited for
    assert s.digest() == hashlib.sha256(plain).hexdigest()


def _manifest(tmp_path, name: str, identity: str | None) -> str:
    args = ["manifest", "init", "builtin:tiny-gemma4"] + (["--identity", identity] if identity else [])
    (tmp_path / name).write_text(run_cli(*args, cwd=tmp_path, check_rc=0).stdout, encoding="utf-8")
    return name


def test_a_new_manifest_names_artifacts_by_the_tree_and_grafts_across_schemes(tmp_path):
    """`manifest init` writes artifact.identity: sha256-tree; a deposit under it is stored under its tree identity
    (checked by hand), `verify --full` re-checks it without torch's help, and since the scheme is not part of the
    compute pin, it grafts under a manifest that names artifacts by sha256 (and that one deposits sha256 names)."""
    tree_m, plain_m = _manifest(tmp_path, "tree.yaml", None), _manifest(tmp_path, "plain.yaml", "sha256")
    assert "identity: sha256-tree" in (tmp_path / tree_m).read_text()
    pins = [
        json.loads(run_cli("manifest", "validate", m, "--json", cwd=tmp_path, check_rc=0).stdout)["compute_sha256"]
        for m in (tree_m, plain_m)
    ]
    assert pins[0] == pins[1]
    dep = json.loads(
        run_cli("deposit", str(EXAMPLES), "-m", tree_m, "--limit", "1", "--json", cwd=tmp_path, check_rc=0).stdout
    )
    sha = dep["results"][0]["artifact"]
    payload, art = kvg.read_file(next((tmp_path / "kvgraft-store" / "objects").rglob(f"{sha}.kvg")))
    assert art.meta["identity"] == "sha256-tree" and by_hand(bytes(payload)) == sha
    run_cli("verify", "--full", cwd=tmp_path, check_rc=0)
    check = json.loads(
        run_cli("graft", sha, "--check", "--samples", "2", "-m", plain_m, "--json", cwd=tmp_path, check_rc=0).stdout
    )
    assert check["passed"] and check["sha_equal"] == 2
    assert check["deposit_reproduced"]  # its own deposit is named by sha256: another name, the same bytes
    # Re-deposited with --recompute under the sha256 manifest: the store holds the prefix under its tree name, the
    # recomputed cache is named by sha256; the check compares the bytes, so it passes.
    dep2 = json.loads(
        run_cli(
            "deposit", str(EXAMPLES), "-m", plain_m, "--limit", "1", "--recompute", "--json", cwd=tmp_path, check_rc=0
        ).stdout
    )
    sha2 = dep2["results"][0]["artifact"]
    payload2, art2 = kvg.read_file(next((tmp_path / "kvgraft-store" / "objects").rglob(f"{sha2}.kvg")))
    assert "identity" not in art2.meta and hashlib.sha256(bytes(payload2)).hexdigest() == sha2 != sha
    assert kvg.with_scheme(payload2, "sha256-tree") == bytes(payload)


def test_a_forked_child_hashes_with_a_pool_of_its_own():
    """The pool is made in this process first; a child forked afterwards must not send leaves to threads it lacks
    (it would wait forever: the test would time out instead of passing)."""
    import multiprocessing

    payload = _payload("sha256-tree", 1111)
    assert ident.payload_identity(payload) == by_hand(payload)  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(ident.payload_identity, (payload,)).get(timeout=60)
    assert got == by_hand(payload)


def test_a_manifest_that_names_artifacts_by_blake3_deposits_verifies_and_grafts(tmp_path):
    """`manifest init --identity blake3`: a deposit is stored under the BLAKE3 of its payload (what b3sum prints),
    `verify --full` re-checks it, and `graft --check` reads it back exact; a flipped byte is a failed check."""
    m = _manifest(tmp_path, "b3.yaml", "blake3")
    assert "identity: blake3" in (tmp_path / m).read_text()
    dep = json.loads(
        run_cli("deposit", str(EXAMPLES), "-m", m, "--limit", "1", "--json", cwd=tmp_path, check_rc=0).stdout
    )
    sha = dep["results"][0]["artifact"]
    path = next((tmp_path / "kvgraft-store" / "objects").rglob(f"{sha}.kvg"))
    payload, art = kvg.read_file(path)
    assert art.meta["identity"] == "blake3" and blake3_of(bytes(payload)) == sha
    run_cli("verify", "--full", cwd=tmp_path, check_rc=0)
    check = json.loads(
        run_cli("graft", sha, "--check", "--samples", "1", "-m", m, "--json", cwd=tmp_path, check_rc=0).stdout
    )
    assert check["passed"] and check["deposit_reproduced"]
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(raw))
    r = run_cli("graft", sha, "-m", m, "--json", cwd=tmp_path)
    assert r.returncode == 1 and "does not match its identity" in r.stderr, r.stderr
