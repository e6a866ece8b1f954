"""The first ledger: canonical lines, hash chain, locked appends from many processes, torn tails refused."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp

import pytest

from kvgraft_cli.errors import LedgerError
from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.util.hashing import canonical_json


def _check_chain(path):
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    prev = None
    for i, line in enumerate(lines[:-1]):
        entry = json.loads(line)
        assert canonical_json(entry) == line  # each line is the RFC 8785 form of itself
        assert entry["seq"] == i
        assert entry["prev"] == prev
        prev = hashlib.sha256(line).hexdigest()
    return len(lines) - 1


def test_append_chains_and_canonicalizes(tmp_path):
    p = tmp_path / "l.jsonl"
    for i in range(5):
        e = ledger.append(p, "test", {"inputs": {"x": {"sha256": "0" * 64}}, "n": i, "é": "ü"})
    assert e["seq"] == 4
    assert _check_chain(p) == 5
    assert [e["n"] for e in ledger.read(p)] == list(range(5))


def _worker(args):
    path, k, n = args
    for i in range(n):
        ledger.append(path, "test", {"worker": k, "i": i})


def test_concurrent_appends_lose_nothing(tmp_path):
    p = tmp_path / "l.jsonl"
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_worker, [(str(p), k, 50) for k in range(4)])
    assert _check_chain(p) == 200
    seen = {(e["worker"], e["i"]) for e in ledger.read(p)}
    assert len(seen) == 200


def test_torn_last_line_stops_appends(tmp_path):
    p = tmp_path / "l.jsonl"
    ledger.append(p, "test", {"a": 1})
    before = p.read_bytes()
    with open(p, "ab") as f:
        f.write(b'{"kind":"test","se')  # a writer killed mid-line
    torn = p.read_bytes()
    with pytest.raises(LedgerError, match="torn"):
        ledger.append(p, "test", {"a": 2})
    assert p.read_bytes() == torn  # nothing appended, nothing dropped
    assert torn.startswith(before)
