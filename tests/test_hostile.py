"""Bounded resources on hostile input (issue 11, section 2): zstd bombs, YAML alias bombs, huge problem texts, and
inputs that used to escape as internal errors. Memory is measured in a subprocess (ru_maxrss, and RLIMIT_AS where
the reader runs without torch), so a regression fails here instead of swapping the machine."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.artifacts import payload as pl
from kvgraft_cli.config.manifest import dump_yaml, load_manifest
from kvgraft_cli.config.profiles import environ_without_pins
from kvgraft_cli.errors import (
    ArtifactError,
    InputError,
    IntegrityError,
    ManifestError,
    ProblemFileError,
    UnsupportedModel,
)

GiB = 1 << 30
MiB = 1 << 20


# -- helpers -----------------------------------------------------------------------------------------------------


def kvg_payload(n_tok: int = 3, head_dim: int = 2, dtype: str = "float32") -> bytes:
    """A valid v1 payload (one full layer, zero tensors) built by hand, without torch: header + data."""
    head, size = kvg_head(n_tok, head_dim, dtype)
    return head + struct.pack(f"<{n_tok}q", *range(n_tok)) + bytes(size - len(head) - 8 * n_tok)


def kvg_head(n_tok: int = 3, head_dim: int = 2, dtype: str = "float32") -> tuple[bytes, int]:
    """The first 8 + N bytes of that payload (length and header), and the payload size they describe."""
    meta = {
        "cumulative_lengths": "[null]",
        "dtype": dtype,
        "format": "kvgraft.kvg",
        "format_version": "1",
        "layer_types": '["full"]',
        "logits_dtype": "float32",
        "logits_sha256": "0" * 64,
        "manifest_sha256": "0" * 64,
        "model_sha256": "0" * 64,
        "num_layers": "1",
        "num_tokens": str(n_tok),
        "prefill": "{}",
        "sliding_windows": "[null]",
        "start_position": "0",
        "tokenizer_sha256": "0" * 64,
    }
    ids, kv = 8 * n_tok, 4 * n_tok * head_dim
    header = {
        "__metadata__": meta,
        "token_ids": {"dtype": "I64", "shape": [n_tok], "data_offsets": [0, ids]},
        "layers.000.keys": {"dtype": "F32", "shape": [1, 1, n_tok, head_dim], "data_offsets": [ids, ids + kv]},
        "layers.000.values": {
            "dtype": "F32",
            "shape": [1, 1, n_tok, head_dim],
            "data_offsets": [ids + kv, ids + 2 * kv],
        },
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, 8 + len(text) + ids + 2 * kv


def zstd_frame(raw: bytes, zeros: int, declared: int | None) -> bytes:
    """One zstd frame by hand (RFC 8878): ``raw`` as raw blocks, then ``zeros`` zero bytes as 128 KiB RLE blocks
    (4 bytes each: 64 GiB of zeros is a 2 MB file), declaring ``declared`` as its content size (None: no size)."""
    block = 1 << 17
    out = bytearray(struct.pack("<I", 0xFD2FB528))
    out += bytes([(3 << 6) if declared is not None else 0, (17 - 10) << 3])  # 8-byte size; 128 KiB window
    if declared is not None:
        out += struct.pack("<Q", declared)
    blocks = [(0, raw[i : i + block]) for i in range(0, len(raw), block)]
    blocks += [(1, min(block, zeros - i)) for i in range(0, zeros, block)]
    for i, (kind, d) in enumerate(blocks):
        last = int(i == len(blocks) - 1)
        if kind == 0:
            out += (last | (len(d) << 3)).to_bytes(3, "little") + d
        else:
            out += (last | (1 << 1) | (d << 3)).to_bytes(3, "little") + b"\0"
    return bytes(out)


_CAPPED = r"""
import json, os, resource, sys, time
from pathlib import Path
from kvgraft_cli.artifacts import format as kvg, payload as pl  # imported before the cap: part of the baseline

def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

def status_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

cap = vm_bytes() + int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
rss0 = status_kib("VmRSS")
reader, path, expected = sys.argv[1], Path(sys.argv[2]), sys.argv[3] or None
# CPU seconds, not wall: the bound is on the work a reader does, whatever else the machine runs meanwhile.
t0, error, code = time.process_time(), None, None
try:
    if reader == "read":  # what graft and store.load call (torch is imported only to decode an accepted payload)
        kvg.read_file(path, expected)
    else:  # what verify does
        pl.kvg_payload_sha256(path)
except Exception as e:
    error = f"{type(e).__name__}: {getattr(e, 'message', e)} Hint: {getattr(e, 'hint', '')}"
    code = getattr(e, "exit_code", None)
print(json.dumps({"error": error, "exit_code": code, "seconds": time.process_time() - t0,
                  "grown_mib": (status_kib("VmHWM") - rss0) / 1024}))
"""


def capped(reader: str, path: Path, expected: str | None = None, extra: int = GiB, env: dict | None = None) -> dict:
    """Run one frame reader in a fresh process whose address space may grow by at most ``extra`` bytes; its peak
    RSS growth is VmHWM (this process's own peak) minus VmRSS before the read."""
    p = subprocess.run(
        [sys.executable, "-c", _CAPPED, reader, str(path), expected or "", str(extra)],
        env={**environ_without_pins(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


_MEASURED_CLI = """
import atexit, sys

def peak_kib():  # VmHWM: this process's peak RSS (ru_maxrss would carry over the forking parent's across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

atexit.register(lambda: print("MAXRSS_KIB", peak_kib(), file=sys.stderr))
sys.argv = ["kvgraft"] + sys.argv[1:]
from kvgraft_cli.cli.app import main
main()
"""


def measured_cli(
    *args: str, cwd: Path, timeout: int = 300, stdout: list | None = None, env: dict | None = None
) -> tuple[int, list[str], float, float]:
    """Run the CLI in a fresh process: (exit code, stderr lines without the measurement, MiB of peak RSS, seconds);
    its stdout is appended to ``stdout`` when given; ``env`` adds variables."""
    env = {**environ_without_pins(), **(env or {})}
    env.pop("KVGRAFT_DEBUG", None)
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _MEASURED_CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    seconds = time.perf_counter() - t0
    if stdout is not None:
        stdout.append(p.stdout)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    rss = [int(x.split()[1]) for x in lines if x.startswith("MAXRSS_KIB")]
    return p.returncode, [x for x in lines if not x.startswith("MAXRSS_KIB")], rss[-1] / 1024 if rss else 0.0, seconds


# -- 1. zstd bombs -----------------------------------------------------------------------------------------------


def _bombs(tmp_path: Path) -> dict[str, Path]:
    small = kvg_payload()
    head, _ = kvg_head()
    big_head, big = kvg_head(n_tok=65536)  # 1.5 MiB of tensors: a frame of it stays within zstd's bound
    huge_head, huge = kvg_head(n_tok=4, head_dim=1 << 25)  # a well-formed header describing a 1 GiB payload
    frames = {
        # a genuine small payload padded with zeros, the frame declaring the padded size
        "declares 1 GiB": zstd_frame(small, GiB - len(small), GiB),
        "declares 64 GiB": zstd_frame(small, 64 * GiB - len(small), 64 * GiB),
        # declares exactly what its header describes, then decompresses to 1 GiB more
        "lying content size": zstd_frame(big_head, big - len(big_head) + GiB, big),
        "no content size": zstd_frame(head, GiB, None),
        # a header consistent with 1 GiB of (zero) data: a legitimate-looking artifact under a wrong name
        "consistent 1 GiB": zstd_frame(huge_head, huge - len(huge_head), huge),
        # 1 GiB of zeros: no safetensors header at all (its length field reads 0)
        "all zeros": zstd_frame(b"", GiB, GiB),
    }
    out = {}
    for name, data in frames.items():
        path = tmp_path / (name.replace(" ", "-") + ".kvg")
        path.write_bytes(data)
        assert path.stat().st_size < 4 * MiB
        out[name] = path
    return out


@pytest.mark.parametrize("reader", ["read", "hash"])
@pytest.mark.parametrize("bomb", ["declares 1 GiB", "declares 64 GiB", "lying content size", "no content size"])
def test_zstd_bomb_is_refused_in_bounded_memory(tmp_path, bomb, reader):
    """Both frame readers (graft's in-memory one, verify's streamed hasher) refuse each bomb within a 1 GiB
    address-space cap, growing by less than 64 MiB, in seconds. Before: 1.2 GB (graft) and 1.0 GB (verify) for
    the 1 GiB bomb, MemoryError for the 64 GiB one."""
    path = _bombs(tmp_path)[bomb]
    r = capped(reader, path, "0" * 64 if reader == "read" else None)
    # PayloadTooLarge: the ArtifactError for a declared size over the limit (exit 2 in verify too, #24.4)
    assert r["error"] and r["error"].split(":")[0] in ("IntegrityError", "ArtifactError", "PayloadTooLarge"), r
    assert r["grown_mib"] < 64 and r["seconds"] < 20, r


def test_consistent_header_is_bounded_by_identity_and_limit(tmp_path):
    """A header that honestly describes 1 GiB: under a wrong identity it is re-hashed in a streamed pass, so it is
    refused without allocating it; with no identity, KVGRAFT_MAX_PAYLOAD bounds it (exit 2, naming the variable)."""
    path = _bombs(tmp_path)["consistent 1 GiB"]
    r = capped("read", path, "0" * 64)
    assert r["error"].startswith("IntegrityError") and "does not match its identity" in r["error"], r
    assert r["grown_mib"] < 64, r
    r = capped("read", path, None, env={"KVGRAFT_MAX_PAYLOAD": "512M"})
    assert r["error"].startswith("PayloadTooLarge") and r["exit_code"] == 2 and "KVGRAFT_MAX_PAYLOAD" in r["error"]
    assert "limit of 536,870,912 bytes" in r["error"] and r["grown_mib"] < 64, r
    r = capped("hash", path, None, env={"KVGRAFT_MAX_PAYLOAD": "512M"})
    assert r["error"].startswith("PayloadTooLarge") and r["exit_code"] == 2, r


def test_a_payload_without_a_header_is_refused_by_graft_and_bounded_in_verify(tmp_path):
    """graft's reader requires the safetensors header; verify's hasher treats a payload without one as opaque bytes
    (tests/test_artifact.py hashes such frames), in bounded memory and time (KVGRAFT_MAX_PAYLOAD bounds it)."""
    path = _bombs(tmp_path)["all zeros"]
    r = capped("read", path, None)
    assert r["error"].startswith("IntegrityError") and "safetensors header (length 0)" in r["error"], r
    assert r["grown_mib"] < 64, r
    r = capped("hash", path, None)
    assert r["grown_mib"] < 64 and r["seconds"] < 20, r


def test_payload_limit_is_configurable_and_checked():
    import os

    old = os.environ.pop(pl.ENV_MAX_PAYLOAD, None)
    try:
        assert pl.max_payload() == pl.DEFAULT_MAX_PAYLOAD == 32 * GiB
        for raw, want in (("1048576", MiB), ("64G", 64 * GiB), ("512MiB", 512 * MiB), ("2t", 2 << 40)):
            os.environ[pl.ENV_MAX_PAYLOAD] = raw
            assert pl.max_payload() == want
        os.environ[pl.ENV_MAX_PAYLOAD] = "lots"
        with pytest.raises(InputError, match="KVGRAFT_MAX_PAYLOAD"):
            pl.max_payload()
    finally:
        os.environ.pop(pl.ENV_MAX_PAYLOAD, None)
        if old is not None:
            os.environ[pl.ENV_MAX_PAYLOAD] = old


def test_64_gib_bomb_over_a_raised_limit_is_refused_by_its_header(tmp_path):
    path = _bombs(tmp_path)["declares 64 GiB"]
    r = capped("hash", path, None, env={"KVGRAFT_MAX_PAYLOAD": "128G"})
    assert r["error"].startswith("IntegrityError") and "header describes" in r["error"], r
    assert r["grown_mib"] < 64 and r["seconds"] < 20, r


def test_bounded_readers_still_read_good_artifacts(tmp_path):
    payload = kvg_payload(n_tok=5)
    for name, data in (("kvgraft", kvg.compress(payload)), ("streamed", _streamed_frame(payload))):
        path = tmp_path / f"{name}.kvg"
        path.write_bytes(data)
        sha = pl.kvg_payload_sha256(path)
        assert pl.read_payload(path, sha) == payload == pl.decompress(data, name, strict=True)
        assert kvg.read_file(path, sha)[1].token_ids == list(range(5))


def _streamed_frame(payload: bytes) -> bytes:
    """A frame as a streaming writer makes it (several blocks, a final empty block)."""
    import io

    import zstandard

    buf = io.BytesIO()
    with zstandard.ZstdCompressor(write_checksum=True).stream_writer(buf, size=len(payload), closefd=False) as w:
        for i in range(0, len(payload), 100):
            w.write(payload[i : i + 100])
            w.flush(zstandard.FLUSH_BLOCK)
    return buf.getvalue()


def test_graft_cli_refuses_a_bomb_in_bounded_memory(tmp_path):
    path = _bombs(tmp_path)["declares 1 GiB"]
    rc, err, rss, seconds = measured_cli("graft", str(path), "--store", str(tmp_path / "s"), cwd=tmp_path)
    assert rc == 1 and len(err) == 1 and err[0].startswith("Error: ") and "describes 896" in err[0], err
    assert rss < 400 and seconds < 60, (rss, seconds)


def test_verify_full_refuses_a_bomb_in_bounded_memory(tmp_path, deposited):
    """A store object replaced by a 1 GiB bomb of the same name: `verify --full` reports it, in bounded memory."""
    ctx, report = deposited
    root = Path(ctx.ledger).parent
    work = tmp_path / "copy"
    shutil.copytree(root, work)
    sha = next(r.artifact for r in report.results if r.artifact)
    obj = next(work.rglob(f"{sha}.kvg"))
    shutil.copy(_bombs(tmp_path)["declares 1 GiB"], obj)
    out: list = []
    rc, err, rss, seconds = measured_cli(
        "verify", str(work / Path(ctx.ledger).name), "--full", "--no-cache", cwd=work, stdout=out
    )
    assert rc == 1 and f"{sha}.kvg does not match its recorded sha256" in "\n".join(err), (out, err)
    assert rss < 400 and seconds < 60, (rss, seconds)


# -- 2. YAML alias bombs -----------------------------------------------------------------------------------------


def _alias_bomb(levels: int = 7) -> str:
    """The default manifest with a 'billion laughs' name: 9^levels strings from ~1.5 KB. Before, 8 levels (1.6 KB)
    took `manifest validate` 152 s and 18 GB of memory; 7 levels keep a run of this test on old code survivable."""
    parts = ['&l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels + 1):
        parts.append(f"&l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]")
    return _default_text().replace("name: tiny-gemma4-portable-cpu", "name: [" + ", ".join(parts) + "]")


def _default_text() -> str:
    from kvgraft_cli.config.manifest import data_dir

    return (data_dir() / "default.yaml").read_text()


def test_yaml_alias_bomb_is_refused_quickly_in_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    assert bomb.stat().st_size < 3000
    rc, err, rss, seconds = measured_cli("manifest", "validate", str(bomb), cwd=tmp_path)
    assert rc == 2 and len(err) == 1 and len(err[0]) < 500, err
    assert "anchor" in err[0] and "bomb.yaml:3:" in err[0], err
    assert rss < 300 and seconds < 30, (rss, seconds)


def test_aliases_are_refused_in_manifests_and_preregs(tmp_path):
    from kvgraft_cli.runs.replay import load_prereg

    m = tmp_path / "m.yaml"
    m.write_text(_default_text().replace("  seed: 0", "  seed: &s 0").replace("  threads: 1", "  threads: *s"))
    with pytest.raises(ManifestError, match=r"m.yaml:\d+:\d+: malformed YAML: YAML anchor &s is not allowed"):
        load_manifest(m)
    p = tmp_path / "prereg.yaml"
    p.write_text("name: x\nruns: &r []\ntargets: {a: *r}\n")
    with pytest.raises(InputError, match="anchor &r"):
        load_prereg(p)


def test_deep_yaml_is_an_input_error(tmp_path):
    m = tmp_path / "m.yaml"
    m.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ManifestError, match="nested deeper than"):
        load_manifest(m)


def test_values_quoted_in_errors_are_clipped(tmp_path):
    data = load_manifest(None).data
    data["name"] = ["x" * 100_000]
    data["runtime"]["y" * 10_000] = 1
    m = tmp_path / "m.yaml"
    m.write_text(dump_yaml(data))
    with pytest.raises(ManifestError) as e:
        load_manifest(m)
    assert len(e.value.message) < 1500 and "chars)" in e.value.message, e.value.message[:2000]
    assert all(len(p) < 600 for p in e.value.problems)


# -- 3. a huge problem text --------------------------------------------------------------------------------------


def _big_problems(path: Path, chars: int, line: int = 1) -> Path:
    recs = [
        {"id": f"p{i}", "problem": "What is 1+1?", "solution": "The answer is: 2", "answer": "2"} for i in range(line)
    ]
    recs[-1]["problem"] = "1+1=? " * (chars // 6)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_long_problem_is_refused_by_its_length_naming_the_line(tmp_path):
    from kvgraft_cli.eval.problems import check_lengths, read_problems

    path = _big_problems(tmp_path / "p.jsonl", 2_000_000, line=2)
    problems = read_problems(path, load_manifest(None).input.as_written())
    with pytest.raises(
        ProblemFileError,
        match=r"p\.jsonl:2: problem 'p1': 2,000,014 characters of problem and solution .* 32,768 positions",
    ):
        check_lengths(problems, path, 32768)
    check_lengths(problems[:1], path, 32768)


def test_engine_refuses_a_long_text_before_tokenizing(engine):
    limit = engine.max_positions
    t0 = time.process_time()  # CPU seconds: bounded work, on a loaded machine too
    with pytest.raises(InputError, match=r"f\.jsonl:3: .* characters cannot fit"):
        engine.prefix_ids("x" * (limit * 32 + 1), where="f.jsonl:3")
    assert time.process_time() - t0 < 1
    with pytest.raises(InputError, match=r"f\.jsonl:4: the prefix has more than the model's 32,768 positions"):
        engine.prefix_ids("x" * (limit + 10), where="f.jsonl:4")
    assert len(engine.encode("x" * (limit + 10))) == limit + 1  # truncated: never more than any check needs


def test_solve_refuses_a_50_mb_problem_early(ctx, engine, tmp_path):
    from kvgraft_cli.library.solve import solve

    path = _big_problems(tmp_path / "big.jsonl", 50_000_000)
    t0 = time.process_time()  # CPU seconds: bounded work, on a loaded machine too
    with pytest.raises(ProblemFileError, match=r"big\.jsonl:1: problem 'p0': 49,999,998 characters"):
        solve(ctx, path, tmp_path / "out.jsonl", use_library=False, engine=engine)
    assert time.process_time() - t0 < 20
    assert not Path(ctx.store).exists() and not (tmp_path / "out.jsonl").exists()


def test_deposit_cli_refuses_a_50_mb_problem_early(tmp_path):
    """Needs deposit.py to call eval.problems.check_lengths before the store opens (see the lead's change)."""
    path = _big_problems(tmp_path / "big.jsonl", 50_000_000)
    rc, err, rss, seconds = measured_cli("deposit", str(path), "--store", "s", "--ledger", "l.jsonl", cwd=tmp_path)
    assert rc == 2 and len(err) == 1 and "big.jsonl:1" in err[0] and "characters" in err[0], err
    assert not (tmp_path / "s").exists(), "a refused deposit left an empty store"
    assert rss < 1500 and seconds < 60, (rss, seconds)


# -- 4. internal errors that are input errors --------------------------------------------------------------------


def test_deeply_nested_json_problem_is_an_input_error(tmp_path):
    from kvgraft_cli.eval.problems import read_problems

    path = tmp_path / "deep.jsonl"
    path.write_text(
        json.dumps({"id": "a", "problem": "p", "solution": "s", "answer": "1"})
        + "\n"
        + "[" * 100_000
        + "]" * 100_000
        + "\n"
    )
    with pytest.raises(ProblemFileError, match=r"deep\.jsonl:2: JSON nested too deeply"):
        read_problems(path, load_manifest(None).input.as_written())
    rc, err, _, _ = measured_cli("deposit", str(path), "--store", "s", "--ledger", "l.jsonl", cwd=tmp_path)
    assert rc == 2 and len(err) == 1 and "deep.jsonl:2" in err[0], err


@pytest.mark.parametrize(
    "field,value", [("runtime.seed", 2**70), ("prefill.chunk_size", 10**30), ("runtime.threads", 2**40)]
)
def test_numbers_a_pin_cannot_hold_are_refused(tmp_path, field, value):
    data = load_manifest(None).data
    section, key = field.split(".")
    data[section][key] = value
    if key == "chunk_size":
        data["prefill"]["schedule"] = "chunked"
    m = tmp_path / "m.yaml"
    m.write_text(dump_yaml(data))
    with pytest.raises(ManifestError, match=rf"m\.yaml:\d+: {field}: \d+ is greater than the maximum"):
        load_manifest(m)
    rc, err, _, _ = measured_cli("manifest", "validate", str(m), cwd=tmp_path)
    assert rc == 2 and "internal error" not in " ".join(err), err


def test_unknown_dtype_in_a_crafted_header_is_an_input_error(tmp_path):
    path = tmp_path / "crafted.kvg"
    path.write_bytes(kvg.compress(kvg_payload(dtype="nonexistent")))
    with pytest.raises(ArtifactError, match="dtype 'nonexistent' is not one kvgraft writes") as e:
        kvg.read_file(path)
    assert e.value.exit_code == 2
    rc, err, _, _ = measured_cli("graft", str(path), "--store", "s", cwd=tmp_path)
    assert rc == 2 and len(err) == 1 and "nonexistent" in err[0], err


def test_deeply_nested_artifact_header_is_refused(tmp_path):
    text = b'{"__metadata__":{"x":"y"},"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    payload = struct.pack("<Q", len(text)) + text
    path = tmp_path / "deep.kvg"
    path.write_bytes(kvg.compress(payload))
    with pytest.raises(IntegrityError, match="corrupt safetensors header"):
        kvg.read_file(path)
    with pytest.raises(IntegrityError, match="corrupt safetensors header"):
        kvg.read_header(payload)


def _tiny_minimax(tmp_path: Path) -> Path:
    import transformers as T

    from kvgraft_cli.engine.tinymodel import write_tiny_model
    from kvgraft_cli.engine.zoo import _COMMON

    return write_tiny_model(
        tmp_path / "minimax",
        seed=1,
        config=T.MiniMaxConfig(**_COMMON, num_local_experts=2, num_experts_per_tok=1, head_dim=8),
    )


def test_minimax_is_refused_by_name_before_its_weights_load(tmp_path):
    from kvgraft_cli.config.manifest import make_manifest
    from kvgraft_cli.config.modelhash import hash_model_dir
    from kvgraft_cli.engine.engine import load_engine

    model_dir = _tiny_minimax(tmp_path)
    h = hash_model_dir(model_dir)
    m = tmp_path / "m.yaml"
    m.write_text(
        dump_yaml(make_manifest(str(model_dir), h.model_sha256, h.tokenizer_sha256, threads=1, profile="portable"))
    )
    with pytest.raises(UnsupportedModel, match="model type 'minimax' is not supported: MiniMax keeps"):
        load_engine(load_manifest(m))


def test_a_model_that_rejects_dynamic_cache_is_refused_in_the_layout_probe(engine, tmp_path):
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvgraft_cli.engine.engine import _probe_layout

    class RejectsDynamicCache(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config

        def forward(self, input_ids=None, cache=None, **kwargs):
            if isinstance(cache, DynamicCache):
                raise ValueError("this model uses a cache of its own")

    fake = dataclasses.replace(engine, model=RejectsDynamicCache(engine.model.config))
    with pytest.raises(
        UnsupportedModel, match=r"\(RejectsDynamicCache\) fails a one-token forward .* cache of its own"
    ):
        _probe_layout(fake)
    minimax = AutoModelForCausalLM.from_pretrained(str(_tiny_minimax(tmp_path))).eval()
    with pytest.raises(UnsupportedModel, match=r"model type minimax \(MiniMaxForCausalLM\) fails"):
        _probe_layout(dataclasses.replace(engine, model=minimax))


def test_builtin_model_names_cannot_leave_the_package(tmp_path):
    from kvgraft_cli.config.manifest import data_dir, manifest_for_model_dir, resolve_model_path

    assert resolve_model_path("builtin:tiny-gemma4", tmp_path) == data_dir() / "tiny-gemma4"
    for bad in ("builtin:../../..", "builtin:/etc", "builtin:tiny-gemma4/../demo-gemma4", "builtin:", "builtin:x"):
        with pytest.raises(ManifestError, match="unknown builtin model"):
            resolve_model_path(bad, tmp_path)
    with pytest.raises(ManifestError, match="unknown builtin model"):
        manifest_for_model_dir("builtin:../../..", None)
    data = load_manifest(None).data
    data["model"]["path"] = "builtin:../../../../../../etc"
    m = tmp_path / "m.yaml"
    m.write_text(dump_yaml(data))
    with pytest.raises(ManifestError, match=r"m\.yaml:\d+: model\.path: unknown builtin model"):
        load_manifest(m)


def test_graft_by_a_path_says_how_its_identity_was_checked(deposited, engine, tmp_path):
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.graft import graft_generate, open_artifact

    ctx, report = deposited
    sha = next(r.artifact for r in report.results if r.artifact)
    obj = Path(ctx.store) / "objects" / sha[:2] / f"{sha}.kvg"
    renamed = tmp_path / "renamed.kvg"
    shutil.copy(obj, renamed)
    named = tmp_path / f"{sha}.kvg"
    shutil.copy(obj, named)
    assert open_artifact(ctx, None).identity == "store"
    assert open_artifact(ctx, str(named)).identity == "file name"
    assert open_artifact(ctx, str(renamed)).identity == "store object"
    elsewhere = RunContext.make(ctx.manifest, tmp_path / "no-store", tmp_path / "ledger.jsonl")
    loaded = open_artifact(elsewhere, str(renamed))
    assert loaded.identity == "file" and loaded.sha256 == sha
    assert not (tmp_path / "no-store").exists()
    assert graft_generate(elsewhere, engine, loaded, "2+2?", 2).identity == "file"
    # The CLI says so: a note on stderr, the field in --json.
    r = run_cli(
        "graft", str(renamed), "--store", "no-store", "--ledger", "l.jsonl", "-n", "2", cwd=tmp_path, check_rc=0
    )
    assert "not named by its hash and the store does not hold it" in r.stderr
    r = run_cli(
        "graft", str(named), "--store", "no-store", "--ledger", "l.jsonl", "-n", "2", "--json", cwd=tmp_path, check_rc=0
    )
    assert json.loads(r.stdout)["identity"] == "file name" and "note:" not in r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("deposit", "p.jsonl", "--limit", str(10**20)),
        ("solve", "p.jsonl", "--k", str(2**53)),
        ("graft", "--samples", str(10**30), "--check"),
    ],
)
def test_counts_past_what_a_ledger_holds_are_usage_errors(tmp_path, args):
    """An option count past 2**53 - 1 is refused by the CLI before any work (it was an internal error after the
    engine loaded, leaving a store and a ledger behind)."""
    (tmp_path / "p.jsonl").write_text('{"id": "a", "problem": "1+1?", "solution": "\\\\boxed{2}", "answer": "2"}\n')
    r = run_cli(*args, "--store", "s", "--ledger", "l.jsonl", cwd=tmp_path, check_rc=2)
    assert "more than 9007199254740991" in r.stderr
    assert not (tmp_path / "s").exists() and not (tmp_path / "l.jsonl").exists()


def test_an_inconsistent_header_is_refused_before_its_size_is_allocated(tmp_path):
    """A 2 MB file whose header describes 1 GiB of token ids while its metadata says 3 tokens: graft's reader and
    inspect refuse it from the header (kvgraft_cli/artifacts/layout.py), in bounded memory, exit 2 — graft used to
    decompress the whole gigabyte first."""
    head, _ = kvg_head(3)
    header = json.loads(head[8:])
    n_ids = (1 << 30) // 8
    header["token_ids"] = {"dtype": "I64", "shape": [n_ids], "data_offsets": [0, 8 * n_ids]}
    for name, t in header.items():
        if name.startswith("layers."):
            t["data_offsets"] = [o + 8 * n_ids - 24 for o in t["data_offsets"]]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    size = 8 + len(text) + 8 * n_ids + 2 * 4 * 3 * 2
    path = tmp_path / "bomb.kvg"
    path.write_bytes(zstd_frame(head, size - len(head), size))
    assert path.stat().st_size < 3 << 20
    with pytest.raises(ArtifactError, match="token_ids must be int64 of length num_tokens"):
        kvg.read_file(path)
    for args in (("graft", str(path), "--store", "s", "--ledger", "l.jsonl"), ("inspect", str(path))):
        rc, err, mib, _ = measured_cli(*args, cwd=tmp_path)
        assert rc == 2 and "token_ids must be int64" in " ".join(err), err
        assert mib < 600, mib  # the CLI and torch themselves; never the described gigabyte


# -- 5. a line without end (#24.8) -------------------------------------------------------------------------------


def test_a_problems_line_longer_than_the_limit_is_refused_before_it_is_read(tmp_path):
    """A line longer than KVGRAFT_MAX_LINE (default 64 MiB) is refused by its length, naming the line and the
    variable, having read at most that many bytes of it (exit 2); a file of one endless line is refused the same."""
    path = tmp_path / "long.jsonl"
    good = json.dumps({"id": "a", "problem": "What is 1+1?", "solution": "The answer is: 2", "answer": "2"})
    path.write_text(good + "\n" + "x" * 3000)  # the second line is 3,000 bytes and never ends
    rc, err, _, _ = measured_cli(
        "deposit", str(path), "--store", "s", "--ledger", "l.jsonl", cwd=tmp_path, env={"KVGRAFT_MAX_LINE": "2K"}
    )
    assert rc == 2 and len(err) == 1, err
    assert "long.jsonl:2" in err[0] and "2,048 bytes" in err[0] and "KVGRAFT_MAX_LINE" in err[0], err
    assert not (tmp_path / "s").exists() and not (tmp_path / "l.jsonl").exists()


def test_an_endless_problems_file_is_refused_in_bounded_memory(tmp_path):
    """`kvgraft deposit /dev/zero` read the whole endless line into memory and died of MemoryError (exit 1). The
    reader alone, in a process whose address space may grow by 256 MiB, now refuses it at the line limit."""
    code = (
        "import resource, sys\n"
        "from kvgraft_cli.eval.problems import read_problems\n"
        "from kvgraft_cli.errors import ProblemFileError\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
        "used = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), hard))\n"
        "m = {'id': 'id', 'problem': 'problem', 'solution': 'solution', 'answer': 'answer', "
        "'answer_extract': 'verbatim'}\n"
        "try:\n"
        "    read_problems('/dev/zero', m)\n"
        "except ProblemFileError as e:\n"
        "    print('refused:', e.message)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        env={**environ_without_pins(), "KVGRAFT_MAX_LINE": "1M"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and p.stdout.startswith("refused: /dev/zero:1:"), (p.stdout, p.stderr[-2000:])
    assert "KVGRAFT_MAX_LINE" in p.stdout


# -- 6. an artifact longer than the model, grafted by its path (#24.9) ---------------------------------------------

_CAPPED_CLI = r"""
import resource, sys
from kvgraft_cli.cli.app import main  # imported before the cap: part of the baseline

def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

cap = vm_bytes() + (512 << 20)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
sys.argv = ["kvgraft"] + sys.argv[1:]
main()
"""


def test_an_artifact_longer_than_the_model_is_refused_by_its_header(tmp_path):
    """A 1 MB zstd file whose well-formed header declares 2,064,885 tokens (a 1 GiB payload), grafted by its path,
    was decompressed before anything looked at its length: MemoryError under an address-space cap, `internal error`,
    exit 1. Its header alone exceeds the model's 32,768 positions: refused first (exit 2), in a process whose
    address space may grow by 512 MiB."""
    head, size = kvg_head(n_tok=2_064_885, head_dim=64)
    bomb = tmp_path / "bomb.kvg"
    bomb.write_bytes(zstd_frame(head, size - len(head), size))
    assert bomb.stat().st_size < 2 * MiB and size > GiB - MiB
    env = environ_without_pins()
    env.pop("KVGRAFT_DEBUG", None)
    p = subprocess.run(
        [sys.executable, "-c", _CAPPED_CLI, "graft", str(bomb), "--store", "s", "--ledger", "l.jsonl"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("Error: ") and p.stderr.count("\n") == 1 and "internal error" not in p.stderr, p.stderr
    assert "2,064,885 tokens" in p.stderr and "32,768 positions" in p.stderr, p.stderr


# -- 7. the same damage, named by hash or by path ---------------------------------------------------------------
#
# A user: "the same corrupt artifact exits 1 grafted by hash and 2 grafted by path (a 64 GiB bomb: the other way
# round)". Grafted by hash, the store's reader met the file; by path, inspect.read_info met it first (for the
# model's positions), and the two classified the same bytes differently. artifacts.verdict now decides for both.


def _raw_container_declaring(good: bytes, payload_bytes: int) -> bytes:
    """A raw v2 file whose container header declares ``payload_bytes`` (its data left as it was)."""
    from kvgraft_cli.artifacts import container

    (h,) = struct.unpack("<I", good[8:12])
    meta = json.loads(good[12 : 12 + h])
    data = good[meta["payload_offset"] :]
    meta["payload_bytes"] = payload_bytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    meta["payload_offset"] = container._payload_offset(len(text))  # same digit count: the text keeps its length
    text = json.dumps(meta, separators=(",", ":")).encode()
    head = good[:8] + struct.pack("<I", len(text)) + text
    return head + bytes(meta["payload_offset"] - len(head)) + data


def _flip_in_metadata(good: bytes) -> bytes:
    """A flipped bit in a metadata key of the payload's header: a damaged artifact whose header no longer has the
    keys an artifact has (the structure alone reads "not a kvgraft artifact", exit 2, before this fix)."""
    i = good.index(b'"cumulative_lengths"') + 1
    return good[:i] + bytes([good[i] ^ 0x01]) + good[i + 1 :]


def _payload_of(good: bytes) -> bytes:
    (h,) = struct.unpack("<I", good[8:12])
    return good[json.loads(good[12 : 12 + h])["payload_offset"] :]


_past_head, _past_size = kvg_head(n_tok=40_000, head_dim=1)  # a 960 KB payload past the model's 32,768 positions
# damage kind: (what it does to a good raw object, the exit code by hash and by path alike)
DAMAGE = {
    "flipped data byte": (lambda g: g[:-100] + bytes([g[-100] ^ 0x01]) + g[-99:], 1),
    "flipped metadata byte": (_flip_in_metadata, 1),
    "truncated": (lambda g: g[: len(g) // 2], 1),
    "container lies about its size": (lambda g: _raw_container_declaring(g, len(_payload_of(g)) + 8), 1),
    "not a .kvg at all": (lambda g: b"this was an artifact\n" * 8, 1),
    "zstd frame, flipped byte": (lambda g: (z := pl.compress(_payload_of(g)))[:200] + b"\0" + z[201:], 1),
    "zstd bomb declaring 1 GiB": (lambda g: zstd_frame(kvg_payload(), GiB - 896, GiB), 1),
    "header past the model's positions": (
        lambda g: zstd_frame(_past_head, _past_size - len(_past_head), _past_size),
        1,
    ),
    # Over KVGRAFT_MAX_PAYLOAD: a setting, exit 2 wherever it is met (docs/FORMAT.md "Reader limits", verify too): a
    # header cannot tell a 64 GiB bomb from a genuine 64 GiB artifact, and the hint says how to read the latter.
    "zstd bomb declaring 64 GiB": (lambda g: zstd_frame(kvg_payload(), 64 * GiB - 896, 64 * GiB), 2),
    "raw container declaring 64 GiB": (lambda g: _raw_container_declaring(g, 64 * GiB), 2),
}


@pytest.fixture
def damaged_copy(deposited, tmp_path):
    """(make(kind) -> (context, identity, object path)): a copy of the session store with one object damaged."""
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.store.local import VERIFIED

    ctx, report = deposited
    sha = next(r.artifact for r in report.results if r.artifact)
    VERIFIED.clear()  # this process may remember the good artifact (a CLI process starts with nothing remembered)

    def make(kind: str):
        root = tmp_path / kind.replace(" ", "-").replace("'", "")
        shutil.copytree(ctx.store, root / "store")
        obj = root / "store" / "objects" / sha[:2] / f"{sha}.kvg"
        obj.write_bytes(DAMAGE[kind][0](obj.read_bytes()))
        return RunContext.make(ctx.manifest, root / "store", root / "ledger.jsonl"), sha, obj

    return make


def _refusal(fn, capsys) -> tuple[int, list[str]]:
    """The exit code and stderr lines the CLI gives for what ``fn`` raises (cli._errors.render, in process)."""
    from kvgraft_cli.cli._errors import render
    from kvgraft_cli.errors import KvgraftError

    capsys.readouterr()
    with pytest.raises(KvgraftError) as e:
        fn()
    rc = render(e.value)
    return rc, [x for x in capsys.readouterr().err.splitlines() if x.strip()]


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_the_same_damage_gets_the_same_exit_code_by_hash_and_by_path(damaged_copy, kind, capsys, monkeypatch):
    """graft (and graft --check, probe, replay: runs.graft.open_artifact) and inspect --hash give one damaged
    artifact the same exit code and one Error line naming its file, whether it is named by its hash (the store's
    reader) or by its path (named by its hash: the header check first, then the same reader)."""
    from kvgraft_cli.cli.inspect import inspect
    from kvgraft_cli.runs.graft import open_artifact

    monkeypatch.delenv("KVGRAFT_DEBUG", raising=False)
    ctx, sha, obj = damaged_copy(kind)
    want = DAMAGE[kind][1]
    for ref in (sha, sha[:12], str(obj)):
        rc, err = _refusal(lambda: open_artifact(ctx, ref), capsys)
        assert (rc, len(err)) == (want, 1) and err[0].startswith("Error: ") and str(obj) in err[0], (ref, rc, err)
        if want == 2:
            assert "KVGRAFT_MAX_PAYLOAD" in err[0], err
        rc, err = _refusal(lambda: inspect(ref, store=str(ctx.store), manifest=None, rehash=True, as_json=True), capsys)
        assert (rc, len(err)) == (want, 1) and str(obj) in err[0], ("inspect --hash", ref, rc, err)


def test_a_64_gib_bomb_under_a_raised_limit_is_damage_by_hash_and_by_path(damaged_copy, capsys, monkeypatch):
    """With the limit raised past what the bomb declares, its header gives it away: a failed check either way."""
    from kvgraft_cli.runs.graft import open_artifact

    monkeypatch.setenv("KVGRAFT_MAX_PAYLOAD", "128G")
    ctx, sha, obj = damaged_copy("zstd bomb declaring 64 GiB")
    for ref in (sha, str(obj)):
        rc, err = _refusal(lambda: open_artifact(ctx, ref), capsys)
        assert (rc, len(err)) == (1, 1) and str(obj) in err[0] and "header describes" in err[0], err


def test_a_genuine_artifact_refused_for_its_own_reason_stays_bad_input(deposited, tmp_path):
    """The verdict re-hashes only to decide: a file named by its hash that does hash to it is the recorded artifact,
    and a refusal of it stands (another model's positions: exit 2), as grafted by hash through the store."""
    from kvgraft_cli.artifacts.verdict import judge
    from kvgraft_cli.errors import ModelMismatch

    payload = zstd_frame(_past_head, _past_size - len(_past_head), _past_size)
    path = tmp_path / "x.kvg"
    path.write_bytes(payload)
    sha = pl.kvg_payload_sha256(path)
    refusal = ModelMismatch(f"{path}: past the model's positions")
    assert judge(refusal, path, sha) is refusal
    assert judge(refusal, path, None) is refusal
    assert isinstance(judge(refusal, path, "0" * 64), IntegrityError)
    assert judge(ArtifactError("artifact not found"), tmp_path / "gone.kvg", sha).exit_code == 2


def test_graft_cli_by_hash_and_by_path_agree_on_the_reported_cases(deposited, tmp_path):
    """The user's two cases end to end, as processes: a store object overwritten by text (was 1 by hash, 2 by path)
    and a raw container declaring 64 GiB (was 2 by hash, 1 by path)."""
    from concurrent.futures import ThreadPoolExecutor

    ctx, report = deposited
    sha = next(r.artifact for r in report.results if r.artifact)
    jobs = []
    for kind in ("not a .kvg at all", "raw container declaring 64 GiB"):
        root = tmp_path / kind.replace(" ", "-")
        shutil.copytree(ctx.store, root / "store")
        obj = root / "store" / "objects" / sha[:2] / f"{sha}.kvg"
        obj.write_bytes(DAMAGE[kind][0](obj.read_bytes()))
        for ref in (sha, str(obj)):
            jobs.append((kind, obj, ("graft", ref, "--store", str(root / "store"), "--ledger", "ledger.jsonl"), root))
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda j: run_cli(*j[2], cwd=j[3]), jobs))
    for (kind, obj, args, root), p in zip(jobs, procs):
        lines = p.stderr.strip("\n").splitlines()
        assert p.returncode == DAMAGE[kind][1], (args, p.stderr)
        assert len(lines) == 1 and lines[0].startswith("Error: ") and str(obj) in lines[0], (args, p.stderr)
        assert not (root / "ledger.jsonl").exists()  # a refused graft records nothing
