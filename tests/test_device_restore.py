"""artifacts.device_restore: the staged, hashed-while-copied restore, on the CPU device (the same pipeline as on
CUDA, which tests/test_cuda.py runs on a GPU). Every tensor must be byte-identical to format.open_file's, every file
format.open_file refuses must be refused the same way, and nothing is returned before the identity matches."""

from __future__ import annotations

import hashlib
import time
from types import SimpleNamespace

import pytest
import torch
from test_codecs import DAMAGE, _damaged

from kvgraft_cli.artifacts import container, device_restore, identity
from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.errors import DeviceError, IntegrityError

MIB = 1 << 20
SMALL = dict(chunk_bytes=MIB, ring=2)  # the smallest ring: every buffer is reused as soon as the rules allow


def _payload(dtype=torch.float32, scheme="sha256", tokens=2048, heads=2, dim=64, seed=0) -> bytes:
    """A payload of several MiB (3 layers x keys/values; 6 MiB in float32) in the given identity scheme."""
    g = torch.Generator().manual_seed(seed)
    layers = [
        kvg.LayerState(
            "full",
            torch.randn(1, heads, tokens, dim, generator=g).to(dtype),
            torch.randn(1, heads, tokens, dim, generator=g).to(dtype),
        )
        for _ in range(3)
    ]
    meta = {k: "x" for k in kvg.REQUIRED_META}
    meta.update(dtype=str(dtype).removeprefix("torch."), start_position="0", prefill="{}")
    if scheme != "sha256":
        meta["identity"] = scheme
    return kvg.encode(list(range(tokens)), layers, meta)


def _raw(tmp_path, payload: bytes, name="a.kvg"):
    path = tmp_path / name
    kvg.write_file(path, payload, codec="raw")
    return path, identity.payload_identity(payload)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got: kvg.Artifact, want: kvg.Artifact, device="cpu") -> None:
    assert got.token_ids == want.token_ids and got.meta == want.meta and len(got.layers) == len(want.layers)
    for a, b in zip(got.layers, want.layers):
        assert (a.kind, a.sliding_window, a.cumulative_length) == (b.kind, b.sliding_window, b.cumulative_length)
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert x.device.type == device and x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(_bytes(x).cpu(), _bytes(y).cpu())
            assert hashlib.sha256(_bytes(x).cpu().numpy()).digest() == hashlib.sha256(_bytes(y).numpy()).digest()


@pytest.mark.parametrize("scheme", identity.SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_restore_is_byte_identical_to_open_file(tmp_path, monkeypatch, scheme, dtype):
    payload = _payload(dtype, scheme)
    assert len(payload) > 3 * MIB
    path, ident = _raw(tmp_path, payload)
    waits = []
    real_wait = identity.PayloadHasher.wait_hashed
    monkeypatch.setattr(
        identity.PayloadHasher, "wait_hashed", lambda self, upto: (waits.append(upto), real_wait(self, upto))[1]
    )
    got_ident, art = device_restore.open_file_on_device(path, "cpu", ident, **SMALL)
    assert got_ident == ident
    assert len(waits) >= 2 and waits == sorted(waits)  # the ring really went round, each reuse waited on the hash
    _, want = kvg.open_file(path)
    _assert_same(art, want)
    assert kvg.encode(art.token_ids, art.layers, art.meta) == payload  # the whole payload back, bit for bit
    # No identity given: the one it computed, in the payload's scheme; the default chunking gives the same.
    assert device_restore.open_file_on_device(path, torch.device("cpu"))[0] == ident


class _SlowSha256:
    """hashlib.sha256 that takes 20 ms an update: a reader that refilled a staging buffer before its hash was done
    would then overwrite bytes not yet hashed, every time (not only when the threads happen to race)."""

    def __init__(self, data=b""):
        self.h = hashlib.sha256(data)

    def update(self, data) -> None:
        time.sleep(0.02)
        self.h.update(data)

    def digest(self) -> bytes:
        return self.h.digest()

    def hexdigest(self) -> str:
        return self.h.hexdigest()


@pytest.mark.parametrize("scheme", identity.SCHEMES)
def test_a_staging_buffer_is_refilled_only_once_hashed(tmp_path, monkeypatch, scheme):
    path, ident = _raw(tmp_path, _payload(scheme=scheme))
    monkeypatch.setattr(identity, "hashlib", SimpleNamespace(sha256=_SlowSha256))
    assert device_restore.open_file_on_device(path, "cpu", ident, **SMALL)[0] == ident


@pytest.mark.parametrize("scheme", identity.SCHEMES)
@pytest.mark.parametrize("where", ["first chunk", "middle", "last byte"])
def test_a_tampered_tensor_byte_is_refused_and_nothing_returned(tmp_path, scheme, where):
    payload = _payload(scheme=scheme)
    path, ident = _raw(tmp_path, payload)
    data = bytearray(path.read_bytes())
    at = {
        "first chunk": container.PAYLOAD_OFFSET + len(payload) - 6 * MIB + 100,
        "middle": len(data) // 2,
        "last byte": len(data) - 1,
    }[where]
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    out = None
    with pytest.raises(IntegrityError) as e:
        out = device_restore.open_file_on_device(path, "cpu", ident, **SMALL)
    assert out is None and "does not match its identity" in e.value.message
    good, good_ident = _raw(tmp_path, payload, "good.kvg")  # the failure left the staging ring usable
    assert device_restore.open_file_on_device(good, "cpu", good_ident, **SMALL)[0] == ident


@pytest.mark.parametrize("name", list(DAMAGE))
def test_every_damaged_raw_file_is_refused_as_open_file_refuses_it(tmp_path, name):
    edit, exc, words = DAMAGE[name]
    path, sha = _damaged(tmp_path, name.replace(" ", "-"), edit)
    with pytest.raises(exc) as want:
        kvg.open_file(path, expected_sha256=sha)
    with pytest.raises(exc) as got:
        device_restore.open_file_on_device(path, "cpu", sha, **SMALL)
    assert type(got.value) is type(want.value) and got.value.message == want.value.message
    assert words in got.value.message


def test_a_file_that_shrinks_while_it_is_read_is_refused(tmp_path, monkeypatch):
    """The container check saw the whole file; the stream then meets its end early (truncated under it)."""
    payload = _payload()
    path, ident = _raw(tmp_path, payload)
    full = path.stat().st_size
    path.write_bytes(path.read_bytes()[: full - 3 * MIB])
    monkeypatch.setattr(container, "file_size", lambda f: full)
    with pytest.raises(IntegrityError, match="truncated"):
        device_restore.open_file_on_device(path, "cpu", ident, **SMALL)


@pytest.mark.parametrize("scheme", identity.SCHEMES)
def test_a_wrong_expected_identity_is_refused(tmp_path, scheme):
    payload = _payload(scheme=scheme)
    path, ident = _raw(tmp_path, payload)
    other_scheme = hashlib.sha256(payload).hexdigest() if scheme != "sha256" else "0" * 64
    for wrong in ("f" * 64, other_scheme):
        with pytest.raises(IntegrityError, match="does not match its identity"):
            device_restore.open_file_on_device(path, "cpu", wrong, **SMALL)


@pytest.mark.parametrize("built_with", [None, "12.4"])
def test_cuda_asked_for_without_cuda_is_refused_never_served_from_the_cpu(tmp_path, monkeypatch, built_with):
    path, ident = _raw(tmp_path, _payload(tokens=64))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", built_with)
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(DeviceError) as e:
            device_restore.open_file_on_device(path, device, ident)
        msg = e.value.message
        assert msg.startswith(f"no CUDA device: {device} was asked for") and torch.__version__ in msg
        assert ("built without CUDA" if built_with is None else f"CUDA {built_with}): no GPU visible") in msg
        assert "runtime.device: cpu" in e.value.hint and e.value.exit_code == 2
    with pytest.raises(DeviceError):  # refused before the file is even looked at
        device_restore.open_file_on_device(tmp_path / "missing.kvg", "cuda")


@pytest.mark.parametrize("codec", ["zstd", "shuffle-zstd"])
def test_a_compressed_file_falls_back_to_open_file_and_matches(tmp_path, monkeypatch, codec):
    payload = _payload(torch.bfloat16)
    raw, ident = _raw(tmp_path, payload)
    _, want = device_restore.open_file_on_device(raw, "cpu", ident, **SMALL)
    path = tmp_path / f"a.{codec}.kvg"
    assert kvg.write_file(path, payload, codec=codec) == codec
    monkeypatch.setattr(device_restore, "_pump", None)  # the staged pipeline must not run for it
    got_ident, art = device_restore.open_file_on_device(path, "cpu", ident, **SMALL)
    assert got_ident == ident
    _assert_same(art, want)
    with pytest.raises(IntegrityError, match="does not match its identity"):
        device_restore.open_file_on_device(path, "cpu", "e" * 64)


def test_a_ring_the_tree_hash_could_deadlock_on_is_refused(tmp_path):
    path, ident = _raw(tmp_path, _payload(tokens=64))
    for bad in (dict(chunk_bytes=identity.LEAF - 1, ring=4), dict(chunk_bytes=MIB, ring=1)):
        with pytest.raises(ValueError):
            device_restore.open_file_on_device(path, "cpu", ident, **bad)


def test_a_valid_layout_with_misaligned_tensors_still_restores(tmp_path):
    """A payload whose tensors are not in canonical order (valid: contiguous, no gaps) can put token_ids at an
    offset that is no multiple of 8; format.open_file reads it (a buffer per tensor), so must this reader."""
    import json
    import struct

    payload = _payload(torch.float16, tokens=3, heads=1, dim=1)  # keys and values: 6 bytes each
    (n,) = struct.unpack("<Q", payload[:8])
    header, data = json.loads(payload[8 : 8 + n]), payload[8 + n :]
    order, blobs, pos = ["layers.000.keys", "layers.000.values", "layers.001.keys", "token_ids"], [], 0
    order += sorted(set(header) - set(order) - {"__metadata__"})
    for name in order:
        begin, end = header[name]["data_offsets"]
        blobs.append(data[begin:end])
        header[name]["data_offsets"] = [pos, pos + end - begin]
        pos += end - begin
    assert header["token_ids"]["data_offsets"][0] % 8
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    odd = struct.pack("<Q", len(text)) + text + b"".join(blobs)
    path, ident = _raw(tmp_path, odd)
    _, want = kvg.open_file(path, ident)
    got_ident, art = device_restore.open_file_on_device(path, "cpu", ident)
    assert got_ident == ident
    _assert_same(art, want)


def test_a_graft_under_a_cuda_manifest_takes_the_device_path_and_refuses_without_cuda(tmp_path):
    """`kvgraft graft` opens the artifact for the manifest's device: under runtime.device cuda on a machine without
    one, a .kvg file and a store reference are both refused with the device's reason (exit 2), before the model
    loads; the same artifact grafts under the CPU manifest."""
    import json

    from conftest import EXAMPLES, run_cli

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the refusal cannot be seen here")
    cpu = run_cli("manifest", "init", "builtin:tiny-gemma4", cwd=tmp_path, check_rc=0).stdout
    (tmp_path / "cpu.yaml").write_text(cpu, encoding="utf-8")
    (tmp_path / "cuda.yaml").write_text(cpu.replace("device: cpu", "device: cuda"), encoding="utf-8")
    sha = json.loads(
        run_cli("deposit", str(EXAMPLES), "-m", "cpu.yaml", "--limit", "1", "--json", cwd=tmp_path, check_rc=0).stdout
    )["results"][0]["artifact"]
    path = next((tmp_path / "kvgraft-store" / "objects").rglob(f"{sha}.kvg"))
    for ref in (str(path), sha):
        r = run_cli("graft", ref, "-m", "cuda.yaml", "-n", "2", cwd=tmp_path, check_rc=2)
        assert r.stderr.startswith("Error: no CUDA device: cuda was asked for") and "runtime.device: cpu" in r.stderr
    run_cli("graft", str(path), "-m", "cpu.yaml", "-n", "2", cwd=tmp_path, check_rc=0)
