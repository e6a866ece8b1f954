"""The project's own reference ledger as its CI gate: it verifies, and the most recently registered prereg replays
under the portable profile with every hash equal. Any change that alters an output hash turns this red."""

from __future__ import annotations

import json
import shutil

from conftest import REPO, run_cli

from kvgraft_cli.audit.verify import verify_ledger
from kvgraft_cli.ledger import log as ledger

REFERENCE = REPO / "ledger" / "reference.jsonl"


def _latest_prereg():
    regs = [e for e in ledger.read(REFERENCE) if e["kind"] == "register"]
    assert regs, "the reference ledger has no registration"
    return REFERENCE.parent / regs[-1]["inputs"]["prereg"]["path"], regs[-1]


def test_reference_ledger_verifies():
    r = verify_ledger(REFERENCE, full=True)
    assert r.passed, r.first_problem()
    assert r.scores_checked >= 1
    kinds = [e["kind"] for e in ledger.read(REFERENCE)]
    assert kinds.index("register") < kinds.index("deposit")  # registered before anything ran
    assert kinds[-1] == "replay" and json.loads(REFERENCE.read_bytes().splitlines()[-1])["outputs"]["passed"]


def test_reference_prereg_replays_with_every_hash_equal(tmp_path):
    prereg, reg = _latest_prereg()
    led = tmp_path / "reference.jsonl"
    shutil.copy(REFERENCE, led)
    p = run_cli("replay", str(prereg), "--ledger", str(led), "--store", str(tmp_path / "store"), "--json", cwd=tmp_path)
    report = json.loads(p.stdout) if p.stdout.strip() else {}
    bad = [c for c in report.get("comparisons", []) if not c["match"]]
    assert p.returncode == 0, f"{p.stderr}\nmismatches: {bad}"
    assert report["passed"] and report["mismatched"] == 0 and report["matched"] >= 20
    # The replay only appended to the reference ledger.
    r = verify_ledger(led, since=REFERENCE, rehash=False)
    assert r.passed and r.since["appended"] > 0


def test_unregistered_prereg_is_refused(tmp_path):
    prereg, _ = _latest_prereg()
    empty = tmp_path / "l.jsonl"
    p = run_cli("replay", str(prereg), "--ledger", str(empty), "--store", str(tmp_path / "s"), cwd=tmp_path, check_rc=2)
    assert "not registered" in p.stderr and not (tmp_path / "s").exists()
