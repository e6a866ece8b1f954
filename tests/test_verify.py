"""`kvgraft verify`: every edit, deletion, reordering or truncation of a line and every flipped artifact byte is
caught and pinpointed; checkpoints, --since, the verified-file cache, repair and diff."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import run_cli, run_without_torch

from kvgraft_cli.artifacts import payload
from kvgraft_cli.audit import hashcache as filehash
from kvgraft_cli.audit.verify import verify_ledger
from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.ledger import merkle
from kvgraft_cli.ledger.checkpoint import Checkpoint, generate_key, sign


def _synthetic(path, n=8):
    for i in range(n):
        ledger.append(path, "test", {"inputs": {"x": {"sha256": f"{i:064x}"}}, "outputs": {"n": i, "kl": 0.5 * i}})
    return path


def _lines(path):
    return path.read_bytes().split(b"\n")[:-1]


def _write(path, lines, tail=b""):
    path.write_bytes(b"".join(l + b"\n" for l in lines) + tail)


@pytest.fixture
def copy(deposited, tmp_path):
    """A private copy of the session's deposited store and ledger (same relative layout)."""
    ctx, _ = deposited
    shutil.copytree(ctx.store, tmp_path / "store")
    shutil.copy(ctx.ledger, tmp_path / "ledger.jsonl")
    return tmp_path / "ledger.jsonl"


def test_real_ledger_passes_and_rehashes_files(copy):
    r = verify_ledger(copy, full=True)
    assert r.passed, r.to_json()
    kinds = {f.field for f in r.files}
    assert {"inputs.problems_file", "outputs.artifact"} <= kinds
    assert all(f.status == "ok" for f in r.files)


def test_floats_are_written_as_strings(tmp_path):
    p = _synthetic(tmp_path / "l.jsonl", 3)
    assert json.loads(_lines(p)[2])["outputs"]["kl"] == "1.0"
    assert verify_ledger(p).passed


TAMPER = {
    # name: (function lines -> lines, first bad 1-based line, expected check)
    "edit a value, re-canonicalized": (lambda ls: ls[:3] + [ls[3].replace(b'"n":3', b'"n":4')] + ls[4:], 5, "chain"),
    "edit a value, non-canonical": (lambda ls: ls[:3] + [ls[3].replace(b'"n":3', b'"n": 3')] + ls[4:], 4, "canonical"),
    "delete a line": (lambda ls: ls[:3] + ls[4:], 4, "sequence"),
    "swap two lines": (lambda ls: ls[:2] + [ls[3], ls[2]] + ls[4:], 3, "sequence"),
    "duplicate a line": (lambda ls: ls[:3] + [ls[2]] + ls[3:], 4, "sequence"),
    "insert a foreign line": (
        lambda ls: ls[:1] + [b'{"kind":"test","prev":null,"seq":1,"time":"2026-01-01T00:00:00+00:00"}'] + ls[1:],
        2,
        "chain",
    ),
    "not JSON": (lambda ls: ls[:5] + [b"{oops"] + ls[6:], 6, "json"),
    "a float sneaks in": (lambda ls: ls[:6] + [ls[6].replace(b'"kl":"3.0"', b'"kl":3.5')] + ls[7:], 7, "values"),
}


@pytest.mark.parametrize("name", sorted(TAMPER))
def test_line_tampering_is_pinpointed(tmp_path, name):
    fn, line, check = TAMPER[name]
    p = _synthetic(tmp_path / "l.jsonl")
    _write(p, fn(_lines(p)))
    r = verify_ledger(p)
    assert not r.passed
    first = min(r.findings, key=lambda f: f.line or 0)
    assert (first.line, first.check) == (line, check), r.to_json()["findings"]
    assert r.first_problem().startswith(f"line {line}:")


def test_truncation_is_caught_by_since_and_checkpoint(tmp_path):
    p = _synthetic(tmp_path / "l.jsonl")
    base = tmp_path / "base.jsonl"
    shutil.copy(p, base)
    body = Checkpoint("t", 8, merkle.root([merkle.leaf_hash(l) for l in _lines(p)])).body()
    (tmp_path / "cp").write_text(body)
    _write(p, _lines(p)[:6])  # two whole lines removed: self-consistent on its own
    assert verify_ledger(p).passed
    r = verify_ledger(p, since=base)
    assert not r.passed and "truncated" in r.first_problem()
    r = verify_ledger(p, checkpoint=tmp_path / "cp")
    assert not r.passed and "lines were removed" in r.first_problem()


def test_torn_tail_is_reported_and_repair_removes_only_it(tmp_path):
    p = _synthetic(tmp_path / "l.jsonl")
    good = p.read_bytes()
    p.write_bytes(good + b'{"kind":"te')
    r = verify_ledger(p)
    assert [(f.line, f.check) for f in r.findings] == [(9, "torn")]
    assert ledger.repair(p) == 11 and p.read_bytes() == good
    assert ledger.repair(p) == 0
    assert verify_ledger(p).passed


def test_repair_names_a_half_written_line_in_the_middle(tmp_path):
    """#24.11: with line 2 of 5 half-written, `ledger repair` said "no torn line; nothing changed", exit 0. It changes
    nothing (it never rewrites complete lines) but fails naming line 2 and `kvgraft verify`; a torn tail is still
    removed first."""
    p = _synthetic(tmp_path / "l.jsonl", 5)
    lines = _lines(p)
    _write(p, lines[:1] + [lines[1][: len(lines[1]) // 2]] + lines[2:])
    damaged = p.read_bytes()
    r = run_cli("ledger", "repair", "l.jsonl", cwd=tmp_path)
    assert r.returncode == 1 and p.read_bytes() == damaged, r
    assert r.stderr.startswith("Error: ") and "line 2" in r.stderr and "kvgraft verify" in r.stderr, r.stderr
    assert "nothing changed" not in r.stdout
    p.write_bytes(damaged + b'{"kind":"te')
    r = run_cli("ledger", "repair", "l.jsonl", cwd=tmp_path)
    assert r.returncode == 1 and p.read_bytes() == damaged and "line 2" in r.stderr, r
    assert "removed a torn last line" in r.stdout


def test_since_names_the_rewritten_line_and_checks_consistency(tmp_path):
    p = _synthetic(tmp_path / "l.jsonl", 5)
    base = tmp_path / "base.jsonl"
    shutil.copy(p, base)
    _synthetic(p, 3)  # appended: fine
    r = verify_ledger(p, since=base)
    assert r.passed and r.since["consistent"] and r.since["appended"] == 3
    assert [e["seq"] for e in ledger.appended_since(_lines(base), _lines(p))] == [5, 6, 7]
    lines = _lines(p)
    lines[2] = lines[2].replace(b'"n":2', b'"n":9')
    _write(p, lines)
    r = verify_ledger(p, since=base)
    assert not r.since["consistent"]
    assert any(f.check == "append-only" and f.line == 3 for f in r.findings)


def test_checkpoint_root_and_signatures(tmp_path):
    p = _synthetic(tmp_path / "l.jsonl", 6)
    skey, vkey = generate_key("ci")
    _, other = generate_key("ci")
    root = merkle.root([merkle.leaf_hash(l) for l in _lines(p)])
    (tmp_path / "cp").write_text(sign(Checkpoint("kvgraft", 6, root).body(), skey))
    r = verify_ledger(p, checkpoint=tmp_path / "cp", keys=[vkey])
    assert r.passed and r.checkpoint["signed_by"] == ["ci"] and r.checkpoint["root_matches"]
    assert not verify_ledger(p, checkpoint=tmp_path / "cp", keys=[other]).passed  # same name, other key
    _synthetic(p, 2)  # appending keeps the checkpoint valid
    assert verify_ledger(p, checkpoint=tmp_path / "cp", keys=[vkey]).passed
    lines = _lines(p)
    lines[1] = lines[1].replace(b'"n":1', b'"n":7')
    _write(p, lines)
    r = verify_ledger(p, checkpoint=tmp_path / "cp", keys=[vkey])
    assert any(f.check == "checkpoint" for f in r.findings)


def test_flipped_artifact_byte_is_pinpointed(copy):
    entries = ledger.read(copy)
    i, e = next((i, e) for i, e in enumerate(entries) if e["kind"] == "deposit")
    art = copy.parent / e["outputs"]["artifact"]["path"]
    data = bytearray(art.read_bytes())
    data[len(data) // 2] ^= 0x10
    art.write_bytes(bytes(data))
    r = verify_ledger(copy, full=True)
    assert not r.passed
    bad = [f for f in r.mismatched if f.field == "outputs.artifact"]
    assert [f.line for f in bad] == [i + 1]
    assert r.first_problem().startswith(f"line {i + 1}: outputs.artifact")


def test_missing_files_are_reported_separately(copy):
    shutil.rmtree(copy.parent / "store")
    r = verify_ledger(copy)
    assert r.passed and len(r.missing) == 7 and not r.mismatched
    assert not verify_ledger(copy, require_files=True).passed


def test_cache_skips_verified_files_and_full_bypasses_it(copy, monkeypatch):
    calls = []
    real = filehash.raw_digest
    monkeypatch.setattr(filehash, "raw_digest", lambda p: calls.append(p) or real(p))
    verify_ledger(copy, full=True)
    n_files = len(calls)
    # Each file once per run, however many entries name it (7 deposits share one problems file).
    assert len(set(calls)) == n_files == 8
    calls.clear()
    assert verify_ledger(copy).passed and calls == []  # all from the cache
    verify_ledger(copy, full=True)
    assert len(calls) == n_files
    # A file rewritten with other bytes has a new mtime/size: re-hashed even without --full, and caught.
    e = next(e for e in ledger.read(copy) if e["kind"] == "deposit")
    art = copy.parent / e["outputs"]["artifact"]["path"]
    art.write_bytes(art.read_bytes()[:-3])
    calls.clear()
    r = verify_ledger(copy)
    assert len(calls) == 1 and not r.passed


def test_a_payload_over_the_limit_is_bad_input_with_full_and_from_the_cache(copy):
    """#24.4: a payload over KVGRAFT_MAX_PAYLOAD is bad input (exit 2, docs/LEDGER.md), not a mismatch (exit 1) under
    --full; and without --full a file already in the cache is still held to the limit (its header is read)."""
    cwd, small = copy.parent, {"KVGRAFT_MAX_PAYLOAD": "1K"}  # every deposited payload is larger
    run_cli("verify", "ledger.jsonl", "--cache", "c.json", cwd=cwd, check_rc=0)  # every file now in the cache
    for extra in (["--full"], []):
        r = run_cli("verify", "ledger.jsonl", "--cache", "c.json", *extra, cwd=cwd, env=small)
        assert r.returncode == 2, (extra, r)
        assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and "KVGRAFT_MAX_PAYLOAD" in r.stderr, r


def test_verify_says_how_many_files_it_took_from_the_cache_unread(copy):
    """#24.5: the cache cannot see a change that keeps size, mtime and inode, so every run that used it says how many
    files it took from it unread, and that --full (the third party's choice) re-reads them."""
    cwd = copy.parent

    def run(*extra):
        return json.loads(
            run_cli("verify", "ledger.jsonl", "--cache", "c.json", "--json", *extra, cwd=cwd, check_rc=0).stdout
        )

    first = run()
    assert first["files"]["from_cache"] == 0 and not any("cache" in w for w in first["warnings"])
    second = run()
    n = second["files"]["checked"]
    assert second["files"]["from_cache"] == n > 0, second["files"]
    assert any(
        f"{n} of {n} referenced files were taken from the verify cache unread" in w and "--full" in w
        for w in second["warnings"]
    ), second["warnings"]
    human = run_cli("verify", "ledger.jsonl", "--cache", "c.json", cwd=cwd, check_rc=0).stdout
    assert "taken from the verify cache unread" in " ".join(human.split()), human
    assert run("--full")["files"]["from_cache"] == 0
    plain = json.loads(run_cli("verify", "ledger.jsonl", "--no-cache", "--json", cwd=cwd, check_rc=0).stdout)
    assert plain["files"]["from_cache"] == 0


def test_payload_hash_matches_artifact_identity(copy):
    e = next(e for e in ledger.read(copy) if e["kind"] == "deposit")
    art = copy.parent / e["outputs"]["artifact"]["path"]
    assert payload.kvg_payload_sha256(art) == art.stem == e["outputs"]["artifact"]["sha256"]


def test_concurrent_appends_8_by_200(tmp_path):
    """8 processes x 200 appends at once: nothing lost, chain valid (verified with the full verifier)."""
    p = tmp_path / "l.jsonl"
    code = (
        "import sys; from kvgraft_cli.ledger import log as ledger\n"
        "for i in range(200): ledger.append(sys.argv[1], 'test', {'w': int(sys.argv[2]), 'i': i})"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(p), str(k)]) for k in range(8)]
    assert [pr.wait(timeout=300) for pr in procs] == [0] * 8
    r = verify_ledger(p)
    assert r.passed and r.entries == 1600
    assert len({(e["w"], e["i"]) for e in ledger.read(p)}) == 1600


def test_verify_runs_without_torch(copy):
    def run(*args):
        return run_without_torch(*args, cwd=copy.parent)

    p = run("verify", "ledger.jsonl", "--full", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["passed"] is True
    p = run("ledger", "checkpoint", "ledger.jsonl", "-o", "cp")
    assert p.returncode == 0, p.stderr
    assert run("verify", "ledger.jsonl", "--checkpoint", "cp").returncode == 0
    # The blocker works: an engine command cannot import torch.
    p = run("graft", "--check", "--store", "store", "--ledger", "ledger.jsonl")
    assert p.returncode == 2 and "kvgraft[engine]" in p.stderr


def test_cli_exit_codes_and_messages(tmp_path):
    p = _synthetic(tmp_path / "l.jsonl", 4)
    run_cli("verify", "l.jsonl", cwd=tmp_path, check_rc=0)
    lines = _lines(p)
    _write(p, lines[:1] + lines[2:])
    r = run_cli("verify", "l.jsonl", cwd=tmp_path, check_rc=1)
    assert "Error: l.jsonl: line 2:" in r.stderr
    r = run_cli("verify", "l.jsonl", "--json", cwd=tmp_path, check_rc=1)
    assert json.loads(r.stdout)["first_problem"].startswith("line 2:")
    run_cli("verify", "nope.jsonl", cwd=tmp_path, check_rc=2)
    (tmp_path / "bad-cp").write_text("not a checkpoint\n")
    run_cli("verify", "l.jsonl", "--checkpoint", "bad-cp", cwd=tmp_path, check_rc=2)
    run_cli("ledger", "diff", "l.jsonl", "l.jsonl", cwd=tmp_path, check_rc=0)


def test_ci_gate_commands(tmp_path):
    """The commands of docs/ci-ledger-gate.yml: an empty or older base passes, a rewritten ledger fails with 1."""
    p = _synthetic(tmp_path / "l.jsonl", 4)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    shutil.copy(p, tmp_path / "base.jsonl")
    _synthetic(p, 2)
    run_cli("verify", "l.jsonl", "--since", "empty.jsonl", "--full", cwd=tmp_path, check_rc=0)
    run_cli("verify", "l.jsonl", "--since", "base.jsonl", cwd=tmp_path, check_rc=0)
    r = run_cli("ledger", "diff", "base.jsonl", "l.jsonl", "--json", cwd=tmp_path, check_rc=0)
    assert [e["seq"] for e in json.loads(r.stdout)["appended"]] == [4, 5]
    lines = _lines(p)
    lines[1] = lines[1].replace(b'"n":1', b'"n":2')
    _write(p, lines)
    r = run_cli("verify", "l.jsonl", "--since", "base.jsonl", cwd=tmp_path, check_rc=1)
    assert "line 2" in r.stderr
    r = run_cli("ledger", "diff", "base.jsonl", "l.jsonl", cwd=tmp_path, check_rc=1)
    assert "not an append: line 2" in r.stderr


def test_odd_inputs_are_findings_or_bad_input_never_crashes(tmp_path):
    p = _synthetic(tmp_path / "l.jsonl", 3)
    good = p.read_bytes()
    # An escaped lone surrogate: a values finding at its line.
    p.write_bytes(good + b'{"kind":"x","prev":null,"seq":3,"time":"2020-01-01T00:00:00Z","z":"\\ud800"}\n')
    r = verify_ledger(p)
    assert any(f.line == 4 and f.check == "values" for f in r.findings)
    p.write_bytes(good)
    # A cache file of the wrong shape is ignored.
    for junk in ("null", "[]", '"s"', '{"x": 5}'):
        (tmp_path / ".kvgraft-verify-cache.json").write_text(junk)
        assert verify_ledger(p).passed
    # --since: a directory is bad input; a damaged checkpoint is bad input, not "rewritten".
    from kvgraft_cli.errors import InputError

    with pytest.raises(InputError):
        verify_ledger(p, since=tmp_path)
    body = Checkpoint("t", 3, merkle.root([merkle.leaf_hash(x) for x in _lines(p)])).body()
    (tmp_path / "crlf").write_text(body.replace("\n", "\r\n"))
    with pytest.raises(InputError):
        verify_ledger(p, since=tmp_path / "crlf")
    (tmp_path / "cp").write_text(body)
    assert verify_ledger(p, since=tmp_path / "cp").passed
    # A size-0 checkpoint must carry the empty tree's root.
    import base64

    (tmp_path / "cp0").write_text("t\n0\n" + base64.b64encode(b"\x11" * 32).decode() + "\n")
    assert not verify_ledger(p, since=tmp_path / "cp0").passed
    (tmp_path / "cp0").write_text("t\n0\n" + base64.b64encode(merkle.EMPTY_ROOT).decode() + "\n")
    assert verify_ledger(p, since=tmp_path / "cp0").passed
    # A digest path too long for the file system is simply missing.
    ledger.append(p, "test", {"inputs": {"f": {"sha256": "0" * 64, "path": "x" * 5000}}})
    r = verify_ledger(p)
    assert r.passed and len(r.missing) == 1


def test_bytes_after_the_frame_are_refused(copy):
    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.errors import ArtifactError

    e = next(e for e in ledger.read(copy) if e["kind"] == "deposit")
    art = copy.parent / e["outputs"]["artifact"]["path"]
    art.write_bytes(art.read_bytes() + kvg.compress(b"more"))
    assert not verify_ledger(copy, full=True).passed
    with pytest.raises(ArtifactError, match="bytes after the"):
        kvg.read_file(art)


def test_ledger_prove_gives_an_inclusion_proof_that_verifies(tmp_path):
    """The proof printed by `kvgraft ledger prove`, in the vectors' format, checked with the library verifier."""
    import base64

    p = _synthetic(tmp_path / "l.jsonl", 9)
    r = json.loads(run_cli("ledger", "prove", "4", "l.jsonl", "--size", "7", "--json", cwd=tmp_path, check_rc=0).stdout)
    b = base64.b64decode
    assert r["leafHash"] == base64.b64encode(merkle.leaf_hash(_lines(p)[3])).decode()
    assert b(r["root"]) == merkle.root([merkle.leaf_hash(x) for x in _lines(p)[:7]])
    merkle.verify_inclusion(r["leafIdx"], r["treeSize"], b(r["leafHash"]), [b(h) for h in r["proof"]], b(r["root"]))
    run_cli("ledger", "prove", "10", "l.jsonl", cwd=tmp_path, check_rc=2)
