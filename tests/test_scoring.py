"""`kvgraft score`: exact comparison after normalization, Wilson interval, order-independent records, unanswered
problems in the denominator, versioned score rules, the math-verify grader, and `kvgraft verify` recomputing a
recorded score (or saying why it cannot)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import EXAMPLES, MATH500, REPO, run_cli, run_without_torch

from kvgraft_cli.audit.verify import verify_ledger
from kvgraft_cli.errors import InputError, ProblemFileError
from kvgraft_cli.eval import scoring
from kvgraft_cli.eval.scoring import ScoreSettings, score, wilson_interval, write_records
from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.util.hashing import sha256_bytes

DEFAULT_MAP = {
    "id": "id",
    "problem": "problem",
    "solution": "solution",
    "answer": "answer",
    "answer_extract": "verbatim",
}
MATH_MAP = {"id": None, "problem": "question", "solution": "answer", "answer": "answer", "answer_extract": "trailer"}


@pytest.mark.parametrize(
    "k,n,lo,hi", [(3, 4, 0.3006, 0.9544), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (50, 100, 0.4038, 0.5962)]
)
def test_wilson_known_values(k, n, lo, hi):
    a, b = wilson_interval(k, n)
    assert (round(a, 4), round(b, 4)) == (lo, hi)


def test_wilson_edges_are_exact():
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(0, 10**6)[0] == 0.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_records_file_may_not_overwrite_an_input(tmp_path):
    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}])
    before = out.read_bytes()
    p = run_cli(
        "score", "outputs.jsonl", "--answers", str(EXAMPLES), "--records", "outputs.jsonl", cwd=tmp_path, check_rc=2
    )
    assert "would be overwritten" in p.stderr and out.read_bytes() == before


def _outputs(tmp_path, rows, name="outputs.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_math500_solutions_score_500_of_500(tmp_path):
    """Real data: each solution's extracted answer agrees with its own trailer on all 500 problems."""
    from kvgraft_cli.eval.problems import read_problems

    probs = read_problems(MATH500, MATH_MAP)
    out = _outputs(tmp_path, [{"id": p.id, "output": p.solution} for p in probs])
    r = score(out, MATH500, MATH_MAP)
    assert (r.n, r.correct) == (500, 500)
    assert [x.id for x in r.records] == sorted(x.id for x in r.records)


def test_records_do_not_depend_on_output_order(tmp_path):
    rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines()]
    outs = [{"id": r["id"], "output": r["solution"]} for r in rows if "answer" in r]
    a = score(_outputs(tmp_path, outs, "a.jsonl"), EXAMPLES, DEFAULT_MAP)
    random.Random(1).shuffle(outs)
    b = score(_outputs(tmp_path, outs, "b.jsonl"), EXAMPLES, DEFAULT_MAP)
    assert a.records_bytes() == b.records_bytes()
    assert a.summary()["correct"] == 7 and a.summary()["n"] == 8  # wrong-1 is wrong


def test_unknown_id_and_bad_lines(tmp_path):
    with pytest.raises(ProblemFileError, match=r"outputs.jsonl:1: id 'nope'"):
        score(_outputs(tmp_path, [{"id": "nope", "output": "\\boxed{1}"}]), EXAMPLES, DEFAULT_MAP)
    (tmp_path / "bad.jsonl").write_text('{"id": "sum-1", "output": "x"}\n{oops\n')
    with pytest.raises(ProblemFileError, match=r"bad.jsonl:2: malformed JSON"):
        score(tmp_path / "bad.jsonl", EXAMPLES, DEFAULT_MAP)


def test_cli_score_and_verify_recomputes(tmp_path):
    _outputs(
        tmp_path,
        [
            {"id": "sum-1", "output": "so \\boxed{42}"},
            {"id": "lin-1", "output": "x = 6"},
            {"id": "gcd-1", "output": "The answer is: 42"},
        ],
    )
    r = json.loads(
        run_cli("score", "outputs.jsonl", "--answers", str(EXAMPLES), "--json", cwd=tmp_path, check_rc=0).stdout
    )
    # 8 problems have a reference answer; the 5 without an output count as incorrect.
    assert (r["n"], r["correct"], r["answered"], r["unanswered"], r["no_reference"]) == (8, 2, 3, 5, 1)
    assert (tmp_path / r["records"]).is_file()
    v = verify_ledger(tmp_path / "kvgraft-ledger.jsonl")
    assert v.passed and v.scores_checked == 1 and not v.scores_not_recomputable
    run_cli("score", "outputs.jsonl", "--answers", "missing.jsonl", cwd=tmp_path, check_rc=2)


def test_unanswered_problems_count_as_incorrect(tmp_path):
    """Issue 11: 3 missing outputs must not turn 16/30 into 16/27. Here: 2 right of 8 problems with a reference."""
    out = _outputs(
        tmp_path,
        [
            {"id": "sum-1", "output": "\\boxed{42}"},
            {"id": "lin-1", "output": "\\boxed{5}"},
            {"id": "gcd-1", "output": "\\boxed{0}"},
        ],
    )
    r = score(out, EXAMPLES, DEFAULT_MAP)
    s = r.summary()
    assert (s["n"], s["correct"], s["answered"], s["unanswered"], s["no_reference"]) == (8, 2, 3, 5, 1)
    assert s["accuracy"] == repr(2 / 8) and s["rules"] == "2" and s["answered_only"] is False
    recs = [json.loads(x) for x in r.records_bytes().splitlines()]
    assert len(recs) == 8 and sum(not x["answered"] for x in recs) == 5
    assert all(not x["correct"] and x["extracted"] is None for x in recs if not x["answered"])
    # The explicit opt-out: only the answered problems in the denominator.
    o = score(out, EXAMPLES, DEFAULT_MAP, settings=ScoreSettings.current(answered_only=True)).summary()
    assert (o["n"], o["correct"], o["answered"], o["unanswered"], o["answered_only"]) == (3, 2, 3, 5, True)


def test_cli_score_table_reports_answered_and_unanswered(tmp_path):
    _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}])
    p = run_cli("score", "outputs.jsonl", "--answers", str(EXAMPLES), cwd=tmp_path, check_rc=0)
    assert "accuracy 1/8 = 0.1250" in p.stdout
    assert "answered 1, unanswered 7 (unanswered count as incorrect), 1 without a reference answer" in p.stdout
    p = run_cli("score", "outputs.jsonl", "--answers", str(EXAMPLES), "--answered-only", cwd=tmp_path, check_rc=0)
    assert "accuracy 1/1 = 1.0000" in p.stdout and "(answered only)" in p.stdout


def test_answered_only_is_recorded_and_recomputed(tmp_path):
    _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}, {"id": "lin-1", "output": "\\boxed{4}"}])
    run_cli("score", "outputs.jsonl", "--answers", str(EXAMPLES), "--answered-only", cwd=tmp_path, check_rc=0)
    led = tmp_path / "kvgraft-ledger.jsonl"
    e = ledger.read(led)[0]
    assert e["inputs"]["settings"]["answered_only"] is True and e["outputs"]["result"]["n"] == 2
    assert e["inputs"]["settings"]["rules"] == "2" and e["inputs"]["settings"]["grader"] == "exact"
    v = verify_ledger(led)
    assert v.passed and v.scores_checked == 1
    # The same result recorded without the opt-out does not recompute (the denominator would be 8).
    entry = {k: e[k] for k in ("inputs", "outputs")}
    entry["inputs"] = {**entry["inputs"], "settings": {**entry["inputs"]["settings"], "answered_only": False}}
    ledger.append(led, "score", entry)
    v = verify_ledger(led)
    assert [(f.line, f.check) for f in v.findings] == [(2, "score")]
    assert "n recorded 2, recomputed 8" in v.findings[0].message


def test_default_records_file_is_in_the_store_named_by_content(tmp_path):
    """Issue 11: the records went beside the input (inside the repository for the README example)."""
    src = tmp_path / "src"
    src.mkdir()
    _outputs(src, [{"id": "sum-1", "output": "\\boxed{42}"}])
    work = tmp_path / "work"
    work.mkdir()
    r = json.loads(
        run_cli("score", str(src / "outputs.jsonl"), "--answers", str(EXAMPLES), "--json", cwd=work, check_rc=0).stdout
    )
    assert list(src.iterdir()) == [src / "outputs.jsonl"]
    rec = Path(r["records"])
    assert rec == Path("kvgraft-store") / "scores" / f"outputs-{r['records_sha256'][:12]}.scores.jsonl"
    assert sha256_bytes((work / rec).read_bytes()) == r["records_sha256"]
    assert ledger.read(work / "kvgraft-ledger.jsonl")[0]["outputs"]["records"]["path"] == str(rec)
    assert verify_ledger(work / "kvgraft-ledger.jsonl").scores_checked == 1


def test_score_does_not_need_a_solution_field(tmp_path):
    """Answers files without solutions (a benchmark's id/problem/answer) score; the solution is never read."""
    ans = tmp_path / "answers.jsonl"
    ans.write_text(
        json.dumps({"id": "a", "problem": "1+1?", "answer": "2"})
        + "\n"
        + json.dumps({"id": "b", "problem": "2+2?", "answer": "4"})
        + "\n"
    )
    _outputs(tmp_path, [{"id": "a", "output": "\\boxed{2}"}])
    r = json.loads(
        run_cli("score", "outputs.jsonl", "--answers", "answers.jsonl", "--json", cwd=tmp_path, check_rc=0).stdout
    )
    assert (r["n"], r["correct"], r["unanswered"]) == (2, 1, 1)


OLD_TIME = "2026-11-30T12:00:00.000000+00:00"  # before score rules 2 shipped (scoring.LAST_RULES_1_DAY)


def _backdate(led, line: int, time: str = OLD_TIME) -> None:
    """Rewrite one line's time (as a kvgraft of rules 1 wrote it, before rules 2 shipped) and re-chain the lines
    after it: an entry without settings.rules dated today is a downgrade (#24.2)."""
    import hashlib

    entries = ledger.read(led)
    entries[line - 1]["time"] = time
    out, prev = [], None
    for e in entries:
        e["prev"] = hashlib.sha256(prev).hexdigest() if prev is not None else None
        prev = json.dumps(e, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()
        out.append(prev)
    led.write_bytes(b"".join(x + b"\n" for x in out))


def _entry(out, rec_sha, result, settings=None, rec_path="rec.jsonl"):
    """A score ledger entry over the examples, as `kvgraft score` writes one (settings: the current ones)."""
    extra = ScoreSettings().to_settings() if settings is None else settings
    return {
        "inputs": {
            "outputs": {"path": out.name, "sha256": sha256_bytes(out.read_bytes())},
            "answers": {"path": str(EXAMPLES), "sha256": sha256_bytes(EXAMPLES.read_bytes())},
            "settings": {"mapping": DEFAULT_MAP, "id_field": "id", "output_field": "output", **extra},
        },
        "outputs": {"records": {"path": rec_path, "sha256": rec_sha}, "result": result},
    }


def test_verify_catches_a_misreported_score(tmp_path):
    """A score entry whose recorded number does not follow from its outputs fails verify, naming the line."""
    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}, {"id": "lin-1", "output": "\\boxed{4}"}])
    res = score(out, EXAMPLES, DEFAULT_MAP)
    rec_sha = write_records(tmp_path / "rec.jsonl", res)
    led = tmp_path / "l.jsonl"
    ledger.append(led, "score", _entry(out, rec_sha, res.summary()))
    inflated = dict(res.summary(), correct=2, accuracy="0.25")
    ledger.append(led, "score", _entry(out, rec_sha, inflated))
    v = verify_ledger(led)
    assert not v.passed and v.scores_checked == 2
    assert [(f.line, f.check) for f in v.findings] == [(2, "score")]
    # A forged entry whose result is not an object is a finding, not a crash.
    ledger.append(
        led,
        "score",
        {
            **_entry(out, rec_sha, res.summary()),
            "outputs": {"records": {"path": "rec.jsonl", "sha256": rec_sha}, "result": "all correct"},
        },
    )
    v = verify_ledger(led)
    assert [(f.line, f.check) for f in v.findings] == [(2, "score"), (3, "score")]
    lines = led.read_bytes().split(b"\n")
    led.write_bytes(b"\n".join(lines[:2]) + b"\n")
    # Without the inputs, the records file alone still recomputes the aggregate, and says so.
    out.unlink()
    v = verify_ledger(led)
    assert [(f.line, f.check) for f in v.findings] == [(2, "score")]
    assert v.scores_checked == 2 and [x["line"] for x in v.scores_from_records] == [1, 2]
    assert "its outputs file outputs.jsonl is missing" in v.scores_from_records[0]["reason"]


def test_verify_shows_what_differs_verbatim(tmp_path):
    """Issue 11: an edited accuracy string was reported as "recomputed 1/8 differs from the recorded 1/8"."""
    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}])
    res = score(out, EXAMPLES, DEFAULT_MAP)
    rec_sha = write_records(tmp_path / "rec.jsonl", res)
    led = tmp_path / "l.jsonl"
    ledger.append(led, "score", _entry(out, rec_sha, dict(res.summary(), accuracy="[b]0.9[/b]")))
    v = verify_ledger(led)
    msg = v.findings[0].message
    assert 'accuracy recorded "[b]0.9[/b]", recomputed "0.125"' in msg and "correct" not in msg
    # The CLI prints the recorded value as it is: rich markup must not eat "[b]".
    p = run_cli("verify", str(led), cwd=tmp_path, env={"COLUMNS": "400"}, check_rc=1)
    assert '"[b]0.9[/b]"' in p.stdout and "FAIL line 1" in p.stdout
    assert p.stdout.count('"[b]0.9[/b]"') == 2  # the table's score row and the FAIL line


def test_old_rules_entries_recompute_with_their_own_rules(tmp_path):
    """An entry without `rules` (written before unanswered problems counted) recomputes with rules 1 and its
    recorded extractor version; the same inputs under the current rules give another number."""
    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}, {"id": "lin-1", "output": "**Answer:** 5"}])
    old = ScoreSettings.from_recorded({})
    assert (old.rules, old.extractor_version) == ("1", "2")
    res = score(out, EXAMPLES, DEFAULT_MAP, settings=old)
    s = res.summary()
    assert (s["n"], s["correct"], s["unscored_problems"], s["extractor_version"]) == (2, 1, 7, "2")
    assert "rules" not in s and b"answered" not in res.records_bytes()
    rec_sha = write_records(tmp_path / "rec.jsonl", res)
    led = tmp_path / "l.jsonl"
    ledger.append(led, "score", _entry(out, rec_sha, s, settings={}))
    _backdate(led, 1)
    new = score(out, EXAMPLES, DEFAULT_MAP).summary()
    assert (new["n"], new["correct"]) == (8, 2)  # extractor 3 reads "**Answer:** 5"; unanswered count
    v = verify_ledger(led)
    assert v.passed and v.scores_checked == 1 and not v.scores_from_records, v.first_problem()


def test_scores_from_another_extractor_version_are_recomputed_from_records(tmp_path):
    """Outputs are never re-extracted with another extractor than the one that scored them (that would change the
    number); without that version here (a later kvgraft's extractor 4), the records file holds each extraction and
    the aggregate is recomputed from it, and verify says the verdicts were not recomputed."""
    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}, {"id": "lin-1", "output": "x"}])
    res = score(out, EXAMPLES, DEFAULT_MAP)
    data = res.records_bytes().replace(b'"extractor_version":"3"', b'"extractor_version":"4"')
    (tmp_path / "rec.jsonl").write_bytes(data)
    led = tmp_path / "l.jsonl"
    later = dict(ScoreSettings().to_settings(), extractor_version="4")
    ledger.append(led, "score", _entry(out, sha256_bytes(data), dict(res.summary(), extractor_version="4"), later))
    ledger.append(
        led, "score", _entry(out, sha256_bytes(data), dict(res.summary(), extractor_version="4", correct=2), later)
    )
    v = verify_ledger(led)
    assert v.scores_checked == 2
    assert [(f.line, f.check) for f in v.findings] == [(2, "score")]
    assert "correct recorded 2, recomputed 1" in v.findings[0].message
    assert [x["line"] for x in v.scores_from_records] == [1, 2]
    assert "extractor version 4 is not in this kvgraft" in v.scores_from_records[0]["reason"]


def test_unrecomputable_score_is_counted_with_its_reason(tmp_path):
    """Issue 11: a score whose extractor is gone and whose records file is missing passed in silence."""
    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}])
    res = score(out, EXAMPLES, DEFAULT_MAP, settings=ScoreSettings.from_recorded({}))
    led = tmp_path / "l.jsonl"
    ledger.append(led, "score", _entry(out, "0" * 64, dict(res.summary(), extractor_version="1"), {}, "gone.jsonl"))
    _backdate(led, 1)
    v = verify_ledger(led)
    assert v.passed and v.scores_checked == 0
    assert v.scores_not_recomputable == [
        {
            "line": 1,
            "reason": "extractor version 1 is not in this kvgraft (it has "
            "2, 3), and its records file gone.jsonl is missing",
        }
    ]
    assert v.to_json()["scores_not_recomputable"] == v.scores_not_recomputable
    p = run_without_torch("verify", str(led), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "1 not recomputable" in p.stdout
    assert "line 1: not recomputable: extractor version 1 is not in this kvgraft" in " ".join(p.stdout.split())


def test_reference_ledger_scores(tmp_path):
    """The project's ledger: its two extractor-2 scores recompute from their inputs with the old rules (their
    records files are not in the repository); the extractor-1 score says why it cannot be recomputed."""
    v = verify_ledger(REPO / "ledger" / "reference.jsonl")
    assert v.passed and v.scores_checked == 2 and not v.scores_from_records
    assert [x["line"] for x in v.scores_not_recomputable] == [11]
    reason = v.scores_not_recomputable[0]["reason"]
    assert "extractor version 1 is not in this kvgraft" in reason and "score-1.scores.jsonl is missing" in reason


def test_prereg_settings_replay_the_recorded_rules():
    """A prereg run copies the entry's settings; without score keys (older preregs) replay uses rules 1 and
    extractor 2, which is what ledger/prereg-v3.yaml expects."""
    assert ScoreSettings.from_recorded(
        {"mapping": DEFAULT_MAP, "id_field": "id", "output_field": "output"}
    ) == ScoreSettings("1", "2", False, "exact", None)
    cur = ScoreSettings.current(answered_only=True)
    assert ScoreSettings.from_recorded({"mapping": DEFAULT_MAP, **cur.to_settings()}) == cur
    from kvgraft_cli.runs.replay import check_prereg

    run = {
        "id": "score-1",
        "kind": "score",
        "outputs": "o.jsonl",
        "outputs_sha256": "0" * 64,
        "answers": "a.jsonl",
        "answers_sha256": "0" * 64,
        "settings": {
            "mapping": DEFAULT_MAP,
            "id_field": "id",
            "output_field": "output",
            **ScoreSettings.current(grader="math-verify").to_settings(),
        },
    }
    check_prereg(
        {
            "kvgraft_prereg": 1,
            "name": "x",
            "manifest": {"path": "builtin:default.yaml", "sha256": "0" * 64},
            "runs": [run],
            "targets": {"t": {}},
        },
        "p.yaml",
    )


def test_prereg_replays_a_score_with_its_recorded_settings(tmp_path):
    """score --answered-only -> prereg make -> register -> replay: the replay scores with the recorded rules (not
    the defaults, which would count the unanswered problems and change n and the records hash)."""
    _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}, {"id": "lin-1", "output": "**Answer:** 4"}])
    run_cli("score", "outputs.jsonl", "--answers", str(EXAMPLES), "--answered-only", cwd=tmp_path, check_rc=0)
    run_cli("prereg", "make", "--target", "t", "-o", "prereg.yaml", cwd=tmp_path, check_rc=0)
    run_cli("replay", "--register", "prereg.yaml", cwd=tmp_path, check_rc=0)
    r = json.loads(run_cli("replay", "prereg.yaml", "--target", "t", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert r["passed"] and r["mismatched"] == 0
    assert {c["what"]: c["actual"] for c in r["comparisons"]}["n"] == 2


# --- the math-verify grader ---------------------------------------------------------------------------------------


def test_unknown_grader_is_an_input_error(tmp_path):
    _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}])
    p = run_cli("score", "outputs.jsonl", "--answers", str(EXAMPLES), "--grader", "llm", cwd=tmp_path, check_rc=2)
    assert "unknown grader 'llm'" in p.stderr


def test_math_verify_not_installed(tmp_path, monkeypatch):
    """Without math-verify, scoring with it is refused (exit 2 with the install hint), and verify counts such a
    score as not recomputable (or recomputed from its records only), naming the version it needs."""
    monkeypatch.setattr(scoring, "math_verify_versions", lambda: None)
    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}])
    mv = ScoreSettings.current(grader="math-verify")
    with pytest.raises(InputError, match="math-verify 0.9.0 not installed") as e:
        score(out, EXAMPLES, DEFAULT_MAP, settings=mv)
    assert "kvgraft[mathverify]" in e.value.hint
    res = score(out, EXAMPLES, DEFAULT_MAP)  # the exact grader's result: what math-verify would add is not needed
    summary = dict(res.summary(), grader="math-verify")
    rec_sha = write_records(tmp_path / "rec.jsonl", res)
    led = tmp_path / "l.jsonl"
    ledger.append(led, "score", _entry(out, rec_sha, summary, mv.to_settings()))
    ledger.append(led, "score", _entry(out, rec_sha, summary, mv.to_settings(), "gone.jsonl"))
    v = verify_ledger(led)
    assert v.passed
    assert v.scores_from_records == [{"line": 1, "reason": "math-verify 0.9.0 not installed"}]
    assert v.scores_not_recomputable == [
        {"line": 2, "reason": "math-verify 0.9.0 not installed, and its records file gone.jsonl is missing"}
    ]
    monkeypatch.setattr(scoring, "math_verify_versions", lambda: {"math-verify": "0.8.0"})
    assert (
        ScoreSettings.current(grader="math-verify").unavailable()
        == "math-verify 0.9.0 not installed (math-verify 0.8.0 is)"
    )


def test_math_verify_time_out_is_an_error_not_a_verdict(monkeypatch):
    import time

    monkeypatch.setattr(scoring, "GRADER_TIMEOUT_S", 0.2)

    def slow(extracted, reference):
        try:
            time.sleep(5)
        except Exception:  # what math-verify does with its own errors: it would turn this into "not equal"
            return False
        return True

    monkeypatch.setattr(scoring, "_math_verify_equal", slow)
    t0 = time.monotonic()
    with pytest.raises(InputError, match="ran past 0.2 s on id 'x'; a time-out is not a verdict"):
        scoring.grade("1", "2", "math-verify", "id 'x'")
    assert time.monotonic() - t0 < 3
    assert scoring.grade("2", "2", "math-verify")  # exact first: no math-verify call at all


# (reference, candidate, equal, what the exact grader says): math-verify adds the equivalents exact misses and
# refuses what kvgraft's policy refuses (decimals to 10 places, equation vs value, percent vs number).
MV_CASES = [
    ("\\frac{1}{2}", "0.5", True, False),
    ("\\{1,2\\}", "\\{2,1\\}", True, False),
    ("1,2,3", "3, 2, 1", True, False),
    ("2\\sqrt{2}", "\\sqrt{8}", True, False),
    ("\\dfrac{3}{4}", "\\frac34", True, False),
    ("25", "025", True, True),
    ("[2,5)", "[2, 5)", True, True),
    ("[2,5)", "(2,5)", False, False),
    ("\\{1,2\\}", "\\{1,3\\}", False, False),
    ("(1,2)", "(2,1)", False, False),
    ("\\frac{1}{3}", "0.333333", False, False),
    ("10", "10\\%", False, False),
    ("x=3", "3", False, False),
    ("5", "x=5", False, False),
    ("\\frac{1}{2}", "\\frac{2}{1}", False, False),
    ("-7", "7", False, False),
    ("(-\\infty, 0]", "[-\\infty, 0]", False, False),
    ("(-\\infty, 0]", "(-\\infty,0]", True, True),
    ("[1, \\infty)", "[1,\\infty)", True, True),
    ("(1,\\infty)", "(1, \\infty]", False, False),
]


@pytest.mark.parametrize("reference,candidate,equal,exact", MV_CASES)
def test_math_verify_grader(reference, candidate, equal, exact):
    pytest.importorskip("math_verify")
    assert scoring.grade(candidate, reference, "math-verify") is equal
    assert scoring.grade(candidate, reference, "exact") is exact


def test_cli_math_verify_score_is_recorded_and_verified_without_torch(tmp_path):
    pytest.importorskip("math_verify")
    _outputs(
        tmp_path,
        [
            {"id": "frac-1", "output": "\\boxed{0.75}"},
            {"id": "sum-1", "output": "\\boxed{42.0}"},
            {"id": "lin-1", "output": "\\boxed{x=5}"},
        ],
    )
    r = json.loads(
        run_cli(
            "score",
            "outputs.jsonl",
            "--answers",
            str(EXAMPLES),
            "--grader",
            "math-verify",
            "--json",
            cwd=tmp_path,
            check_rc=0,
        ).stdout
    )
    assert (r["n"], r["correct"], r["grader"]) == (8, 2, "math-verify")
    assert r["grader_libs"]["math-verify"] == scoring.MATH_VERIFY_PIN and r["grader_libs"]["sympy"]
    e = ledger.read(tmp_path / "kvgraft-ledger.jsonl")[0]
    assert e["inputs"]["settings"]["grader_version"] == scoring.MATH_VERIFY_PIN
    exact = json.loads(
        run_cli("score", "outputs.jsonl", "--answers", str(EXAMPLES), "--json", cwd=tmp_path, check_rc=0).stdout
    )
    assert exact["correct"] == 0
    p = run_without_torch("verify", "kvgraft-ledger.jsonl", "--json", cwd=tmp_path)
    v = json.loads(p.stdout)
    assert p.returncode == 0 and v["scores_checked"] == 2 and not v["scores_not_recomputable"], p.stderr
    # Recorded with another sympy: compared member for member (#24.3), so this machine cannot confirm it; the
    # finding says the verdicts agree and what to install.
    entry = {k: e[k] for k in ("inputs", "outputs")}
    libs = dict(e["outputs"]["result"]["grader_libs"], sympy="0.0")
    entry["outputs"] = {**entry["outputs"], "result": {**e["outputs"]["result"], "grader_libs": libs}}
    ledger.append(tmp_path / "kvgraft-ledger.jsonl", "score", entry)
    v = verify_ledger(tmp_path / "kvgraft-ledger.jsonl")
    assert not v.passed and v.scores_checked == 3 and [f.line for f in v.findings] == [3], v.first_problem()
    assert "grader_libs" in v.findings[0].message and "the verdicts agree" in v.findings[0].message
