"""Pre-registration and replay: make a prereg from a finished run, register it, replay it, catch any change."""

from __future__ import annotations

import json
import shutil
from contextlib import chdir
from pathlib import Path

import pytest
from conftest import EXAMPLES, deposit_here, run_cli

from kvgraft_cli.errors import InputError
from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.runs.context import RunContext
from kvgraft_cli.runs.graft import graft_check
from kvgraft_cli.runs.replay import load_prereg, prereg_from_ledger, write_prereg

# finished_run (a deposit, a graft check, a score, a prereg) built once, on one worker
pytestmark = pytest.mark.xdist_group("replay")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, engine):
    """A scratch run (deposit 2 problems, one graft check: in this process, the ledger lines the CLI writes; one
    score) and a prereg made from it."""
    d = tmp_path_factory.mktemp("run")
    shutil.copy(EXAMPLES, d / "problems.jsonl")
    (d / "outputs.jsonl").write_text('{"id": "sum-1", "output": "\\\\boxed{42}"}\n{"id": "frac-1", "output": "1/2"}\n')
    deposit_here(engine, d, "problems.jsonl", limit=2)
    with chdir(d):
        ctx = RunContext.make(engine.manifest, "kvgraft-store", Path("kvgraft-ledger.jsonl"))
        assert graft_check(ctx, engine, "sum-1", 2, 2).passed
    run_cli("score", "outputs.jsonl", "--answers", "problems.jsonl", cwd=d, check_rc=0)
    run_cli("prereg", "make", "--target", "cpu-portable", "-o", "prereg.yaml", cwd=d, check_rc=0)
    return d


def _machine(finished_run, tmp_path):
    """A 'second machine': the inputs and the prereg, no store, no ledger."""
    for f in ("problems.jsonl", "outputs.jsonl", "prereg.yaml"):
        shutil.copy(finished_run / f, tmp_path / f)
    return tmp_path


def test_prereg_from_run_lists_runs_and_expectations(finished_run):
    pr = load_prereg(finished_run / "prereg.yaml")
    assert [r["kind"] for r in pr.data["runs"]] == ["deposit", "graft-check", "score"]
    exp = pr.data["targets"]["cpu-portable"]
    assert set(exp["deposit-1"]) == {
        "input_sha256",
        "artifact sum-1",
        "logits sum-1",
        "artifact frac-1",
        "logits frac-1",
    }
    assert exp["score-1"]["correct"] == 1 and exp["score-1"]["n"] == 8  # 6 problems without an output count as wrong


def test_register_then_replay_matches_and_references_the_registration(finished_run, tmp_path):
    m = _machine(finished_run, tmp_path)
    run_cli("replay", "prereg.yaml", cwd=m, check_rc=2)  # not registered yet
    run_cli("replay", "--register", "prereg.yaml", cwd=m, check_rc=0)
    run_cli("replay", "--register", "prereg.yaml", cwd=m, check_rc=0)  # idempotent: no second registration
    r = json.loads(run_cli("replay", "prereg.yaml", "--json", cwd=m, check_rc=0).stdout)
    assert r["passed"] and r["mismatched"] == 0
    entries = ledger.read(m / "kvgraft-ledger.jsonl")
    assert [e["kind"] for e in entries].count("register") == 1
    assert entries[0]["kind"] == "register"
    assert entries[-1]["kind"] == "replay" and entries[-1]["inputs"]["registration"]["seq"] == 0


def test_a_changed_input_is_a_mismatch(finished_run, tmp_path):
    m = _machine(finished_run, tmp_path)
    run_cli("replay", "--register", "prereg.yaml", cwd=m, check_rc=0)
    (m / "outputs.jsonl").write_text('{"id": "sum-1", "output": "\\\\boxed{41}"}\n{"id": "frac-1", "output": "1/2"}\n')
    p = run_cli("replay", "prereg.yaml", "--json", cwd=m, check_rc=1)
    bad = {(c["run"], c["what"]) for c in json.loads(p.stdout)["comparisons"] if not c["match"]}
    assert ("score-1", "outputs_sha256") in bad
    assert "Error: replay of prereg.yaml differs" in p.stderr


def test_two_checks_of_one_artifact_are_two_runs(finished_run, tmp_path):
    """The same artifact checked again with another -n is a run of its own (it was a second run under the first
    one's id, and `prereg make` refused its own output: "duplicate id"); both replay and match."""
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    run_cli("graft", "--check", "--samples", "2", "-n", "3", "sum-1", cwd=d, check_rc=0)
    run_cli("prereg", "make", "--target", "cpu-portable", "-o", "prereg.yaml", "--force", cwd=d, check_rc=0)
    runs = load_prereg(d / "prereg.yaml").data["runs"]
    checks = [r for r in runs if r["kind"] == "graft-check"]
    assert [r["max_new_tokens"] for r in checks] == [2, 3]
    assert checks[1]["id"] == checks[0]["id"] + "-2" and checks[0]["artifact"] == checks[1]["artifact"]
    exp = load_prereg(d / "prereg.yaml").data["targets"]["cpu-portable"]
    assert exp[checks[0]["id"]]["fresh_logits"] != exp[checks[1]["id"]]["fresh_logits"]
    (tmp_path / "m").mkdir()
    m = _machine(d, tmp_path / "m")
    run_cli("replay", "--register", "prereg.yaml", cwd=m, check_rc=0)
    r = json.loads(run_cli("replay", "prereg.yaml", "--json", cwd=m, check_rc=0).stdout)
    assert r["passed"] and r["mismatched"] == 0


def test_an_edited_prereg_needs_a_new_registration(finished_run, tmp_path):
    m = _machine(finished_run, tmp_path)
    run_cli("replay", "--register", "prereg.yaml", cwd=m, check_rc=0)
    text = (m / "prereg.yaml").read_text().replace("samples: 2", "samples: 3")
    (m / "prereg.yaml").write_text(text)
    p = run_cli("replay", "prereg.yaml", cwd=m, check_rc=2)
    assert "not registered" in p.stderr


def test_bad_preregs_are_named(tmp_path):
    (tmp_path / "p.yaml").write_text("kvgraft_prereg: 1\nname: x\nruns: []\n")
    with pytest.raises(InputError, match="p.yaml: .*manifest"):
        load_prereg(tmp_path / "p.yaml")
    with pytest.raises(InputError, match="not found"):
        load_prereg(tmp_path / "nope.yaml")


def test_prereg_paths_are_relative_to_the_prereg(finished_run, tmp_path):
    data = prereg_from_ledger(finished_run / "kvgraft-ledger.jsonl", "t", tmp_path / "sub" / "p.yaml")
    assert data["runs"][0]["input"].startswith("..")
    write_prereg(tmp_path / "sub" / "p.yaml", data)
    pr = load_prereg(tmp_path / "sub" / "p.yaml")
    assert pr.resolve(pr.data["runs"][0]["input"]).resolve() == (finished_run / "problems.jsonl").resolve()


def test_prereg_make_writes_nothing_when_invalid(finished_run, tmp_path):
    p = run_cli(
        "prereg",
        "make",
        str(finished_run / "kvgraft-ledger.jsonl"),
        "--target",
        "CPU",
        "-o",
        "t.yaml",
        cwd=tmp_path,
        check_rc=2,
    )
    assert "targets" in p.stderr and not (tmp_path / "t.yaml").exists()
