"""A minimal independent ledger verifier, written from docs/LEDGER.md with hashlib and json only, must agree with
`kvgraft verify` on good and tampered ledgers (verdict, first bad line, Merkle root)."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.audit.verify import verify_ledger


# ---- the independent verifier: only this block is "written from the document" -------------------------------------
def _in_value_space(v) -> bool:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return True
    if isinstance(v, int):
        return abs(v) <= 2**53 - 1
    if isinstance(v, list):
        return all(_in_value_space(x) for x in v)
    if isinstance(v, dict):
        return all(all(0x20 <= ord(c) <= 0x7E for c in k) and _in_value_space(x) for k, x in v.items())
    return False  # floats


def _mth(leaves: list[bytes]) -> bytes:
    """RFC 6962 Merkle Tree Hash, straight from the definition."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return leaves[0]
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return hashlib.sha256(b"\x01" + _mth(leaves[:k]) + _mth(leaves[k:])).digest()


def independent_verify(data: bytes) -> tuple[bool, int | None, str]:
    """(passed, first bad 1-based line or None, Merkle root hex)."""
    *lines, tail = data.split(b"\n")
    bad = None
    prev = None
    for i, raw in enumerate(lines):
        ok = True
        try:
            e = json.loads(raw)
        except ValueError:
            e, ok = None, False
        if ok:
            ok = (isinstance(e, dict) and _in_value_space(e)
                  and json.dumps(e, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode() == raw
                  and e.get("seq") == i
                  and e.get("prev") == (hashlib.sha256(prev).hexdigest() if prev is not None else None)
                  and isinstance(e.get("kind"), str) and isinstance(e.get("time"), str))
        if not ok and bad is None:
            bad = i + 1
        prev = raw
    if tail and bad is None:
        bad = len(lines) + 1
    root = _mth([hashlib.sha256(b"\x00" + raw).digest() for raw in lines]).hex()
    return bad is None, bad, root
# --------------------------------------------------------------------------------------------------------------------


def _base(path, n=10):
    for i in range(n):
        ledger.append(path, "note" if i % 3 else "test", {"n": i, "note": "ü\n\t\"x\"", "r": {"v": 0.25 * i}})
    return path.read_bytes().split(b"\n")[:-1]


CASES = {
    "good": lambda ls: ls,
    "edit": lambda ls: ls[:4] + [ls[4].replace(b'"n":4', b'"n":5')] + ls[5:],
    "spaces": lambda ls: ls[:4] + [ls[4].replace(b'"n":4', b'"n" :4')] + ls[5:],
    "escape": lambda ls: ls[:2] + [ls[2].replace(b"\\t", b"\\u0009")] + ls[3:],
    "delete": lambda ls: ls[:6] + ls[7:],
    "reorder": lambda ls: ls[:1] + [ls[2], ls[1]] + ls[3:],
    "float": lambda ls: ls[:8] + [ls[8].replace(b'"n":8', b'"n":8.0')] + ls[9:],
    "drop first": lambda ls: ls[1:],
    "empty": lambda ls: [],
}


@pytest.mark.parametrize("name", sorted(CASES) + ["torn"])
def test_independent_verifier_agrees(tmp_path, name):
    p = tmp_path / "l.jsonl"
    lines = _base(p)
    if name == "torn":
        data = b"".join(l + b"\n" for l in lines) + lines[0][:20]
    else:
        data = b"".join(l + b"\n" for l in CASES[name](lines))
    p.write_bytes(data)
    passed, bad, root = independent_verify(data)
    r = verify_ledger(p, rehash=False)
    assert r.root == root
    assert r.passed == passed, r.to_json()["findings"]
    first = min((f.line for f in r.findings if f.line), default=None)
    assert first == bad
    assert passed == (name in ("good", "empty"))


def test_real_ledger_agrees(deposited):
    ctx, _ = deposited
    data = ctx.ledger.read_bytes()
    passed, bad, root = independent_verify(data)
    r = verify_ledger(ctx.ledger, rehash=False)
    assert passed and r.passed and r.root == root
